#include "cpu_all_to_all.h"

#include <algorithm>
#include <cstring>

#include "../errors.h"
#include "../wait.h"
#include "fabric/error.h"

namespace moe_a2a::a2a::cpu {

CpuAllToAll::CpuAllToAll(Workspace* workspace, fabric::ProxyEngine* engine, fabric::RegionId region,
                         fabric::GroupId group, const std::vector<int>& remote_peers, const std::vector<int>& pids,
                         const Masked& masked, uint64_t first_epoch)
    : ws_(workspace), engine_(engine), masked_(masked), cfg_(workspace->config()), layout_(workspace->layout()) {
  if (!masked_.empty() && masked_.size() != static_cast<size_t>(cfg_.world))
    throw std::invalid_argument("CpuAllToAll: masked: got " + std::to_string(masked_.size()) +
                                " entries; expected none or one per rank (" + std::to_string(cfg_.world) + ")");
  if (is_masked(masked_, cfg_.rank)) throw std::invalid_argument("CpuAllToAll: masked: this rank is masked");
  for (int r : remote_peers)  // a masked remote peer has left the group (moe_a2a.masking)
    if (is_masked(masked_, r))
      throw std::invalid_argument("CpuAllToAll: masked: rank " + std::to_string(r) +
                                  " is masked and in remote_peers; expected a group without it");
  call_.epoch = first_epoch;  // a backend rebuilt after a loss: every earlier call counts as done
  call_.done = first_epoch > 0 ? combine_phase(first_epoch) : 0;
  maps_.self = ws_->self();
  maps_.node = &ws_->node();
  call_.counts.assign(cfg_.routing_width(), 0);
  call_.slots.assign(static_cast<size_t>(cfg_.max_tokens) * cfg_.topk, 0);
  call_.row_copy.assign(call_.slots.size(), 0);
  call_.entry_of_copy.assign(call_.slots.size(), -1);
  encoded_.assign(cfg_.max_tokens, nullptr);
  peer_seqs_ = std::make_unique<Seq[]>(static_cast<size_t>(kPeerSignalArrays) * cfg_.world);
  peers_ = peer_signals_in(peer_seqs_.get(), cfg_.world);
  // Remote ranks first, from rank + 1 on (the proxy writes to them in this
  // order, each as soon as it is packed), then the ranks of our node.
  for (int near = 0; near < 2; ++near)
    for (int d = 1; d <= cfg_.world; ++d) {
      const int r = (cfg_.rank + d) % cfg_.world;
      if (cfg_.same_node(r) == (near == 1) && !is_masked(masked_, r)) send_order_.push_back(r);
    }
  ProxyContext ctx = proxy_context(*ws_, engine, region, group, remote_peers, &signals_, peers_, pids);
  ctx.caller_wakes = true;  // every flag of ours is raised by a call on this thread
  ctx.masked = masked_;
  ctx.first_epoch = first_epoch;
  proxy_ = std::make_unique<Proxy>(std::move(ctx));
  watch_ = PeerWatch(cfg_, layout_, ws_->self(), engine, remote_peers, pids, masked_, peers_);
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
    if (node_peer(s)) check_node_stamps(cfg_, layout_, maps_.self, call_.at, s);
}

void CpuAllToAll::wait_proxy(const Seq& seq, const char* what, bool lands_phase) {
  if (!wait_at_least(&seq.value, call_.epoch, deadline_after(cfg_.caller_timeout_s()), [this] { check_failed(); }))
    throw fabric::TimeoutError("rank " + std::to_string(cfg_.rank) +
                               ": timed out waiting for the proxy to finish the " + what + " of epoch " +
                               std::to_string(call_.epoch));
  if (lands_phase) watch_.landed = watch_.phase;  // every remote part is here: a peer gone since owes us nothing
  check_failed();
}

void CpuAllToAll::signal_node(FlagKind kind) {
  for (int r = 0; r < cfg_.world; ++r)
    if (node_peer(r))
      flag_at(maps_.of(r), layout_, cfg_.rank, kind)->store(call_.epoch, std::memory_order_release);
}

void CpuAllToAll::wait_node(FlagKind kind, const char* what) {
  auto deadline = deadline_after(cfg_.timeout_s);
  for (int s = 0; s < cfg_.world; ++s) {
    if (!node_peer(s)) continue;
    if (!wait_at_least(flag_at(maps_.self, layout_, s, kind), call_.epoch, deadline, [this] { check_failed(); }))
      throw fabric::TimeoutError("rank " + std::to_string(cfg_.rank) + ": timed out after " +
                                 std::to_string(cfg_.timeout_s) + " s waiting for the " + what + " of same-node peer " +
                                 std::to_string(s) + " (epoch " + std::to_string(call_.epoch) + ")");
  }
}

void CpuAllToAll::dispatch_send(const DispatchSendArgs& args) {
  watch_.phase = dispatch_phase(call_.epoch + 1);
  check_failed();
  DispatchSendParams p;
  p.cfg = &cfg_;
  p.layout = &layout_;
  p.ws = maps_;
  p.x = args.x;
  p.x_dtype = args.x_dtype;
  p.x_scale = args.x_scale;
  p.topk_ids = args.topk_ids;
  p.weights = args.weights;
  p.num_tokens = args.num_tokens;
  p.counts = call_.counts.data();
  p.slots = call_.slots.data();
  p.row_copy = call_.row_copy.data();
  p.entry_of_copy = call_.entry_of_copy.data();
  p.encoded = encoded_.data();
  count_experts(p);
  const uint32_t* routing = args.routing;
  if (routing != nullptr) check_cached_routing(cfg_, routing, args.num_tokens, call_.counts.data());
  const uint64_t epoch = ++call_.epoch;
  call_.num_tokens = args.num_tokens;
  call_.cached = routing != nullptr;
  CallPosition& at = call_.at;
  at = CallPosition{};
  at.epoch = epoch;
  at.cached = at.routed = call_.cached;
  at.overflow = call_.cached && over_capacity(cfg_, routing);  // `routed`: whether it overflows is known
  publish_routing(routing);
  signals_.route_ready.set(epoch);
  proxy_->wake();

  // Rank by rank, each handed over as soon as its rows are in place.
  assign_rows(p);
  RoutingView own{call_.counts.data(), 1, cfg_.num_experts, cfg_.num_local_experts(), cfg_.routing_width()};
  std::vector<uint64_t> first(cfg_.world + 1, 0);
  for (int r = 0; r < cfg_.world; ++r) first[r + 1] = first[r] + own.rows(0, r);
  for (int r : send_order_) {
    pack_rank(p, r, first[r], first[r + 1] - first[r]);
    if (cfg_.same_node(r))
      flag_at(maps_.of(r), layout_, cfg_.rank, kFlagDispatch)->store(epoch, std::memory_order_release);
    else peers_.packed[r].set(epoch);
  }
  signals_.packed.set(epoch);
  proxy_->wake();
}

// A cached call's matrix for the proxy (and its stamp for the node), or our
// routing row into every same-node workspace (ours included, where the proxy
// picks it up for remote peers).
void CpuAllToAll::publish_routing(const uint32_t* routing) {
  const uint64_t epoch = call_.epoch;
  if (routing != nullptr) {
    // The proxy takes the whole matrix from here: nothing to publish.
    call_.cached_matrix.assign(routing, routing + static_cast<size_t>(cfg_.world) * cfg_.routing_width());
    signals_.cached_routing = call_.cached_matrix.data();
    signals_.cached.set(epoch);
    call_.cached_hash = routing_hash(call_.cached_matrix.data(), call_.cached_matrix.size());
    publish_routing_stamp(cfg_, layout_, *maps_.node, epoch, call_.cached_hash);  // before our dispatch flag
    return;
  }
  const size_t row_bytes = call_.counts.size() * sizeof(uint32_t);
  for (int r = 0; r < cfg_.world; ++r) {
    if (!node_peer(r)) continue;
    std::memcpy(maps_.of(r) + layout_.routing_row(cfg_.rank), call_.counts.data(), row_bytes);
    rows_sent_ += r != cfg_.rank;
  }
  signal_node(kFlagRoute);
}

uint64_t CpuAllToAll::dispatch_wait() {
  wait_proxy(signals_.routed, "routing");
  CallPosition& at = call_.at;
  at.routed = true;
  at.overflow = at.combining = signals_.overflow.get() == call_.epoch;  // over capacity: past our barrier
  if (at.overflow) throw CapacityError("rank " + std::to_string(cfg_.rank) + ": " + proxy_->overflow_message());
  if (call_.cached) {
    call_.routing = call_.cached_matrix;
  } else {
    const auto* matrix = reinterpret_cast<const uint32_t*>(maps_.self + layout_.routing);
    call_.routing.assign(matrix, matrix + static_cast<size_t>(cfg_.world) * cfg_.routing_width());
    for (int s = 0; s < cfg_.world; ++s)  // a lost rank's last row is stale: it sends nothing
      if (is_masked(masked_, s))
        std::fill_n(call_.routing.begin() + static_cast<std::ptrdiff_t>(s) * cfg_.routing_width(),
                    cfg_.routing_width(), 0u);
  }
  RoutingView view{call_.routing.data(), cfg_.world, cfg_.num_experts, cfg_.num_local_experts()};
  call_.plan = make_recv_plan(view, cfg_.rank, cfg_.max_private_tokens, cfg_.expert_padding);
  call_.sender_base.resize(static_cast<size_t>(cfg_.world) * cfg_.num_local_experts());
  sender_bases(view, call_.plan, cfg_.rank, call_.sender_base.data());
  if (cfg_.node_rows()) {  // where a forwarder's entries go on each rank of our node
    const int rpn = cfg_.ranks_per_node, node0 = cfg_.node_of(cfg_.rank) * rpn;
    const size_t per_rank = static_cast<size_t>(cfg_.world) * cfg_.num_local_experts();
    call_.node_sender_base.resize(rpn * per_rank);
    for (int q = 0; q < rpn; ++q) {
      const RecvPlan plan = make_recv_plan(view, node0 + q, cfg_.max_private_tokens, cfg_.expert_padding);
      sender_bases(view, plan, node0 + q, call_.node_sender_base.data() + q * per_rank);
    }
  }
  return call_.plan.output_rows;
}

bool CpuAllToAll::landed(int s) const {
  if (cfg_.per_node(s, cfg_.rank))  // raised by its forwarder's proxy on our node (maybe ours)
    return flag_at(maps_.self, layout_, s, kFlagForward)->load(std::memory_order_acquire) >= call_.epoch;
  if (cfg_.same_node(s))
    return flag_at(maps_.self, layout_, s, kFlagDispatch)->load(std::memory_order_acquire) >= call_.epoch;
  return peers_.landed[s].get() >= call_.epoch;
}

void CpuAllToAll::dispatch_unpack(const DispatchUnpackArgs& args) {
  const RowMath& math = args.math;
  if (math.scale != nullptr &&
      (cfg_.dispatch_dtype == DType::kFp8 ||
       (math.dot_y != nullptr && (math.dot_out == nullptr || math.dot_y_dtype == DType::kFp8))))
    throw std::invalid_argument(
        "dispatch_unpack: math: expected a scale, bf16 or fp32 rows, and dot_y with dot_out "
        "in bf16 or fp32");
  RoutingView view{call_.routing.data(), cfg_.world, cfg_.num_experts, cfg_.num_local_experts()};
  const size_t entries = call_.plan.total_wire * cfg_.entries_per_row();
  call_.row_of_entry.assign(entries, -1);
  call_.weight_of_entry.assign(entries, 0.0f);
  call_.rank_of_entry.assign(cfg_.node_rows() ? entries : 0, -1);
  call_.staged_dtype.assign(cfg_.node_rows() ? cfg_.world : 0, kNotStaged);
  DispatchRecvParams p;
  p.cfg = &cfg_;
  p.layout = &layout_;
  p.ws = maps_;
  p.routing = &view;
  p.plan = &call_.plan;
  p.out_x = args.out_x;
  p.out_scale = args.out_scale;
  p.out_weight = args.out_weight;
  if (math.scale != nullptr) {
    p.row_scale = math.scale;
    p.dot_y = math.dot_y;
    p.dot_y_dtype = math.dot_y_dtype;
    p.dot_out = math.dot_out;
  }
  p.row_of_entry = call_.row_of_entry.data();
  p.weight_of_entry = call_.weight_of_entry.data();
  p.sender_base = call_.sender_base.data();
  p.node_sender_base = call_.node_sender_base.data();
  p.rank_of_entry = call_.rank_of_entry.data();
  unpack_as_they_land(p);
  check_stamps(true);  // before the rows go to the caller: also where no wait ran
  zero_padding(p);
  call_.done = dispatch_phase(call_.epoch);
}

// Each sender's rows as soon as they are here (the proxy raises landed[s]
// for remote senders, same-node senders their dispatch flag), while the
// others' are still on the wire.
void CpuAllToAll::unpack_as_they_land(const DispatchRecvParams& p) {
  const auto deadline = deadline_after(cfg_.caller_timeout_s());
  std::vector<int> pending;
  for (int s = 0; s < cfg_.world; ++s)
    if (!is_masked(masked_, s)) pending.push_back(s);
  call_.unpack_order.clear();
  Backoff backoff;
  while (!pending.empty()) {
    size_t kept = 0;
    for (int s : pending) {
      if (landed(s)) {
        if (call_.cached) check_routing_stamp(cfg_, layout_, maps_.self, s, call_.epoch, call_.cached_hash);
        unpack_sender(p, s);
        call_.unpack_order.push_back(s);
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
                                     "sender(s) " + who + " (epoch " + std::to_string(call_.epoch) + ")");
        }
      }
      backoff.pause();
    } else {
      backoff = Backoff{};
    }
    pending.resize(kept);
  }
}

