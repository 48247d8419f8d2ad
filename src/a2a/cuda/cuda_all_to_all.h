// Dispatch and combine on a CUDA GPU: the device side of one rank. It owns
// the device workspace (mapped by same-node ranks through CUDA IPC), the
// kernels' scratch, the proxy's flags in pinned mapped memory and the proxy
// thread, and registers the host workspaces (POSIX shared memory) with CUDA so
// kernels write routing rows and fabric rows there directly.
//
// Start-up: construct, exchange ipc_handle() with the ranks of the node, call
// open_node(), then a barrier before anyone dispatches. Every call enqueues
// work on the caller's stream. The receive halves can first wait on the CPU
// (host_wait) until every peer's flag is up, with the configured timeout: then
// no kernel spins, which matters when several ranks share one GPU by time
// slices, and a dead peer ends in an error instead of a hung stream. Without
// host_wait (graph capture) the kernels wait for the flags themselves.
#pragma once

#include <cuda_runtime.h>

#include <chrono>
#include <functional>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "../call_stamps.h"
#include "../live_ranks.h"
#include "../peer_watch.h"
#include "../proxy.h"
#include "../workspace.h"
#include "fabric_recv.h"
#include "params.h"
#include "resources.h"

namespace moe_a2a::a2a::cuda {

// The send half of dispatch. Pointers are device (or mapped) addresses.
struct DispatchSendArgs {
  const void* x = nullptr;  // [T, hidden] in x_dtype
  DType x_dtype = DType::kBf16;
  const float* x_scale = nullptr;  // [T, num_scales] when x is fp8
  const void* topk_ids = nullptr;  // [T, topk], int32 or int64
  bool ids_64bit = false;
  int num_tokens = 0;
  const int32_t* num_tokens_device = nullptr;  // when non-null, overrides num_tokens
  // Pinned host memory, [world][num_experts]: an earlier dispatch_recv's
  // routing_out for these topk_ids makes this a cached call: no routing row
  // is published or awaited (docs/protocol.md, "Cached calls"); its
  // dispatch_recv needs host_wait.
  const uint32_t* routing = nullptr;
  // The caller leaves x unchanged until the receive half's kernels have run
  // (in stream order: until it is called), so this rank's copies to itself
  // are read from there instead of copied twice; taken where x is in the
  // dispatch dtype (or with dequant_recv).
  bool in_place = false;
  const float* weights = nullptr;  // [T, topk] fp32: each copy's weight into its row's tail (null: zeros)
  // The receive half will dequantise fp8 rows, so with in_place our copies of
  // a bf16 or fp32 x stay there too, and the receive quantises them as the
  // pack would.
  bool dequant_recv = false;
};

// The receive half of dispatch.
struct DispatchRecvArgs {
  void* out_x = nullptr;                 // [max_output_rows, hidden]
  float* out_scale = nullptr;            // [max_output_rows, num_scales] for fp8
  int32_t* tokens_per_expert = nullptr;  // [local_experts]
  bool host_wait = false;
  uint32_t* routing_out = nullptr;  // pinned host: the plan's matrix, final after wait_planned
  RowMath math;                     // config.h; scale null: none
  float* out_weight = nullptr;      // [output rows]: each row's weight from its tail (null: not wanted)
  // fp8 rows: out_x is [rows, hidden] in out_dtype (bf16 or fp32), each row
  // dequantised; out_scale is unused.
  bool dequant = false;
  DType out_dtype = DType::kBf16;
};

// The send half of combine.
struct CombineSendArgs {
  const void* y = nullptr;  // [y_rows, hidden] in y_dtype (bf16 or fp32)
  DType y_dtype = DType::kBf16;
  int64_t y_rows = 0;
  bool in_place = false;              // as DispatchSendArgs::in_place, for y in the combine dtype
  const float* row_values = nullptr;  // [y_rows] fp32, one per row back in its tail (null: zeros)
  // Rows per rank are weighted where the experts are: with the dispatch's
  // weights (true), or summed plainly (false, the unweighted combine).
  bool weighted = true;
};

// The receive half of combine.
struct CombineRecvArgs {
  const float* weights = nullptr;  // [T, topk]
  void* out = nullptr;             // [T, hidden] in the combine dtype
  bool host_wait = false;
  float* values_out = nullptr;  // [T, topk] fp32: each copy's returned value, unreduced (null: not wanted)
};

// The current call: what each send half leaves for its receive half.
struct Call {
  uint64_t epoch = 0;
  // Our position, for check_stamps: eager calls only (epoch 0, nothing
  // checked, when captured: the host's epoch does not follow graph replays).
  CallPosition at;
  // The last phase whose receive half completed on the host (eager calls; a
  // peer_watch.h phase); graph replays leave it behind, which only makes
  // peers stop a phase earlier.
  uint64_t done = 0;
  // Dispatch: its send half's arguments, in_place as taken.
  DispatchSendArgs send;
  bool self_needs_dequant = false;    // our copies left in place as bf16/fp32 rows of an fp8 call
  const uint32_t* routing = nullptr;  // device address of a cached call's matrix; null if uncached
  uint64_t cached_hash = 0;           // routing_hash of it
  std::vector<uint32_t> cached;       // a copy of it, for the proxy until dispatch_done
  DispatchRecvArgs recv;              // its receive half's
  bool plan_signals_host = false;     // its plan raises `planned` (host_wait)
  // Combine: its send half's arguments, in_place as taken.
  CombineSendArgs combine;
};

class CudaAllToAll {
 public:
  // A rank of a job: `host_workspace` already maps its node's peers.
  // `pids[r]`: the pid of rank r where it runs on this host, else 0 (peer_watch.h).
  CudaAllToAll(Workspace* host_workspace, fabric::ProxyEngine* engine, fabric::RegionId region,
               fabric::GroupId group, const std::vector<int>& remote_peers, const std::vector<int>& pids = {});
  // A rank without fabric or proxy (kernel tests: several ranks in one
  // process). The host workspace is pinned memory of its own; peers are
  // joined with connect_local(); with peers on other (virtual) nodes, the
  // caller plays the proxy through the signal and workspace addresses.
  explicit CudaAllToAll(const A2AConfig& config);
  ~CudaAllToAll();
  CudaAllToAll(const CudaAllToAll&) = delete;
  CudaAllToAll& operator=(const CudaAllToAll&) = delete;

