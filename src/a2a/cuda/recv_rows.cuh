// Dispatch, receive half: the copies. Where each received copy (s, j) is read
// from and which output row it goes to, the plain copy of a row's chunk (one
// stream of 16-byte pieces, 8 loads a lane in flight, when aligned, split
// into payload and fp8 scales), and the walk of our own copies left in x by
// token, so that a row of x is read from HBM once, not once per copy.
#pragma once

#include "pack.cuh"
#include "rows.cuh"
#include "segments.cuh"

namespace moe_a2a::a2a::cuda {

// kWide: the instance may have rows per rank or node (wide); kernels of
// instances without them take false, leaving those paths out of their code
// (a rank alone replays its decode step in about 27 us; with those paths
// compiled in beside its own it took 7% longer: docs/benchmarks-fabric.md).
template <bool kWide = true>
__device__ __forceinline__ const uint8_t* source_row(const Instance& in, const SenderPlan* senders, int s, int64_t j) {
  const Layout& l = in.layout;
  const size_t row = l.dispatch_row;
  const int64_t P = in.max_private;
  if (kWide && node_sender(in, s)) {  // its row for our node, in its forwarder's device workspace
    const SenderPlan& sp = senders[s];
    const uint8_t* ws = in.peers[sp.fwd].device;
    if (j < P) return ws + l.private_rows + (static_cast<size_t>(s) * P + j) * row;
    return ws + l.shared_rows + (sp.read_shared_off + j - P) * row;
  }
  if (j < P) {
    const uint8_t* ws = same_node(in, s) ? in.device_ws : in.fabric_ws;
    return ws + l.private_rows + (static_cast<size_t>(s) * P + j) * row;
  }
  if (same_node(in, s)) return in.peers[s].device + l.send + (senders[s].send_off + j) * row;
  return in.fabric_ws + l.shared_rows + (senders[s].shared_off + j - P) * row;
}

// Where copy (s, j) is read from: our copies to ourselves from x itself when
// the send half left them in place. Every one of ours has its output row
// noted (once, by the warp's lane 0 of its first chunk) for a combine that
// reads it in place.
template <bool kWide = true>
__device__ __forceinline__ const uint8_t* row_source(const DispatchRecvParams& p, int s, int j, int row, bool note) {
  const Instance& in = p.inst;
  if (s != in.rank) return source_row<kWide>(in, p.scratch.senders, s, j);
  if (note) p.scratch.self_row[j] = row;
  if (p.self_x == nullptr) return source_row<kWide>(in, p.scratch.senders, s, j);
  const int64_t token = p.scratch.self_copy[j] / in.topk;
  return static_cast<const uint8_t*>(p.self_x) + token * in.payload_bytes;
}

// Output row `row`'s weight, copy (s, j)'s: from its row's tail (a row per
// rank or node: its entry's, as entry_kernel took it), or for one of ours read in
// place from the send half's weights.
template <bool kWide = true>
__device__ __forceinline__ void deliver_weight(const DispatchRecvParams& p, int s, int j, int row) {
  if (p.out_weight == nullptr) return;
  const Instance& in = p.inst;
  float w;
  if (s == in.rank && p.self_x != nullptr)
    w = p.self_weights != nullptr ? p.self_weights[p.scratch.self_copy[j]] : 0.0f;
  else if (kWide && per_rank(in, s)) w = p.scratch.entry_weight[p.scratch.row_entry[row]];
  else if (kWide && node_sender(in, s)) w = p.scratch.row_weight[row];
  else w = load_f32(source_row<kWide>(in, p.scratch.senders, s, j) + in.layout.dispatch_tail);
  p.out_weight[row] = w;
}

// Rows per rank: the wire row (j) of per-rank sender s that output row `row`
// holds an entry of (entry_kernel noted it).
__device__ __forceinline__ int wire_row_of(const DispatchRecvParams& p, int s, int row) {
  return p.scratch.row_entry[row] / p.inst.max_entries - static_cast<int>(p.scratch.senders[s].recv_base);
}

// One warp: chunk `chunk` of copy (s, j) into output row `row`.
template <bool kWide = true>
__device__ __forceinline__ void copy_chunk(const DispatchRecvParams& p, int s, int j, int row, int chunk, int lane) {
  const Instance& in = p.inst;
  const int64_t payload = in.payload_bytes;
  const int64_t scale_bytes = static_cast<int64_t>(in.num_scales) * sizeof(float);
  const int64_t row_bytes = payload + scale_bytes;
  const uint8_t* src = row_source<kWide>(p, s, j, row, chunk == 0 && lane == 0);
  if (chunk == 0 && lane == 0) deliver_weight<kWide>(p, s, j, row);
  uint8_t* dst_x = static_cast<uint8_t*>(p.out_x) + row * payload;
  uint8_t* dst_scale = reinterpret_cast<uint8_t*>(p.out_scale) + row * scale_bytes;
  if (split_copyable(dst_x, dst_scale, src, payload, scale_bytes)) {
    const int64_t chunk_size = chunk_bytes(row_bytes);
    const int64_t begin = chunk * chunk_size;
    const int64_t end = begin + chunk_size < row_bytes ? begin + chunk_size : row_bytes;
    warp_copy_split(dst_x, dst_scale, src, payload, begin, end, lane);
  } else if (chunk == 0) {  // unaligned rows: one warp copies the whole row
    warp_copy(dst_x, src, payload, lane);
    if (scale_bytes > 0) warp_copy(dst_scale, src + payload, scale_bytes, lane);
  }
}

// The output row of one sender's copy j: in its segment that holds it, the
// last one starting at or before j (empty segments start where the next one
// does). The sender's segments lie `stride` apart in segs, one per local expert.
__device__ __forceinline__ int sender_output_row(const Segment* segs, int stride, int local_experts, int64_t j) {
  int lo = 0, hi = local_experts;
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (segs[mid * stride].first_j <= j) lo = mid;
    else hi = mid;
  }
  const Segment& g = segs[lo * stride];
  return g.out_row + static_cast<int>(j - g.first_j);
}