void CpuAllToAll::combine_send(const CombineSendArgs& args) {
  const uint64_t epoch = call_.epoch;
  watch_.phase = combine_phase(epoch);
  check_failed();
  call_.at.combining = true;  // before the first flag or row a peer could act on
  CombineSendParams p;
  p.cfg = &cfg_;
  p.layout = &layout_;
  p.ws = maps_;
  p.plan = &call_.plan;
  p.row_of_entry = call_.row_of_entry.data();
  p.weight_of_entry = call_.weight_of_entry.data();
  p.weighted = args.weighted;
  p.y = args.y;
  p.y_dtype = args.y_dtype;
  p.row_values = args.row_values;
  p.rank_of_entry = call_.rank_of_entry.data();
  const RoutingView view{call_.routing.data(), cfg_.world, cfg_.num_experts, cfg_.num_local_experts()};
  p.routing = &view;
  p.sender_base = call_.sender_base.data();
  bool staged = false;  // every node peer's outputs staged: what the rows per node we forward sum
  if (cfg_.node_rows()) {
    stage_outputs(p);
    signal_node(kFlagStaged);
  }
  for (int s : send_order_) {  // our peers as senders: their rows go back in the proxy's order
    if (cfg_.per_node(s, cfg_.rank) && cfg_.forwarder(s, cfg_.rank) == cfg_.rank && !staged) {
      wait_node(kFlagStaged, "staged expert outputs");
      staged = true;
      for (int t = 0; t < cfg_.world; ++t)  // what traffic() counts; a peer restages only in its next call
        if (cfg_.same_node(t) && t != cfg_.rank) call_.staged_dtype[t] = maps_.of(t)[layout_.y_stage_dtype];
    }
    pack_combine_for(p, s);
    if (cfg_.same_node(s))
      flag_at(maps_.of(s), layout_, cfg_.rank, kFlagCombine)->store(epoch, std::memory_order_release);
    else peers_.combine_packed[s].set(epoch);
  }
  signals_.combine_packed.set(epoch);
  proxy_->wake();
}

