#include "cpu_all_to_all.h"

#include <algorithm>
#include <cstring>

#include "../errors.h"
#include "../wait.h"
#include "fabric/error.h"

namespace moe_a2a::a2a::cpu {

CpuAllToAll::CpuAllToAll(Workspace* workspace, fabric::ProxyEngine* engine, fabric::RegionId region,
                         fabric::GroupId group,
                         const std::vector<int>& remote_peers, const std::vector<int>& pids)
    : ws_(workspace), engine_(engine), cfg_(workspace->config()), layout_(workspace->layout()) {
  maps_.self = ws_->self();
  maps_.node = &ws_->node();
  counts_.assign(cfg_.num_experts, 0);
  slots_.assign(static_cast<size_t>(cfg_.max_tokens) * cfg_.topk, 0);
  row_copy_.assign(slots_.size(), 0);
  encoded_.assign(cfg_.max_tokens, nullptr);
  peer_seqs_ = std::make_unique<Seq[]>(static_cast<size_t>(kPeerSignalArrays) * cfg_.world);
  peers_ = peer_signals_in(peer_seqs_.get(), cfg_.world);
  // Remote ranks first, from rank + 1 on (the proxy writes to them in this
  // order, each as soon as it is packed), then the ranks of our node.
  for (int near = 0; near < 2; ++near)
    for (int d = 1; d <= cfg_.world; ++d) {
      const int r = (cfg_.rank + d) % cfg_.world;
      if (cfg_.same_node(r) == (near == 1)) send_order_.push_back(r);
    }
  ProxyContext ctx = proxy_context(*ws_, engine, region, group, remote_peers, &signals_, peers_, pids);
  ctx.caller_wakes = true;  // every flag of ours is raised by a call on this thread
  proxy_ = std::make_unique<Proxy>(std::move(ctx));
  watch_ = PeerWatch(cfg_, layout_, ws_->self(), engine, remote_peers, pids);
}

CpuAllToAll::~CpuAllToAll() { proxy_.reset(); }

void CpuAllToAll::check_failed() {
  if (signals_.failed.get() != 0) {
    if (proxy_->peer_failed()) throw PeerFailedError(proxy_->error());
    watch_.check(true);  // a peer's announcement explains a broken connection better than the provider
    throw fabric::FabricError("rank " + std::to_string(cfg_.rank) + ": " + proxy_->error());
  }
  watch_.check();
  check_stamps(false);
}

void CpuAllToAll::check_stamps(bool force) {
  auto now = std::chrono::steady_clock::now();
  if (now < next_stamps_ && !force) return;
  next_stamps_ = now + PeerWatch::kInterval;
  for (int s = 0; s < cfg_.world; ++s)
    if (cfg_.same_node(s)) check_node_stamps(cfg_, layout_, maps_.self, at_, s);
}

void CpuAllToAll::wait_proxy(const Seq& seq, const char* what) {
  // The proxy times out on its own waits first and reports why.
  if (!wait_at_least(&seq.value, epoch_, deadline_after(cfg_.caller_timeout_s()), [this] { check_failed(); }))
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
                                int num_tokens, const uint32_t* routing, const float* weights) {
  watch_.phase = dispatch_phase(epoch_ + 1);
  check_failed();
  DispatchSendParams p;
  p.cfg = &cfg_;
  p.layout = &layout_;
  p.ws = maps_;
  p.x = x;
  p.x_dtype = x_dtype;
  p.x_scale = x_scale;
  p.topk_ids = topk_ids;
  p.weights = weights;
  p.num_tokens = num_tokens;
  p.counts = counts_.data();
  p.slots = slots_.data();
  p.row_copy = row_copy_.data();
  p.encoded = encoded_.data();
  count_experts(p);
  if (routing != nullptr) check_cached_routing(cfg_, routing, num_tokens);
  ++epoch_;
  num_tokens_ = num_tokens;
  cached_call_ = routing != nullptr;
  at_ = CallPosition{};
  at_.epoch = epoch_;
  at_.cached = at_.routed = cached_call_;
  at_.overflow = cached_call_ && over_capacity(cfg_, routing);  // `routed`: whether it overflows is known

  if (cached_call_) {
    // The proxy takes the whole matrix from here: nothing to publish.
    cached_.assign(routing, routing + static_cast<size_t>(cfg_.world) * cfg_.num_experts);
    signals_.cached_routing = cached_.data();
    signals_.cached.set(epoch_);
    cached_hash_ = routing_hash(cached_.data(), cached_.size());
    publish_routing_stamp(cfg_, layout_, *maps_.node, epoch_, cached_hash_);  // before our dispatch flag
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
  proxy_->wake();

  // Rank by rank, each handed over as soon as its rows are in place.
  assign_rows(p);
  RoutingView own{counts_.data(), 1, cfg_.num_experts, cfg_.num_local_experts()};
  std::vector<uint64_t> first(cfg_.world + 1, 0);
  for (int r = 0; r < cfg_.world; ++r) first[r + 1] = first[r] + own.to_rank(0, r);
  for (int r : send_order_) {
    pack_rank(p, r, first[r], first[r + 1] - first[r]);
    if (cfg_.same_node(r)) flag_at(maps_.of(r), layout_, cfg_.rank, kFlagDispatch)->store(epoch_, std::memory_order_release);
    else peers_.packed[r].set(epoch_);
  }
  signals_.packed.set(epoch_);
  proxy_->wake();
}

uint64_t CpuAllToAll::dispatch_wait() {
  wait_proxy(signals_.routed, "routing");
  at_.routed = true;
  at_.overflow = at_.combining = signals_.overflow.get() == epoch_;  // over capacity: past our barrier
  if (at_.overflow) throw CapacityError("rank " + std::to_string(cfg_.rank) + ": " + proxy_->overflow_message());
  if (cached_call_) {
    routing_ = cached_;
  } else {
    const auto* matrix = reinterpret_cast<const uint32_t*>(maps_.self + layout_.routing);
    routing_.assign(matrix, matrix + static_cast<size_t>(cfg_.world) * cfg_.num_experts);
  }
  RoutingView view{routing_.data(), cfg_.world, cfg_.num_experts, cfg_.num_local_experts()};
  plan_ = make_recv_plan(view, cfg_.rank, cfg_.max_private_tokens, cfg_.expert_padding);
  sender_base_.resize(static_cast<size_t>(cfg_.world) * cfg_.num_local_experts());
  sender_bases(view, plan_, cfg_.rank, sender_base_.data());
  return plan_.output_rows;
}

bool CpuAllToAll::landed(int s) const {
  if (cfg_.same_node(s)) return flag_at(maps_.self, layout_, s, kFlagDispatch)->load(std::memory_order_acquire) >= epoch_;
  return peers_.landed[s].get() >= epoch_;
}

void CpuAllToAll::dispatch_unpack(void* out_x, float* out_scale, float* out_weight, const RowMath* math) {
  if (math != nullptr && (math->scale == nullptr || cfg_.dispatch_dtype == DType::kFp8 ||
                          (math->dot_y != nullptr && (math->dot_out == nullptr || math->dot_y_dtype == DType::kFp8))))
    throw std::invalid_argument("dispatch_unpack: math: expected a scale, bf16 or fp32 rows, and dot_y with dot_out "
                                "in bf16 or fp32");
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
  p.out_weight = out_weight;
  if (math != nullptr) {
    p.row_scale = math->scale;
    p.dot_y = math->dot_y;
    p.dot_y_dtype = math->dot_y_dtype;
    p.dot_out = math->dot_out;
  }
  p.row_of_copy = row_of_copy_.data();
  p.sender_base = sender_base_.data();
  // Each sender's rows as soon as they are here (the proxy raises landed[s]
  // for remote senders, same-node senders their dispatch flag), while the
  // others' are still on the wire. The proxy times out on its own waits
  // first and reports why.
  const auto deadline = deadline_after(cfg_.caller_timeout_s());
  std::vector<int> pending(cfg_.world);
  for (int s = 0; s < cfg_.world; ++s) pending[s] = s;
  unpack_order_.clear();
  Backoff backoff;
  while (!pending.empty()) {
    size_t kept = 0;
    for (int s : pending) {
      if (landed(s)) {
        if (cached_call_) check_routing_stamp(cfg_, layout_, maps_.self, s, epoch_, cached_hash_);
        unpack_sender(p, s);
        unpack_order_.push_back(s);
      } else {
        pending[kept++] = s;
      }
    }
    if (kept == pending.size()) {  // nothing landed since the last look
      if ((backoff.round & 63) == 0) {
        check_failed();
        if (std::chrono::steady_clock::now() >= deadline) {
          std::string who;
          for (int s : pending) who += (who.empty() ? "" : ", ") + std::to_string(s);
          throw fabric::TimeoutError("rank " + std::to_string(cfg_.rank) + ": timed out waiting for the tokens of " +
                                     "sender(s) " + who + " (epoch " + std::to_string(epoch_) + ")");
        }
      }
      backoff.pause();
    } else {
      backoff = Backoff{};
    }
    pending.resize(kept);
  }
  check_stamps(true);  // before the rows go to the caller: also where no wait ran
  zero_padding(p);
  done_ = dispatch_phase(epoch_);
}

void CpuAllToAll::combine_send(const void* y, DType y_dtype, const float* row_values) {
  watch_.phase = combine_phase(epoch_);
  check_failed();
  at_.combining = true;  // before the first flag or row a peer could act on
  CombineSendParams p;
  p.cfg = &cfg_;
  p.layout = &layout_;
  p.ws = maps_;
  p.plan = &plan_;
  p.row_of_copy = row_of_copy_.data();
  p.y = y;
  p.y_dtype = y_dtype;
  p.row_values = row_values;
  for (int s : send_order_) {  // our peers as senders: their rows go back in the proxy's order
    pack_combine_for(p, s);
    if (cfg_.same_node(s)) flag_at(maps_.of(s), layout_, cfg_.rank, kFlagCombine)->store(epoch_, std::memory_order_release);
    else peers_.combine_packed[s].set(epoch_);
  }
  signals_.combine_packed.set(epoch_);
  proxy_->wake();
}

void CpuAllToAll::combine_recv(const float* weights, void* out, float* values_out) {
  wait_proxy(signals_.combine_done, "combine");
  wait_node(kFlagCombine, "combine rows");
  check_stamps(true);
  CombineRecvParams p;
  p.cfg = &cfg_;
  p.layout = &layout_;
  p.ws = maps_.self;
  p.slots = slots_.data();
  p.weights = weights;
  p.num_tokens = num_tokens_;
  p.out = out;
  p.values_out = values_out;
  reduce_combine(p);
  done_ = combine_phase(epoch_);
}

void CpuAllToAll::copy_routing(uint32_t* out) const { std::copy(routing_.begin(), routing_.end(), out); }

std::vector<uint64_t> CpuAllToAll::sent_counts() const {
  RoutingView view{counts_.data(), 1, cfg_.num_experts, cfg_.num_local_experts()};
  std::vector<uint64_t> out(cfg_.world);
  for (int r = 0; r < cfg_.world; ++r) out[r] = view.to_rank(0, r);
  return out;
}

}  // namespace moe_a2a::a2a::cpu
