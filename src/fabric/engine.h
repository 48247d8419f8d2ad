// TransferEngine: one per rank and provider, shared by every AllToAll of the
// process (each registers its own region and group, and releases them when it
// closes; their immediate tags differ, see a2a/signals.h). It owns a backend per NIC and the worker
// thread, knows every peer's address, the regions registered here and the
// remote regions peers described to us, and offers the few operations the
// dispatch/combine protocol needs: write, scatter, barrier and waits on
// immediate and transmit counters (proxy_engine.h says what each promises).
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
#include "handles.h"
#include "imm_counters.h"
#include "proxy_engine.h"
#include "worker.h"

namespace moe_a2a::fabric {

struct EngineOptions {
  std::string backend = "libfabric";  // open_backend's name
  std::string provider = "tcp";
  int num_nics = 1;
  // Writes of at least this many bytes are split across all NICs.
  uint64_t split_threshold = 1ull << 20;
  // One libfabric domain name per NIC (size num_nics), or empty: every NIC
  // opens the provider's first domain.
  std::vector<std::string> domains;
  // Ask for CUDA memory registration (FI_HMEM): a CUDA rank's engine; the
  // backends open without it where the provider does not offer it.
  bool gpu_memory = false;
};

class TransferEngine : public ProxyEngine {
 public:
  TransferEngine(int rank, int world, const EngineOptions& opts);
  ~TransferEngine() override;

  int rank() const override { return rank_; }
  int world() const override { return world_; }
  int num_nics() const { return static_cast<int>(backends_.size()); }
  const std::string& provider() const { return opts_.provider; }
  const std::string& backend() const { return opts_.backend; }
  // What NIC `nic`'s backend reports it can do.
  const Capabilities& capabilities(int nic) const;

  // Start-up: our address blob, then every rank's (index = rank).
  Bytes address() const;
  void connect(const std::vector<Bytes>& addresses);

  // Liveness of peers on other hosts: one connected stream socket per such
  // peer (index = rank, -1 for none), whose EOF means the peer's process is
  // gone (its kernel closed the connection). The engine owns the descriptors
  // from here on and closes them with itself.
  void watch_peers(const std::vector<int>& fds);
  bool peer_gone(int peer) const override;
  // This process is ending (its script did, at interpreter exit) and its writes were handed over
  // (wait_tx first): one byte on each control connection tells the peers, whose waits then let the
  // writes land after the connection's end (peer_left). Never blocks; best effort.
  void leave();
  bool peer_left(int peer) const override;
  // `peer` is gone and every survivor masked it (moe_a2a.masking): failures
  // of writes to it, past and future, no longer fail the engine. Affects every
  // instance that shares the engine. Never blocks.
  void forgive_peer(int peer);
  // Rank `peer` is a new process (moe_a2a.rejoin): our writes go to its
  // `address` (an address() blob, every NIC) and its failures count again;
  // nothing where the address is the one we have (an instance that rejoins
  // after another on this engine). Never blocks.
  void reconnect_peer(int peer, const Bytes& address);
  // Its liveness connection (watch_peers) is `fd` from here on; the old one closes.
  void watch_peer(int peer, int fd);

  // `kind` other than host memory needs a backend that registers it
  // (Capabilities::gpu_memory); otherwise the error says what would be needed.
  // `name` says what the region holds in a registration error.
  RegionId register_region(void* ptr, uint64_t length, MemoryKind kind = MemoryKind::kHost, int device = -1,
                           const std::string& name = "region");
  Bytes region_descriptor(RegionId region) const;
  RemoteRegionId add_remote_region(int peer, const Bytes& descriptor);
  // A group binds each peer to the remote region its writes land in. Its
  // requests are built here, once: per peer and NIC the address and key of
  // the remote region, and the barrier's zero-byte write; a step fills in
  // only offsets, lengths and the immediate.
  // `rails` (ranks per node; 0: none): the group's data goes only to the
  // peers with our local index on other nodes, whose NICs are then chosen
  // by rail_slot (sharding.h) instead of the plain distance.
  GroupId create_group(const std::vector<int>& peers, const std::vector<RemoteRegionId>& remote_regions,
                       int rails = 0);
  // Deregisters a local region and drops a group (and the remote regions it
  // binds): what one user of a shared engine releases when it closes. Ids are
  // not reused. Without a group: a start-up that failed before its group was made.
  void release(RegionId region, std::optional<GroupId> group);
  size_t group_size(GroupId group) const override;
  int group_peer(GroupId group, uint32_t index) const override;

