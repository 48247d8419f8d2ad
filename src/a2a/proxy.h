// The host proxy: a state machine on its own thread that turns the compute
// side's flags into fabric operations (routing rows, private and overflow
// token writes, combine writes) and raises flags when remote data has landed.
// It serves the CPU and the CUDA implementation alike.
#pragma once

#include <atomic>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "call_stamps.h"
#include "config.h"
#include "fabric/proxy_engine.h"
#include "layout.h"
#include "peer_watch.h"
#include "signals.h"
#include "slices.h"
#include "workspace.h"

namespace moe_a2a::a2a {

struct ProxyContext {
  A2AConfig config;
  Layout layout;
  fabric::ProxyEngine* engine = nullptr;  // null when no peer is remote
  fabric::RegionId region;  // our workspace, registered with the engine
  fabric::GroupId group;    // every remote peer, bound to its workspace
  // Where the dispatch and combine rows are written from and to: the same
  // region and group, or (GPU-direct, docs/transport.md) our device
  // workspace and a group bound to every peer's, at the same offsets.
  fabric::RegionId rows_region;
  fabric::GroupId rows_group;
  uint8_t* workspace = nullptr;
  std::vector<uint8_t*> node_workspaces;  // index = rank; nullptr for remote ranks
  std::vector<int> remote_peers;          // ranks, in group order
  ProxySignals* signals = nullptr;
  std::vector<int> pids;  // index = rank: pid of each peer on this host, else 0 (peer_watch.h)
  // The compute side calls Proxy::wake() after raising each of its flags, so
  // an idle proxy may block instead of polling (the CPU backend; kernels that
  // raise flags from the GPU cannot wake a thread).
  bool caller_wakes = false;
  // The compute side calls Proxy::arm() once per call it starts (the CUDA
  // backend, at launch or from a graph's host node): between calls the proxy
  // may block, and it polls only while a call is under way.
  bool caller_arms = false;
  PeerSignals peers;  // per-peer flags, [world] each
  // Ranks lost and masked (live_ranks.h): never waited for, never sent to.
  Masked masked;
  // The dispatches already started (by an instance this one replaces after a
  // loss): the proxy's first call is the next one.
  uint64_t first_epoch = 0;
  // Rows per node: makes the rows of remote sender s that we forward readable
  // by our node peers before we raise forward[s] (the CUDA backend copies the
  // two byte ranges, private then shared rows, from our host workspace to the
  // same offsets of its device workspace). Blocks until done; a throw fails
  // the proxy. Empty: the rows are readable where they landed (CPU, GPU-direct).
  std::function<void(int s, size_t private_off, size_t private_bytes, size_t shared_off, size_t shared_bytes)>
      before_forward;
  // After each slice of rows lands, before the proxy says so (progress,
  // landed, forward): makes it readable where the provider's completion
  // comes before its copy ends (GPU-direct over shm). Blocks; a throw fails
  // the proxy. Empty: rows are readable once reported.
  std::function<void()> after_landing;
  // Rows per node: whether the proxy raises forward[s] at all. False where
  // the compute side forwards in its stream (CUDA graph-safe instances).
  bool raises_forward = true;
};

// The context of a rank's proxy: its workspace (and the node's mappings), the
// engine with our registered workspace region and the group of remote peers.
inline ProxyContext proxy_context(const Workspace& ws, fabric::ProxyEngine* engine, fabric::RegionId region,
                                  fabric::GroupId group, const std::vector<int>& remote_peers, ProxySignals* signals,
                                  PeerSignals peers, const std::vector<int>& pids = {}) {
  ProxyContext ctx;
  ctx.config = ws.config();
  ctx.layout = ws.layout();
  ctx.engine = engine;
  ctx.region = region;
  ctx.group = group;
  ctx.rows_region = region;
  ctx.rows_group = group;
  ctx.workspace = ws.self();
  ctx.node_workspaces = ws.node();
  ctx.remote_peers = remote_peers;
  ctx.signals = signals;
  ctx.pids = pids;
  ctx.peers = peers;
  return ctx;
}

class Proxy {
 public:
  explicit Proxy(ProxyContext ctx);
  ~Proxy();
  Proxy(const Proxy&) = delete;
  Proxy& operator=(const Proxy&) = delete;

  // The first error, once signals->failed is set; the overflow message of the
  // last overflowing epoch otherwise.
  std::string error() const;
  std::string overflow_message() const;
  // True when the first error was a peer's announced failure (PeerFailedError).
  bool peer_failed() const;
  // Ends a blocking wait for the compute side's next flag (caller_wakes).
  void wake();
  // A call was started (caller_arms): poll for its flags from now on.
  void arm();
  // Tells every peer that this rank failed (`text` says how): they stop at once
  // instead of at their timeout. Best effort: a broken fabric reaches no one.
  // `done`: the last phase the compute side completed (peer_watch.h).
  void announce_failure(const std::string& text, uint64_t done);
  // Routing rows this proxy wrote to remote peers, and peers' rows (remote
  // arrivals and same-node flags) it waited for; cached calls add none.
  uint64_t routing_rows_sent() const { return rows_sent_.load(std::memory_order_relaxed); }
  uint64_t routing_rows_received() const { return rows_received_.load(std::memory_order_relaxed); }

