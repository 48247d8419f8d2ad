// What one rank of the CUDA implementation allocates and maps, and nothing
// else: the device workspace (mapped by same-node ranks through CUDA IPC),
// the kernels' scratch in named sections, the words and flags the kernels and
// the proxy share in pinned mapped host memory, the host workspaces
// registered with CUDA, and the peers' workspaces as the kernels reach them.
// The calls themselves are CudaAllToAll's (cuda_all_to_all.h).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <vector>

#include "../live_ranks.h"
#include "../signals.h"
#include "../workspace.h"
#include "params.h"

namespace moe_a2a::a2a::cuda {

// Words the kernels write into pinned mapped host memory for the host.
struct HostWords {
  int32_t status = 0;       // Status of the last call
  int32_t output_rows = 0;  // padded output rows of the last dispatch_recv
  Seq planned;              // epoch whose plan (status, output_rows) is final
};

// Throws std::runtime_error naming `what` unless `err` is cudaSuccess.
void check_cuda(cudaError_t err, const char* what);

// Bytes of device workspaces kept for reuse (see resources.cc: GPU-direct's are never freed).
size_t pooled_workspace_bytes();

class CudaResources {
 public:
  // Allocates everything but the host workspace, on the current device.
  CudaResources(const A2AConfig& config, const Layout& layout);
  ~CudaResources();
  CudaResources(const CudaResources&) = delete;
  CudaResources& operator=(const CudaResources&) = delete;

  // The host workspace: a rank of a job maps `node` (its node's host
  // workspaces, index = rank, null elsewhere; ours at config.rank) ...
  void map_node(const std::vector<uint8_t*>& node);
  // ... a standalone rank (kernel tests) allocates pinned memory of its own.
  void allocate_host_workspace();

  // CUDA IPC handle of our device workspace and the GPU we run on.
  std::string ipc_handle() const;
  // Opens every same-node peer's handle; whether one of them shares our GPU.
  bool open_node(const std::vector<std::string>& handles);
  // A masked same-node peer replaced by a new process (moe_a2a.rejoin):
  // release_peer lets go of the old one's host workspace (before the
  // Workspace unmaps it) and device workspace; open_peer maps the new one's
  // (`host`: its host workspace as the Workspace maps it now). The next
  // mask_peers that leaves it out reaches it again.
  void release_peer(int rank);
  void open_peer(int rank, const std::string& handle, uint8_t* host);
  // Same process: peer `rank`'s workspaces as it maps them.
  void connect(int rank, uint8_t* device_ws, uint8_t* host_ws);

  // What every kernel knows (params.h), with the peers uploaded where they
  // changed: `has_remote`, `staged` and the kernels' `timeout_ns` as the
  // rank decided them.
  const Instance& instance(bool has_remote, bool staged, int64_t timeout_ns);

  // GPU-direct: the fabric writes rows from and into the device workspace
  // (registered with FI_HMEM), so the kernels' fabric sections are there too.
  // `nic_writes`: a NIC (efa, verbs) writes them, whose PCIe writes into GPU
  // memory this device may not order before the completion the host sees:
  // then flush_fabric_writes() flushes them. Otherwise the provider copies
  // them itself (shm: cudaMemcpy on the thread that progresses it, which may
  // return before the copy ends): wait_provider_copies() waits for those.
  void set_rows_on_device(bool nic_writes);
  bool rows_on_device() const { return rows_on_device_; }
  // Before kernels read rows the host saw land (GPU-direct): a no-op unless
  // this device needs a flush of a NIC's writes.
  void flush_fabric_writes() const;
  bool flushes() const { return flush_writes_; }
  // GPU-direct without a NIC: the calling thread's legacy-stream work done,
  // where the provider's copies into our device workspace were queued. Our
  // own kernels on a blocking stream would follow them anyway; a node peer's
  // (rows per node) or a non-blocking stream's would not.
  void wait_provider_copies() const;
  // Rows per node, staged: copies [offset, offset + bytes) of our host
  // workspace to the same offsets of the device workspace, where node peers
  // read the rows we forward, and waits for it. The proxy's thread calls it
  // (ProxyContext::before_forward), on a stream of its own.
  void forward_to_device(size_t offset, size_t bytes);

