#include "engine.h"

#include <errno.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <stdexcept>

#include "checks.h"
#include "error.h"
#include "imm.h"
#include "sharding.h"
#include "wire.h"

namespace moe_a2a::fabric {
namespace {

// Scatters of one group that may be queued at once (routing, the two
// dispatch parts, combine): what the queues are sized for at registration.
constexpr size_t kScattersInFlight = 4;

std::chrono::nanoseconds to_ns(double seconds) {
  return std::chrono::nanoseconds(static_cast<int64_t>(seconds * 1e9));
}

}  // namespace

TransferEngine::TransferEngine(int rank, int world, const EngineOptions& opts)
    : rank_(rank), world_(world), opts_(opts), imms_(opts.num_nics) {
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
    backends_.push_back(open_backend(
        {opts.backend, opts.provider, i, opts.domains.empty() ? "" : opts.domains[i], opts.gpu_memory}));
  for (auto& b : backends_) scratch_mem_.push_back(b->register_memory({&scratch_, sizeof(scratch_)}));
  worker_ = std::make_unique<Worker>(&backends_, &imms_);
}

TransferEngine::~TransferEngine() {
  for (int fd : peer_fds_)
    if (fd >= 0) ::close(fd);
  worker_.reset();  // stop polling before the registrations go
  for (auto& r : regions_)
    if (r.live)
      for (size_t i = 0; i < r.nics.size(); ++i) backends_[i]->deregister_memory(r.nics[i]);
  for (size_t i = 0; i < scratch_mem_.size(); ++i) backends_[i]->deregister_memory(scratch_mem_[i]);
}

void TransferEngine::watch_peers(const std::vector<int>& fds) {
  if (static_cast<int>(fds.size()) != world_)
    throw FabricError(where() + ": watch_peers: got " + std::to_string(fds.size()) + " descriptors; expected " +
                      std::to_string(world_) + " (one per rank, -1 for none)");
  for (int fd : peer_fds_)
    if (fd >= 0) ::close(fd);
  peer_fds_ = fds;
}

bool TransferEngine::peer_gone(int peer) const {
  if (peer < 0 || peer >= static_cast<int>(peer_fds_.size()) || peer_fds_[peer] < 0) return false;
  // Nobody writes on these connections but a peer that leaves (one byte, then its end): the end,
  // or a reset, means the peer's kernel closed it because its process ended.
  pollfd p{peer_fds_[peer], POLLIN | POLLRDHUP, 0};
  if (::poll(&p, 1, 0) <= 0) return false;
  if (p.revents & (POLLHUP | POLLERR | POLLRDHUP)) return true;
  char byte;
  const ssize_t n = ::recv(peer_fds_[peer], &byte, 1, MSG_PEEK | MSG_DONTWAIT);
  return n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR);
}

namespace {
constexpr char kGoodbye = 'G';  // the only byte ever sent on a control connection
}  // namespace

void TransferEngine::leave() {
  for (int fd : peer_fds_)
    if (fd >= 0) (void)::send(fd, &kGoodbye, 1, MSG_DONTWAIT | MSG_NOSIGNAL);
}

bool TransferEngine::peer_left(int peer) const {
  if (peer < 0 || peer >= static_cast<int>(peer_fds_.size()) || peer_fds_[peer] < 0) return false;
  char byte = 0;
  return ::recv(peer_fds_[peer], &byte, 1, MSG_PEEK | MSG_DONTWAIT) == 1 && byte == kGoodbye;
}

std::string TransferEngine::where() const {
  return "rank " + std::to_string(rank_) + " (provider '" + opts_.provider + "')";
}

const Capabilities& TransferEngine::capabilities(int nic) const {
  if (nic < 0 || nic >= num_nics())
    throw FabricError(where() + ": capabilities: nic " + std::to_string(nic) + " is out of range [0, " +
                      std::to_string(num_nics()) + ")");
  return backends_[nic]->capabilities();
}

