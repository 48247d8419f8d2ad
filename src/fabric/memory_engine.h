// Every rank of a world in one process, on an in-memory fabric: a test seam
// for the dispatch/combine protocol, and the shortest complete implementation
// of ProxyEngine (read proxy_engine.h first).
//
// A write is a memcpy from the sender's registered region into the target's,
// then one arrival counted there (proxy_engine.h, promise 1), done on the
// posting thread at once, unless a test holds it. A test chooses the order:
// it holds every write of a sender (or of one sender to one receiver) and
// releases them later, in the order they were posted, reversed, or shuffled,
// so a late peer, slices landing last-first and senders completing in any
// order are set up exactly, not by sleeping. It injects failures: a sender's
// writes that fail (its engine fails, as a broken connection fails a real
// one), a rank that dies (writes to it fail, its own are lost). And it tells
// a test when a rank's proxy is blocked waiting for a peer, so the test
// releases that peer's writes only then.
//
// What it does not model: NICs (no split writes), the cost of moving bytes,
// and a write's bytes landing in pieces. The real providers run under mpirun
// (tests/mpi) for those.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "imm_counters.h"
#include "proxy_engine.h"

namespace moe_a2a::fabric {

class MemoryFabric;

class MemoryEngine : public ProxyEngine {
 public:
  MemoryEngine(MemoryFabric* fabric, int rank);

  // Start-up, as TransferEngine's: our region, a peer's region (by its
  // RegionId at that peer: no descriptor to exchange in one process), and a
  // group binding each peer to its region.
  RegionId register_region(void* ptr, uint64_t length);
  RemoteRegionId add_remote_region(int peer, RegionId peer_region);
  GroupId create_group(const std::vector<int>& peers, const std::vector<RemoteRegionId>& remote_regions);
  // Writes into a released region fail at their sender, as a real
  // provider's connection breaks on a write to deregistered memory.
  void release(RegionId region, std::optional<GroupId> group);

  int rank() const override { return rank_; }
  int world() const override;
  void scatter(GroupId group, RegionId region, const ScatterItem* items, size_t count,
               std::optional<uint32_t> tag) override;
  void write(RegionId region, uint64_t src_offset, uint64_t length, RemoteRegionId remote, uint64_t dst_offset,
             std::optional<uint32_t> tag) override;
  void wait_imm(uint32_t tag, int peer, uint64_t count, double timeout_s,
                const std::function<void()>& on_idle = {}) override;
  using ProxyEngine::wait_any_imm;
  size_t wait_any_imm(const std::vector<uint32_t>& tags, const std::vector<int>& peers,
                      const std::vector<uint64_t>& counts, double timeout_s,
                      const std::function<void()>& on_idle = {}) override;
  uint64_t imm_count(uint32_t tag, int peer) const override;
  void forget_imm(uint32_t tag, uint32_t mask = 0xffffu) override;
  void barrier(GroupId group, uint32_t tag, double timeout_s, const std::function<void()>& on_idle = {}) override;
  void wait_tx(double timeout_s) override;
  uint64_t tx_submitted() const override;
  uint64_t tx_completed() const override;
  std::string error() const override;
  void check() const override;
  size_t group_size(GroupId group) const override;
  int group_peer(GroupId group, uint32_t index) const override;

 private:
  friend class MemoryFabric;
  struct Region {
    uint8_t* ptr = nullptr;
    uint64_t length = 0;
    bool live = true;
  };
  struct Remote {
    int peer = 0;
    RegionId region;       // at the peer
    uint8_t* ptr = nullptr;  // its memory, for the memcpy; still live is checked on delivery
    uint64_t length = 0;
  };
  struct Group {
    std::vector<int> peers;
    std::vector<RemoteRegionId> remotes;
    bool live = true;
  };
  std::string where() const { return "rank " + std::to_string(rank_) + " (in-memory fabric)"; }
  // Callers hold mu_.
  const Region& region(RegionId id) const;
  // Queued with the fabric, or delivered now.
  void post(RegionId src, const Region& from, uint64_t src_offset, uint64_t length, const Remote& to,
            uint64_t dst_offset, std::optional<uint32_t> tag, const char* op);
  // Runs every few ms while a wait of ours blocks on `peers`: the fabric
  // records it for MemoryFabric::wait_blocked, then the caller's checks.
  std::function<void()> blocked_on(std::vector<int> peers, const std::function<void()>& on_idle);
  // Clears the record when the wait ends, however it ends.
  struct Unblock {
    MemoryFabric* fabric;
    int rank;
    ~Unblock();
  };

