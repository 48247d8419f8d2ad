// The four halves of CudaAllToAll: each checks its arguments, keeps what its
// receive half needs in the current Call, waits on the host where asked, and
// launches its kernels (launch.h).
#include <chrono>
#include <stdexcept>
#include <string>
#include <vector>

#include "../errors.h"
#include "../plan.h"
#include "../wait.h"
#include "cuda_all_to_all.h"
#include "fabric/error.h"
#include "launch.h"

namespace moe_a2a::a2a::cuda {
namespace {

// The device address of pinned host memory (a handle's routing matrix, from
// torch's pinned allocator: mapped wherever addressing is unified).
template <typename T>
T* mapped_device_pointer(T* host, const char* what) {
  void* device = nullptr;
  if (cudaHostGetDevicePointer(&device, const_cast<void*>(static_cast<const void*>(host)), 0) != cudaSuccess) {
    cudaGetLastError();  // not sticky: clear it
    throw std::invalid_argument(std::string("dispatch: ") + what + ": expected pinned host memory mapped for the GPU");
  }
  return static_cast<T*>(device);
}

void CUDART_CB arm_from_stream(void* proxy) { static_cast<Proxy*>(proxy)->arm(); }

}  // namespace

void CudaAllToAll::dispatch_send(const DispatchSendArgs& args, cudaStream_t stream) {
  const uint64_t epoch = call_.epoch + 1;
  watch_.phase = dispatch_phase(epoch);
  int same_node_peers = 0;
  for (int r = 0; r < cfg_.world; ++r) same_node_peers += r != cfg_.rank && node_peer(r);
  const uint32_t* routing = args.routing;
  if (routing != nullptr) {
    if (args.num_tokens_device != nullptr)
      throw std::invalid_argument("dispatch_send: a cached call takes num_tokens from the host, not num_tokens_device");
    check_cached_routing(cfg_, routing, args.num_tokens);
    call_.routing = mapped_device_pointer(routing, "routing");
    call_.cached_hash = routing_hash(routing, static_cast<size_t>(cfg_.world) * cfg_.routing_width());
    publish_routing_stamp(cfg_, layout_, res_.node_ws_cpu(), epoch, call_.cached_hash);  // before our kernels' flags
    if (has_remote_) {  // the proxy starts from the matrix at once: the kernels publish nothing
      ProxySignals* signals = res_.signals();
      call_.cached.assign(routing, routing + static_cast<size_t>(cfg_.world) * cfg_.routing_width());
      signals->cached_routing = call_.cached.data();
      signals->cached.set(epoch);
      signals->route_ready.set(epoch);
    }
  } else {
    call_.routing = nullptr;
    rows_sent_ += same_node_peers;
    if (!has_remote_) rows_received_ += same_node_peers;  // our plan reads them (a proxy counts its own waits)
  }
  // In place only where the receive half's copy is a plain copy of x's row, or
  // a dequantising receive of an fp8 call (which quantises the row itself).
  const bool plain = args.x_dtype == cfg_.dispatch_dtype && args.x_dtype != DType::kFp8;
  const bool round_trip = args.dequant_recv && cfg_.dispatch_dtype == DType::kFp8 && args.x_dtype != DType::kFp8;
  call_.send = args;
  call_.send.in_place = args.in_place && (plain || round_trip);
  call_.self_needs_dequant = call_.send.in_place && round_trip;

  DispatchSendParams p;
  p.inst = instance();
  p.scratch = res_.scratch();
  p.x = args.x;
  p.x_dtype = static_cast<int32_t>(args.x_dtype);
  p.x_scale = args.x_scale;
  p.topk_ids = args.topk_ids;
  p.ids_are_64bit = args.ids_64bit ? 1 : 0;
  p.weights = args.weights;
  p.num_tokens = args.num_tokens;
  p.num_tokens_ptr = args.num_tokens_device;
  p.cached = routing != nullptr ? 1 : 0;
  p.self_in_place = call_.send.in_place ? 1 : 0;
  check_cuda(launch_dispatch_send(p, stream), "dispatch send");
  const bool captured = capturing(stream);
  if (proxy_) arm_proxy(stream, captured);
  call_.epoch = epoch;
  call_.at = CallPosition{};
  if (!captured) {
    CallPosition& at = call_.at;
    at.epoch = epoch;
    at.cached = at.routed = routing != nullptr;
    at.overflow = routing != nullptr && over_capacity(cfg_, routing);  // `routed`: whether it overflows is known
    at.combining = !has_remote_;  // no barrier: a peer may be in our next call once it has our rows
    at.silent_overflow = !has_remote_;
  }
}

bool CudaAllToAll::capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  check_cuda(cudaStreamIsCapturing(stream, &capture), "cudaStreamIsCapturing");
  return capture != cudaStreamCaptureStatusNone;
}