uint64_t TransferEngine::arrivals(int nic) const {
  capabilities(nic);  // the range check
  return worker_->arrivals(nic);
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
    // Same NIC count on both sides: receivers count a split write as num_nics pieces.
    if (blob.provider != opts_.provider || blob.nics.size() != backends_.size())
      throw FabricError(where() + " with " + std::to_string(backends_.size()) + " NIC(s) cannot talk to rank " +
                        std::to_string(r) + ", which uses provider '" + blob.provider + "' with " +
                        std::to_string(blob.nics.size()) + " NIC(s)");
    for (size_t i = 0; i < backends_.size(); ++i) per_nic[i].push_back(blob.nics[i]);
  }
  for (size_t i = 0; i < backends_.size(); ++i) backends_[i]->insert_peers(per_nic[i]);
  addresses_ = addresses;
  connected_ = true;
}

void TransferEngine::reconnect_peer(int peer, const Bytes& address) {
  check_peer(peer, "reconnect_peer");
  if (!connected_) throw FabricError(where() + ": reconnect_peer before connect");
  if (address == addresses_[peer]) return;
  AddressBlob blob = decode_address(address, "address of rank " + std::to_string(peer) + "'s replacement");
  if (blob.provider != opts_.provider || blob.nics.size() != backends_.size())
    throw FabricError(where() + " with " + std::to_string(backends_.size()) + " NIC(s) cannot talk to rank " +
                      std::to_string(peer) + "'s replacement, which uses provider '" + blob.provider + "' with " +
                      std::to_string(blob.nics.size()) + " NIC(s)");
  for (size_t i = 0; i < backends_.size(); ++i) backends_[i]->replace_peer(peer, blob.nics[i]);
  addresses_[peer] = address;
  worker_->unforgive(peer);
}

void TransferEngine::watch_peer(int peer, int fd) {
  check_peer(peer, "watch_peer");
  if (peer_fds_.empty()) peer_fds_.assign(world_, -1);
  if (peer_fds_[peer] >= 0) ::close(peer_fds_[peer]);
  peer_fds_[peer] = fd;
}

RegionId TransferEngine::register_region(void* ptr, uint64_t length, MemoryKind kind, int device,
                                         const std::string& name) {
  if (ptr == nullptr || length == 0)
    throw FabricError(where() + ": cannot register an empty region (ptr=" + std::to_string(reinterpret_cast<uintptr_t>(ptr)) +
                      ", length=" + std::to_string(length) + ")");
  Region r{static_cast<uint8_t*>(ptr), length, {}};
  for (auto& b : backends_) {
    try {
      r.nics.push_back(b->register_memory({ptr, length, kind, device, name.c_str()}));
    } catch (...) {
      for (size_t i = 0; i < r.nics.size(); ++i) backends_[i]->deregister_memory(r.nics[i]);
      throw;
    }
  }
  std::unique_lock lock(tables_mu_);
  regions_.push_back(std::move(r));
  return RegionId{static_cast<uint32_t>(regions_.size() - 1)};
}

Bytes TransferEngine::region_descriptor(RegionId id) const {
  std::shared_lock lock(tables_mu_);
  const Region& r = region(id);
  RegionBlob blob{r.length, {}};
  for (const auto& m : r.nics) blob.nics.push_back(m.remote);
  return encode_region(blob);
}

RemoteRegionId TransferEngine::add_remote_region(int peer, const Bytes& descriptor) {
  check_peer(peer, "add_remote_region");
  RegionBlob blob = decode_region(descriptor, "region descriptor from rank " + std::to_string(peer));
  if (blob.nics.size() != backends_.size())
    throw FabricError(where() + ": region descriptor from rank " + std::to_string(peer) + " has " +
                      std::to_string(blob.nics.size()) + " NIC key(s); expected " + std::to_string(backends_.size()));
  std::unique_lock lock(tables_mu_);
  remotes_.push_back(RemoteRegion{peer, blob.length, blob.nics});
  return RemoteRegionId{static_cast<uint32_t>(remotes_.size() - 1)};
}

