// Dispatch and combine on the CPU: the compute steps run on the calling
// thread, the proxy thread moves bytes to remote ranks. Each half returns as
// soon as its part is done, so callers can overlap work between halves.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "../plan.h"
#include "../proxy.h"
#include "../workspace.h"
#include "kernels.h"

namespace moe_a2a::a2a::cpu {

class CpuAllToAll {
 public:
  CpuAllToAll(Workspace* workspace, fabric::ProxyEngine* engine, fabric::RegionId region, fabric::GroupId group,
              const std::vector<int>& remote_peers, const std::vector<int>& pids = {});
  ~CpuAllToAll();

  // Send half of dispatch: x is [T, hidden] (bf16, fp32, or fp8 with x_scale).
  // With `routing` (the matrix [world][num_experts] of an earlier dispatch of
  // these topk_ids, from copy_routing) it is a cached call: no routing row is
  // published or awaited (docs/protocol.md, "Cached calls").
  // `weights` ([T, topk] fp32, or null for zeros) go in the tails of the copies' rows.
  void dispatch_send(const void* x, DType x_dtype, const float* x_scale, const int32_t* topk_ids, int num_tokens,
                     const uint32_t* routing = nullptr, const float* weights = nullptr);
  // First step of the receive half: waits for every routing row (not for the
  // tokens); returns the number of (padded) output rows. tokens_per_expert()
  // is valid after it.
  uint64_t dispatch_wait();
  // Second step: fills the caller's output, each sender's rows as soon as
  // they have landed; `out_weight` ([output rows] or null): each row's weight.
  // `math` (bf16 or fp32 rows, or null): each row stored times a per-row scale,
  // with its dot product with a row of another tensor (DispatchRecvParams).
  struct RowMath {
    const float* scale = nullptr;  // [output rows]
    const void* dot_y = nullptr;   // [output rows, hidden], or null for no dot
    DType dot_y_dtype = DType::kBf16;
    float* dot_out = nullptr;      // [output rows] fp32, with dot_y
  };
  void dispatch_unpack(void* out_x, float* out_scale, float* out_weight = nullptr, const RowMath* math = nullptr);
  // `row_values` ([output rows] fp32, or null for zeros) go back in the rows' tails.
  void combine_send(const void* y, DType y_dtype, const float* row_values = nullptr);
  // `values_out` ([T, topk] or null): each copy's returned value, unreduced.
  void combine_recv(const float* weights, void* out, float* values_out = nullptr);

  const std::vector<int32_t>& tokens_per_expert() const { return plan_.tokens_per_expert; }
  // Copies this rank sent to / received from each rank in the last dispatch.
  std::vector<uint64_t> sent_counts() const;
  std::vector<uint64_t> received_counts() const { return plan_.from; }
  uint64_t epoch() const { return epoch_; }
  // Tells every peer that this rank failed; see Proxy::announce_failure.
  void announce_failure(const std::string& text) { proxy_->announce_failure(text, done_); }
  // The senders in the order the last dispatch_unpack copied their rows.
  const std::vector<int>& unpack_order() const { return unpack_order_; }
  // The routing matrix of the last dispatch_wait, [world][num_experts], into `out`.
  void copy_routing(uint32_t* out) const;
  // Routing rows written to peers / peers' rows waited for, by this rank and its proxy.
  uint64_t routing_rows_sent() const { return rows_sent_ + proxy_->routing_rows_sent(); }
  uint64_t routing_rows_received() const { return proxy_->routing_rows_received(); }

 private:
  void wait_proxy(const Seq& seq, const char* what);
  void wait_node(FlagKind kind, const char* what);
  void signal_node(FlagKind kind);
  void check_failed();
  // Same-node peers' flags against our position (call_stamps.h); `force`:
  // now, not at the next interval. Remote peers are the proxy's to check.
  void check_stamps(bool force);
  // Whether sender s's rows of this epoch are all here.
  bool landed(int s) const;

  Workspace* ws_;
  fabric::ProxyEngine* engine_;
  A2AConfig cfg_;
  Layout layout_;
  ProxySignals signals_;
  std::unique_ptr<Seq[]> peer_seqs_;  // PeerSignals' arrays
  PeerSignals peers_;
  std::vector<int> send_order_;  // destination ranks: remote ones in the proxy's order, then same-node ones
  std::unique_ptr<Proxy> proxy_;
  PeerWatch watch_;  // this thread's own: the proxy's is its thread's
  Mappings maps_;

  uint64_t epoch_ = 0;
  uint64_t done_ = 0;         // the last phase whose receive half completed (peer_watch.h)
  uint64_t cached_hash_ = 0;  // routing_hash of a cached call's matrix
  int num_tokens_ = 0;
  std::vector<uint32_t> counts_;     // our routing row
  std::vector<int32_t> slots_;       // send row of each (t, k)
  std::vector<int32_t> row_copy_;    // (t, k) of each send row
  std::vector<const uint8_t*> encoded_;  // pack scratch: where each token's row was first stored
  std::vector<uint64_t> sender_base_;    // [world][local experts] output row of (s, i)'s first copy
  std::vector<int> unpack_order_;
  std::vector<uint32_t> routing_;    // snapshot of the routing matrix
  std::vector<uint32_t> cached_;     // a cached call's matrix, read by the proxy until dispatch_done
  bool cached_call_ = false;         // the current call is cached
  CallPosition at_;                  // of the current call, for check_stamps
  std::chrono::steady_clock::time_point next_stamps_{};
  uint64_t rows_sent_ = 0;           // routing rows stored into same-node peers
  RecvPlan plan_;
  std::vector<int64_t> row_of_copy_;
};

}  // namespace moe_a2a::a2a::cpu