// Our copies read from x in place are walked by token: a token's copies
// are written together, so its row of x is read from HBM once (walked in
// output order, the rows of one expert are scattered tokens, and each row of
// x is read once per copy). A plain or dequantising receive reads (and
// quantises) each piece of the row once and stores it to every copy's row; a
// weighted one gives each copy (t, k) a warp of its own (its dot product sums
// in one warp), consecutive warps taking a token's copies at about the same
// time, so the row comes from L2 for all but the first.
// Copy n = t * topk + k: our copy j of it, or false (dropped, another rank's,
// or outside [j_first, j_end)).
__device__ __forceinline__ bool self_copy_of(const DispatchRecvParams& p, int n, int64_t j_first, int64_t j_end,
                                             int64_t* j) {
  const int slot = p.scratch.slots[n];
  *j = slot - p.scratch.senders[p.inst.rank].send_off;  // send_off: our first copy's send row
  return slot >= 0 && *j >= j_first && *j < j_end;
}

// The output rows of one token's copies: lane k (and k + 32) holds copy k's,
// -1 where that copy is not ours to write here (see self_copy_of).
struct TokenRows {
  static constexpr int kPerLane = kMaxTopk / kWarp;
  int row[kPerLane];
  // Every lane calls it (a shuffle); k is the same on every lane.
  __device__ __forceinline__ int of(int k) const {
    return __shfl_sync(kFullMask, k < kWarp ? row[0] : row[1], k % kWarp);
  }
};
static_assert(TokenRows::kPerLane == 2, "TokenRows::of reads two rows a lane");

// Token t's rows among `segs` (ours, `stride` apart). With `first_chunk`
// (once per token) each copy's output row is noted for the combine and its
// weight delivered.
__device__ __forceinline__ TokenRows token_rows(const DispatchRecvParams& p, const Segment* segs, int stride, int t,
                                                int64_t j_first, int64_t j_end, bool first_chunk, int lane) {
  const Instance& in = p.inst;
  TokenRows r;
#pragma unroll
  for (int h = 0; h < TokenRows::kPerLane; ++h) {
    const int k = lane + h * kWarp;
    int64_t j;
    r.row[h] = -1;
    if (k >= in.topk || !self_copy_of(p, t * in.topk + k, j_first, j_end, &j)) continue;
    const int row = sender_output_row(segs, stride, in.local_experts, j);
    r.row[h] = row;
    if (!first_chunk) continue;
    p.scratch.self_row[j] = row;
    if (p.out_weight != nullptr) p.out_weight[row] = p.self_weights != nullptr ? p.self_weights[t * in.topk + k] : 0.0f;
  }
  return r;
}

// A plain receive: chunk `chunk` of token t's row of x, loaded once, stored
// to each of its copies' rows (x is in the dispatch dtype: no fp8 scales).
__device__ __forceinline__ void copy_token_chunk(const DispatchRecvParams& p, int t, const TokenRows& r, int chunk,
                                                 int lane) {
  const Instance& in = p.inst;
  const int64_t bytes = in.payload_bytes;
  const uint8_t* src = static_cast<const uint8_t*>(p.self_x) + t * bytes;
  uint8_t* out = static_cast<uint8_t*>(p.out_x);
  if (aligned(src, 16) && aligned(out, 16) && bytes % 16 == 0) {
    const int64_t size = chunk_bytes(bytes), begin = chunk * size;
    const int64_t end = begin + size < bytes ? begin + size : bytes;
    const int left = static_cast<int>((end - begin) / 16) - lane;  // a chunk is at most one round (kCopyChunkBytes)
    CopyRound v;
    load_round(v, src + begin, left, lane);
#pragma unroll 1
    for (int k = 0; k < in.topk; ++k) {
      const int row = r.of(k);
      if (row >= 0) store_round(out + row * bytes + begin, v, left, lane);
    }
    return;
  }
#pragma unroll 1
  for (int k = 0; k < in.topk; ++k) {  // unaligned rows (rare): chunk 0 copies each whole row, bytewise
    const int row = r.of(k);
    if (chunk == 0 && row >= 0)
      for (int64_t b = lane; b < bytes; b += kWarp) out[row * bytes + b] = src[b];
  }
}

}  // namespace moe_a2a::a2a::cuda