  MemoryFabric* fabric_;
  int rank_;
  ImmCounters imms_{1};
  mutable std::mutex mu_;
  std::deque<Region> regions_;
  std::deque<Remote> remotes_;
  std::deque<Group> groups_;
};

// Orders in which MemoryFabric::release delivers what it held.
enum class Delivery : uint8_t { kPosted, kReversed, kShuffled };

// One delivered write, for tests that check what crossed the fabric.
struct Delivered {
  int src = 0;
  int dst = 0;
  int tag = -1;  // -1: no immediate
  uint64_t length = 0;
};

class MemoryFabric {
 public:
  explicit MemoryFabric(int world);
  ~MemoryFabric();
  int world() const { return static_cast<int>(engines_.size()); }
  MemoryEngine& engine(int rank);

  // Writes from `src` to `dst` (-1: to anyone) are held from now on. Writes
  // already delivered stay delivered.
  void hold(int src, int dst = -1);
  // Delivers the held writes from `src` to `dst` (-1: any) in `order`
  // (kShuffled: by `seed`), then stops holding them. Returns how many.
  size_t release(int src, int dst = -1, Delivery order = Delivery::kPosted, uint64_t seed = 0);
  // Writes held now from `src` to `dst` (-1: any).
  size_t held(int src = -1, int dst = -1) const;
  // Blocks until `count` writes from `src` to `dst` (-1: any) are held; false
  // after `timeout_s`. A test that knows how many writes a call posts knows
  // then that the whole call is held.
  bool wait_held(int src, int dst, size_t count, double timeout_s);
  // Every later write from `src` to `dst` (-1: any) fails: the sender's
  // engine fails with `why`, and nothing is delivered.
  void fail_writes(int src, int dst, const std::string& why);
  // `rank` is gone: its held writes are lost, its engine fails (so its own
  // proxy stops), and every later write to it fails at its sender.
  void kill(int rank);
  // Blocks until `rank` is inside a wait (wait_imm, wait_any_imm, barrier)
  // that waits for `peer` (-1: for anyone) and has found nothing there;
  // false after `timeout_s`. A test that holds `peer`'s writes knows then
  // that `rank` went as far as it can without them.
  bool wait_blocked(int rank, int peer, double timeout_s);
  // Every write delivered so far, in delivery order.
  std::vector<Delivered> log() const;
  // What a wait of `rank` found nothing from ({}: it is not blocked); its
  // engine's waits call it.
  void set_blocked(int rank, std::vector<int> peers);

 private:
  friend class MemoryEngine;
  struct Pending {
    int src = 0;
    int dst = 0;
    const uint8_t* from = nullptr;
    uint8_t* to = nullptr;
    uint64_t length = 0;
    std::optional<uint32_t> tag;
    RegionId src_region, dst_region;
  };
  // From MemoryEngine::post; fabric lock not held.
  void submit(const Pending& p);
  // Callers hold mu_.
  void deliver(const Pending& p);
  void fail(int rank, const std::string& why);
  bool holds(int src, int dst) const;
  size_t count_held(int src, int dst) const;
  bool live(int rank, RegionId region) const;

  std::vector<std::unique_ptr<MemoryEngine>> engines_;
  mutable std::mutex mu_;
  std::condition_variable cv_;  // completions, failures, blocked waits
  std::vector<std::pair<int, int>> holds_;     // (src, dst), dst -1: any
  std::vector<std::pair<int, int>> failing_;   // (src, dst)
  std::vector<std::string> failing_why_;
  std::vector<bool> dead_;
  std::vector<std::string> errors_;            // per rank: its engine's first failure
  std::vector<uint64_t> submitted_, completed_;
  std::vector<std::vector<int>> blocked_;      // per rank: the peers its current wait found nothing from
  std::deque<Pending> held_;
  std::vector<Delivered> log_;
};

}  // namespace moe_a2a::fabric
