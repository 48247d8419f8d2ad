#include "engine.h"

#include <stdexcept>

#include "error.h"
#include "imm.h"
#include "sharding.h"
#include "wire.h"

namespace moe_a2a::fabric {
namespace {

constexpr int kMaxNics = 16;

std::chrono::nanoseconds to_ns(double seconds) {
  return std::chrono::nanoseconds(static_cast<int64_t>(seconds * 1e9));
}

std::string range(uint64_t offset, uint64_t length) {
  return "[" + std::to_string(offset) + ", " + std::to_string(offset + length) + ")";
}

}  // namespace

TransferEngine::TransferEngine(int rank, int world, const EngineOptions& opts) : rank_(rank), world_(world), opts_(opts) {
  if (world < 1 || world > kMaxRanks)
    throw FabricError("world size " + std::to_string(world) + " is outside [1, " + std::to_string(kMaxRanks) + "]");
  if (rank < 0 || rank >= world)
    throw FabricError("rank " + std::to_string(rank) + " is outside [0, " + std::to_string(world) + ")");
  if (opts.num_nics < 1 || opts.num_nics > kMaxNics)
    throw FabricError("num_nics is " + std::to_string(opts.num_nics) + "; expected 1 to " + std::to_string(kMaxNics));
  if (!opts.domains.empty() && static_cast<int>(opts.domains.size()) != opts.num_nics)
    throw FabricError("domains: got " + std::to_string(opts.domains.size()) + " names; expected one per NIC (" +
                      std::to_string(opts.num_nics) + ") or none");
  for (int i = 0; i < opts.num_nics; ++i)
    backends_.push_back(open_libfabric({opts.provider, i, opts.domains.empty() ? "" : opts.domains[i]}));
  worker_ = std::make_unique<Worker>(&backends_, &imms_);
}

TransferEngine::~TransferEngine() {
  worker_.reset();  // stop polling before the registrations go
  for (auto& r : regions_)
    if (r.live)
      for (size_t i = 0; i < r.nics.size(); ++i) backends_[i]->deregister_memory(r.nics[i]);
}

std::string TransferEngine::where() const {
  return "rank " + std::to_string(rank_) + " (provider '" + opts_.provider + "')";
}

Bytes TransferEngine::address() const {
  AddressBlob blob{opts_.provider, {}};
  for (const auto& b : backends_) blob.nics.push_back(b->address());
  return encode_address(blob);
}

void TransferEngine::connect(const std::vector<Bytes>& addresses) {
  if (static_cast<int>(addresses.size()) != world_)
    throw FabricError(where() + ": connect got " + std::to_string(addresses.size()) + " addresses for a world of " +
                      std::to_string(world_));
  std::vector<std::vector<Bytes>> per_nic(backends_.size());
  for (int r = 0; r < world_; ++r) {
    AddressBlob blob = decode_address(addresses[r], "address of rank " + std::to_string(r));
    if (blob.provider != opts_.provider || blob.nics.size() != backends_.size())
      throw FabricError(where() + " with " + std::to_string(backends_.size()) + " NIC(s) cannot talk to rank " +
                        std::to_string(r) + ", which uses provider '" + blob.provider + "' with " +
                        std::to_string(blob.nics.size()) + " NIC(s)");
    for (size_t i = 0; i < backends_.size(); ++i) per_nic[i].push_back(blob.nics[i]);
  }
  for (size_t i = 0; i < backends_.size(); ++i) backends_[i]->insert_peers(per_nic[i]);
  connected_ = true;
}

uint32_t TransferEngine::register_region(void* ptr, uint64_t length) {
  if (ptr == nullptr || length == 0)
    throw FabricError(where() + ": cannot register an empty region (ptr=" + std::to_string(reinterpret_cast<uintptr_t>(ptr)) +
                      ", length=" + std::to_string(length) + ")");
  Region r{static_cast<uint8_t*>(ptr), length, {}};
  for (auto& b : backends_) r.nics.push_back(b->register_memory(ptr, length));
  std::unique_lock lock(tables_mu_);
  regions_.push_back(std::move(r));
  return static_cast<uint32_t>(regions_.size() - 1);
}

Bytes TransferEngine::region_descriptor(uint32_t id) const {
  std::shared_lock lock(tables_mu_);
  const Region& r = region(id);
  RegionBlob blob{r.length, {}};
  for (const auto& m : r.nics) blob.nics.push_back(m.remote);
  return encode_region(blob);
}

uint32_t TransferEngine::add_remote_region(int peer, const Bytes& descriptor) {
  check_peer(peer, "add_remote_region");
  RegionBlob blob = decode_region(descriptor, "region descriptor from rank " + std::to_string(peer));
  if (blob.nics.size() != backends_.size())
    throw FabricError(where() + ": region descriptor from rank " + std::to_string(peer) + " has " +
                      std::to_string(blob.nics.size()) + " NIC key(s); expected " + std::to_string(backends_.size()));
  remotes_.push_back(RemoteRegion{peer, blob.length, blob.nics});
  return static_cast<uint32_t>(remotes_.size() - 1);
}

uint32_t TransferEngine::create_group(const std::vector<int>& peers, const std::vector<uint32_t>& remote_regions) {
  if (peers.size() != remote_regions.size())
    throw FabricError(where() + ": create_group got " + std::to_string(peers.size()) + " peers and " +
                      std::to_string(remote_regions.size()) + " remote regions; expected one region per peer");
  std::unique_lock lock(tables_mu_);
  std::vector<GroupEntry> group;
  for (size_t i = 0; i < peers.size(); ++i) {
    check_peer(peers[i], "create_group");
    if (remote(remote_regions[i]).peer != peers[i])
      throw FabricError(where() + ": create_group binds peer " + std::to_string(peers[i]) + " to remote region " +
                        std::to_string(remote_regions[i]) + ", which belongs to rank " +
                        std::to_string(remote(remote_regions[i]).peer));
    group.push_back({peers[i], remote_regions[i]});
  }
  groups_.push_back(std::move(group));
  group_live_.push_back(true);
  return static_cast<uint32_t>(groups_.size() - 1);
}

void TransferEngine::release(uint32_t region_id, uint32_t group) {
  std::unique_lock lock(tables_mu_);
  group_size_locked(group);  // a clear error for an unknown or released group
  Region& r = const_cast<Region&>(region(region_id));
  for (size_t i = 0; i < r.nics.size(); ++i) backends_[i]->deregister_memory(r.nics[i]);
  r.live = false;
  for (const auto& e : groups_[group]) remotes_[e.remote].live = false;
  groups_[group].clear();
  group_live_[group] = false;
}

size_t TransferEngine::group_size_locked(uint32_t group) const {
  if (group >= groups_.size() || !group_live_[group])
    throw FabricError(where() + ": unknown group " + std::to_string(group) +
                      (group < groups_.size() ? " (released)" : ""));
  return groups_[group].size();
}

size_t TransferEngine::group_size(uint32_t group) const {
  std::shared_lock lock(tables_mu_);
  return group_size_locked(group);
}

int TransferEngine::group_peer(uint32_t group, uint32_t index) const {
  std::shared_lock lock(tables_mu_);
  if (index >= group_size_locked(group))
    throw FabricError(where() + ": peer index " + std::to_string(index) + " is out of range for group " +
                      std::to_string(group) + " of " + std::to_string(groups_[group].size()) + " peers");
  return groups_[group][index].peer;
}

// Callers hold tables_mu_.
const TransferEngine::Region& TransferEngine::region(uint32_t id) const {
  if (id >= regions_.size() || !regions_[id].live)
    throw FabricError(where() + ": unknown local region " + std::to_string(id) +
                      (id < regions_.size() ? " (released)" : ""));
  return regions_[id];
}

const TransferEngine::RemoteRegion& TransferEngine::remote(uint32_t id) const {
  if (id >= remotes_.size() || !remotes_[id].live)
    throw FabricError(where() + ": unknown remote region " + std::to_string(id) +
                      (id < remotes_.size() ? " (released)" : ""));
  return remotes_[id];
}

void TransferEngine::check_peer(int peer, const char* what) const {
  if (peer < 0 || peer >= world_)
    throw FabricError(where() + ": " + what + ": peer " + std::to_string(peer) + " is out of range [0, " +
                      std::to_string(world_) + ")");
}

void TransferEngine::check() const {
  if (worker_->failed()) throw FabricError(where() + ": " + worker_->error());
  if (!connected_) throw FabricError(where() + ": not connected: connect() with every rank's address first");
}

void TransferEngine::add_job(std::vector<Job>* jobs, OpKind op, const Region& src, uint64_t src_offset,
                             uint64_t length, const RemoteRegion& dst, uint64_t dst_offset,
                             std::optional<uint32_t> tag) const {
  if (src_offset > src.length || length > src.length - src_offset)
    throw FabricError(where() + ": " + op_name(op) + " to peer " + std::to_string(dst.peer) + ": source range " +
                      range(src_offset, length) + " is outside the registered region of " +
                      std::to_string(src.length) + " bytes");
  if (dst_offset > dst.length || length > dst.length - dst_offset)
    throw FabricError(where() + ": " + op_name(op) + " to peer " + std::to_string(dst.peer) + ": destination range " +
                      range(dst_offset, length) + " is outside the peer's registered region of " +
                      std::to_string(dst.length) + " bytes");
  if (length == 0 && !tag) return;  // nothing to move, nothing to announce
  if (tag && *tag > 0xffff) throw FabricError(where() + ": immediate tag " + std::to_string(*tag) + " exceeds 16 bits");
  auto piece = [&](const Piece& p, bool final_piece) {
    NicWrite w;
    w.nic = p.nic;
    w.write.peer = dst.peer;
    w.write.src = src.ptr + src_offset + p.offset;
    w.write.len = p.length;
    w.write.desc = src.nics[p.nic].desc;
    w.write.remote_addr = dst.nics[p.nic].base + dst_offset + p.offset;
    w.write.remote_key = dst.nics[p.nic].key;
    w.write.with_imm = final_piece && tag.has_value();
    w.write.imm = tag ? make_imm(*tag, rank_) : 0;
    // Leading pieces of a split write, and untagged writes (which a later
    // barrier must order), complete only once placed at the target.
    w.write.delivery_complete = !final_piece || !tag.has_value();
    return w;
  };
  std::vector<Piece> pieces = split_write(peer_slot(rank_, dst.peer, world_), length, num_nics(), opts_.split_threshold);
  Job job;
  job.op = op;
  for (size_t i = 0; i + 1 < pieces.size(); ++i) job.lead.push_back(piece(pieces[i], false));
  job.last = piece(pieces.back(), true);
  jobs->push_back(std::move(job));
}

void TransferEngine::write(uint32_t region_id, uint64_t src_offset, uint64_t length, uint32_t remote_id,
                           uint64_t dst_offset, std::optional<uint32_t> tag) {
  check();
  std::vector<Job> jobs;
  std::shared_lock lock(tables_mu_);
  add_job(&jobs, OpKind::kWrite, region(region_id), src_offset, length, remote(remote_id), dst_offset, tag);
  worker_->submit(std::move(jobs));
}

void TransferEngine::scatter(uint32_t group, uint32_t region_id, const ScatterItem* items, size_t count,
                             std::optional<uint32_t> tag) {
  check();
  std::shared_lock lock(tables_mu_);
  const Region& src = region(region_id);
  size_t n = group_size_locked(group);
  std::vector<Job> jobs;
  jobs.reserve(count);
  for (size_t i = 0; i < count; ++i) {
    const ScatterItem& it = items[i];
    if (it.peer >= n)
      throw FabricError(where() + ": scatter item " + std::to_string(i) + " names peer index " +
                        std::to_string(it.peer) + "; the group has " + std::to_string(n) + " peers");
    const GroupEntry& e = groups_[group][it.peer];
    add_job(&jobs, OpKind::kScatter, src, it.src_offset, it.length, remote(e.remote), it.dst_offset, tag);
  }
  worker_->submit(std::move(jobs));
}

void TransferEngine::barrier(uint32_t group, uint32_t tag, double timeout_s, const std::function<void()>& on_idle) {
  check();
  // Writes before the barrier must be placed before peers pass it, also on
  // unordered transports: untagged writes complete only once delivered.
  wait_tx(timeout_s);
  std::vector<Job> jobs;
  std::vector<int> peers;
  {
    std::shared_lock lock(tables_mu_);
    group_size_locked(group);     // a clear error for an unknown group
    const Region* src = nullptr;  // zero-byte writes: any live region will do
    for (const auto& r : regions_)
      if (r.live) {
        src = &r;
        break;
      }
    if (src == nullptr) throw FabricError(where() + ": barrier needs one registered region");
    for (const auto& e : groups_[group]) {
      add_job(&jobs, OpKind::kBarrier, *src, 0, 0, remote(e.remote), 0, tag);
      peers.push_back(e.peer);
    }
  }
  worker_->submit(std::move(jobs));
  for (int peer : peers) wait_imm(tag, peer, 1, timeout_s, on_idle);
}

void TransferEngine::wait_imm(uint32_t tag, int peer, uint64_t count, double timeout_s,
                              const std::function<void()>& on_idle) {
  check_peer(peer, "wait_imm");
  uint32_t imm = make_imm(tag, peer);
  uint64_t seen = 0;
  if (imms_.peek(imm) < count) worker_->nudge();
  auto checks = [&] {
    check();
    if (on_idle) on_idle();
  };
  if (imms_.wait(imm, count, to_ns(timeout_s), checks, &seen)) return;
  throw TimeoutError(where() + ": timed out after " + std::to_string(timeout_s) + " s waiting for " +
                     std::to_string(count) + " arrival(s) of " + describe_imm(imm) + "; " + std::to_string(seen) +
                     " arrived. Is peer " + std::to_string(peer) + " alive and in the same step?");
}

uint64_t TransferEngine::imm_count(uint32_t tag, int peer) const { return imms_.peek(make_imm(tag, peer)); }

void TransferEngine::forget_imm(uint32_t tag) {
  imms_.erase_if([tag](uint32_t imm) { return imm_tag(imm) == tag; });
}

size_t TransferEngine::wait_any_imm(uint32_t tag, const std::vector<int>& peers, const std::vector<uint64_t>& counts,
                                    double timeout_s, const std::function<void()>& on_idle) {
  if (peers.empty() || peers.size() != counts.size())
    throw std::invalid_argument(where() + ": wait_any_imm: got " + std::to_string(peers.size()) + " peers and " +
                                std::to_string(counts.size()) + " counts; expected as many of each, at least one");
  std::vector<uint32_t> imms(peers.size());
  for (size_t i = 0; i < peers.size(); ++i) {
    check_peer(peers[i], "wait_any_imm");
    imms[i] = make_imm(tag, peers[i]);
  }
  worker_->nudge();
  auto checks = [&] {
    check();
    if (on_idle) on_idle();
  };
  int i = imms_.wait_any(imms.data(), counts.data(), imms.size(), to_ns(timeout_s), checks);
  if (i >= 0) return static_cast<size_t>(i);
  std::string missing;
  for (size_t k = 0; k < peers.size(); ++k)
    missing += (k ? ", " : "") + std::to_string(peers[k]) + " (" + std::to_string(imms_.peek(imms[k])) + " of " +
               std::to_string(counts[k]) + ")";
  throw TimeoutError(where() + ": timed out after " + std::to_string(timeout_s) + " s waiting for arrivals of tag " +
                     std::to_string(tag) + " from any of peers " + missing + ". Are they alive and in the same step?");
}

void TransferEngine::wait_tx(double timeout_s) {
  bool done = worker_->wait_idle(to_ns(timeout_s));
  check();
  if (!done)
    throw TimeoutError(where() + ": timed out after " + std::to_string(timeout_s) + " s with " +
                       std::to_string(tx_submitted() - tx_completed()) + " of " + std::to_string(tx_submitted()) +
                       " writes not completed");
}

}  // namespace moe_a2a::fabric
