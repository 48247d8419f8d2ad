// Dispatch and combine on the CPU: the compute steps run on the calling
// thread, the proxy thread moves bytes to remote ranks. Each half returns as
// soon as its part is done, so callers can overlap work between halves.
// Each half takes one plain struct of arguments; the current call is one
// struct (`Call`): what each half leaves for the next.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "../plan.h"
#include "../proxy.h"
#include "../workspace.h"
#include "kernels.h"

namespace moe_a2a::a2a::cpu {

// Send half of dispatch: x is [T, hidden] (bf16, fp32, or fp8 with x_scale).
struct DispatchSendArgs {
  const void* x = nullptr;
  DType x_dtype = DType::kBf16;
  const float* x_scale = nullptr;     // [T, num_scales] when x is fp8
  const int32_t* topk_ids = nullptr;  // [T, topk]
  int num_tokens = 0;
  // The matrix [world][E + N] of an earlier dispatch of these topk_ids
  // (from copy_routing) makes this a cached call: no routing row is
  // published or awaited (docs/protocol.md, "Cached calls").
  const uint32_t* routing = nullptr;
  const float* weights = nullptr;  // [T, topk] fp32 into the tails of the copies' rows (null: zeros)
};

// Second step of the receive half of dispatch: the caller's output.
struct DispatchUnpackArgs {
  void* out_x = nullptr;
  float* out_scale = nullptr;
  float* out_weight = nullptr;  // [output rows]: each row's weight (null: not wanted)
  RowMath math;                 // config.h (bf16 or fp32 rows); scale null: none
};

struct CombineSendArgs {
  const void* y = nullptr;  // [output rows, hidden]
  DType y_dtype = DType::kBf16;
  const float* row_values = nullptr;  // [output rows] fp32 back in the rows' tails (null: zeros)
  // Rows per rank are weighted where the experts are: with the dispatch's
  // weights (true), or summed plainly (false, the unweighted combine).
  bool weighted = true;
};

struct CombineRecvArgs {
  const float* weights = nullptr;  // [T, topk]
  void* out = nullptr;             // [T, hidden]
  float* values_out = nullptr;     // [T, topk]: each copy's returned value, unreduced (null: not wanted)
};

// The current call: what each half leaves for the next.
constexpr uint8_t kNotStaged = 0xFF;  // Call::staged_dtype before the combine read it

struct Call {
  uint64_t epoch = 0;
  uint64_t done = 0;  // the last phase whose receive half completed (peer_watch.h)
  CallPosition at;    // for check_stamps
  int num_tokens = 0;
  bool cached = false;                  // along a cached routing
  uint64_t cached_hash = 0;             // routing_hash of its matrix
  std::vector<uint32_t> cached_matrix;  // read by the proxy until dispatch_done
  std::vector<uint32_t> counts;         // our routing row
  std::vector<int32_t> slots;           // send row of each (t, k)
  std::vector<int32_t> row_copy;        // (t, k) of each send row
  std::vector<int16_t> entry_of_copy;   // (t, k)'s entry in its row per rank; -1: a row of its own
  std::vector<uint32_t> routing;        // snapshot of the routing matrix (dispatch_wait)
  RecvPlan plan;
  std::vector<uint64_t> sender_base;  // [world][local experts] output row of (s, i)'s first copy
  std::vector<int64_t> row_of_entry;   // DispatchRecvParams'
  std::vector<float> weight_of_entry;
  std::vector<int32_t> rank_of_entry;       // rows per node we forward: the rank of each entry
  std::vector<uint64_t> node_sender_base;   // rows per node: every node rank's sender_base
  // Rows per node we forward: each node peer's staged dtype, read once it staged (combine_send);
  // kNotStaged before that call's combine.
  std::vector<uint8_t> staged_dtype;
  std::vector<int> unpack_order;
};

class CpuAllToAll {
 public:
  CpuAllToAll(Workspace* workspace, fabric::ProxyEngine* engine, fabric::RegionId region, fabric::GroupId group,
              const std::vector<int>& remote_peers, const std::vector<int>& pids = {}, const Masked& masked = {},
              uint64_t first_epoch = 0);
  ~CpuAllToAll();