GroupId TransferEngine::create_group(const std::vector<int>& peers, const std::vector<RemoteRegionId>& remote_regions,
                                     int rails) {
  if (rails < 0 || (rails > 0 && world_ % rails != 0))
    throw FabricError(where() + ": create_group: rails: got " + std::to_string(rails) +
                      "; expected 0 or the ranks of a node (a divisor of the world size " + std::to_string(world_) + ")");
  if (peers.size() != remote_regions.size())
    throw FabricError(where() + ": create_group got " + std::to_string(peers.size()) + " peers and " +
                      std::to_string(remote_regions.size()) + " remote regions; expected one region per peer");
  std::unique_lock lock(tables_mu_);
  Group group;
  for (size_t i = 0; i < peers.size(); ++i) {
    check_peer(peers[i], "create_group");
    const RemoteRegion& dst = remote(remote_regions[i]);
    if (dst.peer != peers[i])
      throw FabricError(where() + ": create_group binds peer " + std::to_string(peers[i]) + " to remote region " +
                        std::to_string(remote_regions[i].value) + ", which belongs to rank " + std::to_string(dst.peer));
    GroupEntry e;
    e.peer = peers[i];
    e.remote = remote_regions[i];
    e.length = dst.length;
    const bool rail = rails > 0 && peers[i] % rails == rank_ % rails;
    e.slot = rail ? rail_slot(rank_, peers[i], world_, rails) : peer_slot(rank_, peers[i], world_);
    for (const RemoteKey& k : dst.nics) {
      WriteDesc w;
      w.peer = peers[i];
      w.remote_addr = k.base;
      w.remote_key = k.key;
      e.nics.push_back(w);
    }
    const int home = nic_for_peer(peers[i], num_nics());
    e.barrier.nic = home;
    e.barrier.op = OpKind::kBarrier;
    e.barrier.write = e.nics[home];
    e.barrier.write.src = &scratch_;
    e.barrier.write.desc = scratch_mem_[home].desc;
    e.barrier.write.with_imm = true;
    group.peers.push_back(std::move(e));
  }
  group_writes_ += peers.size() * backends_.size();
  worker_->reserve(group_writes_ * kScattersInFlight);
  groups_.push_back(std::move(group));
  return GroupId{static_cast<uint32_t>(groups_.size() - 1)};
}

void TransferEngine::release(RegionId region_id, std::optional<GroupId> group_id) {
  std::unique_lock lock(tables_mu_);
  if (group_id) group(*group_id);  // a clear error for an unknown or released group, before any change
  Region& r = const_cast<Region&>(region(region_id));
  for (size_t i = 0; i < r.nics.size(); ++i) backends_[i]->deregister_memory(r.nics[i]);
  r.live = false;
  if (!group_id) return;
  Group& g = groups_[group_id->value];
  for (const auto& e : g.peers) remotes_[e.remote.value].live = false;
  group_writes_ -= g.peers.size() * backends_.size();
  g.peers.clear();
  g.live = false;
}

size_t TransferEngine::group_size(GroupId id) const {
  std::shared_lock lock(tables_mu_);
  return group(id).peers.size();
}

int TransferEngine::group_peer(GroupId id, uint32_t index) const {
  std::shared_lock lock(tables_mu_);
  const Group& g = group(id);
  if (index >= g.peers.size())
    throw FabricError(where() + ": peer index " + std::to_string(index) + " is out of range for group " +
                      std::to_string(id.value) + " of " + std::to_string(g.peers.size()) + " peers");
  return g.peers[index].peer;
}

// Callers hold tables_mu_.
const TransferEngine::Group& TransferEngine::group(GroupId id) const {
  if (id.value >= groups_.size() || !groups_[id.value].live)
    throw FabricError(where() + ": unknown group " + std::to_string(id.value) +
                      (id.value < groups_.size() ? " (released)" : ""));
  return groups_[id.value];
}

const TransferEngine::Region& TransferEngine::region(RegionId id) const {
  if (id.value >= regions_.size() || !regions_[id.value].live)
    throw FabricError(where() + ": unknown local region " + std::to_string(id.value) +
                      (id.value < regions_.size() ? " (released)" : ""));
  return regions_[id.value];
}

