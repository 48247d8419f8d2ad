// Dispatch send, routing step: copies per expert (our routing row), published
// to every same-node peer and to the proxy, then the send row of every copy.
// Send order is (rank, local expert, token, k) and experts are contiguous per
// rank, so a copy's send row is first[e] plus its rank among the copies of
// expert e in (t, k) order: a stable counting sort by expert.
//
// Each warp owns a contiguous run of copies and walks it twice: once to count
// (per-warp histograms in shared memory), once, after the counts of all
// earlier warps are known, to hand out rows in order. Two ways to run it:
// - small calls (decode): one block does everything, one launch;
// - large calls (prefill): count_kernel and slot_kernel spread the walks over
//   many blocks and offsets_kernel (one block) joins them, so the work is not
//   confined to one multiprocessor.
#include <cuda_runtime.h>

#include "launch.h"
#include "memory.cuh"
#include "rows.cuh"
#include "scan.cuh"

namespace moe_a2a::a2a::cuda {
namespace {

constexpr int kIdsInFlight = 4;                        // id loads a lane issues before the first is used
constexpr int kSmallThreads = 1024;                    // the one block of small calls
constexpr int kSmallWarps = kSmallThreads / kWarp;
constexpr int kLargeThreads = kRouteBlockCopies / (kIdsInFlight * kWarp) * kWarp;  // one walk step per warp
constexpr int kLargeWarps = kLargeThreads / kWarp;
static_assert(kLargeWarps * kIdsInFlight * kWarp == kRouteBlockCopies, "a large-call block covers its copies");

__device__ __forceinline__ int expert_of(const DispatchSendParams& p, int64_t i) {
  const int64_t e =
      p.ids_are_64bit ? static_cast<const int64_t*>(p.topk_ids)[i] : static_cast<const int32_t*>(p.topk_ids)[i];
  return e >= 0 && e < p.inst.num_experts ? static_cast<int>(e) : -1;
}

__device__ __forceinline__ int resolve_tokens(const DispatchSendParams& p) {
  const int t = p.num_tokens_ptr != nullptr ? *p.num_tokens_ptr : p.num_tokens;
  return t < 0 ? 0 : (t > p.inst.max_tokens ? p.inst.max_tokens : t);
}

// First walk: hist[e] += this warp's copies of e in [begin, end). Returns
// whether some id was out of range (that copy is dropped).
__device__ bool warp_count(const DispatchSendParams& p, int64_t begin, int64_t end, int32_t* hist, int lane) {
  bool dropped = false;
  for (int64_t base = begin; base < end; base += kIdsInFlight * kWarp) {  // warp-uniform bounds
    int e[kIdsInFlight];
#pragma unroll
    for (int u = 0; u < kIdsInFlight; ++u) {
      const int64_t i = base + u * kWarp + lane;
      e[u] = i < end ? expert_of(p, i) : -1;
      dropped = dropped || (i < end && e[u] < 0);
    }
#pragma unroll
    for (int u = 0; u < kIdsInFlight; ++u) {
      const unsigned same = __match_any_sync(kFullMask, e[u]);
      if (e[u] >= 0 && lane == __ffs(same) - 1) hist[e[u]] += __popc(same);
      __syncwarp();
    }
  }
  return dropped;
}

// Second walk: hist[e] holds the send row of this warp's next copy of e.
__device__ void warp_slots(const DispatchSendParams& p, int64_t begin, int64_t end, int32_t* hist, int lane) {
  const unsigned lanes_below = (1u << lane) - 1;
  const int L = p.inst.local_experts;
  for (int64_t base = begin; base < end; base += kIdsInFlight * kWarp) {
    int e[kIdsInFlight];
#pragma unroll
    for (int u = 0; u < kIdsInFlight; ++u) {
      const int64_t i = base + u * kWarp + lane;
      e[u] = i < end ? expert_of(p, i) : -1;
    }
#pragma unroll
    for (int u = 0; u < kIdsInFlight; ++u) {  // in order: ranks stay stable
      const int64_t i = base + u * kWarp + lane;
      const unsigned same = __match_any_sync(kFullMask, e[u]);
      const int slot = e[u] >= 0 ? hist[e[u]] + __popc(same & lanes_below) : -1;
      __syncwarp();
      if (e[u] >= 0 && lane == __ffs(same) - 1) hist[e[u]] += __popc(same);
      __syncwarp();
      if (i < end) {
        p.scratch.slots[i] = slot;
        p.scratch.copy_rank[i] = e[u] >= 0 ? e[u] / L : -1;
      }
    }
  }
}

// Per expert, across the block's warps: hist[w][e] becomes base[e] plus the
// copies of warps before w; returns nothing, writes the block's total of e to
// totals[e] when asked.
__device__ void warp_offsets(int32_t* hist, int warps, int E, const int32_t* base, int32_t* totals) {
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    int32_t acc = 0;
    for (int w = 0; w < warps; ++w) {
      const int32_t c = hist[w * E + e];
      hist[w * E + e] = acc + (base != nullptr ? base[e] : 0);
      acc += c;
    }
    if (totals != nullptr) totals[e] = acc;
  }
}

// The routing row into every same-node host workspace (ours too, where the
// proxy scatters it to remote peers), send_start, then the route flags. Every
// thread of the block calls it.
__device__ void publish(const DispatchSendParams& p, const int32_t* counts, const int32_t* first, int64_t copies,
                        uint64_t epoch, bool dropped) {
  const Instance& in = p.inst;
  const int E = in.num_experts;
  for (int r = 0; r < in.world; ++r) {
    if (!same_node(in, r)) continue;
    uint32_t* row = routing_row(in.peers[r].host, in.layout, in.rank, E);
    for (int e = threadIdx.x; e < E; e += blockDim.x) row[e] = static_cast<uint32_t>(counts[e]);
  }
  for (int r = threadIdx.x; r <= in.world; r += blockDim.x)
    p.scratch.send_start[r] = r < in.world ? first[r * in.local_experts] : copies;
  __syncthreads();
  if (threadIdx.x != 0) return;
  fence_sys();
  for (int r = 0; r < in.world; ++r)
    if (same_node(in, r)) st_release_sys(flag_ptr(in.peers[r].host, in.layout, in.rank, kFlagRoute), epoch);
  if (in.proxy.route_ready != nullptr) st_release_sys(in.proxy.route_ready, epoch);
  if (dropped) report(in, kStatusBadExpert);
}

// A new call: epoch, live token count, status. Thread 0 only.
__device__ uint64_t begin_call(const DispatchSendParams& p, int* tokens) {
  const Instance& in = p.inst;
  const uint64_t epoch = *in.epoch + 1;
  *in.epoch = epoch;
  *tokens = resolve_tokens(p);
  *p.scratch.num_tokens = *tokens;
  *reinterpret_cast<volatile int32_t*>(in.status) = kStatusOk;
  return epoch;
}

// Small calls. Shared memory: hist [warps][E], counts [E], first [E].
__global__ void __launch_bounds__(kSmallThreads) route_kernel(DispatchSendParams p) {
  extern __shared__ int32_t smem[];
  kernel_prologue();
  const int E = p.inst.num_experts;
  int32_t* hist = smem;
  int32_t* counts = hist + kSmallWarps * E;
  int32_t* first = counts + E;
  __shared__ uint64_t epoch;
  __shared__ int tokens, dropped;
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  if (threadIdx.x == 0) {
    epoch = begin_call(p, &tokens);
    dropped = 0;
  }
  for (int i = threadIdx.x; i < kSmallWarps * E; i += kSmallThreads) hist[i] = 0;
  __syncthreads();

  const int64_t copies = static_cast<int64_t>(tokens) * p.inst.topk;
  const int64_t chunk = (copies + kSmallWarps - 1) / kSmallWarps;
  const int64_t begin = warp * chunk, end = begin + chunk < copies ? begin + chunk : copies;
  if (warp_count(p, begin, end, hist + warp * E, lane)) dropped = 1;
  __syncthreads();
  warp_offsets(hist, kSmallWarps, E, nullptr, counts);
  __syncthreads();
  block_exclusive_scan<kSmallThreads, int32_t>(
      E, [&](int e) { return counts[e]; }, [&](int e, int32_t v) { first[e] = v; });
  publish(p, counts, first, copies, epoch, dropped != 0);
  for (int e = threadIdx.x; e < E; e += kSmallThreads)
    for (int w = 0; w < kSmallWarps; ++w) hist[w * E + e] += first[e];
  __syncthreads();
  warp_slots(p, begin, end, hist + warp * E, lane);
}

// Large calls, 1/3: each block counts its kRouteBlockCopies copies per expert
// into block_base[block][e]. Shared memory: hist [warps][E].
__global__ void __launch_bounds__(kLargeThreads) count_kernel(DispatchSendParams p) {
  extern __shared__ int32_t hist[];
  kernel_prologue();
  const int E = p.inst.num_experts;
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  for (int i = threadIdx.x; i < kLargeWarps * E; i += kLargeThreads) hist[i] = 0;
  __syncthreads();
  const int64_t copies = static_cast<int64_t>(resolve_tokens(p)) * p.inst.topk;
  const int64_t begin = static_cast<int64_t>(blockIdx.x) * kRouteBlockCopies + warp * kIdsInFlight * kWarp;
  const int64_t end = begin + kIdsInFlight * kWarp < copies ? begin + kIdsInFlight * kWarp : copies;
  if (warp_count(p, begin, end, hist + warp * E, lane)) *p.scratch.dropped = 1;
  __syncthreads();
  warp_offsets(hist, kLargeWarps, E, nullptr, p.scratch.block_base + static_cast<size_t>(blockIdx.x) * E);
}

// Large calls, 2/3 (one block): counts and first rows per expert, each
// block's first row per expert, publication. Shared memory: counts, first.
__global__ void __launch_bounds__(kSmallThreads) offsets_kernel(DispatchSendParams p, int blocks) {
  extern __shared__ int32_t smem[];
  kernel_prologue();
  const int E = p.inst.num_experts;
  int32_t* counts = smem;
  int32_t* first = counts + E;
  __shared__ uint64_t epoch;
  __shared__ int tokens, dropped;
  if (threadIdx.x == 0) {
    epoch = begin_call(p, &tokens);
    dropped = *p.scratch.dropped;
    *p.scratch.dropped = 0;  // for the next call
  }
  int32_t* base = p.scratch.block_base;
  for (int e = threadIdx.x; e < E; e += kSmallThreads) {
    int32_t acc = 0;
    for (int b = 0; b < blocks; ++b) {
      const int32_t c = base[static_cast<size_t>(b) * E + e];
      base[static_cast<size_t>(b) * E + e] = acc;
      acc += c;
    }
    counts[e] = acc;
  }
  __syncthreads();
  block_exclusive_scan<kSmallThreads, int32_t>(
      E, [&](int e) { return counts[e]; }, [&](int e, int32_t v) { first[e] = v; });
  for (int i = threadIdx.x; i < blocks * E; i += kSmallThreads) base[i] += first[i % E];
  publish(p, counts, first, static_cast<int64_t>(tokens) * p.inst.topk, epoch, dropped != 0);
}

// Large calls, 3/3: each block walks its copies again, from its first rows.
__global__ void __launch_bounds__(kLargeThreads) slot_kernel(DispatchSendParams p) {
  extern __shared__ int32_t hist[];
  kernel_prologue();
  const int E = p.inst.num_experts;
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  for (int i = threadIdx.x; i < kLargeWarps * E; i += kLargeThreads) hist[i] = 0;
  __syncthreads();
  const int64_t copies = static_cast<int64_t>(*p.scratch.num_tokens) * p.inst.topk;
  const int64_t begin = static_cast<int64_t>(blockIdx.x) * kRouteBlockCopies + warp * kIdsInFlight * kWarp;
  const int64_t end = begin + kIdsInFlight * kWarp < copies ? begin + kIdsInFlight * kWarp : copies;
  warp_count(p, begin, end, hist + warp * E, lane);
  __syncthreads();
  warp_offsets(hist, kLargeWarps, E, p.scratch.block_base + static_cast<size_t>(blockIdx.x) * E, nullptr);
  __syncthreads();
  warp_slots(p, begin, end, hist + warp * E, lane);
}

}  // namespace

