#include "memory_engine.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <random>

#include "checks.h"
#include "error.h"
#include "imm.h"

namespace moe_a2a::fabric {
namespace {

std::chrono::nanoseconds to_ns(double seconds) { return std::chrono::nanoseconds(static_cast<int64_t>(seconds * 1e9)); }

bool matches(int rule, int value) { return rule < 0 || rule == value; }

}  // namespace

// -- one rank's endpoint -----------------------------------------------------------------------

MemoryEngine::MemoryEngine(MemoryFabric* fabric, int rank) : fabric_(fabric), rank_(rank) {}

int MemoryEngine::world() const { return fabric_->world(); }

RegionId MemoryEngine::register_region(void* ptr, uint64_t length) {
  if (ptr == nullptr || length == 0) throw FabricError(where() + ": cannot register an empty region");
  std::lock_guard<std::mutex> lock(mu_);
  regions_.push_back({static_cast<uint8_t*>(ptr), length, true});
  return RegionId{static_cast<uint32_t>(regions_.size() - 1)};
}

const MemoryEngine::Region& MemoryEngine::region(RegionId id) const {
  if (id.value >= regions_.size() || !regions_[id.value].live)
    throw FabricError(where() + ": unknown or released local region " + std::to_string(id.value));
  return regions_[id.value];
}

RemoteRegionId MemoryEngine::add_remote_region(int peer, RegionId peer_region) {
  if (peer < 0 || peer >= world() || peer == rank_)
    throw FabricError(where() + ": add_remote_region: peer " + std::to_string(peer) + " is not another rank of [0, " +
                      std::to_string(world()) + ")");
  Remote r{peer, peer_region};
  {
    MemoryEngine& other = fabric_->engine(peer);
    std::lock_guard<std::mutex> lock(other.mu_);
    const Region& at = other.region(peer_region);
    r.ptr = at.ptr;
    r.length = at.length;
  }
  std::lock_guard<std::mutex> lock(mu_);
  remotes_.push_back(r);
  return RemoteRegionId{static_cast<uint32_t>(remotes_.size() - 1)};
}

GroupId MemoryEngine::create_group(const std::vector<int>& peers, const std::vector<RemoteRegionId>& remote_regions) {
  std::lock_guard<std::mutex> lock(mu_);
  if (peers.size() != remote_regions.size())
    throw FabricError(where() + ": create_group: got " + std::to_string(peers.size()) + " peers and " +
                      std::to_string(remote_regions.size()) + " remote regions; expected one region per peer");
  for (size_t i = 0; i < peers.size(); ++i)
    if (remote_regions[i].value >= remotes_.size() || remotes_[remote_regions[i].value].peer != peers[i])
      throw FabricError(where() + ": create_group: remote region " + std::to_string(remote_regions[i].value) +
                        " is not peer " + std::to_string(peers[i]) + "'s");
  groups_.push_back({peers, remote_regions, true});
  return GroupId{static_cast<uint32_t>(groups_.size() - 1)};
}

void MemoryEngine::release(RegionId id, std::optional<GroupId> group) {
  std::lock_guard<std::mutex> lock(mu_);
  const_cast<Region&>(region(id)).live = false;
  if (group && group->value < groups_.size()) groups_[group->value].live = false;
}

size_t MemoryEngine::group_size(GroupId id) const {
  std::lock_guard<std::mutex> lock(mu_);
  if (id.value >= groups_.size() || !groups_[id.value].live)
    throw FabricError(where() + ": unknown or released group " + std::to_string(id.value));
  return groups_[id.value].peers.size();
}

int MemoryEngine::group_peer(GroupId id, uint32_t index) const {
  if (index >= group_size(id))
    throw FabricError(where() + ": peer index " + std::to_string(index) + " is out of range for group " +
                      std::to_string(id.value));
  std::lock_guard<std::mutex> lock(mu_);
  return groups_[id.value].peers[index];
}

void MemoryEngine::post(RegionId src, const Region& from, uint64_t src_offset, uint64_t length, const Remote& to,
                        uint64_t dst_offset, std::optional<uint32_t> tag, const char* op) {
  check_write(where(), op, to.peer, from.length, src_offset, length, to.length, dst_offset, tag);
  MemoryFabric::Pending p;
  p.src = rank_;
  p.dst = to.peer;
  p.from = from.ptr + src_offset;
  p.to = to.ptr + dst_offset;
  p.length = length;
  p.tag = tag;
  p.src_region = src;
  p.dst_region = to.region;
  fabric_->submit(p);
}

void MemoryEngine::scatter(GroupId group, RegionId src, const ScatterItem* items, size_t count,
                           std::optional<uint32_t> tag) {
  check();
  std::vector<Remote> to;
  Region from;
  {
    std::lock_guard<std::mutex> lock(mu_);
    from = region(src);
    if (group.value >= groups_.size() || !groups_[group.value].live)
      throw FabricError(where() + ": unknown or released group " + std::to_string(group.value));
    const Group& g = groups_[group.value];
    for (size_t i = 0; i < count; ++i) {
      if (items[i].peer >= g.peers.size())
        throw FabricError(where() + ": scatter item " + std::to_string(i) + " names peer index " +
                          std::to_string(items[i].peer) + "; the group has " + std::to_string(g.peers.size()) +
                          " peers");
      to.push_back(remotes_[g.remotes[items[i].peer].value]);
      check_write(where(), "scatter", to.back().peer, from.length, items[i].src_offset, items[i].length,
                  to.back().length, items[i].dst_offset, tag);
    }
  }
  for (size_t i = 0; i < count; ++i)
    post(src, from, items[i].src_offset, items[i].length, to[i], items[i].dst_offset, tag, "scatter");
}

void MemoryEngine::write(RegionId src, uint64_t src_offset, uint64_t length, RemoteRegionId remote,
                         uint64_t dst_offset, std::optional<uint32_t> tag) {
  check();
  Region from;
  Remote to;
  {
    std::lock_guard<std::mutex> lock(mu_);
    from = region(src);
    if (remote.value >= remotes_.size())
      throw FabricError(where() + ": unknown remote region " + std::to_string(remote.value));
    to = remotes_[remote.value];
  }
  post(src, from, src_offset, length, to, dst_offset, tag, "write");
}

std::function<void()> MemoryEngine::blocked_on(std::vector<int> peers, const std::function<void()>& on_idle) {
  return [this, peers = std::move(peers), &on_idle] {
    check();
    fabric_->set_blocked(rank_, peers);
    if (on_idle) on_idle();
  };
}

MemoryEngine::Unblock::~Unblock() { fabric->set_blocked(rank, {}); }

void MemoryEngine::wait_imm(uint32_t tag, int peer, uint64_t count, double timeout_s,
                            const std::function<void()>& on_idle) {
  if (peer < 0 || peer >= world())
    throw FabricError(where() + ": wait_imm: peer " + std::to_string(peer) + " is out of range");
  const uint32_t imm = make_imm(tag, peer);
  uint64_t seen = 0;
  bool done;
  {
    auto checks = blocked_on({peer}, on_idle);
    Unblock unblock{fabric_, rank_};
    done = imms_.wait(imm, count, to_ns(timeout_s), checks, &seen);
  }
  if (!done) throw wait_imm_timeout(where(), timeout_s, count, imm, seen, peer);
}

size_t MemoryEngine::wait_any_imm(const std::vector<uint32_t>& tags, const std::vector<int>& peers,
                                  const std::vector<uint64_t>& counts, double timeout_s,
                                  const std::function<void()>& on_idle) {
  check_wait_any(where(), tags.size(), peers.size(), counts.size());
  std::vector<uint32_t> imms;
  for (size_t i = 0; i < peers.size(); ++i) imms.push_back(make_imm(tags[i], peers[i]));
  int i;
  {
    auto checks = blocked_on(peers, on_idle);
    Unblock unblock{fabric_, rank_};
    i = imms_.wait_any(imms.data(), counts.data(), imms.size(), to_ns(timeout_s), checks);
  }
  if (i >= 0) return static_cast<size_t>(i);
  std::vector<uint64_t> seen;
  for (uint32_t imm : imms) seen.push_back(imms_.peek(imm));
  throw wait_any_timeout(where(), timeout_s, tags, peers, counts, seen);
}

uint64_t MemoryEngine::imm_count(uint32_t tag, int peer) const { return imms_.peek(make_imm(tag, peer)); }

void MemoryEngine::forget_imm(uint32_t tag, uint32_t mask) {
  imms_.erase_if([tag, mask](uint32_t imm) { return (imm_tag(imm) & mask) == tag; });
}

void MemoryEngine::barrier(GroupId group, uint32_t tag, double timeout_s, const std::function<void()>& on_idle) {
  wait_tx(timeout_s);  // what we posted before is placed before any peer passes
  const size_t n = group_size(group);
  std::vector<Remote> to;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (RemoteRegionId r : groups_[group.value].remotes) to.push_back(remotes_[r.value]);
  }
  for (const Remote& r : to) {
    MemoryFabric::Pending p;
    p.src = rank_;
    p.dst = r.peer;
    p.tag = tag;
    p.dst_region = r.region;
    p.src_region = RegionId{UINT32_MAX};  // nothing to read
    fabric_->submit(p);
  }
  for (size_t i = 0; i < n; ++i) wait_imm(tag, to[i].peer, 1, timeout_s, on_idle);
}

