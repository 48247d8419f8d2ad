#include "cuda_all_to_all.h"

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <new>
#include <string>
#include <stdexcept>
#include <vector>

#include "../env.h"
#include "../errors.h"
#include "scratch.h"
#include "../plan.h"
#include "../wait.h"
#include "fabric/error.h"
#include "launch.h"

namespace moe_a2a::a2a::cuda {
namespace {

constexpr double kNsPerSecond = 1e9;
// Kernels give the proxy time to report its own timeout first (as the CPU
// path does): twice the configured timeout plus a second.
constexpr double kProxyGrace = 2.0;
constexpr double kGraceSeconds = 1.0;

void check_cuda(cudaError_t err, const char* what) {
  if (err != cudaSuccess)
    throw std::runtime_error(std::string("CUDA error in ") + what + ": " + cudaGetErrorName(err) + " (" +
                             cudaGetErrorString(err) + ")");
}

size_t aligned_size(size_t bytes) { return align_up(bytes, kScratchAlign); }

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

}  // namespace

CudaAllToAll::CudaAllToAll(Workspace* host_workspace, fabric::TransferEngine* engine, fabric::RegionId region,
                           fabric::GroupId group, const std::vector<int>& remote_peers,
                           const std::vector<int>& pids)
    : cfg_(host_workspace->config()), layout_(host_workspace->layout()) {
  allocate();
  const auto& node = host_workspace->node();
  host_ws_cpu_ = host_workspace->self();
  node_ws_cpu_ = node;
  watch_ = PeerWatch(cfg_, layout_, host_ws_cpu_, engine, remote_peers, pids);
  register_host(host_ws_cpu_, layout_.total, &host_ws_);
  peers_[cfg_.rank].host = host_ws_;
  for (int r = 0; r < cfg_.world; ++r)
    // Kernels write only flags and routing rows into a peer's host
    // workspace: register that head, not the gigabytes of rows behind it.
    if (r != cfg_.rank && node[r] != nullptr) register_host(node[r], layout_.private_rows, &peers_[r].host);

  // Every peer on this node: kernels reach them all through CUDA IPC and
  // nothing waits for the proxy (its flags are read only with remote peers),
  // so no thread polls through steps that move nothing.
  if (has_remote_) {
    ProxyContext ctx = proxy_context(*host_workspace, engine, region, group, remote_peers, signals_,
                                     peer_signals(), pids);
    ctx.caller_arms = true;  // dispatch_send arms it; kernels cannot wake a thread
    proxy_ = std::make_unique<Proxy>(std::move(ctx));
  }
  choose_recv(false);  // until open_node says whom we share the GPU with
}

CudaAllToAll::CudaAllToAll(const A2AConfig& config) : cfg_(config), layout_(Layout::of(config)) {
  cfg_.validate();
  allocate();
  void* host = nullptr;
  check_cuda(cudaHostAlloc(&host, layout_.total, cudaHostAllocMapped | cudaHostAllocPortable), "cudaHostAlloc(workspace)");
  std::memset(host, 0, layout_.total);
  own_host_ws_ = true;
  host_ws_cpu_ = static_cast<uint8_t*>(host);
  registered_.push_back(host);
  check_cuda(cudaHostGetDevicePointer(reinterpret_cast<void**>(&host_ws_), host, 0), "cudaHostGetDevicePointer");
  peers_[cfg_.rank].host = host_ws_;
  choose_recv(false);  // until connect_local joins a peer on our GPU
}

void CudaAllToAll::allocate() {
  check_cuda(cudaGetDevice(&device_), "cudaGetDevice");
  for (int r = 0; r < cfg_.world; ++r) has_remote_ = has_remote_ || !cfg_.same_node(r);
  overlap_ = has_remote_ && env_switch("MOE_A2A_CUDA_OVERLAP") != 0;
  combine_dma_ = overlap_ && env_switch("MOE_A2A_CUDA_COMBINE_DMA") != 0;
  peers_.assign(cfg_.world, PeerWorkspaces{});

  check_cuda(cudaMalloc(&device_ws_, layout_.total), "cudaMalloc(device workspace)");
  check_cuda(cudaMemset(device_ws_, 0, layout_.total), "cudaMemset(device workspace)");
  peers_[cfg_.rank].device = device_ws_;

  const auto sizes = scratch_sizes(cfg_);
  const size_t total = scratch_bytes(cfg_);
  check_cuda(cudaMalloc(&scratch_mem_, total), "cudaMalloc(scratch)");
  check_cuda(cudaMemset(scratch_mem_, 0, total), "cudaMemset(scratch)");
  uint8_t* at = scratch_mem_;
  size_t next = 0;  // sections in the order of `sizes`
  auto take = [&]() {
    uint8_t* p = at;
    at += aligned_size(sizes[next++]);
    return p;
  };
  scratch_.num_tokens = reinterpret_cast<int32_t*>(take());
  scratch_.slots = reinterpret_cast<int32_t*>(take());
  scratch_.copy_rank = reinterpret_cast<int32_t*>(take());
  scratch_.copy_dst = reinterpret_cast<uint8_t**>(take());
  scratch_.block_base = reinterpret_cast<int32_t*>(take());
  scratch_.dropped = reinterpret_cast<int32_t*>(take());
  scratch_.done_blocks = reinterpret_cast<uint32_t*>(take());
  scratch_.senders = reinterpret_cast<SenderPlan*>(take());
  scratch_.segments = reinterpret_cast<Segment*>(take());
  scratch_.output_rows = reinterpret_cast<int32_t*>(take());
  scratch_.plan_ready = reinterpret_cast<uint64_t*>(take());
  scratch_.plan_ticket = reinterpret_cast<uint32_t*>(take());
  scratch_.stage_chunks = reinterpret_cast<uint32_t*>(take());
  scratch_.stage_slices = reinterpret_cast<uint32_t*>(take());
  epoch_device_ = reinterpret_cast<uint64_t*>(take());
  scratch_.self_copy = reinterpret_cast<int32_t*>(take());
  scratch_.self_row = reinterpret_cast<int32_t*>(take());

  void* words = nullptr;
  check_cuda(cudaHostAlloc(&words, sizeof(HostWords), cudaHostAllocMapped | cudaHostAllocPortable),
             "cudaHostAlloc(host words)");
  words_ = new (words) HostWords();
  void* words_dev = nullptr;
  check_cuda(cudaHostGetDevicePointer(&words_dev, words, 0), "cudaHostGetDevicePointer(host words)");
  auto* dev = static_cast<HostWords*>(words_dev);
  status_device_ = &dev->status;
  scratch_.output_rows_host = &dev->output_rows;
  scratch_.planned_host = reinterpret_cast<uint64_t*>(&dev->planned.value);

  void* signals = nullptr;
  check_cuda(cudaHostAlloc(&signals, sizeof(ProxySignals), cudaHostAllocMapped | cudaHostAllocPortable),
             "cudaHostAlloc(signals)");
  signals_ = new (signals) ProxySignals();

  const size_t peer_seqs = static_cast<size_t>(kPeerSignalArrays) * cfg_.world;
  const size_t slice_flags = 2 * static_cast<size_t>(cfg_.world) * kMaxPeerSlices;  // dispatch, then combine
  void* seqs = nullptr;
  check_cuda(cudaHostAlloc(&seqs, peer_seqs * sizeof(Seq) + slice_flags * sizeof(uint64_t),
                           cudaHostAllocMapped | cudaHostAllocPortable),
             "cudaHostAlloc(peer signals)");
  peer_seqs_ = static_cast<Seq*>(seqs);
  for (size_t i = 0; i < peer_seqs; ++i) new (peer_seqs_ + i) Seq();  // one by one: no array cookie
  auto* flags = reinterpret_cast<std::atomic<uint64_t>*>(peer_seqs_ + peer_seqs);
  for (size_t i = 0; i < slice_flags; ++i) new (flags + i) std::atomic<uint64_t>(0);

  check_cuda(cudaMalloc(&peers_device_, cfg_.world * sizeof(PeerWorkspaces)), "cudaMalloc(peers)");
}

PeerSignals CudaAllToAll::peer_signals() const {
  PeerSignals p = peer_signals_in(peer_seqs_, cfg_.world);
  auto* flags = reinterpret_cast<std::atomic<uint64_t>*>(peer_seqs_ + static_cast<size_t>(kPeerSignalArrays) * cfg_.world);
  p.slices_packed = flags;
  p.combine_slices_packed = flags + static_cast<size_t>(cfg_.world) * kMaxPeerSlices;
  return p;
}

void CudaAllToAll::register_host(uint8_t* ptr, size_t bytes, uint8_t** device_ptr) {
  check_cuda(cudaHostRegister(ptr, bytes, cudaHostRegisterMapped | cudaHostRegisterPortable),
             "cudaHostRegister(host workspace)");
  registered_.push_back(ptr);
  check_cuda(cudaHostGetDevicePointer(reinterpret_cast<void**>(device_ptr), ptr, 0), "cudaHostGetDevicePointer");
}

CudaAllToAll::~CudaAllToAll() {
  proxy_.reset();  // stops the thread before its flags go
  cudaDeviceSynchronize();
  for (void* p : ipc_opened_) cudaIpcCloseMemHandle(p);
  for (void* p : registered_) {
    if (own_host_ws_ && p == registered_.front()) cudaFreeHost(p);
    else cudaHostUnregister(p);
  }
  if (signals_ != nullptr) {
    signals_->~ProxySignals();
    cudaFreeHost(signals_);
  }
  if (peer_seqs_ != nullptr) cudaFreeHost(peer_seqs_);  // Seq is trivially destructible
  if (words_ != nullptr) {
    words_->~HostWords();
    cudaFreeHost(words_);
  }
  cudaFree(peers_device_);
  cudaFree(scratch_mem_);
  cudaFree(device_ws_);
}

namespace {

// What a rank tells the ranks of its node: its device workspace, and which
// GPU it runs on (ranks may share one).
struct NodeHandle {
  cudaIpcMemHandle_t workspace;
  cudaUUID_t gpu;
};

cudaUUID_t gpu_uuid(int device) {
  cudaDeviceProp prop;
  check_cuda(cudaGetDeviceProperties(&prop, device), "cudaGetDeviceProperties");
  return prop.uuid;
}

bool same_gpu(const cudaUUID_t& a, const cudaUUID_t& b) { return std::memcmp(&a, &b, sizeof(a)) == 0; }

// MOE_A2A_CUDA_FUSED_RECV on or off forces the choice of fused_recv_ (-1: not forced).
int fused_recv_override() { return env_switch("MOE_A2A_CUDA_FUSED_RECV"); }

}  // namespace

std::string CudaAllToAll::ipc_handle() const {
  NodeHandle h;
  check_cuda(cudaIpcGetMemHandle(&h.workspace, device_ws_), "cudaIpcGetMemHandle");
  h.gpu = gpu_uuid(device_);
  return std::string(reinterpret_cast<const char*>(&h), sizeof(h));
}

void CudaAllToAll::choose_recv(bool gpu_shared) {
  const int forced = fused_recv_override();
  fused_recv_ = forced >= 0 ? forced == 1 : !gpu_shared;
}

void CudaAllToAll::open_node(const std::vector<std::string>& handles) {
  if (static_cast<int>(handles.size()) != cfg_.world)
    throw std::invalid_argument("open_node: got " + std::to_string(handles.size()) + " handles for a world of " +
                                std::to_string(cfg_.world));
  const cudaUUID_t mine = gpu_uuid(device_);
  bool gpu_shared = false;
  for (int r = 0; r < cfg_.world; ++r) {
    if (r == cfg_.rank || !cfg_.same_node(r)) continue;
    if (handles[r].size() != sizeof(NodeHandle))
      throw std::invalid_argument("open_node: the handle of rank " + std::to_string(r) + " has " +
                                  std::to_string(handles[r].size()) + " bytes, expected " +
                                  std::to_string(sizeof(NodeHandle)));
    NodeHandle h;
    std::memcpy(&h, handles[r].data(), sizeof(h));
    void* p = nullptr;
    check_cuda(cudaIpcOpenMemHandle(&p, h.workspace, cudaIpcMemLazyEnablePeerAccess), "cudaIpcOpenMemHandle");
    ipc_opened_.push_back(p);
    peers_[r].device = static_cast<uint8_t*>(p);
    gpu_shared = gpu_shared || same_gpu(h.gpu, mine);
  }
  choose_recv(gpu_shared);
  peers_dirty_ = true;
}

void CudaAllToAll::connect_local(const CudaAllToAll& peer) {
  const int r = peer.cfg_.rank;
  if (r < 0 || r >= cfg_.world || !cfg_.same_node(r) || r == cfg_.rank)
    throw std::invalid_argument("connect_local: rank " + std::to_string(r) + " is not another rank of our node");
  peers_[r].device = peer.device_ws_;
  peers_[r].host = peer.host_ws_;
  if (peer.device_ == device_) choose_recv(true);
  peers_dirty_ = true;
}

void CudaAllToAll::upload_peers() {
  for (int r = 0; r < cfg_.world; ++r)
    if (cfg_.same_node(r) && (peers_[r].device == nullptr || peers_[r].host == nullptr))
      throw std::runtime_error("rank " + std::to_string(cfg_.rank) + ": same-node rank " + std::to_string(r) +
                               " is not mapped (open_node / connect_local missing)");
  check_cuda(cudaMemcpy(peers_device_, peers_.data(), peers_.size() * sizeof(PeerWorkspaces), cudaMemcpyHostToDevice),
             "cudaMemcpy(peers)");
  peers_dirty_ = false;
}

const Instance& CudaAllToAll::instance() {
  int current = -1;
  if (cudaGetDevice(&current) != cudaSuccess || current != device_) check_cuda(cudaSetDevice(device_), "cudaSetDevice");
  if (!peers_dirty_) return instance_;
  upload_peers();
  Instance& in = instance_;
  in = Instance{};
  in.layout = layout_;
  in.rank = cfg_.rank;
  in.world = cfg_.world;
  in.num_experts = cfg_.num_experts;
  in.local_experts = cfg_.num_local_experts();
  in.topk = cfg_.topk;
  in.hidden = cfg_.hidden;
  in.max_tokens = cfg_.max_tokens;
  in.max_private = cfg_.max_private_tokens;
  in.max_recv = cfg_.max_recv_tokens;
  in.expert_padding = cfg_.expert_padding;
  in.dispatch_dtype = static_cast<int32_t>(cfg_.dispatch_dtype);
  in.combine_dtype = static_cast<int32_t>(cfg_.combine_dtype);
  in.num_scales = cfg_.num_scales();
  in.payload_bytes = static_cast<int64_t>(cfg_.payload_bytes());
  in.has_remote = has_remote_ ? 1 : 0;
  in.staged = overlap_ ? 1 : 0;
  in.timeout_ns = static_cast<int64_t>((kProxyGrace * cfg_.timeout_s + kGraceSeconds) * kNsPerSecond);
  in.peers = peers_device_;
  in.device_ws = device_ws_;
  in.host_ws = host_ws_;
  in.fabric_ws = host_ws_;  // no FI_HMEM with the providers used here
  auto dev = [](auto* host_ptr) {
    void* d = nullptr;
    check_cuda(cudaHostGetDevicePointer(&d, const_cast<void*>(static_cast<const void*>(host_ptr)), 0),
               "cudaHostGetDevicePointer(signals)");
    return static_cast<uint64_t*>(d);
  };
  in.proxy.route_ready = dev(&signals_->route_ready.value);
  in.proxy.packed = dev(&signals_->packed.value);
  in.proxy.combine_packed = dev(&signals_->combine_packed.value);
  in.proxy.dispatch_done = dev(&signals_->dispatch_done.value);
  in.proxy.combine_done = dev(&signals_->combine_done.value);
  in.proxy.overflow = dev(&signals_->overflow.value);
  in.proxy.failed = dev(&signals_->failed.value);
  static_assert(sizeof(Seq) == kPeerFlagStride * sizeof(uint64_t), "per-peer flags are kPeerFlagStride apart");
  const PeerSignals peer = peer_signals();
  in.proxy.peer_packed = dev(&peer.packed[0].value);
  in.proxy.peer_combine_packed = dev(&peer.combine_packed[0].value);
  static_assert(sizeof(std::atomic<uint64_t>) == sizeof(uint64_t), "slice flags are plain words to the kernels");
  in.proxy.slices_packed = dev(reinterpret_cast<uint64_t*>(peer.slices_packed));
  in.proxy.combine_slices_packed = dev(reinterpret_cast<uint64_t*>(peer.combine_slices_packed));
  in.slice_bytes = static_cast<int64_t>(cfg_.slice_bytes);
  in.epoch = epoch_device_;
  in.status = status_device_;
  return in;
}

void CudaAllToAll::check_proxy() const {
  if (signals_->failed.get() != 0) {
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
  if (host_ws_cpu_ == nullptr || at_.epoch == 0 || (now < next_stamps_ && !force)) return;
  next_stamps_ = now + PeerWatch::kInterval;
  for (int s = 0; s < cfg_.world; ++s)
    if (cfg_.same_node(s)) check_node_stamps(cfg_, layout_, host_ws_cpu_, at_, s);
}

void CudaAllToAll::announce_failure(const std::string& text) {
  if (proxy_) {
    proxy_->announce_failure(text, done_);  // the node's records too
    return;
  }
  if (host_ws_cpu_ != nullptr) announce_on_node(cfg_, layout_, host_ws_cpu_, node_ws_cpu_, text, done_);
}

void CudaAllToAll::wait_host(FlagKind kind, const Seq& done, const char* what) {
  const std::string who = "rank " + std::to_string(cfg_.rank) + ": timed out after ";
  if (has_remote_) {
    // The proxy times out on its own waits first and reports why.
    const auto deadline = deadline_after(kProxyGrace * cfg_.timeout_s + kGraceSeconds);
    if (!wait_at_least(&done.value, epoch_, deadline, [this] { check_proxy(); }))
      throw fabric::TimeoutError(who + "waiting for the proxy to finish the " + what + " of epoch " +
                                 std::to_string(epoch_));
    check_proxy();
  }
  const auto deadline = deadline_after(cfg_.timeout_s);
  for (int s = 0; s < cfg_.world; ++s) {
    if (s == cfg_.rank || !cfg_.same_node(s)) continue;  // our own kernels come first on the stream
    if (!wait_at_least(flag_at(host_ws_cpu_, layout_, s, kind), epoch_, deadline, [this] { check_proxy(); }))
      throw fabric::TimeoutError(who + std::to_string(cfg_.timeout_s) + " s waiting for the " + what +
                                 " of same-node peer " + std::to_string(s) + " (epoch " + std::to_string(epoch_) + ")");
  }
}

void CudaAllToAll::wait_planned() {
  if (!plan_signals_host_)
    throw std::logic_error("wait_planned: the last dispatch_recv had host_wait=false; its plan kernel "
                           "does not signal the host (synchronise the stream, then check())");
  // Our kernels may queue behind anything earlier on the stream, and the plan
  // kernel itself may wait that long for flags (graph mode's deadline): a
  // grace second more than that.
  const auto deadline = deadline_after(kProxyGrace * cfg_.timeout_s + 2 * kGraceSeconds);
  if (!wait_at_least(&words_->planned.value, epoch_, deadline, [this] { check_proxy(); }))
    throw fabric::TimeoutError("rank " + std::to_string(cfg_.rank) + ": timed out waiting for the plan kernel of epoch " +
                               std::to_string(epoch_) + " (its stream did not reach it)");
  try {
    check();
  } catch (const CapacityError&) {
    at_.routed = at_.overflow = at_.combining = true;  // nobody combines it
    throw;
  }
  at_.routed = true;
}

int64_t CudaAllToAll::max_output_rows() const {
  return static_cast<int64_t>(cfg_.max_recv_tokens) + static_cast<int64_t>(cfg_.num_local_experts()) * (cfg_.expert_padding - 1);
}

void CudaAllToAll::dispatch_send(const void* x, DType x_dtype, const float* x_scale, const void* topk_ids,
                                 bool ids_64bit, int num_tokens, const int32_t* num_tokens_device,
                                 cudaStream_t stream, const uint32_t* routing, bool in_place, const float* weights,
                                 bool dequant_recv) {
  watch_.phase = dispatch_phase(epoch_ + 1);
  int same_node_peers = 0;
  for (int r = 0; r < cfg_.world; ++r) same_node_peers += r != cfg_.rank && cfg_.same_node(r);
  if (routing != nullptr) {
    if (num_tokens_device != nullptr)
      throw std::invalid_argument("dispatch_send: a cached call takes num_tokens from the host, not num_tokens_device");
    check_cached_routing(cfg_, routing, num_tokens);
    call_routing_ = mapped_device_pointer(routing, "routing");
    cached_hash_ = routing_hash(routing, static_cast<size_t>(cfg_.world) * cfg_.num_experts);
    publish_routing_stamp(cfg_, layout_, node_ws_cpu_, epoch_ + 1, cached_hash_);  // before our kernels' flags
    if (has_remote_) {  // the proxy starts from the matrix at once: the kernels publish nothing
      cached_.assign(routing, routing + static_cast<size_t>(cfg_.world) * cfg_.num_experts);
      signals_->cached_routing = cached_.data();
      signals_->cached.set(epoch_ + 1);
      signals_->route_ready.set(epoch_ + 1);
    }
  } else {
    call_routing_ = nullptr;
    rows_sent_ += same_node_peers;
    if (!has_remote_) rows_received_ += same_node_peers;  // our plan reads them (a proxy counts its own waits)
  }
  DispatchSendParams p;
  p.inst = instance();
  p.scratch = scratch_;
  p.x = x;
  p.x_dtype = static_cast<int32_t>(x_dtype);
  p.x_scale = x_scale;
  p.topk_ids = topk_ids;
  p.ids_are_64bit = ids_64bit ? 1 : 0;
  p.weights = weights;
  p.num_tokens = num_tokens;
  p.num_tokens_ptr = num_tokens_device;
  p.cached = routing != nullptr ? 1 : 0;
  // In place only where the receive half's copy is a plain copy of x's row, or
  // a dequantising receive of an fp8 call (which quantises the row itself).
  const bool plain = x_dtype == cfg_.dispatch_dtype && x_dtype != DType::kFp8;
  const bool round_trip = dequant_recv && cfg_.dispatch_dtype == DType::kFp8 && x_dtype != DType::kFp8;
  in_place = in_place && (plain || round_trip);
  p.self_in_place = in_place ? 1 : 0;
  self_x_ = in_place ? x : nullptr;
  self_x_dtype_ = x_dtype;
  self_needs_dequant_ = in_place && round_trip;
  self_weights_ = in_place ? weights : nullptr;
  check_cuda(launch_dispatch_send(p, stream), "dispatch send");
  const bool captured = capturing(stream);
  if (proxy_) arm_proxy(stream, captured);
  ++epoch_;
  at_ = CallPosition{};
  if (!captured) {
    at_.epoch = epoch_;
    at_.cached = at_.routed = routing != nullptr;
    at_.overflow = routing != nullptr && over_capacity(cfg_, routing);  // `routed`: whether it overflows is known
    at_.combining = !has_remote_;  // no barrier: a peer may be in our next call once it has our rows
    at_.silent_overflow = !has_remote_;
  }
}

namespace {
void CUDART_CB arm_from_stream(void* proxy) { static_cast<Proxy*>(proxy)->arm(); }
}  // namespace

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

DispatchRecvParams CudaAllToAll::recv_params(void* out_x, float* out_scale, int32_t* tokens_per_expert,
                                             uint32_t* routing_out) {
  DispatchRecvParams p;
  p.inst = instance();
  p.scratch = scratch_;
  p.out_x = out_x;
  p.out_scale = out_scale;
  p.tokens_per_expert = tokens_per_expert;
  p.max_output_rows = max_output_rows();
  p.routing = call_routing_;
  p.routing_out = routing_out != nullptr ? mapped_device_pointer(routing_out, "routing_out") : nullptr;
  p.self_x = self_x_;
  p.out_weight = out_weight_;
  p.self_weights = self_weights_;
  p.dequant = dequant_ ? 1 : 0;
  p.out_dtype = static_cast<int32_t>(out_dtype_);
  p.self_x_dtype = static_cast<int32_t>(self_x_dtype_);
  p.row_scale = row_math_.scale;
  p.dot_y = row_math_.dot_y;
  p.dot_y_dtype = static_cast<int32_t>(row_math_.dot_y_dtype);
  p.dot_out = row_math_.dot_out;
  return p;
}

void CudaAllToAll::dispatch_recv(void* out_x, float* out_scale, int32_t* tokens_per_expert, bool host_wait,
                                 cudaStream_t stream, uint32_t* routing_out, const RowMath* math,
                                 float* out_weight, bool dequant, DType out_dtype) {
  if (dequant && (cfg_.dispatch_dtype != DType::kFp8 || out_dtype == DType::kFp8 || math != nullptr))
    throw std::invalid_argument("dispatch_recv: dequant: expected fp8 rows, a bf16 or fp32 out_dtype and no math");
  if (self_needs_dequant_ && !dequant)
    throw std::logic_error("dispatch_recv: the send half left our copies in place for a dequantising receive "
                           "(dequant_recv); expected dequant");
  dequant_ = dequant;
  out_dtype_ = out_dtype;
  if (!host_wait && (call_routing_ != nullptr || routing_out != nullptr))
    throw std::invalid_argument("dispatch_recv: a cached call and routing_out need host_wait (eager calls)");
  row_math_ = math != nullptr ? *math : RowMath{};
  out_weight_ = out_weight;
  if (math != nullptr) {
    if (math->scale == nullptr) throw std::invalid_argument("dispatch_recv: math: got no scale; expected one per output row");
    if (cfg_.dispatch_dtype == DType::kFp8)
      throw std::invalid_argument("dispatch_recv: math: the rows are fp8; expected a bf16 or fp32 dispatch dtype");
    if (math->dot_y != nullptr && (math->dot_out == nullptr || math->dot_y_dtype == DType::kFp8))
      throw std::invalid_argument("dispatch_recv: math: dot_y needs dot_out and a bf16 or fp32 dot_y_dtype");
  }
  if (host_wait && overlap_)
    return dispatch_recv_by_sender(out_x, out_scale, tokens_per_expert, stream, routing_out);
  if (host_wait) {
    wait_host(kFlagDispatch, signals_->dispatch_done, "dispatch");
    if (call_routing_ != nullptr)
      for (int s = 0; s < cfg_.world; ++s) check_routing_stamp(cfg_, layout_, host_ws_cpu_, s, epoch_, cached_hash_);
    if (has_remote_ && signals_->overflow.get() == epoch_) {
      at_.routed = at_.overflow = at_.combining = true;  // over capacity: past our barrier
      throw CapacityError("rank " + std::to_string(cfg_.rank) + ": " + capacity_message());
    }
    // With a proxy, it waited for every routing row; without one nobody does in
    // eager calls: a same-node peer that ran this call cached raised its dispatch
    // flag but no route flag, and its row in our workspace is an older call's.
    if (!has_remote_ && call_routing_ == nullptr) {
      try {
        wait_host(kFlagRoute, signals_->dispatch_done, "routing row");
      } catch (const fabric::TimeoutError& e) {
        throw fabric::TimeoutError(e.what() + std::string(kCachedMismatchHint));
      }
    }
    done_ = dispatch_phase(epoch_);  // every peer's part is here
    // With a proxy, whether the call is over capacity is known here; without
    // one only once the plan kernel has run (wait_planned).
    if (has_remote_) {
      at_.routed = true;
      check_stamps(true);
    }
  }
  DispatchRecvParams p = recv_params(out_x, out_scale, tokens_per_expert, routing_out);
  p.wait_in_kernel = host_wait ? 0 : 1;  // and with host_wait the plan kernel signals `planned`
  p.fused = host_wait && fused_recv_ ? 1 : 0;
  check_cuda(launch_dispatch_recv(p, stream), "dispatch recv");
  plan_signals_host_ = host_wait;
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

// Eager receive with fabric peers: once every routing row is in (the proxy's
// `routed`), the plan; then each sender's rows are copied out as soon as they
// have landed (the proxy's landed[s], a same-node peer's dispatch flag),
// sender by sender, while the later ones are still on the wire. Before, the
// copy started once the last sender's rows were in.
void CudaAllToAll::dispatch_recv_by_sender(void* out_x, float* out_scale, int32_t* tokens_per_expert,
                                           cudaStream_t stream, uint32_t* routing_out) {
  const std::string who = "rank " + std::to_string(cfg_.rank) + ": timed out ";
  const auto deadline = deadline_after(kProxyGrace * cfg_.timeout_s + kGraceSeconds);
  const auto check = [this] { check_proxy(); };
  if (!wait_either(signals_->routed, signals_->dispatch_done, epoch_, deadline, check))
    throw fabric::TimeoutError(who + "waiting for the proxy to gather the routing rows of epoch " +
                               std::to_string(epoch_));
  check_proxy();
  at_.routed = true;
  if (signals_->overflow.get() == epoch_) {
    at_.overflow = at_.combining = true;  // over capacity: past our barrier once dispatch_done
    if (!wait_at_least(&signals_->dispatch_done.value, epoch_, deadline, check))  // everyone met: the next call is clean
      throw fabric::TimeoutError(who + "waiting for the proxy to end the overflowing dispatch of epoch " +
                                 std::to_string(epoch_));
    throw CapacityError("rank " + std::to_string(cfg_.rank) + ": " + capacity_message());
  }
  const auto node_deadline = deadline_after(cfg_.timeout_s);
  for (int s = 0; s < cfg_.world && call_routing_ == nullptr; ++s)  // a cached call has every row already
    if (s != cfg_.rank && cfg_.same_node(s) &&
        !wait_at_least(flag_at(host_ws_cpu_, layout_, s, kFlagRoute), epoch_, node_deadline, check))
      throw fabric::TimeoutError(who + "waiting for the routing row of same-node peer " + std::to_string(s) +
                                 " (epoch " + std::to_string(epoch_) + ")");
  DispatchRecvParams p = recv_params(out_x, out_scale, tokens_per_expert, routing_out);
  p.wait_in_kernel = 0;
  check_cuda(launch_dispatch_plan(p, stream), "dispatch plan");
  plan_signals_host_ = true;

  // Every routing row is in our host workspace (remote ones from the proxy,
  // same-node ones from their kernels), so the host knows each sender's copies.
  const auto* matrix = call_routing_ != nullptr ? cached_.data()
                                                : reinterpret_cast<const uint32_t*>(host_ws_cpu_ + layout_.routing);
  RoutingView view{matrix, cfg_.world, cfg_.num_experts, cfg_.num_local_experts()};
  if (combine_dma_) {  // where each remote peer's combine rows will land (peers may rewrite the matrix by then)
    combine_blocks_.clear();
    for (int s = 0; s < cfg_.world; ++s) {
      const uint64_t c = view.to_rank(cfg_.rank, s);
      if (cfg_.same_node(s) || c == 0) continue;
      combine_blocks_.push_back({s, layout_.combine_recv + view.send_offset(cfg_.rank, s) * layout_.combine_row,
                                 static_cast<size_t>(c) * layout_.combine_row});
    }
    combine_blocks_epoch_ = epoch_;
  }
  // Each sender's copies in the slices they land in (slices.h): a remote
  // sender's as the proxy wrote them, anyone else's in one piece. A cached
  // call copies a remote sender's rows once the proxy took its routing stamp
  // (with its last slice), so no row of another routing is ever copied out.
  struct Pending {
    int sender;
    DispatchSlices cut;
    uint32_t next;  // slices copied
  };
  std::vector<Pending> pending;
  for (int d = 0; d < cfg_.world; ++d) {  // ourselves first: our rows are there in stream order
    const int s = (cfg_.rank + d) % cfg_.world;
    const uint64_t c = view.to_rank(s, cfg_.rank);
    if (c == 0) continue;
    const bool sliced = !cfg_.same_node(s) && call_routing_ == nullptr;
    pending.push_back({s, sliced ? dispatch_slices(c, cfg_.max_private_tokens, layout_.dispatch_row, cfg_.slice_bytes)
                                 : one_piece(c),
                       0});
  }
  const PeerSignals peer = peer_signals();
  const auto landed = [&](const Pending& q) -> uint32_t {
    const int s = q.sender;
    const uint32_t all = q.cut.count();
    if (s == cfg_.rank) return all;
    if (cfg_.same_node(s))
      return flag_at(host_ws_cpu_, layout_, s, kFlagDispatch)->load(std::memory_order_acquire) >= epoch_ ? all : 0;
    return slices_landed(peer.slices_landed[s], peer.landed[s], signals_->dispatch_done, all);
  };
  Backoff backoff;
  while (!pending.empty()) {
    size_t kept = 0;
    bool moved = false;
    for (Pending& q : pending) {
      const uint32_t in = landed(q);
      if (in > q.next) {
        p.sender = q.sender;
        if (call_routing_ != nullptr && q.next == 0)
          check_routing_stamp(cfg_, layout_, host_ws_cpu_, p.sender, epoch_, cached_hash_);
        p.sender_first = static_cast<int64_t>(q.cut.begin(q.next));  // consecutive slices are consecutive copies
        p.sender_end = static_cast<int64_t>(q.cut.end(in - 1));
        check_cuda(launch_copy_sender(p, stream), "dispatch copy");
        q.next = in;
        moved = true;
      }
      if (q.next < q.cut.count()) pending[kept++] = q;
    }
    pending.resize(kept);
    if (moved) {
      backoff = Backoff{};
      continue;
    }
    if ((backoff.round & 63) == 0) {
      check_proxy();
      if (std::chrono::steady_clock::now() >= deadline) {
        std::string senders;
        for (const Pending& q : pending) senders += (senders.empty() ? "" : ", ") + std::to_string(q.sender);
        throw fabric::TimeoutError(who + "waiting for the tokens of sender(s) " + senders + " (epoch " +
                                   std::to_string(epoch_) + ")");
      }
    }
    backoff.pause();
  }
  done_ = dispatch_phase(epoch_);
  check_stamps(true);
}

void CudaAllToAll::combine_send(const void* y, DType y_dtype, int64_t y_rows, cudaStream_t stream, bool in_place,
                                const float* row_values) {
  if (y_rows < 0) throw std::invalid_argument("combine_send: y_rows: got " + std::to_string(y_rows) + "; expected >= 0");
  watch_.phase = combine_phase(epoch_);
  at_.combining = true;  // before a peer could see our combine flag
  CombineSendParams p;
  p.inst = instance();
  p.scratch = scratch_;
  p.y = y;
  p.y_dtype = static_cast<int32_t>(y_dtype);
  p.y_rows = y_rows;
  p.row_values = row_values;
  in_place = in_place && y_dtype == cfg_.combine_dtype;  // the reduction reads rows in the combine dtype
  p.self_in_place = in_place ? 1 : 0;
  self_y_ = in_place ? y : nullptr;
  self_y_rows_ = y_rows;
  self_values_ = in_place ? row_values : nullptr;
  check_cuda(launch_combine_send(p, stream), "combine send");
}

// Each remote peer's combine rows, from the host workspace (where the fabric
// put them) to the same offsets of the device workspace, with the copy engine
// as soon as the proxy saw them land (combine_landed), while later peers' are
// still on the wire; the reduction then reads GPU memory only.
void CudaAllToAll::copy_combine_rows_as_they_land(cudaStream_t stream) {
  const PeerSignals peer = peer_signals();
  const auto deadline = deadline_after(kProxyGrace * cfg_.timeout_s + kGraceSeconds);
  struct Pending {
    CombineBlock block;
    DispatchSlices cut;  // the peer's write to us, slice by slice (slices.h)
    uint32_t next;       // slices copied
  };
  std::vector<Pending> pending;
  for (const CombineBlock& b : combine_blocks_)
    pending.push_back({b, combine_slices(b.bytes / layout_.combine_row, layout_.combine_row, cfg_.slice_bytes), 0});
  Backoff backoff;
  while (!pending.empty()) {
    size_t kept = 0;
    bool moved = false;
    for (Pending& q : pending) {
      const uint32_t all = q.cut.count();
      const uint32_t in =
          slices_landed(peer.combine_slices_landed[q.block.peer], peer.combine_landed[q.block.peer],
                        signals_->combine_done, all);
      if (in > q.next) {
        const size_t at = q.block.offset + q.cut.begin(q.next) * layout_.combine_row;
        const size_t bytes = (q.cut.end(in - 1) - q.cut.begin(q.next)) * layout_.combine_row;
        check_cuda(cudaMemcpyAsync(device_ws_ + at, host_ws_cpu_ + at, bytes, cudaMemcpyHostToDevice, stream),
                   "combine rows to the device");
        q.next = in;
        moved = true;
      }
      if (q.next < all) pending[kept++] = q;
    }
    pending.resize(kept);
    if (moved) {
      backoff = Backoff{};
      continue;
    }
    if (pending.empty()) break;
    if ((backoff.round & 63) == 0) {
      check_proxy();
      if (std::chrono::steady_clock::now() >= deadline)
        throw fabric::TimeoutError("rank " + std::to_string(cfg_.rank) + ": timed out waiting for the combine rows of peer " +
                                   std::to_string(pending.front().block.peer) + " (epoch " + std::to_string(epoch_) + ")");
    }
    backoff.pause();
  }
}

uint32_t CudaAllToAll::slices_landed(const Seq& progress, const Seq& whole, const Seq& all, uint32_t count) const {
  if (whole.get() >= epoch_ || all.get() >= epoch_) return count;
  const uint64_t v = progress.get();
  if (v < progress_word(epoch_, 0)) return 0;  // an earlier call's
  const uint64_t in = v - progress_word(epoch_, 0);
  return in < count ? static_cast<uint32_t>(in) : count;
}

void CudaAllToAll::combine_recv(const float* weights, void* out, bool host_wait, cudaStream_t stream,
                                float* values_out) {
  const bool dma = host_wait && combine_dma_ && combine_blocks_epoch_ == epoch_;
  if (dma) copy_combine_rows_as_they_land(stream);
  if (host_wait) {
    wait_host(kFlagCombine, signals_->combine_done, "combine");
    check_stamps(true);
    done_ = combine_phase(epoch_);
  }
  CombineRecvParams p;
  p.inst = instance();
  p.scratch = scratch_;
  p.weights = weights;
  p.out = out;
  p.wait_in_kernel = host_wait ? 0 : 1;
  p.remote_on_device = dma ? 1 : 0;
  p.self_y = self_y_;
  p.self_y_rows = self_y_rows_;
  p.values_out = values_out;
  p.self_values = self_values_;
  check_cuda(launch_combine_recv(p, stream), "combine recv");
}

std::string CudaAllToAll::capacity_message() const {
  std::string msg = proxy_ ? proxy_->overflow_message() : std::string();
  if (!msg.empty()) return msg;
  return "dispatch would deliver more token copies to some rank than max_recv_tokens=" +
         std::to_string(cfg_.max_recv_tokens) +
         "; raise max_recv_tokens in Config (nothing was delivered; the next call can proceed)";
}

void CudaAllToAll::check() const {
  const std::string who = "rank " + std::to_string(cfg_.rank) + ": ";
  const int32_t status = words_->status;
  switch (status) {
    case kStatusOk:
      return;
    case kStatusCapacity:
      throw CapacityError(who + capacity_message());
    case kStatusProxyFailed:
      throw fabric::FabricError(who + (proxy_ ? proxy_->error() : std::string("the proxy failed")));
    case kStatusTimeout:
      throw fabric::TimeoutError(who + "a kernel timed out waiting for a peer's or the proxy's flag (epoch " +
                                 std::to_string(epoch_) + ")");
    case kStatusBadExpert:
      throw std::invalid_argument(who + "topk_ids held an expert id outside [0, " + std::to_string(cfg_.num_experts) +
                                  "); those copies were dropped");
    default:
      throw std::runtime_error(who + "unknown status " + std::to_string(status));
  }
}

}  // namespace moe_a2a::a2a::cuda