void CudaAllToAll::arm_proxy(cudaStream_t stream, bool captured) {
  if (!captured) {
    proxy_->arm();
    return;
  }
  // Captured: each replay runs this host node once, after the send kernel
  // (the proxy only has to be polling by the time the receive half waits).
  check_cuda(cudaLaunchHostFunc(stream, arm_from_stream, proxy_.get()), "cudaLaunchHostFunc(arm the proxy)");
}

DispatchRecvParams CudaAllToAll::recv_params() {
  const DispatchSendArgs& send = call_.send;
  const DispatchRecvArgs& recv = call_.recv;
  DispatchRecvParams p;
  p.inst = instance();
  p.scratch = res_.scratch();
  p.out_x = recv.out_x;
  p.out_scale = recv.out_scale;
  p.tokens_per_expert = recv.tokens_per_expert;
  p.max_output_rows = max_output_rows();
  p.routing = call_.routing;
  p.routing_out = recv.routing_out != nullptr ? mapped_device_pointer(recv.routing_out, "routing_out") : nullptr;
  p.self_x = send.in_place ? send.x : nullptr;
  p.out_weight = recv.out_weight;
  p.self_weights = send.in_place ? send.weights : nullptr;
  p.dequant = recv.dequant ? 1 : 0;
  p.out_dtype = static_cast<int32_t>(recv.out_dtype);
  p.self_x_dtype = static_cast<int32_t>(send.x_dtype);
  p.row_scale = recv.math.scale;
  p.dot_y = recv.math.dot_y;
  p.dot_y_dtype = static_cast<int32_t>(recv.math.dot_y_dtype);
  p.dot_out = recv.math.dot_out;
  return p;
}

namespace {

// The receive arguments' rules, before anything waits.
void check_recv_args(const A2AConfig& cfg, const DispatchRecvArgs& a, bool self_needs_dequant, bool cached) {
  const bool math = a.math.scale != nullptr;
  if (a.dequant && (cfg.dispatch_dtype != DType::kFp8 || a.out_dtype == DType::kFp8 || math))
    throw std::invalid_argument("dispatch_recv: dequant: expected fp8 rows, a bf16 or fp32 out_dtype and no math");
  if (self_needs_dequant && !a.dequant)
    throw std::logic_error(
        "dispatch_recv: the send half left our copies in place for a dequantising receive "
        "(dequant_recv); expected dequant");
  if (!a.host_wait && (cached || a.routing_out != nullptr))
    throw std::invalid_argument("dispatch_recv: a cached call and routing_out need host_wait (eager calls)");
  if (math) {
    if (cfg.dispatch_dtype == DType::kFp8)
      throw std::invalid_argument("dispatch_recv: math: the rows are fp8; expected a bf16 or fp32 dispatch dtype");
    if (a.math.dot_y != nullptr && (a.math.dot_out == nullptr || a.math.dot_y_dtype == DType::kFp8))
      throw std::invalid_argument("dispatch_recv: math: dot_y needs dot_out and a bf16 or fp32 dot_y_dtype");
  }
}

}  // namespace