  // CUDA IPC handle of our device workspace, for the ranks of our node.
  std::string ipc_handle() const { return res_.ipc_handle(); }
  // handles[r] for every rank (ignored for ourselves and other nodes).
  void open_node(const std::vector<std::string>& handles);
  // Same process: map a same-node peer's workspaces directly.
  void connect_local(const CudaAllToAll& peer);
  // A masked rank's replacement (moe_a2a.rejoin), with the proxy stopped:
  // release_peer before the host Workspace remaps a same-node rank;
  // replace_peer after, with its IPC handle ("" for another node's) and pid.
  // The mask() that follows without it reaches it.
  void release_peer(int rank) { res_.release_peer(rank); }
  void replace_peer(int rank, const std::string& handle, uint8_t* host_ws, int pid);
  // GPU-direct (docs/transport.md), before the first call: the proxy writes
  // the rows from `region` (our device workspace, registered with FI_HMEM)
  // into each peer's through `group`, at the host workspace's offsets; no
  // staging copy, no copy back. Host staging is what runs otherwise.
  // `nic_writes`: a NIC provider (efa, verbs) writes them, not shm's CUDA copies.
  void rows_on_device(fabric::RegionId region, fabric::GroupId group, bool nic_writes);
  // Graph-safe instances, before the first call: every call waits in kernels.
  // Rows per node are then forwarded in the stream (forward_kernel), never by
  // CUDA calls on the proxy's thread, which could wait behind a kernel that
  // waits for the proxy (a module's lazy load synchronises the context).
  void kernel_waits();
  // Instances that may be masked (on_peer_loss="mask"), before the first
  // call: every kernel then checks that its graph was not captured before a
  // mask. Others skip that read; mask() refuses them.
  void maskable();
  bool gpu_direct() const { return res_.rows_on_device(); }
  // Stops the proxy (a close whose memory stays registered a while longer).
  void stop_proxy() { proxy_.reset(); }
  // Mask and continue (docs/reliability.md): after a call failed because a
  // peer's process is gone, the caller synchronised the device and stopped
  // the proxy, and the survivors agreed on `masked` (index = rank) and on
  // `first_epoch`. Re-arms this rank with them, without any collective: the
  // next dispatch is first_epoch + 1, masked ranks are never waited for,
  // written to or read from again, and the proxy serves `remote_peers` (the
  // live ones) through `group` (`rows_group`: GPU-direct's group of device
  // workspaces; ignored when staging). The caller drops every masked
  // (token, k) before dispatch (ids kMaskedExpert, row_tail.h). Blocks only on a
  // device copy; a graph captured before it must be captured again.
  void mask(const Masked& masked, uint64_t first_epoch, fabric::GroupId group, fabric::GroupId rows_group,
            const std::vector<int>& remote_peers);
  // The device's epoch counter (synchronises with the device): graph replays
  // raise it and not the host's epoch(), so a mask after replays resumes after it.
  uint64_t device_epoch() const { return res_.device_epoch(); }