  // The data path (proxy_engine.h). A write of at least split_threshold
  // bytes is split across every NIC, each piece with the immediate; the
  // receiver counts pieces (imm_counters.h).
  void write(RegionId region, uint64_t src_offset, uint64_t length, RemoteRegionId remote, uint64_t dst_offset,
             std::optional<uint32_t> tag) override;
  void scatter(GroupId group, RegionId region, const ScatterItem* items, size_t count,
               std::optional<uint32_t> tag) override;
  void barrier(GroupId group, uint32_t tag, double timeout_s, const std::function<void()>& on_idle = {}) override;
  void wait_imm(uint32_t tag, int peer, uint64_t count, double timeout_s,
                const std::function<void()>& on_idle = {}) override;
  uint64_t imm_count(uint32_t tag, int peer) const override;
  void forget_imm(uint32_t tag, uint32_t mask = 0xffffu) override;
  // The same, for arrivals from `peer` only: a replaced rank's old process
  // left them, and the new one's must not pair with them.
  void forget_peer_imm(int peer, uint32_t tag, uint32_t mask);
  using ProxyEngine::wait_any_imm;
  size_t wait_any_imm(const std::vector<uint32_t>& tags, const std::vector<int>& peers,
                      const std::vector<uint64_t>& counts, double timeout_s,
                      const std::function<void()>& on_idle = {}) override;

  // Writes posted (a split write counts one per piece) and completed.
  uint64_t tx_submitted() const override { return worker_->submitted(); }
  uint64_t tx_completed() const override { return worker_->completed(); }
  // Debug counters: immediates that arrived on NIC `nic`; times a hot-path
  // queue grew (a heap allocation on the hot path; 0 in steady state).
  uint64_t arrivals(int nic) const;
  uint64_t hot_path_allocations() const { return worker_->allocations(); }
  void wait_tx(double timeout_s) override;
  std::string error() const override { return worker_->error(); }
  // Throws the worker's error, if any, or that connect() has not run.
  void check() const override;

 private:
  std::vector<int> peer_fds_;  // watch_peers: index = rank, -1 where none
  std::vector<Bytes> addresses_;  // connect, reconnect_peer: index = rank

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
  // A group's prebuilt requests, per peer.
  struct GroupEntry {
    int peer = 0;
    RemoteRegionId remote;
    uint64_t length = 0;              // of the remote region, for bounds checks
    std::vector<WriteDesc> nics;      // per NIC: peer, remote base address and key
    int slot = 0;                     // which NIC a write starts on (sharding.h)
    NicWrite barrier;                 // the zero-byte write; the immediate is filled per call
  };
  struct Group {
    std::vector<GroupEntry> peers;
    bool live = true;
  };

  const Group& group(GroupId id) const;
  const Region& region(RegionId id) const;
  const RemoteRegion& remote(RemoteRegionId id) const;
  void check_peer(int peer, const char* what) const;
  // `slot`: the peer's (sharding.h), which picks the NIC(s) of the write.
  void check_range(OpKind op, int peer, int slot, const Region& src, uint64_t src_offset, uint64_t length,
                   uint64_t dst_length, uint64_t dst_offset, std::optional<uint32_t> tag) const;
  // Appends the piece(s) of one write; `to` holds the destination's per-NIC
  // requests (peer, base address, key).
  void add_write(Worker::Batch* batch, OpKind op, int slot, const Region& src, uint64_t src_offset, uint64_t length,
                 const WriteDesc* to, uint64_t dst_offset, std::optional<uint32_t> tag) const;
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
  std::deque<Group> groups_;
  size_t group_writes_ = 0;  // peers x NICs over the live groups: what the queues are sized for
  // The source of barrier writes: zero bytes move, but providers want a
  // registered buffer.
  uint64_t scratch_ = 0;
  std::vector<LocalMemory> scratch_mem_;
  ImmCounters imms_;
  std::unique_ptr<Worker> worker_;
};

}  // namespace moe_a2a::fabric