void CudaAllToAll::dispatch_recv(const DispatchRecvArgs& args, cudaStream_t stream) {
  check_recv_args(cfg_, args, call_.self_needs_dequant, call_.routing != nullptr);
  if (res_.rows_on_device() && !args.host_wait)
    throw std::invalid_argument("dispatch_recv: GPU-direct rows need host_wait (graph-safe instances stage)");
  if (cfg_.node_rows() && has_remote_ && args.host_wait == kernel_waits_)
    throw std::invalid_argument(std::string("dispatch_recv: fabric_rows='node': host_wait=") +
                                (args.host_wait ? "true" : "false") + " on an instance that " +
                                (kernel_waits_ ? "waits in kernels (kernel_waits)" : "forwards on the host") +
                                "; expected host_wait=" + (kernel_waits_ ? "false" : "true"));
  call_.recv = args;
  if (args.host_wait && overlap_) return dispatch_recv_by_sender(stream);
  if (args.host_wait) wait_dispatch_host();
  DispatchRecvParams p = recv_params();
  p.wait_in_kernel = args.host_wait ? 0 : 1;  // and with host_wait the plan kernel signals `planned`
  p.fused = args.host_wait && fused_recv_ ? 1 : 0;
  check_cuda(launch_dispatch_recv(p, stream), "dispatch recv");
  call_.plan_signals_host = args.host_wait;
}

[[noreturn]] void CudaAllToAll::throw_capacity() const {
  throw CapacityError("rank " + std::to_string(cfg_.rank) + ": " + capacity_message());
}

// Eager dispatch_recv without the fabric receive: every peer's part is here.
void CudaAllToAll::wait_dispatch_host() {
  const ProxySignals* signals = res_.signals();
  const uint64_t epoch = call_.epoch;
  wait_host(kFlagDispatch, signals->dispatch_done, "dispatch");
  if (call_.routing != nullptr)
    for (int s = 0; s < cfg_.world; ++s)
      check_routing_stamp(cfg_, layout_, res_.host_ws_cpu(), s, epoch, call_.cached_hash);
  if (has_remote_ && signals->overflow.get() == epoch) {
    call_.at.routed = call_.at.overflow = call_.at.combining = true;  // over capacity: past our barrier
    throw_capacity();
  }
  if (has_remote_ && cfg_.node_rows())  // each remote sender's rows for our node, readable at its forwarder here
    wait_flags(
        kFlagForward, [this](int s) { return cfg_.per_node(s, cfg_.rank); },
        [this](int s) {
          return "rank " + std::to_string(cfg_.forwarder(s, cfg_.rank)) + " to forward the rows of sender " +
                 std::to_string(s);
        });
  // With a proxy, it waited for every routing row; without one nobody does in
  // eager calls: a same-node peer that ran this call cached raised its dispatch
  // flag but no route flag, and its row in our workspace is an older call's.
  if (!has_remote_ && call_.routing == nullptr) {
    try {
      wait_host(kFlagRoute, signals->dispatch_done, "routing row");
    } catch (const fabric::TimeoutError& e) {
      throw fabric::TimeoutError(e.what() + std::string(kCachedMismatchHint));
    }
  }
  call_.done = dispatch_phase(epoch);  // every peer's part is here
  res_.flush_fabric_writes();          // GPU-direct through a NIC: before the kernels read them
  // With a proxy, whether the call is over capacity is known here; without
  // one only once the plan kernel has run (wait_planned).
  if (has_remote_) {
    call_.at.routed = true;
    check_stamps(true);
  }
}

namespace {

// Until `flag` or `all` reaches `epoch` (false at the deadline). The proxy
// raises a peer's flag and then the whole call's; a stand-in for it (the
// kernel tests) only the latter.
template <typename OnIdle>
bool wait_either(const Seq& flag, const Seq& all, uint64_t epoch, std::chrono::steady_clock::time_point deadline,
                 OnIdle&& on_idle) {
  Backoff backoff;
  while (flag.get() < epoch && all.get() < epoch) {
    if ((backoff.round & 63) == 0) {
      on_idle();
      if (std::chrono::steady_clock::now() >= deadline) return false;
    }
    backoff.pause();
  }
  return true;
}

}  // namespace

