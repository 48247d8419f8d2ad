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
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "../call_stamps.h"
#include "../proxy.h"
#include "../workspace.h"
#include "params.h"

namespace moe_a2a::a2a::cuda {

// Words the kernels write into pinned mapped host memory for the host.
struct HostWords {
  int32_t status = 0;       // Status of the last call
  int32_t output_rows = 0;  // padded output rows of the last dispatch_recv
  Seq planned;              // epoch whose plan (status, output_rows) is final
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
  std::string ipc_handle() const;
  // handles[r] for every rank (ignored for ourselves and other nodes).
  void open_node(const std::vector<std::string>& handles);
  // Same process: map a same-node peer's workspaces directly.
  void connect_local(const CudaAllToAll& peer);

  // The four halves; pointers are device (or mapped) addresses, `stream` a
  // cudaStream_t. num_tokens_device, when non-null, overrides num_tokens.
  // `routing` (pinned host memory, [world][num_experts]: an earlier
  // dispatch_recv's routing_out for these topk_ids) makes dispatch_send a
  // cached call: no routing row is published or awaited (docs/protocol.md,
  // "Cached calls"); its dispatch_recv needs host_wait. `routing_out`
  // (pinned host) receives the plan's matrix, final after wait_planned.
  // `in_place`: the caller leaves x (combine: y) unchanged until the receive
  // half's kernels have run (in stream order: until it is called), so this
  // rank's copies to itself are read from there instead of copied twice;
  // taken where x is in the dispatch dtype (y in the combine dtype).
  // Row tails: `weights` ([T, topk] fp32) go with the copies' rows and come
  // out as `out_weight` ([output rows]); `row_values` ([y_rows] fp32) go back
  // with the combine's rows and come out unreduced as `values_out` ([T,
  // topk]). Null where not wanted (a tail not sent holds zero).
  // `dequant_recv`: the receive half will dequantise fp8 rows (`dequant`), so
  // with `in_place` our copies of a bf16 or fp32 x stay there too, and the
  // receive quantises them as the pack would.
  void dispatch_send(const void* x, DType x_dtype, const float* x_scale, const void* topk_ids, bool ids_64bit,
                     int num_tokens, const int32_t* num_tokens_device, cudaStream_t stream,
                     const uint32_t* routing = nullptr, bool in_place = false, const float* weights = nullptr,
                     bool dequant_recv = false);
  // `math` (bf16 or fp32 rows): each output row delivered times a per-row
  // scale, and its dot product with a row of another tensor (the weighted
  // combine's backward, in the pass that delivers its rows).
  struct RowMath {
    const float* scale = nullptr;  // [output rows]
    const void* dot_y = nullptr;   // [output rows, hidden], or null for no dot
    DType dot_y_dtype = DType::kBf16;
    float* dot_out = nullptr;      // [output rows] fp32, with dot_y
  };
  // `dequant` (fp8 rows): out_x is [rows, hidden] in `out_dtype` (bf16 or fp32), each row
  // dequantised; out_scale is unused.
  void dispatch_recv(void* out_x, float* out_scale, int32_t* tokens_per_expert, bool host_wait, cudaStream_t stream,
                     uint32_t* routing_out = nullptr, const RowMath* math = nullptr, float* out_weight = nullptr,
                     bool dequant = false, DType out_dtype = DType::kBf16);
  void combine_send(const void* y, DType y_dtype, int64_t y_rows, cudaStream_t stream, bool in_place = false,
                    const float* row_values = nullptr);
  void combine_recv(const float* weights, void* out, bool host_wait, cudaStream_t stream,
                    float* values_out = nullptr);

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
  int32_t status() const { return words_->status; }
  int64_t output_rows() const { return words_->output_rows; }
  int64_t max_output_rows() const;
  bool fused_recv() const { return fused_recv_; }
  uint64_t epoch() const { return epoch_; }
  // Routing rows written to peers / peers' rows waited for or read, by this
  // rank's kernels (counted at their launch) and its proxy.
  uint64_t routing_rows_sent() const { return rows_sent_ + (proxy_ ? proxy_->routing_rows_sent() : 0); }
  uint64_t routing_rows_received() const { return rows_received_ + (proxy_ ? proxy_->routing_rows_received() : 0); }

  const A2AConfig& config() const { return cfg_; }
  const Layout& layout() const { return layout_; }
  uintptr_t device_workspace() const { return reinterpret_cast<uintptr_t>(device_ws_); }
  uintptr_t host_workspace() const { return reinterpret_cast<uintptr_t>(host_ws_cpu_); }
  ProxySignals* signals() const { return signals_; }

 private:
  void allocate();
  void register_host(uint8_t* ptr, size_t bytes, uint8_t** device_ptr);
  const Instance& instance();
  void upload_peers();
  // Host waits of the receive halves: every same-node flag of `kind` and the
  // proxy's `done` (with remote peers) at the current epoch.
  void wait_host(FlagKind kind, const Seq& done, const char* what);
  DispatchRecvParams recv_params(void* out_x, float* out_scale, int32_t* tokens_per_expert, uint32_t* routing_out);
  void dispatch_recv_by_sender(void* out_x, float* out_scale, int32_t* tokens_per_expert, cudaStream_t stream,
                               uint32_t* routing_out);
  void check_proxy() const;
  // Same-node peers' flags against our call (call_stamps.h); the proxy checks
  // remote peers. At most every PeerWatch::kInterval unless `force`.
  void check_stamps(bool force) const;
  // The proxy polls only while a call is under way: tell it one started.
  void arm_proxy(cudaStream_t stream, bool captured);
  static bool capturing(cudaStream_t stream);
  std::string capacity_message() const;