void MemoryEngine::wait_tx(double timeout_s) {
  std::unique_lock<std::mutex> lock(fabric_->mu_);
  const bool done = fabric_->cv_.wait_for(lock, to_ns(timeout_s), [&] {
    return fabric_->completed_[rank_] == fabric_->submitted_[rank_] || !fabric_->errors_[rank_].empty();
  });
  if (!fabric_->errors_[rank_].empty()) throw FabricError(where() + ": " + fabric_->errors_[rank_]);
  if (!done)
    throw TimeoutError(where() + ": timed out after " + std::to_string(timeout_s) + " s with " +
                       std::to_string(fabric_->submitted_[rank_] - fabric_->completed_[rank_]) + " of " +
                       std::to_string(fabric_->submitted_[rank_]) + " writes not completed (held by the test?)");
}

uint64_t MemoryEngine::tx_submitted() const {
  std::lock_guard<std::mutex> lock(fabric_->mu_);
  return fabric_->submitted_[rank_];
}

uint64_t MemoryEngine::tx_completed() const {
  std::lock_guard<std::mutex> lock(fabric_->mu_);
  return fabric_->completed_[rank_];
}

std::string MemoryEngine::error() const {
  std::lock_guard<std::mutex> lock(fabric_->mu_);
  return fabric_->errors_[rank_];
}