LandingView CudaAllToAll::landing(std::chrono::steady_clock::time_point deadline) {
  LandingView v;
  v.cfg = &cfg_;
  v.layout = &layout_;
  v.host_ws_cpu = res_.host_ws_cpu();
  v.device_ws = res_.device_ws();
  v.signals = res_.signals();
  v.peer = res_.peer_signals();
  v.epoch = call_.epoch;
  v.deadline = deadline;
  v.check = [this] { check_proxy(); };
  if (res_.flushes()) v.before_read = [this] { res_.flush_fabric_writes(); };
  return v;
}

// Eager receive with fabric peers: once every routing row is in (the proxy's
// `routed`), the plan; then each sender's rows are copied out as soon as they
// have landed (the proxy's landed[s], a same-node peer's dispatch flag),
// sender by sender, while the later ones are still on the wire.
void CudaAllToAll::dispatch_recv_by_sender(cudaStream_t stream) {
  const ProxySignals* signals = res_.signals();
  const uint64_t epoch = call_.epoch;
  const std::string who = "rank " + std::to_string(cfg_.rank) + ": timed out ";
  const auto deadline = deadline_after(cfg_.caller_timeout_s());
  const auto check = [this] { check_proxy(); };
  if (!wait_either(signals->routed, signals->dispatch_done, epoch, deadline, check))
    throw fabric::TimeoutError(who + "waiting for the proxy to gather the routing rows of epoch " +
                               std::to_string(epoch));
  check_proxy();
  call_.at.routed = true;
  if (signals->overflow.get() == epoch) {
    call_.at.overflow = call_.at.combining = true;  // over capacity: past our barrier once dispatch_done
    if (!wait_at_least(&signals->dispatch_done.value, epoch, deadline, check))  // everyone met: the next call is clean
      throw fabric::TimeoutError(who + "waiting for the proxy to end the overflowing dispatch of epoch " +
                                 std::to_string(epoch));
    throw_capacity();
  }
  const bool cached = call_.routing != nullptr;
  const auto node_deadline = deadline_after(cfg_.timeout_s);
  for (int s = 0; s < cfg_.world && !cached; ++s)  // a cached call has every row already
    if (s != cfg_.rank && node_peer(s) &&
        !wait_at_least(flag_at(res_.host_ws_cpu(), layout_, s, kFlagRoute), epoch, node_deadline, check))
      throw fabric::TimeoutError(who + "waiting for the routing row of same-node peer " + std::to_string(s) +
                                 " (epoch " + std::to_string(epoch) + ")");
  DispatchRecvParams p = recv_params();
  p.wait_in_kernel = 0;
  check_cuda(launch_dispatch_plan(p, stream), "dispatch plan");
  call_.plan_signals_host = true;

  // Every routing row is in our host workspace (remote ones from the proxy,
  // same-node ones from their kernels), so the host knows each sender's copies.
  const uint32_t* matrix =
      cached ? call_.cached.data() : reinterpret_cast<const uint32_t*>(res_.host_ws_cpu() + layout_.routing);
  const LandingView view = landing(deadline);
  if (combine_dma_)
    fabric_recv_.note_combine_blocks(view, {matrix, cfg_.world, cfg_.num_experts, cfg_.num_local_experts()});
  const auto on_first = [&](int s) {
    if (cached) check_routing_stamp(cfg_, layout_, res_.host_ws_cpu(), s, epoch, call_.cached_hash);
  };
  fabric_recv_.copy_dispatch(view, p, matrix, cached, on_first, stream);
  call_.done = dispatch_phase(epoch);
  check_stamps(true);
}