  void dispatch_send(const DispatchSendArgs& args);
  // First step of the receive half: waits for every routing row (not for the
  // tokens); returns the number of (padded) output rows. tokens_per_expert()
  // is valid after it.
  uint64_t dispatch_wait();
  // Second step: fills the caller's output, each sender's rows as soon as
  // they have landed.
  void dispatch_unpack(const DispatchUnpackArgs& args);
  void combine_send(const CombineSendArgs& args);
  void combine_recv(const CombineRecvArgs& args);

  const std::vector<int32_t>& tokens_per_expert() const { return call_.plan.tokens_per_expert; }
  // Wire rows this rank sent to / received from each rank in the last dispatch
  // (copies, except towards per-rank peers: A2AConfig::per_rank).
  std::vector<uint64_t> sent_counts() const;
  std::vector<uint64_t> received_counts() const { return call_.plan.wire; }
  // Rows per node in the last call, per node peer t (0 elsewhere): the rows
  // we forwarded that hold an entry of t (t read them from us), and the bytes
  // of t's outputs our combine read for those entries (each an output row, in
  // the dtype t staged it in, and its fp32 row value).
  std::pair<std::vector<uint64_t>, std::vector<uint64_t>> forwarded_traffic() const;
  uint64_t epoch() const { return call_.epoch; }
  // Tells every peer that this rank failed; see Proxy::announce_failure.
  void announce_failure(const std::string& text) { proxy_->announce_failure(text, call_.done); }
  // The senders in the order the last dispatch_unpack copied their rows.
  const std::vector<int>& unpack_order() const { return call_.unpack_order; }
  // The routing matrix of the last dispatch_wait, [world][E + N], into `out`.
  void copy_routing(uint32_t* out) const;
  // Routing rows written to peers / peers' rows waited for, by this rank and its proxy.
  uint64_t routing_rows_sent() const { return rows_sent_ + proxy_->routing_rows_sent(); }
  uint64_t routing_rows_received() const { return proxy_->routing_rows_received(); }

 private:
  // `lands_phase`: the proxy's `seq` means every remote part of the phase has landed.
  void wait_proxy(const Seq& seq, const char* what, bool lands_phase = false);
  // How long we wait for the proxy: it times out on its own waits first and
  // reports why.
  void wait_node(FlagKind kind, const char* what);
  void signal_node(FlagKind kind);
  void publish_routing(const uint32_t* routing);
  void unpack_as_they_land(const DispatchRecvParams& p);
  void check_failed();
  // Same-node peers' flags against our position (call_stamps.h); `force`:
  // now, not at the next interval. Remote peers are the proxy's to check.
  void check_stamps(bool force);
  // Whether sender s's rows of this epoch are all here.
  bool landed(int s) const;
  // A same-node peer we exchange flags and rows with: not masked (live_ranks.h).
  bool node_peer(int r) const { return cfg_.same_node(r) && !is_masked(masked_, r); }

  Workspace* ws_;
  fabric::ProxyEngine* engine_;
  Masked masked_;  // lost ranks: never waited for, never sent to
  A2AConfig cfg_;
  Layout layout_;
  ProxySignals signals_;
  std::unique_ptr<Seq[]> peer_seqs_;  // PeerSignals' arrays
  PeerSignals peers_;
  std::vector<int> send_order_;  // destination ranks: remote ones in the proxy's order, then same-node ones
  std::unique_ptr<Proxy> proxy_;
  PeerWatch watch_;  // this thread's own: the proxy's is its thread's
  Mappings maps_;
  std::vector<const uint8_t*> encoded_;  // pack scratch: where each token's row was first stored
  std::chrono::steady_clock::time_point next_stamps_{};
  uint64_t rows_sent_ = 0;  // routing rows stored into same-node peers
  Call call_;
};

}  // namespace moe_a2a::a2a::cpu
