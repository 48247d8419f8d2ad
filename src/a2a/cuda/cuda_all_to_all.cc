#include "cuda_all_to_all.h"

#include <chrono>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "../env.h"
#include "../errors.h"
#include "../plan.h"
#include "../wait.h"
#include "fabric/error.h"
#include "launch.h"

namespace moe_a2a::a2a::cuda {
namespace {

constexpr double kNsPerSecond = 1e9;
// The plan kernel may itself wait A2AConfig::caller_timeout_s for flags (graph
// mode's deadline): the host waits for it a second longer.
constexpr double kPlanGraceS = 1.0;

// MOE_A2A_CUDA_FUSED_RECV on or off forces the choice of fused_recv_ (-1: not forced).
int fused_recv_override() { return env_switch("MOE_A2A_CUDA_FUSED_RECV"); }

}  // namespace

CudaAllToAll::CudaAllToAll(Workspace* host_workspace, fabric::ProxyEngine* engine, fabric::RegionId region,
                           fabric::GroupId group, const std::vector<int>& remote_peers, const std::vector<int>& pids)
    : cfg_(host_workspace->config()), layout_(host_workspace->layout()), res_(cfg_, layout_), engine_(engine),
      pids_(pids) {
  init_switches();
  res_.map_node(host_workspace->node());
  watch_ = PeerWatch(cfg_, layout_, res_.host_ws_cpu(), engine, remote_peers, pids, {}, res_.peer_signals());
  // Every peer on this node: kernels reach them all through CUDA IPC and
  // nothing waits for the proxy (its flags are read only with remote peers),
  // so no thread polls through steps that move nothing.
  if (has_remote_) {
    ProxyContext ctx =
        proxy_context(*host_workspace, engine, region, group, remote_peers, res_.signals(), res_.peer_signals(), pids);
    ctx.caller_arms = true;  // dispatch_send arms it; kernels cannot wake a thread
    if (cfg_.node_rows())  // staged: the rows we forward go to our device workspace, where node peers read them
      ctx.before_forward = [this](int, size_t private_off, size_t private_bytes, size_t shared_off,
                                  size_t shared_bytes) {
        res_.forward_to_device(private_off, private_bytes);
        res_.forward_to_device(shared_off, shared_bytes);
      };
    proxy_ctx_ = ctx;
    proxy_ = std::make_unique<Proxy>(std::move(ctx));
  }
  choose_recv(false);  // until open_node says whom we share the GPU with
}

CudaAllToAll::CudaAllToAll(const A2AConfig& config)
    : cfg_((config.validate(), config)), layout_(Layout::of(cfg_)), res_(cfg_, layout_) {
  init_switches();
  res_.allocate_host_workspace();
  choose_recv(false);  // until connect_local joins a peer on our GPU
}

CudaAllToAll::~CudaAllToAll() {
  proxy_.reset();  // stops the thread before its flags go (res_ after it)
}

void CudaAllToAll::init_switches() {
  // A copy's entry word (rows.cuh, entry_word) holds its expert on the
  // destination rank (rows per node: on its node) in 15 bits.
  constexpr int kMaxRankRowExperts = 1 << 15;
  const int entry_experts = cfg_.num_local_experts() * (cfg_.node_rows() ? cfg_.ranks_per_node : 1);
  if (cfg_.wide_rows() && entry_experts >= kMaxRankRowExperts)
    throw std::invalid_argument(std::string("fabric_rows='") + (cfg_.node_rows() ? "node" : "rank") +
                                "' on device cuda takes fewer than " + std::to_string(kMaxRankRowExperts) +
                                " experts per " + (cfg_.node_rows() ? "node" : "rank") + "; got " +
                                std::to_string(entry_experts) + " (use fabric_rows='expert')");
  for (int r = 0; r < cfg_.world; ++r) has_remote_ = has_remote_ || !cfg_.same_node(r);
  overlap_ = has_remote_ && env_switch("MOE_A2A_CUDA_OVERLAP") != 0;
  combine_dma_ = overlap_ && env_switch("MOE_A2A_CUDA_COMBINE_DMA") != 0;
}

void CudaAllToAll::choose_recv(bool gpu_shared) {
  const int forced = fused_recv_override();
  fused_recv_ = forced >= 0 ? forced == 1 : !gpu_shared;
}

void CudaAllToAll::rows_on_device(fabric::RegionId region, fabric::GroupId group, bool nic_writes) {
  if (!proxy_ || call_.epoch != 0)
    throw std::logic_error("rows_on_device: expected a rank with remote peers before its first call");
  proxy_.reset();  // idle: nothing was armed yet
  proxy_ctx_.rows_region = region;
  proxy_ctx_.rows_group = group;
  if (cfg_.node_rows())  // the rows land in our device workspace: a NIC's writes may want a flush first
    proxy_ctx_.before_forward = [this](int, size_t, size_t, size_t, size_t) {
      check_cuda(cudaSetDevice(res_.device()), "cudaSetDevice(forward)");
      res_.flush_fabric_writes();
    };
  if (!nic_writes)  // shm: its copies into our device workspace may still run when it reports them
    proxy_ctx_.after_landing = [this] { res_.wait_provider_copies(); };
  proxy_ = std::make_unique<Proxy>(proxy_ctx_);
  res_.set_rows_on_device(nic_writes);
  combine_dma_ = false;  // the rows land in GPU memory: nothing to copy back
}

void CudaAllToAll::maskable() {
  if (call_.epoch != 0) throw std::logic_error("maskable: expected it before the first call");
  res_.set_maskable();
}

void CudaAllToAll::kernel_waits() {
  if (call_.epoch != 0) throw std::logic_error("kernel_waits: expected it before the first call");
  kernel_waits_ = true;
  if (!proxy_ || !cfg_.node_rows()) return;
  proxy_.reset();  // idle: nothing was armed yet
  proxy_ctx_.before_forward = nullptr;  // forward_kernel copies the rows we forward and raises
  proxy_ctx_.raises_forward = false;    // forward[s], in the stream
  proxy_ = std::make_unique<Proxy>(proxy_ctx_);
}

void CudaAllToAll::mask(const Masked& masked, uint64_t first_epoch, fabric::GroupId group, fabric::GroupId rows_group,
                        const std::vector<int>& remote_peers) {
  const std::string who = "mask: ";
  if (masked.size() != static_cast<size_t>(cfg_.world))
    throw std::invalid_argument(who + "masked: got " + std::to_string(masked.size()) + " entries; expected one per rank (" +
                                std::to_string(cfg_.world) + ")");
  if (is_masked(masked, cfg_.rank)) throw std::invalid_argument(who + "masked: this rank is masked");
  for (int r : remote_peers)
    if (is_masked(masked, r))
      throw std::invalid_argument(who + "rank " + std::to_string(r) +
                                  " is masked and in remote_peers; expected the live remote peers");
  if (first_epoch < call_.epoch)
    throw std::invalid_argument(who + "first_epoch: got " + std::to_string(first_epoch) +
                                "; expected at least this rank's epoch " + std::to_string(call_.epoch));
  proxy_.reset();  // joined before anything it reads changes
  masked_ = masked;
  res_.mask_peers(masked_);
  res_.set_epoch(first_epoch);
  res_.words()->status = kStatusOk;  // the failed call's status is not the next one's
  ProxySignals* signals = res_.signals();
  signals->failed.set(0);  // the failed call's proxy is gone; its flags stay at or below first_epoch
  call_ = Call{};
  call_.epoch = first_epoch;  // every earlier call counts as done
  call_.done = first_epoch > 0 ? combine_phase(first_epoch) : 0;
  watch_ = PeerWatch(cfg_, layout_, res_.host_ws_cpu(), engine_, remote_peers, pids_, masked_, res_.peer_signals());
  if (has_remote_) {
    proxy_ctx_.group = group;
    proxy_ctx_.rows_group = res_.rows_on_device() ? rows_group : group;
    proxy_ctx_.remote_peers = remote_peers;
    proxy_ctx_.masked = masked_;
    proxy_ctx_.first_epoch = first_epoch;
    proxy_ = std::make_unique<Proxy>(proxy_ctx_);
  }
}

void CudaAllToAll::open_node(const std::vector<std::string>& handles) { choose_recv(res_.open_node(handles)); }

void CudaAllToAll::replace_peer(int rank, const std::string& handle, uint8_t* host_ws, int pid) {
  if (rank < 0 || rank >= cfg_.world || rank == cfg_.rank)
    throw std::invalid_argument("replace_peer: rank " + std::to_string(rank) + " is not a peer");
  if (proxy_) throw std::logic_error("replace_peer: stop the proxy first");
  if (cfg_.same_node(rank)) {
    res_.open_peer(rank, handle, host_ws);
    if (!proxy_ctx_.node_workspaces.empty()) proxy_ctx_.node_workspaces[rank] = host_ws;
  }
  if (rank < static_cast<int>(pids_.size())) pids_[rank] = pid;
  if (rank < static_cast<int>(proxy_ctx_.pids.size())) proxy_ctx_.pids[rank] = pid;
}

void CudaAllToAll::connect_local(const CudaAllToAll& peer) {
  const int r = peer.cfg_.rank;
  if (r < 0 || r >= cfg_.world || !cfg_.same_node(r) || r == cfg_.rank)
    throw std::invalid_argument("connect_local: rank " + std::to_string(r) + " is not another rank of our node");
  res_.connect(r, peer.res_.device_ws(), peer.res_.host_ws());
  if (peer.res_.device() == res_.device()) choose_recv(true);
}

const Instance& CudaAllToAll::instance() {
  return res_.instance(has_remote_, overlap_, static_cast<int64_t>(cfg_.caller_timeout_s() * kNsPerSecond));
}

void CudaAllToAll::check_proxy() const {
  if (res_.signals()->failed.get() != 0) {
    const std::string error = proxy_ ? proxy_->error() : std::string("the proxy failed");
    if (proxy_ && proxy_->peer_failed()) throw PeerFailedError(error);
    watch_.check(true);  // a peer's announcement explains a broken connection better than the provider
    throw fabric::FabricError("rank " + std::to_string(cfg_.rank) + ": " + error);
  }
  watch_.check();
  check_stamps(false);
}

void CudaAllToAll::check_stamps(bool force) const {
  const auto now = std::chrono::steady_clock::now();
  if (res_.host_ws_cpu() == nullptr || call_.at.epoch == 0 || (now < next_stamps_ && !force)) return;
  next_stamps_ = now + PeerWatch::kInterval;
  for (int s = 0; s < cfg_.world; ++s)
    if (node_peer(s)) check_node_stamps(cfg_, layout_, res_.host_ws_cpu(), call_.at, s);
}

void CudaAllToAll::announce_failure(const std::string& text) {
  if (proxy_) {
    proxy_->announce_failure(text, call_.done);  // the node's records too
    return;
  }
  if (res_.host_ws_cpu() != nullptr)
    announce_on_node(cfg_, layout_, res_.host_ws_cpu(), res_.node_ws_cpu(), text, call_.done);
}

void CudaAllToAll::wait_host(FlagKind kind, const Seq& done, const char* what) {
  const std::string who = "rank " + std::to_string(cfg_.rank) + ": timed out after ";
  const uint64_t epoch = call_.epoch;
  if (has_remote_) {
    // The proxy times out on its own waits first and reports why.
    const auto deadline = deadline_after(cfg_.caller_timeout_s());
    if (!wait_at_least(&done.value, epoch, deadline, [this] { check_proxy(); }))
      throw fabric::TimeoutError(who + "waiting for the proxy to finish the " + what + " of epoch " +
                                 std::to_string(epoch));
    watch_.landed = watch_.phase;  // every remote part is here: a peer gone since owes us nothing
    check_proxy();
  }
  // Our own kernels come first on the stream.
  wait_flags(
      kind, [this](int s) { return s != cfg_.rank && node_peer(s); },
      [what](int s) { return std::string("the ") + what + " of same-node peer " + std::to_string(s); });
}

void CudaAllToAll::wait_flags(FlagKind kind, const std::function<bool(int)>& from,
                              const std::function<std::string(int)>& what) {
  const uint64_t epoch = call_.epoch;
  const auto deadline = deadline_after(cfg_.timeout_s);
  for (int s = 0; s < cfg_.world; ++s)
    if (from(s) &&
        !wait_at_least(flag_at(res_.host_ws_cpu(), layout_, s, kind), epoch, deadline, [this] { check_proxy(); }))
      throw fabric::TimeoutError("rank " + std::to_string(cfg_.rank) + ": timed out after " +
                                 std::to_string(cfg_.timeout_s) + " s waiting for " + what(s) + " (epoch " +
                                 std::to_string(epoch) + ")");
}

void CudaAllToAll::wait_planned() {
  if (!call_.plan_signals_host)
    throw std::logic_error(
        "wait_planned: the last dispatch_recv had host_wait=false; its plan kernel "
        "does not signal the host (synchronise the stream, then check())");
  // Our kernels may queue behind anything earlier on the stream, and the plan
  // kernel itself may wait that long for flags (graph mode's deadline): a
  // grace second more than that.
  const auto deadline = deadline_after(cfg_.caller_timeout_s() + kPlanGraceS);
  if (!wait_at_least(&res_.words()->planned.value, call_.epoch, deadline, [this] { check_proxy(); }))
    throw fabric::TimeoutError("rank " + std::to_string(cfg_.rank) +
                               ": timed out waiting for the plan kernel of epoch " + std::to_string(call_.epoch) +
                               " (its stream did not reach it)");
  try {
    check();
  } catch (const CapacityError&) {
    call_.at.routed = call_.at.overflow = call_.at.combining = true;  // nobody combines it
    throw;
  }
  call_.at.routed = true;
}

int64_t CudaAllToAll::max_output_rows() const { return cfg_.max_output_rows(); }

std::pair<std::vector<uint64_t>, std::vector<uint64_t>> CudaAllToAll::forwarded_traffic() const {
  std::vector<uint64_t> rows(cfg_.world, 0), output_bytes(cfg_.world, 0);
  if (!cfg_.node_rows() || call_.epoch == 0) return {rows, output_bytes};
  // stage_outputs_kernel stages fp32 rows, each with its fp32 row value.
  const uint64_t per_entry = static_cast<uint64_t>(cfg_.hidden) * sizeof(float) + sizeof(float);
  const std::vector<SenderPlan> plans = sender_plans();
  const int m = cfg_.max_entries();
  const int64_t wire = plans.back().recv_base + plans.back().wire;
  std::vector<int32_t> entry_rank(static_cast<size_t>(wire) * m);
  if (wire > 0)
    check_cuda(cudaMemcpy(entry_rank.data(), res_.scratch().entry_rank, entry_rank.size() * sizeof(int32_t),
                          cudaMemcpyDeviceToHost),
               "reading the forwarded entries");
  const int node0 = cfg_.rank / cfg_.ranks_per_node * cfg_.ranks_per_node;
  for (int s = 0; s < cfg_.world; ++s) {
    if (!cfg_.per_node(s, cfg_.rank) || cfg_.forwarder(s, cfg_.rank) != cfg_.rank) continue;
    for (int64_t j = 0; j < plans[s].wire; ++j) {
      std::vector<bool> counted(cfg_.ranks_per_node, false);  // the row, once per node peer
      for (int e = 0; e < m; ++e) {
        const int l = entry_rank[static_cast<size_t>(plans[s].recv_base + j) * m + e];
        const int t = node0 + l;
        if (l < 0 || t == cfg_.rank) continue;
        output_bytes[t] += per_entry;
        if (!counted[l]) counted[l] = true, ++rows[t];
      }
    }
  }
  return {rows, output_bytes};
}

std::vector<SenderPlan> CudaAllToAll::sender_plans() const {
  std::vector<SenderPlan> plans(cfg_.world);
  check_cuda(cudaMemcpy(plans.data(), res_.scratch().senders, plans.size() * sizeof(SenderPlan), cudaMemcpyDeviceToHost),
             "reading the plan's senders");
  return plans;
}

std::vector<int64_t> CudaAllToAll::wire_received() const {
  const std::vector<SenderPlan> plans = sender_plans();
  std::vector<int64_t> wire(plans.size());
  for (size_t s = 0; s < plans.size(); ++s) wire[s] = plans[s].wire;
  return wire;
}

}  // namespace moe_a2a::a2a::cuda