cudaError_t launch_route(const DispatchSendParams& p, cudaStream_t stream) {
  const Instance& in = p.inst;
  const size_t E = in.num_experts;
  const int64_t max_copies = static_cast<int64_t>(in.max_tokens) * in.topk;
  cudaError_t err;
  if (max_copies <= kRouteSingleBlockCopies) {
    const size_t smem = (kSmallWarps + 2) * E * sizeof(int32_t);
    if ((err = allow_dynamic_smem(reinterpret_cast<const void*>(route_kernel), smem)) != cudaSuccess) return err;
    return launch_kernel(route_kernel, 1, kSmallThreads, smem, stream, p);
  }
  const int blocks = route_blocks(max_copies);
  const size_t hist_smem = kLargeWarps * E * sizeof(int32_t);
  const size_t offsets_smem = 2 * E * sizeof(int32_t);
  if ((err = allow_dynamic_smem(reinterpret_cast<const void*>(count_kernel), hist_smem)) != cudaSuccess) return err;
  if ((err = allow_dynamic_smem(reinterpret_cast<const void*>(slot_kernel), hist_smem)) != cudaSuccess) return err;
  if ((err = allow_dynamic_smem(reinterpret_cast<const void*>(offsets_kernel), offsets_smem)) != cudaSuccess)
    return err;
  if ((err = launch_kernel(count_kernel, blocks, kLargeThreads, hist_smem, stream, p)) != cudaSuccess) return err;
  if ((err = launch_kernel(offsets_kernel, 1, kSmallThreads, offsets_smem, stream, p, blocks)) != cudaSuccess)
    return err;
  return launch_kernel(slot_kernel, blocks, kLargeThreads, hist_smem, stream, p);
}

}  // namespace moe_a2a::a2a::cuda
