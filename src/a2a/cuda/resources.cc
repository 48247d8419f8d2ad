#include "resources.h"

#include <atomic>
#include <algorithm>
#include <cstring>
#include <mutex>
#include <new>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "launch.h"
#include "scratch.h"

namespace moe_a2a::a2a::cuda {

void check_cuda(cudaError_t err, const char* what) {
  if (err != cudaSuccess)
    throw std::runtime_error(std::string("CUDA error in ") + what + ": " + cudaGetErrorName(err) + " (" +
                             cudaGetErrorString(err) + ")");
}

namespace {

// Pinned host memory, mapped for the GPU.
void* host_alloc_mapped(size_t bytes, const char* what) {
  void* p = nullptr;
  check_cuda(cudaHostAlloc(&p, bytes, cudaHostAllocMapped | cudaHostAllocPortable), what);
  return p;
}

template <typename T>
T* device_address(T* host, const char* what) {
  void* d = nullptr;
  check_cuda(cudaHostGetDevicePointer(&d, const_cast<void*>(static_cast<const void*>(host)), 0), what);
  return static_cast<T*>(d);
}

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

// Device workspaces that were registered for GPU-direct are never given back to CUDA while the
// process lives. libfabric's shm provider keeps its CUDA IPC mapping of a peer's registered
// memory until its domain closes (not when the region or the peer goes), and a peer that opens
// a new allocation of ours at the freed address then fails with cudaErrorAlreadyMapped. A later
// instance on the same device takes one back: the same allocation, so the same IPC handle, which
// CUDA lets a process open more than once.
struct PooledWorkspace {
  int device;
  size_t bytes;
  uint8_t* ptr;
};
std::mutex pool_mutex;
std::vector<PooledWorkspace>& workspace_pool() {
  static auto* pool = new std::vector<PooledWorkspace>();  // never destroyed: the driver reclaims at exit
  return *pool;
}

// The smallest pooled workspace of `device` holding `bytes`, or null; `*held` its size.
uint8_t* take_pooled(int device, size_t bytes, size_t* held) {
  std::lock_guard<std::mutex> lock(pool_mutex);
  auto& pool = workspace_pool();
  auto best = pool.end();
  for (auto it = pool.begin(); it != pool.end(); ++it)
    if (it->device == device && it->bytes >= bytes && (best == pool.end() || it->bytes < best->bytes)) best = it;
  if (best == pool.end()) return nullptr;
  uint8_t* p = best->ptr;
  *held = best->bytes;
  pool.erase(best);
  return p;
}

}  // namespace

size_t pooled_workspace_bytes() {
  std::lock_guard<std::mutex> lock(pool_mutex);
  size_t total = 0;
  for (const auto& w : workspace_pool()) total += w.bytes;
  return total;
}

CudaResources::CudaResources(const A2AConfig& config, const Layout& layout) : cfg_(config), layout_(layout) {
  check_cuda(cudaGetDevice(&device_), "cudaGetDevice");
  peers_.assign(cfg_.world, PeerWorkspaces{});
  device_ws_ = take_pooled(device_, layout_.total, &device_ws_bytes_);
  if (device_ws_ == nullptr) {
    check_cuda(cudaMalloc(&device_ws_, layout_.total), "cudaMalloc(device workspace)");
    device_ws_bytes_ = layout_.total;
  } else {
    pooled_ = true;
  }
  check_cuda(cudaMemset(device_ws_, 0, layout_.total), "cudaMemset(device workspace)");
  peers_[cfg_.rank].device = device_ws_;
  allocate_scratch();
  allocate_mapped();
  check_cuda(cudaMalloc(&peers_device_, cfg_.world * sizeof(PeerWorkspaces)), "cudaMalloc(peers)");
}

void CudaResources::allocate_scratch() {
  const size_t total = scratch_bytes(cfg_);
  check_cuda(cudaMalloc(&scratch_mem_, total), "cudaMalloc(scratch)");
  check_cuda(cudaMemset(scratch_mem_, 0, total), "cudaMemset(scratch)");
  uint8_t* at = scratch_mem_;
  scratch_sections(cfg_, scratch_, epoch_device_, [&](auto*& p, size_t count) {
    const size_t bytes = scratch_section_bytes(p, count);
    p = reinterpret_cast<std::remove_reference_t<decltype(p)>>(at);
    at += bytes;
  });
}

void CudaResources::allocate_mapped() {
  words_ = new (host_alloc_mapped(sizeof(HostWords), "cudaHostAlloc(host words)")) HostWords();
  HostWords* dev = device_address(words_, "cudaHostGetDevicePointer(host words)");
  status_device_ = &dev->status;
  scratch_.output_rows_host = &dev->output_rows;
  scratch_.planned_host = reinterpret_cast<uint64_t*>(&dev->planned.value);

  signals_ = new (host_alloc_mapped(sizeof(ProxySignals), "cudaHostAlloc(signals)")) ProxySignals();

  const size_t peer_seqs = static_cast<size_t>(kPeerSignalArrays) * cfg_.world;
  const size_t slice_flags = 2 * static_cast<size_t>(cfg_.world) * kMaxPeerSlices;  // dispatch, then combine
  peer_seqs_ = static_cast<Seq*>(
      host_alloc_mapped(peer_seqs * sizeof(Seq) + slice_flags * sizeof(uint64_t), "cudaHostAlloc(peer signals)"));
  for (size_t i = 0; i < peer_seqs; ++i) new (peer_seqs_ + i) Seq();  // one by one: no array cookie
  auto* flags = reinterpret_cast<std::atomic<uint64_t>*>(peer_seqs_ + peer_seqs);
  for (size_t i = 0; i < slice_flags; ++i) new (flags + i) std::atomic<uint64_t>(0);
}

CudaResources::~CudaResources() {
  cudaDeviceSynchronize();
  if (forward_stream_ != nullptr) cudaStreamDestroy(forward_stream_);  // the proxy is gone (~CudaAllToAll)
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
  if (rows_on_device_ || pooled_) {
    std::lock_guard<std::mutex> lock(pool_mutex);
    workspace_pool().push_back({device_, device_ws_bytes_, device_ws_});
  } else {
    cudaFree(device_ws_);
  }
}

PeerSignals CudaResources::peer_signals() const {
  PeerSignals p = peer_signals_in(peer_seqs_, cfg_.world);
  auto* flags =
      reinterpret_cast<std::atomic<uint64_t>*>(peer_seqs_ + static_cast<size_t>(kPeerSignalArrays) * cfg_.world);
  p.slices_packed = flags;
  p.combine_slices_packed = flags + static_cast<size_t>(cfg_.world) * kMaxPeerSlices;
  return p;
}

void CudaResources::register_host(uint8_t* ptr, size_t bytes, uint8_t** device_ptr) {
  check_cuda(cudaHostRegister(ptr, bytes, cudaHostRegisterMapped | cudaHostRegisterPortable),
             "cudaHostRegister(host workspace)");
  registered_.push_back(ptr);
  *device_ptr = device_address(ptr, "cudaHostGetDevicePointer");
}

void CudaResources::set_rows_on_device(bool nic_writes) {
  rows_on_device_ = true;
  peers_dirty_ = true;
  if (!nic_writes) return;
  int ordering = 0, options = 0;
  check_cuda(cudaDeviceGetAttribute(&ordering, cudaDevAttrGPUDirectRDMAWritesOrdering, device_),
             "cudaDeviceGetAttribute(GPUDirect RDMA writes ordering)");
  if (ordering >= cudaGPUDirectRDMAWritesOrderingOwner) return;  // our kernels see them in order already
  check_cuda(cudaDeviceGetAttribute(&options, cudaDevAttrGPUDirectRDMAFlushWritesOptions, device_),
             "cudaDeviceGetAttribute(GPUDirect RDMA flush options)");
  if ((options & cudaFlushGPUDirectRDMAWritesOptionHost) == 0)
    throw std::runtime_error("GPU-direct: CUDA device " + std::to_string(device_) +
                             " neither orders a NIC's writes for its kernels nor can flush them from the host; "
                             "stage through host memory instead (MOE_A2A_GPU_DIRECT=0)");
  flush_writes_ = true;
}

void CudaResources::flush_fabric_writes() const {
  if (flush_writes_)
    check_cuda(cudaDeviceFlushGPUDirectRDMAWrites(cudaFlushGPUDirectRDMAWritesTargetCurrentDevice,
                                                  cudaFlushGPUDirectRDMAWritesToOwner),
               "cudaDeviceFlushGPUDirectRDMAWrites");
}

void CudaResources::wait_provider_copies() const {
  check_cuda(cudaSetDevice(device_), "cudaSetDevice(landed rows)");  // the proxy's thread
  check_cuda(cudaStreamSynchronize(cudaStreamLegacy), "cudaStreamSynchronize(provider's copies)");
}

void CudaResources::forward_to_device(size_t offset, size_t bytes) {
  if (bytes == 0) return;
  if (offset + bytes > layout_.total)
    throw std::logic_error("forward_to_device: bytes [" + std::to_string(offset) + ", " +
                           std::to_string(offset + bytes) + ") past the workspace (" + std::to_string(layout_.total) +
                           ")");
  check_cuda(cudaSetDevice(device_), "cudaSetDevice(forward)");  // the proxy's thread
  if (forward_stream_ == nullptr)
    check_cuda(cudaStreamCreateWithFlags(&forward_stream_, cudaStreamNonBlocking), "cudaStreamCreate(forward)");
  check_cuda(cudaMemcpyAsync(device_ws_ + offset, host_ws_cpu_ + offset, bytes, cudaMemcpyHostToDevice, forward_stream_),
             "cudaMemcpyAsync(forwarded rows)");
  check_cuda(cudaStreamSynchronize(forward_stream_), "cudaStreamSynchronize(forwarded rows)");
}

void CudaResources::map_node(const std::vector<uint8_t*>& node) {
  node_ws_cpu_ = node;
  host_ws_cpu_ = node[cfg_.rank];
  register_host(host_ws_cpu_, layout_.total, &host_ws_);
  peers_[cfg_.rank].host = host_ws_;
  for (int r = 0; r < cfg_.world; ++r)
    // Kernels write only flags and routing rows into a peer's host
    // workspace: register that head, not the gigabytes of rows behind it.
    if (r != cfg_.rank && node[r] != nullptr) register_host(node[r], layout_.private_rows, &peers_[r].host);
}

void CudaResources::allocate_host_workspace() {
  void* host = host_alloc_mapped(layout_.total, "cudaHostAlloc(workspace)");
  std::memset(host, 0, layout_.total);
  own_host_ws_ = true;
  host_ws_cpu_ = static_cast<uint8_t*>(host);
  registered_.push_back(host);
  host_ws_ = device_address(host_ws_cpu_, "cudaHostGetDevicePointer");
  peers_[cfg_.rank].host = host_ws_;
}

std::string CudaResources::ipc_handle() const {
  NodeHandle h;
  check_cuda(cudaIpcGetMemHandle(&h.workspace, device_ws_), "cudaIpcGetMemHandle");
  h.gpu = gpu_uuid(device_);
  return std::string(reinterpret_cast<const char*>(&h), sizeof(h));
}

bool CudaResources::open_node(const std::vector<std::string>& handles) {
  if (static_cast<int>(handles.size()) != cfg_.world)
    throw std::invalid_argument("open_node: got " + std::to_string(handles.size()) + " handles for a world of " +
                                std::to_string(cfg_.world));
  bool gpu_shared = false;
  for (int r = 0; r < cfg_.world; ++r) {
    if (r == cfg_.rank || !cfg_.same_node(r)) continue;
    gpu_shared = open_ipc(r, handles[r]) || gpu_shared;
  }
  peers_dirty_ = true;
  return gpu_shared;
}

bool CudaResources::open_ipc(int r, const std::string& handle) {
  if (handle.size() != sizeof(NodeHandle))
    throw std::invalid_argument("open_node: the handle of rank " + std::to_string(r) + " has " +
                                std::to_string(handle.size()) + " bytes, expected " + std::to_string(sizeof(NodeHandle)));
  NodeHandle h;
  std::memcpy(&h, handle.data(), sizeof(h));
  void* p = nullptr;
  check_cuda(cudaIpcOpenMemHandle(&p, h.workspace, cudaIpcMemLazyEnablePeerAccess), "cudaIpcOpenMemHandle");
  ipc_opened_.push_back(p);
  if (ipc_of_.empty()) ipc_of_.assign(cfg_.world, nullptr);
  ipc_of_[r] = p;
  peers_[r].device = static_cast<uint8_t*>(p);
  return same_gpu(h.gpu, gpu_uuid(device_));
}

void CudaResources::release_peer(int r) {
  if (r < 0 || r >= cfg_.world || r == cfg_.rank || !cfg_.same_node(r))
    throw std::invalid_argument("release_peer: rank " + std::to_string(r) + " is not another rank of our node");
  check_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize(release_peer)");
  uint8_t* host = r < static_cast<int>(node_ws_cpu_.size()) ? node_ws_cpu_[r] : nullptr;
  auto reg = std::find(registered_.begin(), registered_.end(), static_cast<void*>(host));
  if (host != nullptr && reg != registered_.end()) {
    check_cuda(cudaHostUnregister(host), "cudaHostUnregister(replaced peer)");
    registered_.erase(reg);
  }
  if (!ipc_of_.empty() && ipc_of_[r] != nullptr) {
    auto open = std::find(ipc_opened_.begin(), ipc_opened_.end(), ipc_of_[r]);
    if (open != ipc_opened_.end()) {
      cudaIpcCloseMemHandle(*open);  // the old process's memory: gone with it, or going
      ipc_opened_.erase(open);
    }
    ipc_of_[r] = nullptr;
  }
  node_ws_cpu_[r] = nullptr;
  peers_[r] = PeerWorkspaces{};
  peers_dirty_ = true;
}

void CudaResources::open_peer(int r, const std::string& handle, uint8_t* host) {
  if (r < 0 || r >= cfg_.world || r == cfg_.rank || !cfg_.same_node(r) || host == nullptr)
    throw std::invalid_argument("open_peer: rank " + std::to_string(r) + " is not another mapped rank of our node");
  open_ipc(r, handle);
  node_ws_cpu_[r] = host;
  register_host(host, layout_.private_rows, &peers_[r].host);
  peers_dirty_ = true;
}

void CudaResources::connect(int rank, uint8_t* device_ws, uint8_t* host_ws) {
  peers_[rank].device = device_ws;
  peers_[rank].host = host_ws;
  peers_dirty_ = true;
}

void CudaResources::mask_peers(const Masked& masked) {
  // A graph captured by an unmaskable instance would replay after the mask.
  if (!maskable_) throw std::logic_error("mask_peers: this instance was not made maskable before its first call");
  masked_ = masked;
  const size_t row_bytes = static_cast<size_t>(cfg_.routing_width()) * sizeof(uint32_t);
  for (int r = 0; r < cfg_.world; ++r) {
    if (!is_masked(masked_, r) || r == cfg_.rank) continue;
    peers_[r] = PeerWorkspaces{};  // the mapping stays open (a dead process's memory), unused
    if (host_ws_cpu_ != nullptr) std::memset(host_ws_cpu_ + layout_.routing_row(r), 0, row_bytes);
    check_cuda(cudaMemset(device_ws_ + layout_.routing_row(r), 0, row_bytes), "cudaMemset(masked routing row)");
  }
  ++generation_;
  peers_dirty_ = true;
}

void CudaResources::set_epoch(uint64_t epoch) {
  const uint64_t words[2] = {epoch, generation_};
  check_cuda(cudaMemcpy(epoch_device_, words, sizeof(words), cudaMemcpyHostToDevice), "cudaMemcpy(epoch)");
}

uint64_t CudaResources::device_epoch() const {
  uint64_t epoch = 0;
  check_cuda(cudaMemcpy(&epoch, epoch_device_, sizeof(epoch), cudaMemcpyDeviceToHost), "cudaMemcpy(epoch)");
  return epoch;
}

void CudaResources::upload_peers() {
  for (int r = 0; r < cfg_.world; ++r)
    if (cfg_.same_node(r) && !is_masked(masked_, r) && (peers_[r].device == nullptr || peers_[r].host == nullptr))
      throw std::runtime_error("rank " + std::to_string(cfg_.rank) + ": same-node rank " + std::to_string(r) +
                               " is not mapped (open_node / connect_local missing)");
  check_cuda(cudaMemcpy(peers_device_, peers_.data(), peers_.size() * sizeof(PeerWorkspaces), cudaMemcpyHostToDevice),
             "cudaMemcpy(peers)");
  peers_dirty_ = false;
}

const Instance& CudaResources::instance(bool has_remote, bool staged, int64_t timeout_ns) {
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
  in.has_remote = has_remote ? 1 : 0;
  in.staged = staged ? 1 : 0;
  in.timeout_ns = timeout_ns;
  in.rank_rows = cfg_.rank_rows() ? 1 : 0;
  in.node_rows = cfg_.node_rows() ? 1 : 0;
  in.ranks_per_node = cfg_.ranks_per_node;
  in.max_entries = cfg_.max_entries();
  in.any_masked = 0;
  for (const uint8_t m : masked_) in.any_masked |= m;
  in.peers = peers_device_;
  in.device_ws = device_ws_;
  in.host_ws = host_ws_;
  in.fabric_ws = rows_on_device_ ? device_ws_ : host_ws_;  // GPU-direct: the fabric moves device memory
  const auto dev = [](auto* host_ptr) {
    return reinterpret_cast<uint64_t*>(device_address(host_ptr, "cudaHostGetDevicePointer(signals)"));
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
  in.generation = generation_;
  in.maskable = maskable_ ? 1 : 0;
  in.status = status_device_;
  return in;
}

}  // namespace moe_a2a::a2a::cuda