const TransferEngine::RemoteRegion& TransferEngine::remote(RemoteRegionId id) const {
  if (id.value >= remotes_.size() || !remotes_[id.value].live)
    throw FabricError(where() + ": unknown remote region " + std::to_string(id.value) +
                      (id.value < remotes_.size() ? " (released)" : ""));
  return remotes_[id.value];
}

void TransferEngine::check_peer(int peer, const char* what) const {
  if (peer < 0 || peer >= world_)
    throw FabricError(where() + ": " + what + ": peer " + std::to_string(peer) + " is out of range [0, " +
                      std::to_string(world_) + ")");
}

void TransferEngine::forgive_peer(int peer) {
  check_peer(peer, "forgive_peer");
  worker_->forgive(peer);
}

void TransferEngine::check() const {
  if (worker_->failed()) throw FabricError(where() + ": " + worker_->error());
  if (!connected_) throw FabricError(where() + ": not connected: connect() with every rank's address first");
}

void TransferEngine::check_range(OpKind op, int peer, int slot, const Region& src, uint64_t src_offset,
                                 uint64_t length, uint64_t dst_length, uint64_t dst_offset,
                                 std::optional<uint32_t> tag) const {
  check_write(where(), op_name(op), peer, src.length, src_offset, length, dst_length, dst_offset, tag);
  Piece pieces[kMaxNics];
  const int n = split_pieces(slot, length, num_nics(), opts_.split_threshold, pieces);
  for (int i = 0; i < n; ++i) {
    const uint64_t most = backends_[pieces[i].nic]->capabilities().max_message_size;
    if (most > 0 && pieces[i].length > most)
      throw FabricError(where() + ": " + op_name(op) + " to peer " + std::to_string(peer) + ": a piece of " +
                        std::to_string(pieces[i].length) + " bytes exceeds the most NIC " +
                        std::to_string(pieces[i].nic) + " writes at once (" + std::to_string(most) + " bytes)");
  }
}

void TransferEngine::add_write(Worker::Batch* batch, OpKind op, int slot, const Region& src, uint64_t src_offset,
                               uint64_t length, const WriteDesc* to, uint64_t dst_offset,
                               std::optional<uint32_t> tag) const {
  if (length == 0 && !tag) return;  // nothing to move, nothing to announce
  Piece pieces[kMaxNics];
  const int n = split_pieces(slot, length, num_nics(), opts_.split_threshold, pieces);
  for (int i = 0; i < n; ++i) {
    const Piece& p = pieces[i];
    NicWrite w;
    w.nic = p.nic;
    w.op = op;
    w.write = to[p.nic];
    w.write.src = src.ptr + src_offset + p.offset;
    w.write.len = p.length;
    w.write.desc = src.nics[p.nic].desc;
    w.write.remote_addr += dst_offset + p.offset;
    // Every piece carries the immediate; the receiver counts pieces (imm.h).
    w.write.with_imm = tag.has_value();
    w.write.imm = tag ? (make_imm(*tag, rank_) | (n > 1 ? kImmPieceBit : 0)) : 0;
    // Untagged writes, which a later barrier must order, complete only once placed.
    w.write.delivery_complete = !tag.has_value();
    batch->add(w);
  }
}

void TransferEngine::write(RegionId region_id, uint64_t src_offset, uint64_t length, RemoteRegionId remote_id,
                           uint64_t dst_offset, std::optional<uint32_t> tag) {
  check();
  std::shared_lock lock(tables_mu_);
  const Region& src = region(region_id);
  const RemoteRegion& dst = remote(remote_id);
  const int slot = peer_slot(rank_, dst.peer, world_);
  check_range(OpKind::kWrite, dst.peer, slot, src, src_offset, length, dst.length, dst_offset, tag);
  WriteDesc to[kMaxNics];
  for (size_t i = 0; i < dst.nics.size(); ++i) {
    to[i].peer = dst.peer;
    to[i].remote_addr = dst.nics[i].base;
    to[i].remote_key = dst.nics[i].key;
  }
  Worker::Batch batch(worker_.get());
  add_write(&batch, OpKind::kWrite, slot, src, src_offset, length, to, dst_offset, tag);
}