  // The four halves enqueue work on `stream` (a cudaStream_t).
  void dispatch_send(const DispatchSendArgs& args, cudaStream_t stream);
  void dispatch_recv(const DispatchRecvArgs& args, cudaStream_t stream);
  void combine_send(const CombineSendArgs& args, cudaStream_t stream);
  void combine_recv(const CombineRecvArgs& args, cudaStream_t stream);

  // After the caller synchronised with the stream (or wait_planned): the
  // outcome of the last call (throws CapacityError, fabric errors), and the
  // rows it filled.
  void check() const;
  // Tells every peer that this rank failed (`text` says how), so their waits
  // end at once: abort records in the node's host workspaces, and through the
  // proxy across the fabric (Proxy::announce_failure).
  void announce_failure(const std::string& text);
  // Eager dispatch (after dispatch_recv with host_wait): wait until the plan
  // of the current epoch is final (its kernel wrote `planned`), then
  // check(). Cheaper than a stream synchronisation, and the copy after the
  // plan keeps running.
  void wait_planned();
  int32_t status() const { return res_.words()->status; }
  // Output rows of the last dispatch_recv with host_wait (eager calls): calls
  // that wait in kernels (graphs) leave it, as no host reads it there.
  int64_t output_rows() const { return res_.words()->output_rows; }
  int64_t max_output_rows() const;
  // Wire rows each sender sent us in the last planned dispatch, from the
  // plan's scratch: the workspace's routing matrix may already hold a peer's
  // row of its next call. Synchronises with the device.
  std::vector<int64_t> wire_received() const;
  // Rows per node, the last planned dispatch, per node peer t: the rows we
  // forwarded that t read entries from, and the bytes of t's outputs our
  // combine sums for those entries (staged in fp32, and each row value).
  // Synchronises with the device.
  std::pair<std::vector<uint64_t>, std::vector<uint64_t>> forwarded_traffic() const;
  bool fused_recv() const { return fused_recv_; }
  uint64_t epoch() const { return call_.epoch; }
  // Routing rows written to peers / peers' rows waited for or read, by this
  // rank's kernels (counted at their launch) and its proxy.
  uint64_t routing_rows_sent() const { return rows_sent_ + (proxy_ ? proxy_->routing_rows_sent() : 0); }
  uint64_t routing_rows_received() const { return rows_received_ + (proxy_ ? proxy_->routing_rows_received() : 0); }