void MemoryEngine::check() const {
  const std::string e = error();
  if (!e.empty()) throw FabricError(where() + ": " + e);
}

// -- the world ---------------------------------------------------------------------------------

MemoryFabric::MemoryFabric(int world) {
  if (world < 1 || world > kMaxRanks)
    throw FabricError("MemoryFabric: world size " + std::to_string(world) + " is outside [1, " +
                      std::to_string(kMaxRanks) + "]");
  for (int r = 0; r < world; ++r) engines_.push_back(std::make_unique<MemoryEngine>(this, r));
  dead_.assign(world, false);
  errors_.assign(world, "");
  submitted_.assign(world, 0);
  completed_.assign(world, 0);
  blocked_.assign(world, {});
}

MemoryFabric::~MemoryFabric() = default;

MemoryEngine& MemoryFabric::engine(int rank) {
  if (rank < 0 || rank >= world())
    throw FabricError("MemoryFabric: rank " + std::to_string(rank) + " is outside [0, " + std::to_string(world()) +
                      ")");
  return *engines_[rank];
}

bool MemoryFabric::holds(int src, int dst) const {
  for (const auto& [s, d] : holds_)
    if (s == src && matches(d, dst)) return true;
  return false;
}

bool MemoryFabric::live(int rank, RegionId region) const {
  const MemoryEngine& e = *engines_[rank];
  std::lock_guard<std::mutex> lock(e.mu_);
  return region.value < e.regions_.size() && e.regions_[region.value].live;
}

void MemoryFabric::fail(int rank, const std::string& why) {
  if (errors_[rank].empty()) errors_[rank] = why;
  cv_.notify_all();
}