void CpuAllToAll::combine_recv(const CombineRecvArgs& args) {
  wait_proxy(signals_.combine_done, "combine", true);
  wait_node(kFlagCombine, "combine rows");
  check_stamps(true);
  CombineRecvParams p;
  p.cfg = &cfg_;
  p.layout = &layout_;
  p.ws = maps_.self;
  p.slots = call_.slots.data();
  p.entry_of_copy = call_.entry_of_copy.data();
  p.weights = args.weights;
  p.num_tokens = call_.num_tokens;
  p.out = args.out;
  p.values_out = args.values_out;
  reduce_combine(p);
  call_.done = combine_phase(call_.epoch);
}

std::pair<std::vector<uint64_t>, std::vector<uint64_t>> CpuAllToAll::forwarded_traffic() const {
  std::vector<uint64_t> rows(cfg_.world, 0), output_bytes(cfg_.world, 0);
  if (!cfg_.node_rows() || call_.rank_of_entry.empty()) return {rows, output_bytes};
  const int m = cfg_.max_entries();
  std::vector<int> last(cfg_.world, -1);  // the last row counted for each peer
  for (int s = 0; s < cfg_.world; ++s) {
    if (!cfg_.per_node(s, cfg_.rank) || cfg_.forwarder(s, cfg_.rank) != cfg_.rank) continue;
    for (uint64_t j = 0; j < call_.plan.wire[s]; ++j) {
      const uint64_t w = call_.plan.recv_base[s] + j;
      for (int e = 0; e < m; ++e) {
        const int t = call_.rank_of_entry[w * m + e];
        if (t < 0 || t == cfg_.rank) continue;
        const uint8_t staged = call_.staged_dtype[t];
        if (staged != kNotStaged)  // else none read yet: the combine has not run
          output_bytes[t] += cfg_.hidden * dtype_bytes(static_cast<DType>(staged)) + sizeof(float);
        if (last[t] != static_cast<int>(w)) {
          last[t] = static_cast<int>(w);
          ++rows[t];
        }
      }
    }
  }
  return {rows, output_bytes};
}

void CpuAllToAll::copy_routing(uint32_t* out) const { std::copy(call_.routing.begin(), call_.routing.end(), out); }

std::vector<uint64_t> CpuAllToAll::sent_counts() const {
  RoutingView view{call_.counts.data(), 1, cfg_.num_experts, cfg_.num_local_experts(), cfg_.routing_width()};
  std::vector<uint64_t> out(cfg_.world);
  for (int r = 0; r < cfg_.world; ++r) out[r] = view.rows(0, r);
  return out;
}

}  // namespace moe_a2a::a2a::cpu