 private:
  void run();
  // `next_call`: the wait between calls, which may block until arm().
  bool wait_signal(const Seq& seq, uint64_t epoch, bool next_call = false);
  // Slice k (slices.h) of peer r's rows is staged: its flag (`slices`, may be
  // null), or the peer's, or the whole call's.
  bool wait_slice_packed(const std::atomic<uint64_t>* slices, const Seq& peer, const Seq& all, int r, uint32_t k,
                         uint64_t epoch);
  [[noreturn]] void skipped_own(uint64_t epoch, uint64_t started);
  void step(uint64_t epoch);
  // Dispatch, peer by peer (false when stopping): each remote peer's rows as
  // soon as they are packed, then each sender's arrivals as they complete.
  bool dispatch(uint64_t epoch);
  bool routes_in(uint64_t epoch) const;
  bool take_routes(uint64_t epoch);  // false: over capacity
  void dispatch_overflow(uint64_t epoch);
  // A cached call's routing stamp (call_stamps.h): ours to every remote peer; a peer's, checked.
  void send_routing_stamp(uint64_t epoch);
  void take_routing_stamp(uint64_t epoch, int s);
  // Part `part` of group peer i's dispatch rows (0: private, 1: overflow),
  // slice by slice as each is staged; false when stopping.
  bool post_part(size_t i, int part, uint64_t epoch);
  void wait_dispatch_arrivals(uint64_t epoch);
  // Each sender's slices (`slices[k]`: how its rows are cut) as they land, in
  // the order senders complete them: `progress` (may be null) slice by slice,
  // `landed` once all are in; `on_sender` (cached calls) before `landed`.
  void wait_slices(Tag kind, const std::vector<int>& senders, const std::vector<DispatchSlices>& slices,
                   Seq* progress, Seq* landed, uint64_t epoch, const std::function<void(int)>& on_sender);
  bool combine(uint64_t epoch);
  void delay_writes();
  void node_barrier(uint64_t epoch);
  // A same-node peer we exchange flags with: not us, not masked.
  bool node_peer(int r) const { return ctx_.config.same_node(r) && !is_masked(ctx_.masked, r); }
  // The routing matrix's rows of masked ranks, stale (their last row), are zero for this call.
  void zero_masked_rows();
  void wait_node_flags(FlagKind kind, uint64_t epoch, const char* what);
  void wait_imm(Tag kind, int peer, uint64_t count);  // and counts what it took (call stamps)
  // Slice `index` of part `part` from `peer` (one write); the first of a part counts for the call stamps.
  void take_slice(Tag kind, int peer, int part, uint32_t index);
  // In every wait on peers: stop requested, a peer failed, or runs other calls
  // (`node`: same-node peers' flags too, see check_stamps).
  void on_idle(bool node = false);
  // Remote peers' arrivals against what our call allows (call_stamps.h);
  // `force`: now, not at the next interval. `node`: same-node peers' flags too
  // (only where the proxy knows how far the compute side has gone).
  void check_stamps(bool force, bool node = false);
  void exchange_routing(uint64_t epoch);
  uint32_t tag(Tag kind) const { return wire_tag(ctx_.config.instance, kind); }
  uint32_t tag(Tag kind, int part, uint32_t index) const {
    return slice_tag(ctx_.config.instance, kind, part, index);
  }
  DispatchSlices dispatch_slices_of(uint64_t copies) const {
    return dispatch_slices(copies, ctx_.config.max_private_tokens, ctx_.layout.dispatch_row, ctx_.config.slice_bytes);
  }
  DispatchSlices combine_slices_of(uint64_t copies) const {
    return combine_slices(copies, ctx_.layout.combine_row, ctx_.config.slice_bytes);
  }

  ProxyContext ctx_;
  std::atomic<bool> stop_{false};
  std::mutex wake_mu_;
  std::condition_variable wake_cv_;
  bool woken_ = false;
  std::atomic<uint64_t> armed_{0};  // calls the compute side started (caller_arms)
  PeerWatch watch_;
  mutable std::mutex mu_;
  std::string error_;
  bool peer_failed_ = false;
  std::string overflow_;
  std::vector<uint32_t> routing_;  // snapshot of the routing matrix of the current epoch
  std::vector<size_t> order_;      // remote peers (group indices) in the order we write to them
  std::vector<uint64_t> to_, send_off_;  // of the current epoch: our wire rows to and first send row for each rank
  // MOE_A2A_TEST_DELAY_WRITES_MS: a late peer, for tests. Only its dispatch
  // writes wait: a late combine would let its next dispatch start early by as
  // much (it hears the others' combine on time), and its rows would not be late.
  long delay_ms_ = 0;
  std::atomic<uint64_t> rows_sent_{0}, rows_received_{0};
  bool cached_ = false;  // the current epoch is a cached call (its matrix in routing_)
  uint64_t cached_hash_ = 0;  // routing_hash of that matrix
  CallPosition at_;                  // of the current epoch
  std::vector<int> group_index_;     // index = rank: its index in remote_peers, or -1
  std::vector<StampCounts> taken_;   // index = group index: writes taken in the current epoch
  std::vector<uint64_t> posted_;     // index = group index: dispatch writes posted in the current epoch
  uint64_t dispatch_max_ = 0;        // the most dispatch writes one peer sends us in one call
  std::chrono::steady_clock::time_point next_stamps_{};
  std::thread thread_;
};

}  // namespace moe_a2a::a2a