  // Masked ranks (live_ranks.h), after every kernel of ours ended: a masked
  // same-node peer's workspaces are no longer reached (the kernels take it
  // for a rank of another node that is sent nothing), and every masked rank's
  // routing row in our workspaces is zeroed (its last one is stale).
  void mask_peers(const Masked& masked);
  // Instances made from then on check the generation in every kernel; without
  // it mask_peers is refused (CudaAllToAll::maskable).
  void set_maskable() { maskable_ = true; }
  // The device's epoch counter (a rebuilt call sequence resumes after it),
  // with the generation word after it: mask_peers counts one more, and every
  // Instance made from then on carries it (a graph captured before replays
  // nothing: stale_replay, rows.cuh).
  void set_epoch(uint64_t epoch);
  // The device's epoch counter: a graph's replays raise it, the host's epoch not.
  uint64_t device_epoch() const;

  // The per-peer flags of the proxy (signals.h) in our pinned mapped memory.
  PeerSignals peer_signals() const;

  int device() const { return device_; }
  uint8_t* device_ws() const { return device_ws_; }
  uint8_t* host_ws() const { return host_ws_; }          // device address of our host workspace
  uint8_t* host_ws_cpu() const { return host_ws_cpu_; }  // its host address
  const std::vector<uint8_t*>& node_ws_cpu() const { return node_ws_cpu_; }
  const Scratch& scratch() const { return scratch_; }
  HostWords* words() const { return words_; }
  ProxySignals* signals() const { return signals_; }

 private:
  void allocate_scratch();
  void allocate_mapped();
  void register_host(uint8_t* ptr, size_t bytes, uint8_t** device_ptr);
  void upload_peers();
  // Opens rank r's handle into peers_[r].device; whether it shares our GPU.
  bool open_ipc(int r, const std::string& handle);

  A2AConfig cfg_;
  Layout layout_;
  int device_ = 0;
  uint8_t* device_ws_ = nullptr;
  size_t device_ws_bytes_ = 0;  // its allocation's size (a pooled one may be larger)
  bool pooled_ = false;         // taken from the pool of GPU-direct workspaces: goes back there
  uint8_t* host_ws_ = nullptr;
  uint8_t* host_ws_cpu_ = nullptr;
  std::vector<uint8_t*> node_ws_cpu_;  // index = rank: the node's host workspaces (host addresses), else null
  bool own_host_ws_ = false;           // allocated here (standalone)
  std::vector<void*> registered_;      // host ranges registered with CUDA
  std::vector<void*> ipc_opened_;      // peer device workspaces opened here
  std::vector<void*> ipc_of_;          // index = rank: its entry of ipc_opened_, else null
  std::vector<PeerWorkspaces> peers_;  // index = rank
  Masked masked_;                      // ranks never reached again (mask_peers)
  uint64_t generation_ = 0;            // mask_peers calls so far (Instance::generation)
  bool maskable_ = false;              // set_maskable (Instance::maskable)
  PeerWorkspaces* peers_device_ = nullptr;
  bool peers_dirty_ = true;
  bool rows_on_device_ = false;  // GPU-direct
  bool flush_writes_ = false;    // GPU-direct through a NIC on a device that needs a flush
  cudaStream_t forward_stream_ = nullptr;  // forward_to_device's, made at its first call
  Instance instance_;  // rebuilt when peers change

  uint8_t* scratch_mem_ = nullptr;
  Scratch scratch_;
  uint64_t* epoch_device_ = nullptr;  // in scratch_mem_
  HostWords* words_ = nullptr;        // mapped host
  int32_t* status_device_ = nullptr;  // its status, device address
  ProxySignals* signals_ = nullptr;   // mapped host
  Seq* peer_seqs_ = nullptr;          // mapped host: PeerSignals' Seq arrays, then its slice flags
};

}  // namespace moe_a2a::a2a::cuda
