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
};

// The context of a rank's proxy: its workspace (and the node's mappings), the
// engine with our registered workspace region and the group of remote peers.
inline ProxyContext proxy_context(const Workspace& ws, fabric::TransferEngine* engine, uint32_t region,
                                  uint32_t group, const std::vector<int>& remote_peers, ProxySignals* signals) {
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
  // Routing rows this proxy wrote to remote peers, and peers' rows (remote
  // arrivals and same-node flags) it waited for; cached calls add none.
  uint64_t routing_rows_sent() const { return rows_sent_.load(std::memory_order_relaxed); }
  uint64_t routing_rows_received() const { return rows_received_.load(std::memory_order_relaxed); }

 private:
  void run();
  bool wait_signal(const Seq& seq, uint64_t epoch);
  void step(uint64_t epoch);
  void node_barrier(uint64_t epoch);
  void wait_node_flags(FlagKind kind, uint64_t epoch, const char* what);
  void exchange_routing(uint64_t epoch);
  uint32_t tag(Tag kind) const { return wire_tag(ctx_.config.instance, kind); }

  ProxyContext ctx_;
  std::atomic<bool> stop_{false};
  mutable std::mutex mu_;
  std::string error_;
  std::string overflow_;
  std::vector<uint32_t> routing_;  // snapshot of the routing matrix of the current epoch
  std::atomic<uint64_t> rows_sent_{0}, rows_received_{0};
  std::thread thread_;
};

}  // namespace moe_a2a::a2a
