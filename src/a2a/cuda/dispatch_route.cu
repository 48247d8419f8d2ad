// Dispatch send, routing step of large calls (prefill): copies per expert
// (our routing row), published to every same-node peer and to the proxy, then
// the send row and destination of every copy (route.cuh). Two launches
// spread the walks over many blocks, so that the work is not confined to one
// multiprocessor: count_kernel and slot_kernel walk kRouteBlockCopies copies
// a block; every slot_kernel block joins the blocks' counts itself (a few KB
// from L2), which costs less than a joining launch between them. Small calls
// route inside their pack kernel instead (dispatch_send.cu).
#include <cuda_runtime.h>

#include "launch.h"
#include "route.cuh"
#include "scan.cuh"
#include "tuning.h"

namespace moe_a2a::a2a::cuda {
namespace {

constexpr int kLargeThreads = kRouteBlockCopies / kWarpCopies * kWarp;
constexpr int kLargeWarps = kLargeThreads / kWarp;
constexpr int kBlockBaseChunk = RouteTuning::kBlockBaseChunk;
static_assert(kLargeWarps * kWarpCopies == kRouteBlockCopies, "a large-call block covers its copies");

// Large calls, 1/2: each block counts its kRouteBlockCopies copies per expert
// into block_base[block][e]. Shared memory: hist [warps][E].
__global__ void __launch_bounds__(kLargeThreads) count_kernel(DispatchSendParams p) {
  if (stale_replay(p.inst)) return;  // a graph captured before a mask
  extern __shared__ int32_t hist[];
  kernel_prologue();
  const int E = route_keys(p.inst);  // the keys: experts, and with rows per rank one per rank
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int64_t copies = static_cast<int64_t>(resolve_tokens(p)) * p.inst.topk;
  const int64_t begin = static_cast<int64_t>(blockIdx.x) * kRouteBlockCopies + warp * kWarpCopies;
  const int64_t end = begin + kWarpCopies < copies ? begin + kWarpCopies : copies;
  const WarpIds ids = load_ids(p, begin, end, lane);
  for (int i = threadIdx.x; i < kLargeWarps * E; i += kLargeThreads) hist[i] = 0;
  __syncthreads();
  count_ids(ids, hist + warp * E, lane);
  if (wide(p.inst)) count_ranks(p.inst, ids, match_ranks(p, ids, begin, lane), hist + warp * E, lane);
  if (__any_sync(kFullMask, ids.dropped) && lane == 0) *p.scratch.dropped = 1;
  __syncthreads();
  warp_offsets(hist, kLargeWarps, E, nullptr, p.scratch.block_base + static_cast<size_t>(blockIdx.x) * E);
}

// Large calls, 2/2: each block finds the first row of each expert and its
// own first row per expert from the blocks' counts, then walks its copies
// again. Block 0 also starts the call and publishes the routing row.
// Shared memory: hist [warps][E], counts [E], first [E], mine [E].
//
// The ids are loaded and matched before the grid wait: they are the call's
// input, complete before count_kernel's own wait returned, and only after
// that wait does count_kernel let this kernel be scheduled. So this part
// overlaps count_kernel (with programmatic dependent launch).
__global__ void __launch_bounds__(kLargeThreads) slot_kernel(DispatchSendParams p) {
  if (stale_replay(p.inst)) return;  // a graph captured before a mask
  extern __shared__ int32_t hist[];
  const Instance& in = p.inst;
  const Scratch& s = p.scratch;
  const int E = route_keys(in);  // the keys (route.cuh)
  int32_t* counts = hist + kLargeWarps * E;
  int32_t* first = counts + E;
  int32_t* mine = first + E;  // this block's first row of each expert, less first[e]
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const bool leader = blockIdx.x == 0;
  const int tokens = resolve_tokens(p);
  const int64_t copies = static_cast<int64_t>(tokens) * in.topk;
  const int64_t begin = static_cast<int64_t>(blockIdx.x) * kRouteBlockCopies + warp * kWarpCopies;
  const int64_t end = begin + kWarpCopies < copies ? begin + kWarpCopies : copies;
  const WarpIds ids = load_ids(p, begin, end, lane);
  kernel_prologue();  // count_kernel's block_base from here on
  // Per expert, the copies of every block (count_kernel) and of those before ours.
  const int blocks = gridDim.x;
  for (int e = threadIdx.x; e < E; e += kLargeThreads) {
    int32_t total = 0, before = 0;
    for (int b0 = 0; b0 < blocks; b0 += kBlockBaseChunk) {  // loads first, so they overlap
      int32_t c[kBlockBaseChunk];
#pragma unroll
      for (int u = 0; u < kBlockBaseChunk; ++u)
        c[u] = b0 + u < blocks ? s.block_base[static_cast<size_t>(b0 + u) * E + e] : 0;
#pragma unroll
      for (int u = 0; u < kBlockBaseChunk; ++u) {
        if (b0 + u < static_cast<int>(blockIdx.x)) before += c[u];
        total += c[u];
      }
    }
    counts[e] = total;
    mine[e] = before;
  }
  for (int i = threadIdx.x; i < kLargeWarps * E; i += kLargeThreads) hist[i] = 0;
  __syncthreads();
  const int32_t send_rows = block_exclusive_scan<kLargeThreads, int32_t>(
      E, [&](int o) { return key_rows(in, counts, key_at(in, o)); },
      [&](int o, int32_t v) { first[key_at(in, o)] = v; });
  for (int e = threadIdx.x; e < E; e += kLargeThreads) mine[e] += first[e];
  count_ids(ids, hist + warp * E, lane);
  const RankIds ranks = wide(in) ? match_ranks(p, ids, begin, lane) : RankIds{};
  if (wide(in)) count_ranks(in, ids, ranks, hist + warp * E, lane);
  __syncthreads();
  warp_offsets(hist, kLargeWarps, E, mine, nullptr);
  if (leader) {
    __shared__ uint64_t epoch;
    __shared__ int dropped;
    if (threadIdx.x == 0) {
      epoch = begin_call(p, tokens);
      dropped = *s.dropped;
      *s.dropped = 0;  // for the next call
    }
    write_routing(p, counts, first, send_rows);
    __syncthreads();
    if (threadIdx.x == 0) publish_routing(in, epoch, dropped != 0, p.cached != 0);
  }
  __syncthreads();
  const auto sink = [&](int64_t i, int slot, int e, int32_t word) {
    const int r = e >= 0 ? e / in.local_experts : -1;
    const int64_t send_start = e >= 0 ? first[r * in.local_experts] : 0;
    const bool in_place = r == in.rank && p.self_in_place;  // the receive half reads x
    s.slots[i] = slot;
    s.copy_rank[i] = r >= 0 ? wire_dest(in, r) : -1;  // where its combine comes back from
    if (in_place) s.self_copy[slot - send_start] = static_cast<int32_t>(i);
    // A row per rank is packed once, by its token's entry 0.
    const bool packs = e >= 0 && !in_place && (word < 0 || word_entry(word) == 0);
    s.copy_dst[i] = packs ? destination(in, slot, r, send_start) : nullptr;
    if (wide(in)) s.copy_entry[i] = word;
  };
  if (wide(in)) {
    slot_ids_ranked(in, ids, ranks, begin, end, hist + warp * E, nullptr, sink, lane);
  } else {
    slot_ids(ids, begin, end, hist + warp * E, nullptr, [&](int64_t i, int slot, int e) { sink(i, slot, e, -1); },
             lane);
  }
}

}  // namespace

cudaError_t launch_route(const DispatchSendParams& p, cudaStream_t stream) {
  const size_t E = p.inst.num_experts + (wide(p.inst) ? p.inst.world : 0);  // route_keys
  const int blocks = route_blocks(static_cast<int64_t>(p.inst.max_tokens) * p.inst.topk);
  const size_t hist_smem = kLargeWarps * E * sizeof(int32_t);
  const size_t slot_smem = hist_smem + 3 * E * sizeof(int32_t);
  cudaError_t err;
  if ((err = allow_dynamic_smem(reinterpret_cast<const void*>(count_kernel), hist_smem)) != cudaSuccess) return err;
  if ((err = allow_dynamic_smem(reinterpret_cast<const void*>(slot_kernel), slot_smem)) != cudaSuccess) return err;
  if ((err = launch_kernel(count_kernel, blocks, kLargeThreads, hist_smem, stream, p)) != cudaSuccess) return err;
  return launch_kernel(slot_kernel, blocks, kLargeThreads, slot_smem, stream, p);
}

}  // namespace moe_a2a::a2a::cuda