void MemoryFabric::submit(const Pending& p) {
  std::lock_guard<std::mutex> lock(mu_);
  if (dead_[p.src]) return;  // a gone rank's writes go nowhere
  ++submitted_[p.src];
  for (size_t i = 0; i < failing_.size(); ++i)
    if (failing_[i].first == p.src && matches(failing_[i].second, p.dst)) {
      ++completed_[p.src];
      fail(p.src, "write to peer " + std::to_string(p.dst) + " failed: " + failing_why_[i]);
      return;
    }
  if (holds(p.src, p.dst)) {
    held_.push_back(p);
    cv_.notify_all();
    return;
  }
  deliver(p);
}

void MemoryFabric::deliver(const Pending& p) {
  ++completed_[p.src];
  const std::string to = "write to peer " + std::to_string(p.dst) + " failed: ";
  if (dead_[p.dst]) return fail(p.src, to + "peer " + std::to_string(p.dst) + " is gone");
  if (!live(p.dst, p.dst_region)) return fail(p.src, to + "its region was released");
  if (p.length > 0) {
    if (!live(p.src, p.src_region)) return fail(p.src, to + "the source region was released");
    std::memcpy(p.to, p.from, p.length);
  }
  if (p.tag) engines_[p.dst]->imms_.add(make_imm(*p.tag, p.src));
  log_.push_back({p.src, p.dst, p.tag ? static_cast<int>(*p.tag) : -1, p.length});
  cv_.notify_all();
}

void MemoryFabric::hold(int src, int dst) {
  std::lock_guard<std::mutex> lock(mu_);
  holds_.emplace_back(src, dst);
}

size_t MemoryFabric::release(int src, int dst, Delivery order, uint64_t seed) {
  std::lock_guard<std::mutex> lock(mu_);
  holds_.erase(std::remove_if(holds_.begin(), holds_.end(),
                              [&](const auto& h) { return h.first == src && (dst < 0 || h.second == dst); }),
               holds_.end());
  std::vector<Pending> out;
  std::deque<Pending> kept;
  for (const Pending& p : held_) (p.src == src && matches(dst, p.dst) ? out.push_back(p) : kept.push_back(p));
  held_.swap(kept);
  if (order == Delivery::kReversed) std::reverse(out.begin(), out.end());
  if (order == Delivery::kShuffled) std::shuffle(out.begin(), out.end(), std::mt19937_64(seed));
  for (const Pending& p : out) deliver(p);
  return out.size();
}

size_t MemoryFabric::count_held(int src, int dst) const {
  return std::count_if(held_.begin(), held_.end(),
                       [&](const Pending& p) { return matches(src, p.src) && matches(dst, p.dst); });
}

size_t MemoryFabric::held(int src, int dst) const {
  std::lock_guard<std::mutex> lock(mu_);
  return count_held(src, dst);
}

bool MemoryFabric::wait_held(int src, int dst, size_t count, double timeout_s) {
  std::unique_lock<std::mutex> lock(mu_);
  return cv_.wait_for(lock, to_ns(timeout_s), [&] { return count_held(src, dst) >= count; });
}

void MemoryFabric::fail_writes(int src, int dst, const std::string& why) {
  std::lock_guard<std::mutex> lock(mu_);
  failing_.emplace_back(src, dst);
  failing_why_.push_back(why);
}

void MemoryFabric::kill(int rank) {
  std::lock_guard<std::mutex> lock(mu_);
  dead_[rank] = true;
  held_.erase(std::remove_if(held_.begin(), held_.end(), [&](const Pending& p) { return p.src == rank; }),
              held_.end());
  fail(rank, "this rank was killed by the test");
}

void MemoryFabric::set_blocked(int rank, std::vector<int> peers) {
  std::lock_guard<std::mutex> lock(mu_);
  blocked_[rank] = std::move(peers);
  cv_.notify_all();
}

bool MemoryFabric::wait_blocked(int rank, int peer, double timeout_s) {
  engine(rank);  // the range check
  std::unique_lock<std::mutex> lock(mu_);
  return cv_.wait_for(lock, to_ns(timeout_s), [&] {
    const auto& b = blocked_[rank];
    return peer < 0 ? !b.empty() : std::find(b.begin(), b.end(), peer) != b.end();
  });
}

std::vector<Delivered> MemoryFabric::log() const {
  std::lock_guard<std::mutex> lock(mu_);
  return log_;
}

}  // namespace moe_a2a::fabric