  const A2AConfig& config() const { return cfg_; }
  const Layout& layout() const { return layout_; }
  uintptr_t device_workspace() const { return reinterpret_cast<uintptr_t>(res_.device_ws()); }
  uintptr_t host_workspace() const { return reinterpret_cast<uintptr_t>(res_.host_ws_cpu()); }
  ProxySignals* signals() const { return res_.signals(); }

 private:
  void init_switches();
  // How long the host waits for the proxy (and a kernel for any flag): the
  // proxy times out on its own waits first and reports why.
  const Instance& instance();
  // Host waits of the receive halves: every same-node flag of `kind` and the
  // proxy's `done` (with remote peers) at the current epoch.
  void wait_host(FlagKind kind, const Seq& done, const char* what);
  // Until flag `kind` of every sender s with from(s) reaches the current
  // epoch (timeout_s); the TimeoutError names what(s) and where it is late.
  void wait_flags(FlagKind kind, const std::function<bool(int)>& from, const std::function<std::string(int)>& what);
  // The plan's senders (SenderPlan), from the device.
  std::vector<SenderPlan> sender_plans() const;
  void wait_dispatch_host();
  DispatchRecvParams recv_params();
  void dispatch_recv_by_sender(cudaStream_t stream);
  LandingView landing(std::chrono::steady_clock::time_point deadline);
  void check_proxy() const;
  // Same-node peers' flags against our call (call_stamps.h); the proxy checks
  // remote peers. At most every PeerWatch::kInterval unless `force`.
  void check_stamps(bool force) const;
  // The proxy polls only while a call is under way: tell it one started.
  void arm_proxy(cudaStream_t stream, bool captured);
  static bool capturing(cudaStream_t stream);
  std::string capacity_message() const;
  [[noreturn]] void throw_capacity() const;
  // A same-node peer we exchange flags with: not masked (live_ranks.h).
  bool node_peer(int r) const { return cfg_.same_node(r) && !is_masked(masked_, r); }
  // Eager dispatch_recv plans and copies in one launch, unless another rank
  // of the node runs on our GPU: there the copy blocks that wait for the plan
  // hold multiprocessors the other ranks' kernels need (8 ranks under MPS:
  // decode step 313-321 -> 413-457 us), while alone it saves a launch.
  void choose_recv(bool gpu_shared);

  A2AConfig cfg_;
  Layout layout_;
  CudaResources res_;
  bool has_remote_ = false;
  // Fabric peers: stage their rows peer by peer and receive sender by sender
  // (MOE_A2A_CUDA_OVERLAP, on unless 0).
  bool overlap_ = false;
  // Eager calls with fabric peers: each remote peer's combine rows go to the
  // device workspace by cudaMemcpyAsync as they land
  // (MOE_A2A_CUDA_COMBINE_DMA, on unless 0).
  bool combine_dma_ = false;
  bool fused_recv_ = true;
  bool kernel_waits_ = false;  // kernel_waits(): a graph-safe instance
  FabricReceive fabric_recv_;
  // A peer's announced failure or a dead same-host peer ends our host waits.
  mutable PeerWatch watch_;
  mutable std::chrono::steady_clock::time_point next_stamps_{};
  std::unique_ptr<Proxy> proxy_;
  ProxyContext proxy_ctx_;  // what proxy_ was made from (rows_on_device and mask remake it)
  fabric::ProxyEngine* engine_ = nullptr;  // for the PeerWatch that mask remakes
  std::vector<int> pids_;
  Masked masked_;  // lost ranks (mask): never waited for, never reached
  Call call_;
  uint64_t rows_sent_ = 0, rows_received_ = 0;  // same-node routing rows (kernels)
};

}  // namespace moe_a2a::a2a::cuda