void CudaAllToAll::combine_send(const CombineSendArgs& args, cudaStream_t stream) {
  if (args.y_rows < 0)
    throw std::invalid_argument("combine_send: y_rows: got " + std::to_string(args.y_rows) + "; expected >= 0");
  watch_.phase = combine_phase(call_.epoch);
  call_.at.combining = true;  // before a peer could see our combine flag
  call_.combine = args;
  // The reduction reads rows in the combine dtype.
  call_.combine.in_place = args.in_place && args.y_dtype == cfg_.combine_dtype;
  CombineSendParams p;
  p.inst = instance();
  p.scratch = res_.scratch();
  p.y = args.y;
  p.y_dtype = static_cast<int32_t>(args.y_dtype);
  p.y_rows = args.y_rows;
  p.row_values = args.row_values;
  p.weighted = args.weighted ? 1 : 0;
  p.self_in_place = call_.combine.in_place ? 1 : 0;
  // Rows per node: the rows we forward sum our node peers' staged outputs, so
  // ours are staged first and theirs awaited, on the host (eager calls) or in
  // a kernel (graph-safe ones, whose dispatch_recv did not wait on the host).
  p.wait_in_kernel = call_.recv.host_wait ? 0 : 1;
  if (cfg_.node_rows()) check_cuda(launch_stage_outputs(p, stream), "combine stage outputs");
  if (cfg_.node_rows() && !p.wait_in_kernel)
    wait_flags(
        kFlagStaged, [this](int t) { return t != cfg_.rank && node_peer(t); },
        [](int t) { return "the staged expert outputs of same-node peer " + std::to_string(t); });
  check_cuda(launch_combine_send(p, stream), "combine send");
}

void CudaAllToAll::combine_recv(const CombineRecvArgs& args, cudaStream_t stream) {
  if (res_.rows_on_device() && !args.host_wait)
    throw std::invalid_argument("combine_recv: GPU-direct rows need host_wait (graph-safe instances stage)");
  const bool dma = args.host_wait && combine_dma_ && fabric_recv_.combine_on_device(call_.epoch);
  if (dma) fabric_recv_.copy_combine(landing(deadline_after(cfg_.caller_timeout_s())), stream);
  if (args.host_wait) {
    wait_host(kFlagCombine, res_.signals()->combine_done, "combine");
    res_.flush_fabric_writes();  // GPU-direct through a NIC: before the reduction reads them
    check_stamps(true);
    call_.done = combine_phase(call_.epoch);
  }
  const CombineSendArgs& send = call_.combine;
  CombineRecvParams p;
  p.inst = instance();
  p.scratch = res_.scratch();
  p.weights = args.weights;
  p.out = args.out;
  p.wait_in_kernel = args.host_wait ? 0 : 1;
  p.remote_on_device = dma ? 1 : 0;
  p.self_y = send.in_place ? send.y : nullptr;
  p.self_y_rows = send.y_rows;
  p.values_out = args.values_out;
  p.self_values = send.in_place ? send.row_values : nullptr;
  check_cuda(launch_combine_recv(p, stream), "combine recv");
}

std::string CudaAllToAll::capacity_message() const {
  std::string msg = proxy_ ? proxy_->overflow_message() : std::string();
  if (!msg.empty()) return msg;
  return a2a::capacity_message(cfg_);
}

void CudaAllToAll::check() const {
  const std::string who = "rank " + std::to_string(cfg_.rank) + ": ";
  const int32_t status = res_.words()->status;
  switch (status) {
    case kStatusOk:
      return;
    case kStatusCapacity:
      throw CapacityError(who + capacity_message());
    case kStatusProxyFailed:
      throw fabric::FabricError(who + (proxy_ ? proxy_->error() : std::string("the proxy failed")));
    case kStatusTimeout:
      throw fabric::TimeoutError(who + "a kernel timed out waiting for a peer's or the proxy's flag (epoch " +
                                 std::to_string(call_.epoch) + ")");
    case kStatusBadRow:
      throw fabric::FabricError(who + "a row per rank or node (epoch " + std::to_string(call_.epoch) +
                                ") named an expert or more entries than its sender's routing row holds; "
                                "those entries were dropped");
    case kStatusStaleGraph:
      throw StaleGraphError(who + "a CUDA graph captured before ranks were masked was replayed; its kernels did "
                                  "nothing (no row sent, no peer awaited): capture the step again");
    case kStatusBadExpert:
      throw std::invalid_argument(who + "topk_ids held an expert id outside [0, " + std::to_string(cfg_.num_experts) +
                                  "); those copies were dropped");
    default:
      throw std::runtime_error(who + "unknown status " + std::to_string(status));
  }
}

}  // namespace moe_a2a::a2a::cuda
