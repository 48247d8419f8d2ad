// Dispatch send, routing step: copies per expert (our routing row), published
// to every same-node peer and to the proxy, then the send row of every copy.
// Send order is (rank, local expert, token, k) and experts are contiguous per
// rank, so a copy's send row is first[e] plus its rank among the copies of
// expert e in (t, k) order: a stable counting sort by expert.
//
// Each warp owns a contiguous run of copies (one id load a lane) and walks it
// twice: once to count (per-warp histograms in shared memory), once, after
// the counts of all earlier warps are known, to hand out rows in order; the
// second walk also writes where pack stores each copy, so that pack reads one
// pointer per copy instead of a chain of lookups. Two ways to run it:
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
constexpr int kWarpCopies = kIdsInFlight * kWarp;      // copies one warp walks: one load each lane
constexpr int kSmallThreads = 1024;                    // the one block of small calls
constexpr int kSmallWarps = kSmallThreads / kWarp;
constexpr int kLargeThreads = kRouteBlockCopies / kWarpCopies * kWarp;
constexpr int kLargeWarps = kLargeThreads / kWarp;
constexpr int kBlockBaseChunk = 16;  // block_base loads a thread issues before its stores
static_assert(kLargeWarps * kWarpCopies == kRouteBlockCopies, "a large-call block covers its copies");
static_assert(kSmallWarps * kWarpCopies >= kRouteSingleBlockCopies, "the small-call block covers its copies");

__device__ __forceinline__ int expert_of(const DispatchSendParams& p, int64_t i) {
  const int64_t e =
      p.ids_are_64bit ? static_cast<const int64_t*>(p.topk_ids)[i] : static_cast<const int32_t*>(p.topk_ids)[i];
  return e >= 0 && e < p.inst.num_experts ? static_cast<int>(e) : -1;
}

__device__ __forceinline__ int resolve_tokens(const DispatchSendParams& p) {
  const int t = p.num_tokens_ptr != nullptr ? *p.num_tokens_ptr : p.num_tokens;
  return t < 0 ? 0 : (t > p.inst.max_tokens ? p.inst.max_tokens : t);
}

// The experts of one warp's copies [begin, end) (at most kWarpCopies): copy
// begin + u * kWarp + lane in e[u], -1 past the end or for an id out of range
// (that copy is dropped). Loaded once, walked twice (count, then slots).
struct WarpIds {
  int e[kIdsInFlight];
  bool dropped = false;  // this lane saw an id out of range
};

__device__ __forceinline__ WarpIds load_ids(const DispatchSendParams& p, int64_t begin, int64_t end, int lane) {
  WarpIds ids;
#pragma unroll
  for (int u = 0; u < kIdsInFlight; ++u) {
    const int64_t i = begin + u * kWarp + lane;
    ids.e[u] = i < end ? expert_of(p, i) : -1;
    ids.dropped = ids.dropped || (i < end && ids.e[u] < 0);
  }
  return ids;
}

// First walk: hist[e] += this warp's copies of e.
__device__ __forceinline__ void count_ids(const WarpIds& ids, int32_t* hist, int lane) {
#pragma unroll
  for (int u = 0; u < kIdsInFlight; ++u) {
    const unsigned same = __match_any_sync(kFullMask, ids.e[u]);
    if (ids.e[u] >= 0 && lane == __ffs(same) - 1) hist[ids.e[u]] += __popc(same);
    __syncwarp();
  }
}

// Where pack stores copy (slot, rank r): a same-node peer's private row, our
// device send section (same-node overflow, which the peer pulls), or our
// fabric send section (remote peers).
__device__ __forceinline__ uint8_t* destination(const Instance& in, int slot, int r, int64_t send_start) {
  const Layout& l = in.layout;
  const size_t row = l.dispatch_row;
  const int64_t j = slot - send_start;
  if (!same_node(in, r)) return in.fabric_ws + l.send + slot * row;
  if (j < in.max_private)
    return in.peers[r].device + l.private_rows + (static_cast<size_t>(in.rank) * in.max_private + j) * row;
  return in.device_ws + l.send + slot * row;
}

// Second walk: hist[e] (+ first[e] when given) is the send row of this warp's
// next copy of e. Writes each copy's row, rank and destination;
// send_start(r) is send_off[rank][r].
template <typename SendStart>
__device__ void slot_ids(const DispatchSendParams& p, const WarpIds& ids, int64_t begin, int64_t end, int32_t* hist,
                         const int32_t* first, SendStart send_start, int lane) {
  const unsigned lanes_below = (1u << lane) - 1;
  const Instance& in = p.inst;
  const int L = in.local_experts;
#pragma unroll
  for (int u = 0; u < kIdsInFlight; ++u) {  // in order: ranks stay stable
    const int e = ids.e[u];
    const int64_t i = begin + u * kWarp + lane;
    const unsigned same = __match_any_sync(kFullMask, e);
    const int slot = e >= 0 ? hist[e] + (first != nullptr ? first[e] : 0) + __popc(same & lanes_below) : -1;
    __syncwarp();
    if (e >= 0 && lane == __ffs(same) - 1) hist[e] += __popc(same);
    __syncwarp();
    if (i < end) {
      const int r = e >= 0 ? e / L : -1;
      p.scratch.slots[i] = slot;
      p.scratch.copy_rank[i] = r;
      p.scratch.copy_dst[i] = e >= 0 ? destination(in, slot, r, send_start(r)) : nullptr;
    }
  }
}

