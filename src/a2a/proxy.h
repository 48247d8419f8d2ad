// The host proxy: a state machine on its own thread that turns the compute
// side's flags into fabric operations (routing rows, private and overflow
// token writes, combine writes) and raises flags when remote data has landed.
// It serves the CPU and the CUDA implementation alike.
#pragma once

#include <atomic>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "config.h"
#include "fabric/engine.h"
#include "layout.h"
#include "signals.h"
#include "workspace.h"

namespace moe_a2a::a2a {

struct ProxyContext {
  A2AConfig config;
  Layout layout;
  fabric::TransferEngine* engine = nullptr;  // null when no peer is remote
  uint32_t region = 0;  // our workspace, registered with the engine
  uint32_t group = 0;   // every remote peer, bound to its workspace
  uint8_t* workspace = nullptr;
  std::vector<uint8_t*> node_workspaces;  // index = rank; nullptr for remote ranks
  std::vector<int> remote_peers;          // ranks, in group order
  ProxySignals* signals = nullptr;
  PeerSignals peers;  // per-peer flags, [world] each
};

// The context of a rank's proxy: its workspace (and the node's mappings), the
// engine with our registered workspace region and the group of remote peers.
inline ProxyContext proxy_context(const Workspace& ws, fabric::TransferEngine* engine, uint32_t region,
                                  uint32_t group, const std::vector<int>& remote_peers, ProxySignals* signals,
                                  PeerSignals peers) {
  ProxyContext ctx;
  ctx.config = ws.config();
  ctx.layout = ws.layout();
  ctx.engine = engine;
  ctx.region = region;
  ctx.group = group;
  ctx.workspace = ws.self();
  ctx.node_workspaces = ws.node();
  ctx.remote_peers = remote_peers;
  ctx.signals = signals;
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

 private:
  void run();
  bool wait_signal(const Seq& seq, uint64_t epoch);
  // Peer r's rows are packed: its own flag, or the whole call's.
  bool wait_packed(const Seq& peer, const Seq& all, uint64_t epoch);
  void step(uint64_t epoch);
  // Dispatch, peer by peer (false when stopping): each remote peer's rows as
  // soon as they are packed, then each sender's arrivals as they complete.
  bool dispatch(uint64_t epoch);
  bool routes_in(uint64_t epoch) const;
  bool take_routes(uint64_t epoch);  // false: over capacity
  void dispatch_overflow(uint64_t epoch);
  void post_private(size_t i);
  void post_overflow(size_t i);
  void wait_dispatch_arrivals(uint64_t epoch);
  bool combine(uint64_t epoch);
  void delay_writes();
  void node_barrier(uint64_t epoch);
  void wait_node_flags(FlagKind kind, uint64_t epoch, const char* what);
  uint32_t tag(Tag kind) const { return wire_tag(ctx_.config.instance, kind); }

  ProxyContext ctx_;
  std::atomic<bool> stop_{false};
  mutable std::mutex mu_;
  std::string error_;
  std::string overflow_;
  std::vector<uint32_t> routing_;  // snapshot of the routing matrix of the current epoch
  std::vector<size_t> order_;      // remote peers (group indices) in the order we write to them
  std::vector<uint64_t> to_, send_off_;  // of the current epoch: our copies to and first send row for each rank
  // MOE_A2A_TEST_DELAY_WRITES_MS: a late peer, for tests. Only its dispatch
  // writes wait: a late combine would let its next dispatch start early by as
  // much (it hears the others' combine on time), and its rows would not be late.
  long delay_ms_ = 0;
  std::thread thread_;
};

}  // namespace moe_a2a::a2a
