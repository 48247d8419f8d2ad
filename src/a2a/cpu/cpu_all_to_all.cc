#include "cpu_all_to_all.h"

#include <algorithm>
#include <cstring>

#include "../errors.h"
#include "../wait.h"
#include "fabric/error.h"

namespace moe_a2a::a2a::cpu {

CpuAllToAll::CpuAllToAll(Workspace* workspace, fabric::TransferEngine* engine, uint32_t region, uint32_t group,
                         const std::vector<int>& remote_peers)
    : ws_(workspace), engine_(engine), cfg_(workspace->config()), layout_(workspace->layout()) {
  maps_.self = ws_->self();
  maps_.node = &ws_->node();
  counts_.assign(cfg_.num_experts, 0);
  slots_.assign(static_cast<size_t>(cfg_.max_tokens) * cfg_.topk, 0);
  proxy_ = std::make_unique<Proxy>(proxy_context(*ws_, engine, region, group, remote_peers, &signals_));
}

CpuAllToAll::~CpuAllToAll() { proxy_.reset(); }

void CpuAllToAll::check_failed() const {
  if (signals_.failed.get() != 0) throw fabric::FabricError("rank " + std::to_string(cfg_.rank) + ": " + proxy_->error());
}

void CpuAllToAll::wait_proxy(const Seq& seq, const char* what) {
  // The proxy times out on its own waits first and reports why.
  constexpr double kProxyGrace = 2.0;
  if (!wait_at_least(&seq.value, epoch_, deadline_after(kProxyGrace * cfg_.timeout_s + 1.0), [this] { check_failed(); }))
    throw fabric::TimeoutError("rank " + std::to_string(cfg_.rank) + ": timed out waiting for the proxy to finish the " +
                               what + " of epoch " + std::to_string(epoch_));
  check_failed();
}

void CpuAllToAll::signal_node(FlagKind kind) {
  for (int r = 0; r < cfg_.world; ++r)
    if (cfg_.same_node(r)) flag_at(maps_.of(r), layout_, cfg_.rank, kind)->store(epoch_, std::memory_order_release);
}

void CpuAllToAll::wait_node(FlagKind kind, const char* what) {
  auto deadline = deadline_after(cfg_.timeout_s);
  for (int s = 0; s < cfg_.world; ++s) {
    if (!cfg_.same_node(s)) continue;
    if (!wait_at_least(flag_at(maps_.self, layout_, s, kind), epoch_, deadline, [this] { check_failed(); }))
      throw fabric::TimeoutError("rank " + std::to_string(cfg_.rank) + ": timed out after " +
                                 std::to_string(cfg_.timeout_s) + " s waiting for the " + what +
                                 " of same-node peer " + std::to_string(s) + " (epoch " + std::to_string(epoch_) + ")");
  }
}

void CpuAllToAll::dispatch_send(const void* x, DType x_dtype, const float* x_scale, const int32_t* topk_ids,
                                int num_tokens, const uint32_t* routing) {
  check_failed();
  DispatchSendParams p;
  p.cfg = &cfg_;
  p.layout = &layout_;
  p.ws = maps_;
  p.x = x;
  p.x_dtype = x_dtype;
  p.x_scale = x_scale;
  p.topk_ids = topk_ids;
  p.num_tokens = num_tokens;
  p.counts = counts_.data();
  p.slots = slots_.data();
  count_experts(p);
  if (routing != nullptr) check_cached_routing(cfg_, routing, num_tokens);
  ++epoch_;
  num_tokens_ = num_tokens;
  cached_call_ = routing != nullptr;

  if (cached_call_) {
    // The proxy takes the whole matrix from here: nothing to publish.
    cached_.assign(routing, routing + static_cast<size_t>(cfg_.world) * cfg_.num_experts);
    signals_.cached_routing = cached_.data();
    signals_.cached.set(epoch_);
  } else {
    // Our routing row: into every same-node workspace (ours included, where the
    // proxy picks it up for remote peers).
    const size_t row_bytes = counts_.size() * sizeof(uint32_t);
    for (int r = 0; r < cfg_.world; ++r) {
      if (!cfg_.same_node(r)) continue;
      std::memcpy(maps_.of(r) + layout_.routing_row(cfg_.rank, cfg_.num_experts), counts_.data(), row_bytes);
      rows_sent_ += r != cfg_.rank;
    }
    signal_node(kFlagRoute);
  }
  signals_.route_ready.set(epoch_);

  pack_dispatch(p);
  signal_node(kFlagDispatch);
  signals_.packed.set(epoch_);
}

uint64_t CpuAllToAll::dispatch_wait() {
  wait_proxy(signals_.dispatch_done, "dispatch");
  if (signals_.overflow.get() == epoch_) throw CapacityError("rank " + std::to_string(cfg_.rank) + ": " + proxy_->overflow_message());
  wait_node(kFlagDispatch, "tokens");
  if (cached_call_) {
    routing_ = cached_;
  } else {
    const auto* matrix = reinterpret_cast<const uint32_t*>(maps_.self + layout_.routing);
    routing_.assign(matrix, matrix + static_cast<size_t>(cfg_.world) * cfg_.num_experts);
  }
  RoutingView view{routing_.data(), cfg_.world, cfg_.num_experts, cfg_.num_local_experts()};
  plan_ = make_recv_plan(view, cfg_.rank, cfg_.max_private_tokens, cfg_.expert_padding);
  return plan_.output_rows;
}

void CpuAllToAll::dispatch_unpack(void* out_x, float* out_scale) {
  RoutingView view{routing_.data(), cfg_.world, cfg_.num_experts, cfg_.num_local_experts()};
  row_of_copy_.assign(plan_.total_received, 0);
  DispatchRecvParams p;
  p.cfg = &cfg_;
  p.layout = &layout_;
  p.ws = maps_;
  p.routing = &view;
  p.plan = &plan_;
  p.out_x = out_x;
  p.out_scale = out_scale;
  p.row_of_copy = row_of_copy_.data();
  unpack_dispatch(p);
}

void CpuAllToAll::combine_send(const void* y, DType y_dtype) {
  check_failed();
  CombineSendParams p;
  p.cfg = &cfg_;
  p.layout = &layout_;
  p.ws = maps_;
  p.plan = &plan_;
  p.row_of_copy = row_of_copy_.data();
  p.y = y;
  p.y_dtype = y_dtype;
  pack_combine(p);
  signal_node(kFlagCombine);
  signals_.combine_packed.set(epoch_);
}

void CpuAllToAll::combine_recv(const float* weights, void* out) {
  wait_proxy(signals_.combine_done, "combine");
  wait_node(kFlagCombine, "combine rows");
  CombineRecvParams p;
  p.cfg = &cfg_;
  p.layout = &layout_;
  p.ws = maps_.self;
  p.slots = slots_.data();
  p.weights = weights;
  p.num_tokens = num_tokens_;
  p.out = out;
  reduce_combine(p);
}

void CpuAllToAll::copy_routing(uint32_t* out) const { std::copy(routing_.begin(), routing_.end(), out); }

std::vector<uint64_t> CpuAllToAll::sent_counts() const {
  RoutingView view{counts_.data(), 1, cfg_.num_experts, cfg_.num_local_experts()};
  std::vector<uint64_t> out(cfg_.world);
  for (int r = 0; r < cfg_.world; ++r) out[r] = view.to_rank(0, r);
  return out;
}

}  // namespace moe_a2a::a2a::cpu
