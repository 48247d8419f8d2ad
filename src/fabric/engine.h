// TransferEngine: one per rank and provider, shared by every AllToAll of the
// process (each registers its own region and group, and releases them when it
// closes; their immediate tags differ, see a2a/signals.h). It owns a backend per NIC and the worker
// thread, knows every peer's address, the regions registered here and the
// remote regions peers described to us, and offers the few operations the
// dispatch/combine protocol needs: write, scatter, barrier and waits on
// immediate and transmit counters.
#pragma once

#include <cstdint>
#include <memory>
#include <deque>
#include <functional>
#include <optional>
#include <shared_mutex>
#include <string>
#include <vector>

#include "backend.h"
#include "imm_counters.h"
#include "worker.h"

namespace moe_a2a::fabric {

struct EngineOptions {
  std::string provider = "tcp";
  int num_nics = 1;
  // Writes of at least this many bytes are split across all NICs.
  uint64_t split_threshold = 1ull << 20;
  // One libfabric domain name per NIC (size num_nics), or empty: every NIC
  // opens the provider's first domain.
  std::vector<std::string> domains;
};

// One destination of a scatter: `peer` indexes the group.
struct ScatterItem {
  uint32_t peer = 0;
  uint64_t src_offset = 0;
  uint64_t length = 0;
  uint64_t dst_offset = 0;
};

class TransferEngine {
 public:
  TransferEngine(int rank, int world, const EngineOptions& opts);
  ~TransferEngine();

  int rank() const { return rank_; }
  int world() const { return world_; }
  int num_nics() const { return static_cast<int>(backends_.size()); }
  const std::string& provider() const { return opts_.provider; }

  // Start-up: our address blob, then every rank's (index = rank).
  Bytes address() const;
  void connect(const std::vector<Bytes>& addresses);

  uint32_t register_region(void* ptr, uint64_t length);
  Bytes region_descriptor(uint32_t region) const;
  uint32_t add_remote_region(int peer, const Bytes& descriptor);
  // A group binds each peer to the remote region its writes land in; the
  // addresses and keys are resolved here, once.
  uint32_t create_group(const std::vector<int>& peers, const std::vector<uint32_t>& remote_regions);
  // Deregisters a local region and drops a group (and the remote regions it
  // binds): what one user of a shared engine releases when it closes. Ids are
  // not reused.
  void release(uint32_t region, uint32_t group);
  size_t group_size(uint32_t group) const;
  int group_peer(uint32_t group, uint32_t index) const;

  // Immediates are 16-bit tags; the receiver sees (tag, our rank).
  void write(uint32_t region, uint64_t src_offset, uint64_t length, uint32_t remote, uint64_t dst_offset,
             std::optional<uint32_t> tag);
  void scatter(uint32_t group, uint32_t region, const ScatterItem* items, size_t count, std::optional<uint32_t> tag);
  // A zero-byte write with `tag` to every peer of the group, then a wait for
  // the same from each of them.
  void barrier(uint32_t group, uint32_t tag, double timeout_s, const std::function<void()>& on_idle = {});

  // Waits for `count` arrivals of `tag` from `peer` and consumes them.
  // `on_idle` runs every few milliseconds while waiting; it may throw to end
  // the wait (a peer that announced a failure, or died).
  void wait_imm(uint32_t tag, int peer, uint64_t count, double timeout_s, const std::function<void()>& on_idle = {});
  uint64_t imm_count(uint32_t tag, int peer) const;
  // Forgets arrivals of `tag` from every peer, counted but never waited for.
  void forget_imm(uint32_t tag);
  // Waits until some peers[i] has sent counts[i] arrivals of `tag`; returns
  // that i, consuming nothing (wait_imm takes them). Receivers use it to
  // serve peers in the order their data completes.
  size_t wait_any_imm(uint32_t tag, const std::vector<int>& peers, const std::vector<uint64_t>& counts,
                      double timeout_s, const std::function<void()>& on_idle = {});

  uint64_t tx_submitted() const { return worker_->submitted(); }
  uint64_t tx_completed() const { return worker_->completed(); }
  void wait_tx(double timeout_s);
  std::string error() const { return worker_->error(); }
  // Throws the worker's error, if any.
  void check() const;

 private:
  struct Region {
    uint8_t* ptr = nullptr;
    uint64_t length = 0;
    std::vector<LocalMemory> nics;
    bool live = true;
  };
  struct RemoteRegion {
    int peer = 0;
    uint64_t length = 0;
    std::vector<RemoteKey> nics;
    bool live = true;
  };
  struct GroupEntry {
    int peer;
    uint32_t remote;
  };

  size_t group_size_locked(uint32_t group) const;
  const Region& region(uint32_t id) const;
  const RemoteRegion& remote(uint32_t id) const;
  void check_peer(int peer, const char* what) const;
  void add_job(std::vector<Job>* jobs, OpKind op, const Region& src, uint64_t src_offset, uint64_t length,
               const RemoteRegion& dst, uint64_t dst_offset, std::optional<uint32_t> tag) const;
  std::string where() const;

  int rank_;
  int world_;
  EngineOptions opts_;
  std::vector<std::unique_ptr<Backend>> backends_;
  bool connected_ = false;
  // Tables of several users (their proxies post writes while another
  // instance registers): a deque keeps references stable as they grow, the
  // lock orders additions and releases against lookups.
  mutable std::shared_mutex tables_mu_;
  std::deque<Region> regions_;
  std::deque<RemoteRegion> remotes_;
  std::deque<std::vector<GroupEntry>> groups_;
  std::deque<bool> group_live_;
  ImmCounters imms_;
  std::unique_ptr<Worker> worker_;
};

}  // namespace moe_a2a::fabric