// Per expert, across the block's first `warps` warps: hist[w][e] becomes
// base[e] (when given) plus the copies of warps before w; writes the block's
// total of e to totals[e] when asked.
__device__ void warp_offsets(int32_t* hist, int warps, int E, const int32_t* base, int32_t* totals) {
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    int32_t acc = base != nullptr ? base[e] : 0;
    for (int w = 0; w < warps; ++w) {
      const int32_t c = hist[w * E + e];
      hist[w * E + e] = acc;
      acc += c;
    }
    if (totals != nullptr) totals[e] = acc;
  }
}

// The routing row into every same-node host workspace (ours too, where the
// proxy scatters it to remote peers, and the host reads it) and device
// workspace (where their plan reads it, without a trip over PCIe), and
// send_start (read by the large calls' slot kernel). Every thread of
// the block calls it.
__device__ void write_routing(const DispatchSendParams& p, const int32_t* counts, const int32_t* first,
                              int64_t copies) {
  const Instance& in = p.inst;
  const int E = in.num_experts;
  for (int r = 0; r < in.world; ++r) {
    if (!same_node(in, r)) continue;
    uint32_t* host_row = routing_row(in.peers[r].host, in.layout, in.rank, E);
    uint32_t* device_row = routing_row(in.peers[r].device, in.layout, in.rank, E);
    for (int e = threadIdx.x; e < E; e += blockDim.x) host_row[e] = device_row[e] = static_cast<uint32_t>(counts[e]);
  }
  for (int r = threadIdx.x; r <= in.world; r += blockDim.x)
    p.scratch.send_start[r] = r < in.world ? first[r * in.local_experts] : copies;
}

// Thread 0, after write_routing and a block barrier: the route flags of
// same-node peers and the proxy (a rank alone has nobody to tell).
__device__ void raise_route(const Instance& in, uint64_t epoch) {
  fence_sys();
  for (int r = 0; r < in.world; ++r)
    if (same_node(in, r)) st_release_sys(flag_ptr(in.peers[r].host, in.layout, in.rank, kFlagRoute), epoch);
  if (in.proxy.route_ready != nullptr) st_release_sys(in.proxy.route_ready, epoch);
}

// A new call: epoch and status. Thread 0 only.
__device__ uint64_t begin_call(const DispatchSendParams& p, int tokens) {
  const Instance& in = p.inst;
  const uint64_t epoch = *in.epoch + 1;
  *in.epoch = epoch;
  *p.scratch.num_tokens = tokens;
  *reinterpret_cast<volatile int32_t*>(in.status) = kStatusOk;
  return epoch;
}

// Small calls: warp w walks copies [w * kWarpCopies, ...). Shared memory:
// hist [warps][E], counts [E], first [E].
__global__ void __launch_bounds__(kSmallThreads) route_kernel(DispatchSendParams p) {
  extern __shared__ int32_t smem[];
  kernel_prologue();
  const int E = p.inst.num_experts;
  int32_t* hist = smem;
  int32_t* counts = hist + kSmallWarps * E;
  int32_t* first = counts + E;
  __shared__ int dropped;
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  // Every thread resolves the token count, so the id loads need not wait for thread 0.
  const int64_t copies = static_cast<int64_t>(resolve_tokens(p)) * p.inst.topk;
  const int64_t begin = static_cast<int64_t>(warp) * kWarpCopies;
  const int64_t end = begin + kWarpCopies < copies ? begin + kWarpCopies : copies;
  const WarpIds ids = load_ids(p, begin, end, lane);
  const int warps = static_cast<int>((copies + kWarpCopies - 1) / kWarpCopies);  // those with copies
  uint64_t epoch = 0;
  if (threadIdx.x == 0) {
    epoch = begin_call(p, static_cast<int>(copies / p.inst.topk));
    dropped = 0;
  }
  for (int i = threadIdx.x; i < warps * E; i += kSmallThreads) hist[i] = 0;
  __syncthreads();
  count_ids(ids, hist + warp * E, lane);
  if (__any_sync(kFullMask, ids.dropped) && lane == 0) dropped = 1;
  __syncthreads();
  warp_offsets(hist, warps, E, nullptr, counts);
  __syncthreads();
  block_exclusive_scan<kSmallThreads, int32_t>(
      E, [&](int e) { return counts[e]; }, [&](int e, int32_t v) { first[e] = v; });
  write_routing(p, counts, first, copies);
  const int L = p.inst.local_experts;
  slot_ids(p, ids, begin, end, hist + warp * E, first, [&](int r) -> int64_t { return first[r * L]; }, lane);
  if (threadIdx.x == 0 && dropped) report(p.inst, kStatusBadExpert);
  if (p.inst.world > 1) {
    __syncthreads();  // every thread's routing row before thread 0's fence
    if (threadIdx.x == 0) raise_route(p.inst, epoch);
  }
}

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
__global__ void __launch_bounds__(kSmallThreads) offsets_kernel(DispatchSendParams p, int blocks) {
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
  for (int e = threadIdx.x; e < E; e += kSmallThreads) {
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
  block_exclusive_scan<kSmallThreads, int32_t>(
      E, [&](int e) { return counts[e]; }, [&](int e, int32_t v) { first[e] = v; });
  for (int i = threadIdx.x; i < blocks * E; i += kSmallThreads) base[i] += first[i % E];
  write_routing(p, counts, first, static_cast<int64_t>(tokens) * p.inst.topk);
  __syncthreads();
  if (threadIdx.x != 0) return;
  if (dropped) report(p.inst, kStatusBadExpert);
  if (p.inst.world > 1) raise_route(p.inst, epoch);
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
  slot_ids(p, ids, begin, end, hist + warp * E, nullptr, [&](int r) { return p.scratch.send_start[r]; }, lane);
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
