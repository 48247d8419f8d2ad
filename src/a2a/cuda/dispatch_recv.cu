// Dispatch, receive half (docs/protocol.md, "Dispatch at receiver r"):
// 1. plan_kernel (dispatch_plan.cu, one block, beside our pack kernel): the
//    plan (recv_plan.cuh), after the route flags and, with remote peers, the
//    proxy's dispatch_done; then it waits for the packs.
// 2. copy_kernel (here, persistent, one warp per chunk of an output row):
//    copies each received row into the expert-major output (recv_rows.cuh),
//    or applies the training row math to it (row_math.cuh). Our own copies
//    left in x are walked token by token instead, so a row of x is read from
//    HBM once, not once per copy.
// Eager calls (the host saw every flag) of a rank alone on its GPU run both
// in one launch instead, plan_copy_kernel: the plan has nothing to wait for
// there, so running it beside the pack gains nothing, and a launch costs the
// host more than the plan takes on the GPU (see CudaAllToAll::fused_recv).
#include <cuda_runtime.h>

#include "launch.h"
#include "recv_plan.cuh"
#include "recv_rows.cuh"
#include "row_math.cuh"
#include "tuning.h"

namespace moe_a2a::a2a::cuda {
namespace {

constexpr int kCopyThreads = CopyTuning::kThreads;
constexpr int kCopyBlocksPerSm = CopyTuning::kBlocksPerSm;

// What the copy kernels do to a row: each mode is a kernel of its own, so the
// plain copy keeps its registers.
enum RecvMode : int { kRecvCopy = 0, kRecvScaled = 1, kRecvDequant = 2 };

// Chunks a warp takes of each output row: one whole row when weighted (its
// dot sums in one warp) or dequantised (a block's amax in one warp). The host
// sizes the grid by it too.
__host__ __device__ __forceinline__ int recv_row_chunks(const DispatchRecvParams& p) {
  if (p.row_scale != nullptr || p.dequant) return 1;
  return row_chunks(p.inst.payload_bytes + static_cast<int64_t>(p.inst.num_scales) * sizeof(float));
}

// Copy (s, j) into output row `row`: the walk's chunk of it, or (weighted) all
// of it. Weighted receives are kernels of their own, so that the plain copy
// keeps its registers.
// kWide: as source_row's (recv_rows.cuh).
template <int kMode, bool kWide = true>
__device__ __forceinline__ void receive_row(const DispatchRecvParams& p, int s, int j, int row, const ChunkWalk& walk) {
  if constexpr (kMode == kRecvScaled) copy_row_scaled<kWide>(p, s, j, row, walk.lane);
  else if constexpr (kMode == kRecvDequant) dequant_row<kWide>(p, s, j, row, walk.lane);
  else copy_chunk<kWide>(p, s, j, row, walk.chunk, walk.lane);
}

// Items of the walk of our copies: tokens, or copies when weighted.
template <int kMode>
__device__ __forceinline__ int self_walk_items(const DispatchRecvParams& p) {
  return *p.scratch.num_tokens * (kMode == kRecvScaled ? p.inst.topk : 1);
}

// Item `item` of the walk of our copies (self_walk_items) among `segs`:
// done here for a plain or dequantising receive (false), else the copy's j
// and output row for receive_row (true; false for a copy not ours to write).
// Weighted rows take one call site of receive_row, so its registers stay few.
template <int kMode>
__device__ __forceinline__ bool walk_self(const DispatchRecvParams& p, const Segment* segs, int stride, int item,
                                          int64_t j_first, int64_t j_end, const ChunkWalk& walk, int* j, int* row) {
  if constexpr (kMode == kRecvScaled) {
    int64_t jj;
    if (!self_copy_of(p, item, j_first, j_end, &jj)) return false;
    *j = static_cast<int>(jj);
    *row = sender_output_row(segs, stride, p.inst.local_experts, jj);
    return true;
  } else {
    const TokenRows rows = token_rows(p, segs, stride, item, j_first, j_end, walk.chunk == 0, walk.lane);
    if constexpr (kMode == kRecvDequant) dequant_token(p, item, rows, walk.lane);
    else copy_token_chunk(p, item, rows, walk.chunk, walk.lane);
    return false;
  }
}

// Copies every received row into the output, from the plan in scratch; our
// copies left in x by token (self_copy_of), the rest in output order.
template <int kMode, bool kWide>
__device__ __forceinline__ void copy_rows(const DispatchRecvParams& p, Segment* segs) {
  const Instance& in = p.inst;
  load_segments(segs, p.scratch.segments, in.num_experts);
  __syncthreads();
  const int rows = *p.scratch.output_rows;
  const bool by_token = p.self_x != nullptr && rows > 0;  // rows == 0: no plan (a failed wait, over capacity)
  const int64_t copies = by_token ? p.scratch.senders[in.rank].copies : 0;
  const int items = by_token ? self_walk_items<kMode>(p) : 0;
  // One walk: our copies by token (items 0..items-1), then the output rows of the others.
  for (ChunkWalk walk(recv_row_chunks(p)); walk.row < items + rows; walk.next()) {
    int s = in.rank, j, row;
    if (walk.row < items) {
      if (!walk_self<kMode>(p, segs + in.rank, in.world, walk.row, 0, copies, walk, &j, &row)) continue;
    } else {
      row = walk.row - items;
      if (!locate(segs, in.num_experts, row, &s, &j)) continue;  // padding
      if (by_token && s == in.rank) continue;
      if (kWide && per_rank(in, s)) j = wire_row_of(p, s, row);  // a row per rank holds it
      else if (kWide && node_sender(in, s)) j = p.scratch.row_wire[row];  // a row per node, at its forwarder
    }
    receive_row<kMode, kWide>(p, s, j, row, walk);
  }
}

// Copies sender p.sender's copies [sender_first, sender_end) only (the host
// launches this as each slice of a sender's rows lands). Its segments, one
// per local expert, are in j order (sender_output_row).
template <int kMode>
__device__ __forceinline__ void copy_sender_rows(const DispatchRecvParams& p, Segment* segs) {
  const Instance& in = p.inst;
  const int N = in.world, L = in.local_experts, s = p.sender;
  for (int i = threadIdx.x; i < L; i += blockDim.x) segs[i] = p.scratch.segments[i * N + s];
  __syncthreads();
  const bool by_token = s == in.rank && p.self_x != nullptr;  // see self_copy_of
  // A per-rank sender's wire rows hold up to m entries each: one item an entry
  // (also for m = 1: its rows are in token order, not the output's).
  const bool ranked = per_rank(in, s);
  const int m = ranked ? in.max_entries : 1;
  const int items = by_token ? self_walk_items<kMode>(p) : static_cast<int>(p.sender_end - p.sender_first) * m;
  for (ChunkWalk walk(recv_row_chunks(p)); walk.row < items; walk.next()) {
    int j = static_cast<int>(p.sender_first) + walk.row / m, row;
    if (by_token) {
      if (!walk_self<kMode>(p, segs, 1, walk.row, p.sender_first, p.sender_end, walk, &j, &row)) continue;
    } else if (ranked) {
      row = p.scratch.entry_row[(p.scratch.senders[s].recv_base + j) * m + walk.row % m];
      if (row < 0) continue;  // an unused entry
    } else {
      row = sender_output_row(segs, 1, L, j);
      if (node_sender(in, s)) j = p.scratch.row_wire[row];  // a row per node, at its forwarder
    }
    receive_row<kMode>(p, s, j, row, walk);
  }
}

template <int kMode, bool kWide>
__global__ void __launch_bounds__(kCopyThreads, kCopyBlocksPerSm) copy_kernel(DispatchRecvParams p) {
  if (stale_replay(p.inst)) return;  // a graph captured before a mask
  extern __shared__ Segment segs[];
  kernel_prologue();
  copy_rows<kMode, kWide>(p, segs);
}

template <int kMode>
__global__ void __launch_bounds__(kCopyThreads, kCopyBlocksPerSm) copy_sender_kernel(DispatchRecvParams p) {
  if (stale_replay(p.inst)) return;  // a graph captured before a mask
  extern __shared__ Segment segs[];  // the sender's [local experts]
  kernel_prologue();                 // the plan, and the copies of earlier senders
  copy_sender_rows<kMode>(p, segs);
}

// Eager calls: the first block to start plans while the others wait for its
// word in device scratch, then every block copies.
static_assert(kCopyThreads == kPlanThreads, "a block of plan_copy_kernel runs the plan");
template <int kMode>
__global__ void __launch_bounds__(kCopyThreads, kCopyBlocksPerSm) plan_copy_kernel(DispatchRecvParams p) {
  if (stale_replay(p.inst)) return;  // a graph captured before a mask
  extern __shared__ int32_t smem[];  // the planner: the plan's matrix; then every block's segment table
  kernel_prologue();                 // the routing before us reported its status
  const Instance& in = p.inst;
  const uint64_t epoch = *reinterpret_cast<volatile uint64_t*>(in.epoch);
  // The first block to start plans: CUDA does not promise that block 0 runs
  // before the blocks that wait for its plan, but the first ticket's holder is
  // running by construction.
  __shared__ bool planner;
  if (threadIdx.x == 0) {
    const uint32_t ticket = atomicAdd(p.scratch.plan_ticket, 1u);
    if (ticket == gridDim.x - 1) *p.scratch.plan_ticket = 0;  // every block has its ticket: ready for the next launch
    planner = ticket == 0;
  }
  __syncthreads();
  if (planner) {
    compute_plan<false>(p, smem, true);  // launched without rows per rank or node
    __threadfence();  // every thread's plan before thread 0's word
    __syncthreads();
    if (threadIdx.x == 0) {
      st_release_gpu(p.scratch.plan_ready, epoch);
      signal_planned(p, epoch);
    }
  }
  __shared__ int planned;
  if (threadIdx.x == 0) {
    planned = wait_geq<true, CopyTuning::kPlanPollNs>(p.scratch.plan_ready, epoch, global_timer_ns() + in.timeout_ns);
    if (!planned) report(in, kStatusTimeout);
  }
  __syncthreads();
  if (!planned || ld_acquire_gpu(p.scratch.plan_ready) < epoch) return;  // each thread acquires the plan
  copy_rows<kMode, false>(p, reinterpret_cast<Segment*>(smem));
}

}  // namespace

cudaError_t launch_copy_sender(const DispatchRecvParams& p, cudaStream_t stream) {
  const Instance& in = p.inst;
  const int64_t rows = p.sender_end - p.sender_first;
  if (p.sender < 0 || p.sender >= in.world || p.sender_first < 0 || rows <= 0) return cudaErrorInvalidValue;
  const size_t smem = static_cast<size_t>(in.local_experts) * sizeof(Segment);
  const auto kernel = p.dequant                ? copy_sender_kernel<kRecvDequant>
                      : p.row_scale != nullptr ? copy_sender_kernel<kRecvScaled>
                                               : copy_sender_kernel<kRecvCopy>;
  cudaError_t err = allow_dynamic_smem(reinterpret_cast<const void*>(kernel), smem);
  if (err != cudaSuccess) return err;
  const int entries = in.rank_rows ? in.max_entries : 1;  // a row per rank: one item an entry
  const int blocks = persistent_blocks(rows * entries * recv_row_chunks(p), kCopyThreads / kWarp, kCopyBlocksPerSm);
  return launch_kernel(kernel, blocks, kCopyThreads, smem, stream, p);
}

cudaError_t launch_dispatch_recv(const DispatchRecvParams& p, cudaStream_t stream) {
  const Instance& in = p.inst;
  const size_t plan_smem = plan_smem_bytes(in);
  const size_t seg_smem = static_cast<size_t>(in.num_experts) * sizeof(Segment);
  const int blocks = persistent_blocks(p.max_output_rows * recv_row_chunks(p), kCopyThreads / kWarp, kCopyBlocksPerSm);
  if (p.fused && !wide(in)) {  // rows per rank or node need entry_kernel between the plan and the copies
    const size_t smem = plan_smem > seg_smem ? plan_smem : seg_smem;
    const auto kernel = p.dequant                ? plan_copy_kernel<kRecvDequant>
                        : p.row_scale != nullptr ? plan_copy_kernel<kRecvScaled>
                                                 : plan_copy_kernel<kRecvCopy>;
    cudaError_t err = allow_dynamic_smem(reinterpret_cast<const void*>(kernel), smem);
    if (err != cudaSuccess) return err;
    return launch_kernel(kernel, blocks, kCopyThreads, smem, stream, p);
  }
  cudaError_t err = launch_dispatch_plan(p, stream);
  // Rows per node, waiting in kernels: the rows we forward, in the stream, before anyone's entries.
  if (err == cudaSuccess && p.wait_in_kernel) err = launch_dispatch_forward(p, stream);
  if (err == cudaSuccess && wide(in)) {
    DispatchRecvParams every = p;
    every.sender = -1;
    err = launch_dispatch_entries(every, stream);
  }
  if (err != cudaSuccess) return err;
  const bool w = wide(in);
  const auto copy = p.dequant                ? (w ? copy_kernel<kRecvDequant, true> : copy_kernel<kRecvDequant, false>)
                    : p.row_scale != nullptr ? (w ? copy_kernel<kRecvScaled, true> : copy_kernel<kRecvScaled, false>)
                                             : (w ? copy_kernel<kRecvCopy, true> : copy_kernel<kRecvCopy, false>);
  err = allow_dynamic_smem(reinterpret_cast<const void*>(copy), seg_smem);
  if (err != cudaSuccess) return err;
  return launch_kernel(copy, blocks, kCopyThreads, seg_smem, stream, p);
}

}  // namespace moe_a2a::a2a::cuda