void TransferEngine::scatter(GroupId group_id, RegionId region_id, const ScatterItem* items, size_t count,
                             std::optional<uint32_t> tag) {
  check();
  std::shared_lock lock(tables_mu_);
  const Region& src = region(region_id);
  const Group& g = group(group_id);
  // Every item is checked before any is queued: a bad one posts nothing.
  for (size_t i = 0; i < count; ++i) {
    const ScatterItem& it = items[i];
    if (it.peer >= g.peers.size())
      throw FabricError(where() + ": scatter item " + std::to_string(i) + " names peer index " +
                        std::to_string(it.peer) + "; the group has " + std::to_string(g.peers.size()) + " peers");
    const GroupEntry& e = g.peers[it.peer];
    check_range(OpKind::kScatter, e.peer, e.slot, src, it.src_offset, it.length, e.length, it.dst_offset, tag);
  }
  Worker::Batch batch(worker_.get());
  for (size_t i = 0; i < count; ++i) {
    const ScatterItem& it = items[i];
    const GroupEntry& e = g.peers[it.peer];
    add_write(&batch, OpKind::kScatter, e.slot, src, it.src_offset, it.length, e.nics.data(), it.dst_offset, tag);
  }
}

void TransferEngine::barrier(GroupId group_id, uint32_t tag, double timeout_s, const std::function<void()>& on_idle) {
  check();
  if (tag > 0xffff) throw FabricError(where() + ": immediate tag " + std::to_string(tag) + " exceeds 16 bits");
  // Writes before the barrier must be placed before peers pass it, also on
  // unordered transports: untagged writes complete only once delivered.
  wait_tx(timeout_s);
  const uint32_t imm = make_imm(tag, rank_);
  size_t n = 0;
  {
    std::shared_lock lock(tables_mu_);
    const Group& g = group(group_id);
    n = g.peers.size();
    Worker::Batch batch(worker_.get());
    for (const auto& e : g.peers) {
      NicWrite w = e.barrier;
      w.write.imm = imm;
      batch.add(w);
    }
  }
  // The group's peers, read again without the lock: a group is never changed, only released.
  for (size_t i = 0; i < n; ++i) wait_imm(tag, group_peer(group_id, static_cast<uint32_t>(i)), 1, timeout_s, on_idle);
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
  throw wait_imm_timeout(where(), timeout_s, count, imm, seen, peer);
}

uint64_t TransferEngine::imm_count(uint32_t tag, int peer) const { return imms_.peek(make_imm(tag, peer)); }

void TransferEngine::forget_imm(uint32_t tag, uint32_t mask) {
  imms_.erase_if([tag, mask](uint32_t imm) { return (imm_tag(imm) & mask) == tag; });
}

void TransferEngine::forget_peer_imm(int peer, uint32_t tag, uint32_t mask) {
  check_peer(peer, "forget_peer_imm");
  imms_.erase_if([peer, tag, mask](uint32_t imm) {
    return imm_peer(imm) == static_cast<uint32_t>(peer) && (imm_tag(imm) & mask) == tag;
  });
}

size_t TransferEngine::wait_any_imm(const std::vector<uint32_t>& tags, const std::vector<int>& peers,
                                    const std::vector<uint64_t>& counts, double timeout_s,
                                    const std::function<void()>& on_idle) {
  check_wait_any(where(), tags.size(), peers.size(), counts.size());
  std::vector<uint32_t> imms(peers.size());
  for (size_t i = 0; i < peers.size(); ++i) {
    check_peer(peers[i], "wait_any_imm");
    imms[i] = make_imm(tags[i], peers[i]);
  }
  worker_->nudge();
  auto checks = [&] {
    check();
    if (on_idle) on_idle();
  };
  int i = imms_.wait_any(imms.data(), counts.data(), imms.size(), to_ns(timeout_s), checks);
  if (i >= 0) return static_cast<size_t>(i);
  std::vector<uint64_t> seen;
  for (uint32_t imm : imms) seen.push_back(imms_.peek(imm));
  throw wait_any_timeout(where(), timeout_s, tags, peers, counts, seen);
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
