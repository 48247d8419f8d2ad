// Dispatch, send half (docs/protocol.md, "Send order" and "Dispatch"):
// 1. routing (route.cuh): our routing row, published to same-node peers and
//    the proxy, and the send row and destination of every copy;
// 2. packing (one slice of a token per warp at a time): reads each piece
//    once, converts or quantises it once, and stores it to each of the
//    token's top-k destinations: a same-node peer's private slot, our device
//    send section (same-node overflow, pulled by the peer), or our fabric
//    send section (remote).
// Small calls (decode) do both in one launch, route_pack_kernel: every block
// routes the whole call itself into shared memory (at most 1024 ids, read
// from L2) instead of waiting for a separate routing kernel, whose launch,
// drain and one-block chain cost more than the repeated work. Large calls
// (prefill) route in two launches (dispatch_route.cu), then pack through the
// bulk copy engine (dispatch_bulk.cu) or, where that does not fit, pack_kernel.
// Both grids are persistent, because each block ends with a system-scope
// fence before it is counted: one per resident block, not one per token.
#include <cuda_runtime.h>

#include "launch.h"
#include "pack.cuh"
#include "route.cuh"
#include "scan.cuh"
#include "signal.cuh"
#include "tuning.h"

namespace moe_a2a::a2a::cuda {
namespace {

// Launch tuning: PackTuning and RoutePackTuning (tuning.h). Larger calls
// than route_pack_kernel takes route in separate kernels.
constexpr int kPackThreads = PackTuning::kThreads;
constexpr int kPackBlocksPerSm = PackTuning::kBlocksPerSm;
constexpr int kPackWarps = kPackThreads / kWarp;
constexpr int kRoutePackThreads = RoutePackTuning::kThreads;
constexpr int kRoutePackWarps = kRoutePackThreads / kWarp;
constexpr int kRouteWarps = RoutePackTuning::kRouteWarps;
constexpr int64_t kRoutePackMaxCopies = kRouteWarps * kWarpCopies;  // 1024: a decode call of 128 tokens, top-8
constexpr int kRoutePackBlocksPerSm = RoutePackTuning::kBlocksPerSm;
constexpr size_t kRoutePackSmemBytes = RoutePackTuning::kSmemBytes;

// Work items: one warp, kWarp consecutive pieces (a slice) of one token.
// A warp's items advance by a fixed stride: (token, slice) is stepped, not
// divided out of an item counter each time.
struct PackCursor {
  int t, slice, slices, stride_t, stride_s;
  __device__ __forceinline__ explicit PackCursor(int hidden) {
    const int pieces = (hidden + kVec - 1) / kVec;
    slices = (pieces + kWarp - 1) / kWarp;
    const int warps = blockDim.x / kWarp;
    const int stride = gridDim.x * warps;
    stride_t = stride / slices;
    stride_s = stride % slices;
    const int item = blockIdx.x * warps + threadIdx.x / kWarp;
    t = item / slices;
    slice = item % slices;
  }
  __device__ __forceinline__ void next() {
    t += stride_t;
    slice += stride_s;
    if (slice >= slices) slice -= slices, ++t;
  }
};

// One lane's piece of a work item, loaded and encoded, ready to store.
struct PackPiece {
  Encoded enc;
  float scale;
  int64_t first;  // element offset in the row
  int n;          // elements, 0 past the row's end
};

// Loads and encodes the lane's piece of item (t, slice). Every lane of the
// warp calls it (the amax shuffles need all lanes).
template <int kMode>
__device__ __forceinline__ PackPiece load_item(const DispatchSendParams& p, int t, int slice, int out_bytes) {
  const int H = p.inst.hidden;
  PackPiece piece;
  piece.first = static_cast<int64_t>(slice * kWarp + threadIdx.x % kWarp) * kVec;
  piece.n = piece.first >= H ? 0 : (H - piece.first < kVec ? static_cast<int>(H - piece.first) : kVec);
  piece.enc = encode_piece<kMode>(p, t, piece.first, piece.n, out_bytes, piece.scale);
  return piece;
}

// Stores the piece to every copy of token t: lane k's `mine` is copy
// copy0 + k's row (from dst_of for topk > 32).
template <int kMode, typename DstOf>
__device__ __forceinline__ void store_item(const DispatchSendParams& p, const PackPiece& piece, int64_t copy0,
                                           uint8_t* mine, int out_bytes, DstOf dst_of) {
  const Instance& in = p.inst;
  const int K = in.topk, lane = threadIdx.x % kWarp;
  const bool scale_lane = kMode != kPackConvert && piece.n > 0 && piece.first % kFp8Block == 0;
  for (int k0 = 0; k0 < K; k0 += kWarp) {
    if (k0 > 0) mine = k0 + lane < K ? dst_of(copy0 + k0 + lane) : nullptr;  // topk > 32
    const int count = K - k0 < kWarp ? K - k0 : kWarp;
    for (int k = 0; k < count; ++k) {
      uint8_t* row = reinterpret_cast<uint8_t*>(__shfl_sync(kFullMask, reinterpret_cast<uintptr_t>(mine), k));
      if (row == nullptr) continue;  // dropped copy (warp-uniform)
      if (piece.n > 0) store_piece(row + piece.first * out_bytes, piece.enc, out_bytes, piece.n);
      if (scale_lane) store_f32(row + in.payload_bytes + (piece.first / kFp8Block) * sizeof(float), piece.scale);
    }
  }
}

// Each copy's weight into the tail of its row, once per token (by the warp
// that packs its first slice): lane k stores copy copy0 + k's.
template <typename DstOf>
__device__ __forceinline__ void store_weights(const DispatchSendParams& p, int64_t copy0, uint8_t* mine, DstOf dst_of) {
  const int K = p.inst.topk, lane = threadIdx.x % kWarp;
  for (int k0 = 0; k0 < K; k0 += kWarp) {
    uint8_t* row = k0 == 0 ? mine : (k0 + lane < K ? dst_of(copy0 + k0 + lane) : nullptr);
    if (k0 + lane < K && row != nullptr)
      store_f32(row + p.inst.layout.dispatch_tail, p.weights != nullptr ? p.weights[copy0 + k0 + lane] : 0.0f);
  }
}

// Rows per rank: each copy's tail, once per token. tail_of(c, &word) is the
// row copy c's entry goes to (a row per rank: its token's row, also for the
// copies that do not pack it) and its entry word (rows.cuh, -1: a row of its own).
template <typename TailOf>
__device__ __forceinline__ void store_tails(const DispatchSendParams& p, int64_t copy0, TailOf tail_of) {
  const int K = p.inst.topk, lane = threadIdx.x % kWarp;
  for (int k = lane; k < K; k += kWarp) {
    int32_t word = -1;
    uint8_t* row = tail_of(copy0 + k, &word);
    if (row != nullptr) store_tail(p.inst, row, word, p.weights != nullptr ? p.weights[copy0 + k] : 0.0f, k);
  }
}

// A row per rank in our send section (the device copy when staged): every
// copy of its token for that rank writes its entry there.
__device__ __forceinline__ uint8_t* rank_row(const Instance& in, int slot) {
  return (in.staged ? in.device_ws : in.fabric_ws) + in.layout.send + static_cast<size_t>(slot) * in.layout.dispatch_row;
}

// Fetches the lane's piece of the cursor's item into L2.
__device__ __forceinline__ void prefetch_item(const DispatchSendParams& p, const PackCursor& at) {
  const int64_t first = static_cast<int64_t>(at.slice * kWarp + threadIdx.x % kWarp) * kVec;
  if (first >= p.inst.hidden) return;
  const int64_t element = static_cast<int64_t>(at.t) * p.inst.hidden + first;
  prefetch_l2(static_cast<const uint8_t*>(p.x) + element * dtype_size(p.x_dtype));
}

// Packs the cursor's items from `at` on: loads each piece once, converts or
// quantises it once and stores it to every destination. The warp reads the
// token's destinations (lane k holds copy k's, dst_of(t * topk + k)) before
// the piece, to use after it. (Loading the next item's piece early changed
// nothing measurable here; what made large calls faster was fewer, larger
// writes: dispatch_bulk.cu.)
template <int kMode, typename DstOf, typename TailOf>
__device__ __forceinline__ void pack_items(const DispatchSendParams& p, int tokens, PackCursor at, DstOf dst_of,
                                           TailOf tail_of, bool ranked) {
  const int K = p.inst.topk, lane = threadIdx.x % kWarp;
  const int out_bytes = pack_out_bytes(p.inst, kMode);
  for (; at.t < tokens; at.next()) {
    const int64_t copy0 = static_cast<int64_t>(at.t) * K;
    uint8_t* mine = lane < K ? dst_of(copy0 + lane) : nullptr;
    const PackPiece piece = load_item<kMode>(p, at.t, at.slice, out_bytes);
    store_item<kMode>(p, piece, copy0, mine, out_bytes, dst_of);
    if (at.slice != 0) continue;
    if (ranked) store_tails(p, copy0, tail_of);
    else store_weights(p, copy0, mine, dst_of);
  }
}

// Large calls: packs from the destinations the routing kernels wrote.
template <int kMode>
__global__ void __launch_bounds__(kPackThreads, kPackBlocksPerSm) pack_kernel(DispatchSendParams p) {
  if (stale_replay(p.inst)) return;  // a graph captured before a mask
  kernel_prologue();
  uint8_t* const* copy_dst = p.scratch.copy_dst;
  const Scratch& s = p.scratch;
  pack_items<kMode>(
      p, *s.num_tokens, PackCursor(p.inst.hidden), [&](int64_t c) { return copy_dst[c]; },
      [&](int64_t c, int32_t* word) -> uint8_t* {
        *word = s.copy_entry[c];
        return *word >= 0 ? rank_row(p.inst, s.slots[c]) : copy_dst[c];
      },
      wide(p.inst));
  signal_when_grid_done(p.inst, p.scratch.done_blocks, kFlagDispatch, packed_flag(p.inst, p.inst.proxy.packed));
}

// Shared memory of route_pack_kernel: each copy's (slot, expert) [max copies],
// then per-warp histograms [kRouteWarps][E], counts [E] and first rows [E].
__host__ __device__ constexpr size_t route_pack_smem(int64_t max_copies, int num_experts) {
  return static_cast<size_t>(max_copies) * sizeof(int2) +
         static_cast<size_t>(kRouteWarps + 2) * num_experts * sizeof(int32_t);
}

// Small calls: every block routes all copies into its own table of (slot,
// expert), then packs its items, finding the destinations of their copies
// only. Block 0 alone starts the call, publishes the routing row and writes
// each copy's slot and rank for the receive and combine kernels; it lets our
// next kernel (the plan, which reads the epoch and the routing row) be
// scheduled only after publishing them, the other blocks as soon as they
// start. kRanked: rows per rank or node (wide), an instantiation of its
// own, so that the decode path without them keeps its registers and code.
// kCheck: as stale_replay's (rows.cuh).
template <int kMode, bool kRanked, bool kCheck>
__global__ void __launch_bounds__(kRoutePackThreads, kRoutePackBlocksPerSm) route_pack_kernel(DispatchSendParams p) {
  if (stale_replay<kCheck>(p.inst)) return;  // a graph captured before a mask
  extern __shared__ int2 route_smem[];  // the copy table first: 8-byte aligned
  grid_dependency_wait();
  const bool leader = blockIdx.x == 0;
  if (!leader) allow_dependents();
  const Instance& in = p.inst;
  const int E = in.num_experts + (kRanked ? in.world : 0), L = in.local_experts;  // the keys (route_keys)
  const int tokens = resolve_tokens(p);
  const int64_t copies = static_cast<int64_t>(tokens) * in.topk;
  int2* table = reinterpret_cast<int2*>(route_smem);  // (slot, expert) of each copy
  int32_t* hist = reinterpret_cast<int32_t*>(table + static_cast<int64_t>(in.max_tokens) * in.topk);
  int32_t* counts = hist + kRouteWarps * E;
  int32_t* first = counts + E;
  __shared__ int dropped;
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  // Warp w < kRouteWarps walks copies [w * kWarpCopies, ...) (the call has at
  // most kRoutePackMaxCopies); the other warps, and those past the copies,
  // walk nothing. The ids stay in registers from the first walk to the second.
  const int64_t run_begin = warp < kRouteWarps ? static_cast<int64_t>(warp) * kWarpCopies : copies;
  const int64_t run_end = run_begin + kWarpCopies < copies ? run_begin + kWarpCopies : copies;
  const bool walks = run_begin < run_end;  // warp-uniform
  uint64_t epoch = 0;
  if (threadIdx.x == 0) {
    dropped = 0;
    if (leader) epoch = begin_call(p, tokens);
  }
  // The ids first, then the warp's first item is fetched into L2 while the
  // block routes (at decode sizes it is the warp's only item).
  const RawIds raw = walks ? load_raw_ids(p, run_begin, run_end, lane) : RawIds{};
  const PackCursor items(in.hidden);
  if (items.t < tokens) prefetch_item(p, items);
  for (int i = threadIdx.x; i < kRouteWarps * E; i += kRoutePackThreads) hist[i] = 0;
  __syncthreads();
  const WarpIds ids = walks ? match_ids(p, raw, run_begin, run_end, lane) : WarpIds{};
  if (walks) count_ids(ids, hist + warp * E, lane);
  RankIds ranks{};
  if constexpr (kRanked) {
    if (walks) ranks = match_ranks(p, ids, run_begin, lane);
    if (walks) count_ranks(in, ids, ranks, hist + warp * E, lane);
  }
  if (__any_sync(kFullMask, ids.dropped) && lane == 0) dropped = 1;
  __syncthreads();
  warp_offsets(hist, kRouteWarps, E, nullptr, counts);
  __syncthreads();
  const int32_t send_rows = block_exclusive_scan<kRoutePackThreads, int32_t>(
      E, [&](int o) { return key_rows<kRanked>(in, counts, key_at<kRanked>(in, o)); },
      [&](int o, int32_t v) { first[key_at<kRanked>(in, o)] = v; });
  if (leader) write_routing<kRanked>(p, counts, first, send_rows);
  const Scratch& s = p.scratch;
  const auto sink = [&](int64_t i, int slot, int e, int32_t word) {
    table[i] = make_int2(slot, e);
    if (!leader) return;
    const int r = e >= 0 ? e / L : -1;
    s.slots[i] = slot, s.copy_rank[i] = r >= 0 && kRanked ? wire_dest(in, r) : r;  // where its combine comes back from
    if (kRanked) s.copy_entry[i] = word;
    if (r == in.rank && p.self_in_place) s.self_copy[slot - first[r * L]] = static_cast<int32_t>(i);
  };
  if constexpr (kRanked) {
    if (walks) slot_ids_ranked(in, ids, ranks, run_begin, run_end, hist + warp * E, first, sink, lane);
  } else if (walks) {
    slot_ids(
        ids, run_begin, run_end, hist + warp * E, first, [&](int64_t i, int slot, int e) { sink(i, slot, e, -1); },
        lane);
  }
  __syncthreads();  // the copy table; block 0: every thread's routing row
  if (leader) {
    if (threadIdx.x == 0) publish_routing(in, epoch, dropped != 0, p.cached != 0);
    __syncthreads();  // the fence before any thread lets the plan be scheduled
    allow_dependents();
  }
  // Only the copies of our own items need a destination: one lane each. With
  // rows per rank or node a copy's entry comes from its token's copies in the
  // table (d: their wire destination).
  const auto entry_of = [&](int64_t c, int d) {
    int entry, count;
    token_entries(
        c, in.topk, d, [&](int64_t o) { return table[o].y >= 0 ? wire_dest(in, table[o].y / L) : -1; }, &entry,
        &count);
    return entry_word(entry, count, table[c].y - dest_first_expert(in, d));
  };
  pack_items<kMode>(
      p, tokens, items,
      [&](int64_t c) -> uint8_t* {
        const int2 copy = table[c];
        if (copy.y < 0) return nullptr;  // dropped
        const int r = copy.y / L;
        if (r == in.rank && p.self_in_place) return nullptr;  // the receive half reads x
        if (kRanked && wide_remote(in, r) && word_entry(entry_of(c, wire_dest(in, r))) != 0)
          return nullptr;  // entry 0 packs the row
        return destination(in, copy.x, r, first[r * L]);
      },
      [&](int64_t c, int32_t* word) -> uint8_t* {
        const int2 copy = table[c];
        if (copy.y < 0) return nullptr;  // dropped
        const int r = copy.y / L;
        if (r == in.rank && p.self_in_place) return nullptr;
        if (!kRanked || !wide_remote(in, r)) return destination(in, copy.x, r, first[r * L]);
        *word = entry_of(c, wire_dest(in, r));
        return rank_row(in, copy.x);
      },
      kRanked);
  signal_when_grid_done(in, s.done_blocks, kFlagDispatch, packed_flag(in, in.proxy.packed));
}

template <int kMode>
cudaError_t launch_pack(const DispatchSendParams& p, cudaStream_t stream) {
  const Instance& in = p.inst;
  const int slices = ((in.hidden + kVec - 1) / kVec + kWarp - 1) / kWarp;
  const int64_t items = static_cast<int64_t>(in.max_tokens) * slices;
  const int64_t max_copies = static_cast<int64_t>(in.max_tokens) * in.topk;
  const size_t smem = route_pack_smem(max_copies, in.num_experts + (wide(in) ? in.world : 0));  // route_keys
  if (max_copies <= kRoutePackMaxCopies && smem <= kRoutePackSmemBytes) {
    const bool check = in.maskable != 0;
    const auto kernel = wide(in) ? (check ? route_pack_kernel<kMode, true, true>  // rows per rank or node
                                          : route_pack_kernel<kMode, true, false>)
                                 : (check ? route_pack_kernel<kMode, false, true>  // rows per copy
                                          : route_pack_kernel<kMode, false, false>);
    cudaError_t err = allow_dynamic_smem(reinterpret_cast<const void*>(kernel), smem);
    if (err != cudaSuccess) return err;
    const int blocks = persistent_blocks(items, kRoutePackWarps, kRoutePackBlocksPerSm);
    return launch_kernel(kernel, blocks, kRoutePackThreads, smem, stream, p);
  }
  cudaError_t err = launch_route(p, stream);
  if (err != cudaSuccess) return err;
  // Alone, with our copies left in place, there is nothing to pack (and no
  // peer waits for a dispatch flag).
  if (p.self_in_place && in.world == 1) return cudaSuccess;
  if (bulk_pack_fits(p)) return launch_bulk_pack(p, stream);
  const int blocks = persistent_blocks(items, kPackWarps, kPackBlocksPerSm);
  return launch_kernel(pack_kernel<kMode>, blocks, kPackThreads, 0, stream, p);
}

}  // namespace

cudaError_t launch_dispatch_send(const DispatchSendParams& p, cudaStream_t stream) {
  if (p.inst.topk > kMaxTopk) return cudaErrorInvalidValue;
  cudaError_t err;
  if (p.inst.dispatch_dtype != static_cast<int>(DType::kFp8)) err = launch_pack<kPackConvert>(p, stream);
  else if (p.x_dtype == static_cast<int>(DType::kFp8)) err = launch_pack<kPackFp8>(p, stream);
  else err = launch_pack<kPackQuantize>(p, stream);
  if (err != cudaSuccess || !p.inst.staged) return err;
  StageParams stage;
  stage.inst = p.inst;
  stage.scratch = p.scratch;
  stage.kind = kStageDispatch;
  return launch_stage(stage, stream);
}

}  // namespace moe_a2a::a2a::cuda