  A2AConfig cfg_;
  Layout layout_;
  int device_ = 0;
  bool has_remote_ = false;
  // Fabric peers: stage their rows peer by peer and receive sender by sender
  // (MOE_A2A_CUDA_OVERLAP, on unless 0).
  bool overlap_ = false;
  // Eager calls with fabric peers: each remote peer's combine rows go to the
  // device workspace by cudaMemcpyAsync as they land (MOE_A2A_CUDA_COMBINE_DMA,
  // on unless 0); `combine_blocks_` (from the dispatch's matrix) says where.
  struct CombineBlock {
    int peer;
    size_t offset, bytes;  // in the combine_recv section, the same in both workspaces
  };
  bool combine_dma_ = false;
  uint64_t combine_blocks_epoch_ = 0;  // the call they were taken for
  std::vector<CombineBlock> combine_blocks_;
  void copy_combine_rows_as_they_land(cudaStream_t stream);
  // Which of remote sender s's slices (slices.h) have landed: every one
  // when its whole flag (or the call's) is up, else its progress word.
  uint32_t slices_landed(const Seq& progress, const Seq& whole, const Seq& all, uint32_t count) const;

  uint8_t* device_ws_ = nullptr;
  uint8_t* host_ws_ = nullptr;         // device address of our host workspace
  uint8_t* host_ws_cpu_ = nullptr;     // its host address
  std::vector<uint8_t*> node_ws_cpu_;  // index = rank: the node's host workspaces (host addresses), else null
  // A peer's announced failure or a dead same-host peer ends our host waits.
  mutable PeerWatch watch_;
  // Our call, for check_stamps: eager calls only (epoch 0, nothing checked,
  // when captured: the host's epoch does not follow graph replays).
  CallPosition at_;
  mutable std::chrono::steady_clock::time_point next_stamps_{};
  bool own_host_ws_ = false;           // allocated here (standalone)
  std::vector<void*> registered_;      // host ranges registered with CUDA
  std::vector<void*> ipc_opened_;      // peer device workspaces opened here
  std::vector<PeerWorkspaces> peers_;  // index = rank
  PeerWorkspaces* peers_device_ = nullptr;
  bool peers_dirty_ = true;
  Instance instance_;  // rebuilt when peers change

  uint8_t* scratch_mem_ = nullptr;
  Scratch scratch_;
  uint64_t* epoch_device_ = nullptr;
  HostWords* words_ = nullptr;           // mapped host
  int32_t* status_device_ = nullptr;     // its status, device address
  ProxySignals* signals_ = nullptr;      // mapped host
  Seq* peer_seqs_ = nullptr;             // mapped host: PeerSignals' Seq arrays, then its slice flags
  PeerSignals peer_signals() const;
  std::unique_ptr<Proxy> proxy_;
  uint64_t epoch_ = 0;
  // The last phase whose receive half completed on the host (eager calls; a
  // peer_watch.h phase); graph replays leave it behind, which only makes peers
  // stop a phase earlier.
  uint64_t done_ = 0;
  uint64_t cached_hash_ = 0;  // routing_hash of the current cached call's matrix
  std::vector<uint32_t> cached_;                // a cached call's matrix, for the proxy until dispatch_done
  const uint32_t* call_routing_ = nullptr;      // device address of the current cached call's matrix; null if uncached
  uint64_t rows_sent_ = 0, rows_received_ = 0;  // same-node routing rows (kernels)
  bool plan_signals_host_ = false;  // the last dispatch_recv's plan raises `planned` (host_wait)
  // The call's inputs where their own rows were left in place (`in_place`), else null.
  const void* self_x_ = nullptr;
  const void* self_y_ = nullptr;
  int64_t self_y_rows_ = 0;
  const float* self_weights_ = nullptr;  // the send half's weights, for our copies read in place
  DType self_x_dtype_ = DType::kBf16;    // x's, where our copies were left in place
  bool self_needs_dequant_ = false;      // ... as bf16/fp32 rows of an fp8 call: only a dequantising receive reads them
  bool dequant_ = false;                 // the current dispatch_recv's
  DType out_dtype_ = DType::kBf16;
  const float* self_values_ = nullptr;   // the combine send's row_values, for our rows left in place
  float* out_weight_ = nullptr;          // the current dispatch_recv's
  RowMath row_math_;  // the current dispatch_recv's (scale null: none)
  // Eager dispatch_recv plans and copies in one launch, unless another rank
  // of the node runs on our GPU: there the copy blocks that wait for the plan
  // hold multiprocessors the other ranks' kernels need (8 ranks under MPS:
  // decode step 313-321 -> 413-457 us), while alone it saves a launch.
  bool fused_recv_ = true;
  void choose_recv(bool gpu_shared);
};

}  // namespace moe_a2a::a2a::cuda
