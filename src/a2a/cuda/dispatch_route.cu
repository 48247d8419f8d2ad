// Dispatch send, routing step of large calls (prefill): copies per expert
// (our routing row), published to every same-node peer and to the proxy, then
// the send row and destination of every copy (route.cuh). Three launches
// spread the walks over many blocks, so that the work is not confined to one
// multiprocessor: count_kernel and slot_kernel walk kRouteBlockCopies copies
// a block, offsets_kernel (one block) joins them. Small calls route inside
// their pack kernel instead (dispatch_send.cu).
#include <cuda_runtime.h>

#include "launch.h"
#include "route.cuh"
#include "scan.cuh"

namespace moe_a2a::a2a::cuda {
namespace {

constexpr int kOffsetsThreads = 1024;                  // the one block of offsets_kernel
constexpr int kLargeThreads = kRouteBlockCopies / kWarpCopies * kWarp;
constexpr int kLargeWarps = kLargeThreads / kWarp;
constexpr int kBlockBaseChunk = 16;  // block_base loads a thread issues before its stores
static_assert(kLargeWarps * kWarpCopies == kRouteBlockCopies, "a large-call block covers its copies");

// Large calls, 1/3: each block counts its kRouteBlockCopies copies per expert
// into block_base[block][e]. Shared memory: hist [warps][E].
__global__ void __launch_bounds__(kLargeThreads) count_kernel(DispatchSendParams p) {
  extern __shared__ int32_t hist[];
  kernel_prologue();
  const int E = p.inst.num_experts;
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int64_t copies = static_cast<int64_t>(resolve_tokens(p)) * p.inst.topk;
  const int64_t begin = static_cast<int64_t>(blockIdx.x) * kRouteBlockCopies + warp * kWarpCopies;
  const int64_t end = begin + kWarpCopies < copies ? begin + kWarpCopies : copies;
  const WarpIds ids = load_ids(p, begin, end, lane);
  for (int i = threadIdx.x; i < kLargeWarps * E; i += kLargeThreads) hist[i] = 0;
  __syncthreads();
  count_ids(ids, hist + warp * E, lane);
  if (__any_sync(kFullMask, ids.dropped) && lane == 0) *p.scratch.dropped = 1;
  __syncthreads();
  warp_offsets(hist, kLargeWarps, E, nullptr, p.scratch.block_base + static_cast<size_t>(blockIdx.x) * E);
}

// Large calls, 2/3 (one block): counts and first rows per expert, each
// block's first row per expert, publication. Shared memory: counts, first.
__global__ void __launch_bounds__(kOffsetsThreads) offsets_kernel(DispatchSendParams p, int blocks) {
  extern __shared__ int32_t smem[];
  kernel_prologue();
  const int E = p.inst.num_experts;
  int32_t* counts = smem;
  int32_t* first = counts + E;
  __shared__ uint64_t epoch;
  __shared__ int tokens, dropped;
  if (threadIdx.x == 0) {
    tokens = resolve_tokens(p);
    epoch = begin_call(p, tokens);
    dropped = *p.scratch.dropped;
    *p.scratch.dropped = 0;  // for the next call
  }
  int32_t* base = p.scratch.block_base;
  for (int e = threadIdx.x; e < E; e += kOffsetsThreads) {
    int32_t acc = 0;
    for (int b0 = 0; b0 < blocks; b0 += kBlockBaseChunk) {  // loads first, so they overlap
      int32_t c[kBlockBaseChunk];
#pragma unroll
      for (int u = 0; u < kBlockBaseChunk; ++u) c[u] = b0 + u < blocks ? base[static_cast<size_t>(b0 + u) * E + e] : 0;
#pragma unroll
      for (int u = 0; u < kBlockBaseChunk; ++u) {
        if (b0 + u < blocks) base[static_cast<size_t>(b0 + u) * E + e] = acc;
        acc += c[u];
      }
    }
    counts[e] = acc;
  }
  __syncthreads();
  block_exclusive_scan<kOffsetsThreads, int32_t>(
      E, [&](int e) { return counts[e]; }, [&](int e, int32_t v) { first[e] = v; });
  for (int i = threadIdx.x; i < blocks * E; i += kOffsetsThreads) base[i] += first[i % E];
  write_routing(p, counts, first, static_cast<int64_t>(tokens) * p.inst.topk);
  __syncthreads();
  if (threadIdx.x == 0) publish_routing(p.inst, epoch, dropped != 0);
}

// Large calls, 3/3: each block walks its copies again, from its first rows.
__global__ void __launch_bounds__(kLargeThreads) slot_kernel(DispatchSendParams p) {
  extern __shared__ int32_t hist[];
  kernel_prologue();
  const int E = p.inst.num_experts;
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int64_t copies = static_cast<int64_t>(*p.scratch.num_tokens) * p.inst.topk;
  const int64_t begin = static_cast<int64_t>(blockIdx.x) * kRouteBlockCopies + warp * kWarpCopies;
  const int64_t end = begin + kWarpCopies < copies ? begin + kWarpCopies : copies;
  const WarpIds ids = load_ids(p, begin, end, lane);
  for (int i = threadIdx.x; i < kLargeWarps * E; i += kLargeThreads) hist[i] = 0;
  __syncthreads();
  count_ids(ids, hist + warp * E, lane);
  __syncthreads();
  warp_offsets(hist, kLargeWarps, E, p.scratch.block_base + static_cast<size_t>(blockIdx.x) * E, nullptr);
  __syncthreads();
  const Scratch& s = p.scratch;
  const Instance& in = p.inst;
  slot_ids(
      ids, begin, end, hist + warp * E, nullptr,
      [&](int64_t i, int slot, int e) {
        const int r = e >= 0 ? e / in.local_experts : -1;
        s.slots[i] = slot;
        s.copy_rank[i] = r;
        s.copy_dst[i] = e >= 0 ? destination(in, slot, r, s.send_start[r]) : nullptr;
      },
      lane);
}

}  // namespace

cudaError_t launch_route(const DispatchSendParams& p, cudaStream_t stream) {
  const size_t E = p.inst.num_experts;
  const int blocks = route_blocks(static_cast<int64_t>(p.inst.max_tokens) * p.inst.topk);
  const size_t hist_smem = kLargeWarps * E * sizeof(int32_t);
  const size_t offsets_smem = 2 * E * sizeof(int32_t);
  cudaError_t err;
  if ((err = allow_dynamic_smem(reinterpret_cast<const void*>(count_kernel), hist_smem)) != cudaSuccess) return err;
  if ((err = allow_dynamic_smem(reinterpret_cast<const void*>(slot_kernel), hist_smem)) != cudaSuccess) return err;
  if ((err = allow_dynamic_smem(reinterpret_cast<const void*>(offsets_kernel), offsets_smem)) != cudaSuccess)
    return err;
  if ((err = launch_kernel(count_kernel, blocks, kLargeThreads, hist_smem, stream, p)) != cudaSuccess) return err;
  if ((err = launch_kernel(offsets_kernel, 1, kOffsetsThreads, offsets_smem, stream, p, blocks)) != cudaSuccess)
    return err;
  return launch_kernel(slot_kernel, blocks, kLargeThreads, hist_smem, stream, p);
}

}  // namespace moe_a2a::a2a::cuda
