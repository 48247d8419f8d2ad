// Dispatch, receive half (docs/protocol.md, "Dispatch at receiver r"):
// 1. plan_kernel (one block, beside our pack kernel): waits for the route
//    flag of every same-node sender and, with remote peers, for the proxy's
//    dispatch_done; reads the routing matrix (same-node rows from the device
//    workspace, remote ones from the host workspace, where the proxy put
//    them; a cached call's from its handle, with no route flag to wait for);
//    checks max_recv_tokens on every rank (each rank holds the whole
//    matrix, so all decide alike); computes tokens_per_expert, the padded
//    expert starts and the segment table; then waits for the packs.
// 2. copy_kernel (persistent, one warp per chunk of an output row): copies
//    each received row into the expert-major output, splitting payload and
//    fp8 scales (one stream of 16-byte pieces, 8 loads a lane in flight, when
//    aligned). Our own copies left in x are walked token by token instead,
//    so a row of x is read from HBM once, not once per copy.
// Eager calls (the host saw every flag) of a rank alone on its GPU run both
// in one launch instead, plan_copy_kernel: the plan has nothing to wait for
// there, so running it beside the pack gains nothing, and a launch costs the
// host more than the plan takes on the GPU (see CudaAllToAll::fused_recv_).
#include <cuda_runtime.h>

#include "launch.h"
#include "memory.cuh"
#include "pack.cuh"
#include "rows.cuh"
#include "scan.cuh"
#include "segments.cuh"

namespace moe_a2a::a2a::cuda {
namespace {

// The plan runs beside our pack kernel, so it must fit beside its blocks: at
// most 16K registers (256 threads of 64), which a multiprocessor holding
// four pack blocks still has free.
constexpr int kPlanThreads = 256;
constexpr int kPlanMaxRegisters = 64;
constexpr int kRegistersPerSm = 65536;  // sm_90
constexpr int kPlanMinBlocks = kRegistersPerSm / (kPlanThreads * kPlanMaxRegisters);  // for __launch_bounds__
constexpr int kPlanWarps = kPlanThreads / kWarp;
constexpr int kCopyThreads = 256;
// Blocks a multiprocessor: the persistent grid is sized for this many, so all
// must be resident at once (a second wave would leave its rows to the end).
// Three: the row copy holds 8 x 16 bytes a lane in flight (24 warps, 96 KB a
// multiprocessor) in about 80 registers.
constexpr int kCopyBlocksPerSm = 3;
// plan_copy_kernel: the longest a block sleeps between looks at the planner's
// word (the plan takes microseconds; a longer sleep would start the copy late).
constexpr unsigned kPlanPollNs = 128;

__device__ __forceinline__ int64_t warp_sum(int64_t v) {
#pragma unroll
  for (int offset = kWarp / 2; offset > 0; offset /= 2) v += __shfl_xor_sync(kFullMask, v, offset);
  return v;
}

// Waits for the proxy's flag; false (with the status set) on failure or timeout.
__device__ bool wait_proxy(const Instance& in, const uint64_t* flag, uint64_t epoch, uint64_t deadline) {
  constexpr unsigned kSleepNs = 256;
  while (ld_acquire_sys(flag) < epoch) {
    if (ld_acquire_sys(in.proxy.failed) != 0) {
      report(in, kStatusProxyFailed);
      return false;
    }
    if (global_timer_ns() > deadline) {
      report(in, kStatusTimeout);
      return false;
    }
    __nanosleep(kSleepNs);
  }
  return true;
}

// Waits (every thread of the block) for flag `kind` of every same-node peer
// but ourselves; false, with the status set, on a timeout.
__device__ bool wait_peers(const Instance& in, int kind, uint64_t epoch, uint64_t deadline) {
  bool ok = true;
  for (int s = threadIdx.x; s < in.world; s += blockDim.x)
    if (s != in.rank && same_node(in, s) && !wait_geq(flag_ptr(in.host_ws, in.layout, s, kind), epoch, deadline)) {
      report(in, kStatusTimeout);
      ok = false;
    }
  return __syncthreads_and(ok);
}

// After a failed wait or over capacity: no rows; the host raises the status.
// Every thread of the block calls it.
__device__ void deliver_nothing(const DispatchRecvParams& p) {
  for (int i = threadIdx.x; i < p.inst.local_experts; i += blockDim.x) p.tokens_per_expert[i] = 0;
  if (threadIdx.x == 0) *p.scratch.output_rows = *p.scratch.output_rows_host = 0;
}

// Where the eager host waits: the plan is final (output rows, status).
// Thread 0, after every thread's plan writes.
__device__ __forceinline__ void signal_planned(const DispatchRecvParams& p, uint64_t epoch) {
  fence_sys();
  st_release_sys(p.scratch.planned_host, epoch);
}

// The plan from the routing matrix: capacity for every rank, per-sender
// placement, tokens_per_expert, expert starts and the segment table; with
// `ok` false (a wait failed) or over capacity it delivers nothing.
// Shared memory: matrix [world][E], n[L], start[L].
__device__ void compute_plan(const DispatchRecvParams& p, int32_t* matrix, bool ok_in) {
  const Instance& in = p.inst;
  const Layout& l = in.layout;
  const int N = in.world, E = in.num_experts, L = in.local_experts, rank = in.rank;
  const int64_t P = in.max_private;
  int32_t* n = matrix + N * E;
  int32_t* start = n + L;
  __shared__ int ok;
  const int tid = threadIdx.x, warp = tid / kWarp, lane = tid % kWarp;
  if (tid == 0) ok = ok_in;
  __syncthreads();
  if (ok) {  // rows of same-node senders from our device workspace, the others' where the proxy put them
    for (int i = tid; i < N * E; i += kPlanThreads) {
      const int s = i / E;
      const uint32_t* row = p.routing != nullptr ? p.routing + static_cast<size_t>(s) * E  // a cached call's
                                                 : routing_row(same_node(in, s) ? in.device_ws : in.host_ws, l, s, E);
      matrix[i] = static_cast<int32_t>(__ldcg(row + i % E));
      if (p.routing_out != nullptr) p.routing_out[i] = static_cast<uint32_t>(matrix[i]);
    }
  }
  __syncthreads();
  // Capacity, for every rank (the same decision everywhere).
  if (ok) {
    for (int r = warp; r < N; r += kPlanWarps) {
      int64_t received = 0;
      for (int i = lane; i < N * L; i += kWarp) received += matrix[(i / L) * E + r * L + i % L];
      received = warp_sum(received);
      if (lane == 0 && received > in.max_recv) ok = 0, report(in, kStatusCapacity);
    }
  }
  __syncthreads();
  if (!ok) return deliver_nothing(p);

  const int32_t* mine = matrix + rank * L;  // column block of our experts: mine[s * E + i]
  for (int s = warp; s < N; s += kPlanWarps) {
    int64_t copies = 0, before = 0;
    for (int i = lane; i < L; i += kWarp) copies += mine[s * E + i];
    for (int e = lane; e < rank * L; e += kWarp) before += matrix[s * E + e];
    copies = warp_sum(copies);
    before = warp_sum(before);
    if (lane == 0) {
      p.scratch.senders[s].copies = copies;
      p.scratch.senders[s].send_off = before;
    }
  }
  for (int i = tid; i < L; i += kPlanThreads) {
    int32_t total = 0;
    for (int s = 0; s < N; ++s) total += mine[s * E + i];
    n[i] = total;
    p.tokens_per_expert[i] = total;
  }
  __syncthreads();

  SenderPlan* senders = p.scratch.senders;
  block_exclusive_scan<kPlanThreads, int64_t>(
      N, [&](int s) { return senders[s].copies; }, [&](int s, int64_t v) { senders[s].recv_base = v; });
  block_exclusive_scan<kPlanThreads, int64_t>(
      N, [&](int s) { return senders[s].copies > P ? senders[s].copies - P : int64_t{0}; },
      [&](int s, int64_t v) { senders[s].shared_off = v; });
  const int pad = in.expert_padding;
  const int32_t rows_out = block_exclusive_scan<kPlanThreads, int32_t>(
      L, [&](int i) { return (n[i] + pad - 1) / pad * pad; }, [&](int i, int32_t v) { start[i] = v; });

  Segment* segs = p.scratch.segments;
  for (int s = 0; s < N; ++s) {
    block_exclusive_scan<kPlanThreads, int32_t>(
        L, [&](int i) { return mine[s * E + i]; },
        [&](int i, int32_t v) {
          Segment& g = segs[i * N + s];
          g.first_j = v;
          g.count = mine[s * E + i];
          g.sender = s;
        });
  }
  for (int i = tid; i < L; i += kPlanThreads) {
    int32_t at = start[i];
    for (int s = 0; s < N; ++s) {
      segs[i * N + s].out_row = at;
      at += mine[s * E + i];
    }
  }
  if (tid == 0) *p.scratch.output_rows = *p.scratch.output_rows_host = rows_out;
}

// The plan needs only routing rows, which our dispatch send published (with
// the call's epoch) before it let this kernel be scheduled, so this kernel
// does not start by waiting for the kernel before it (our pack): with
// programmatic dependent launch it runs beside it. It waits for the packs
// (ours through the grid dependency, the peers' through their dispatch
// flags) only before it ends, because the copy kernel after it reads their
// rows.
__global__ void __launch_bounds__(kPlanThreads, kPlanMinBlocks) plan_kernel(DispatchRecvParams p) {
  extern __shared__ int32_t matrix[];
  const Instance& in = p.inst;
  const uint64_t epoch = *reinterpret_cast<volatile uint64_t*>(in.epoch);  // published before we were scheduled
  const uint64_t deadline = global_timer_ns() + in.timeout_ns;
  // Waiting on no flag (eager calls, whose host saw them all, or a rank
  // alone), the plan lets the copy kernel's blocks in at once: they wait in
  // hardware for this grid to end and start without a launch gap. Otherwise
  // only after its waits (see allow_dependents in memory.cuh).
  if (!p.wait_in_kernel || (in.world == 1 && !in.has_remote)) allow_dependents();
  bool ok = true;
  if (p.wait_in_kernel) {
    ok = p.routing != nullptr || wait_peers(in, kFlagRoute, epoch, deadline);  // a cached call has no route flags
    __shared__ int proxy_ok;
    if (threadIdx.x == 0) {
      proxy_ok = 1;
      if (in.has_remote) {  // remote routing rows: the proxy says everything arrived
        if (!wait_proxy(in, in.proxy.dispatch_done, epoch, deadline)) proxy_ok = 0;
        else if (ld_acquire_sys(in.proxy.overflow) == epoch) proxy_ok = 0, report(in, kStatusCapacity);
      }
    }
    __syncthreads();
    ok = ok && proxy_ok;
  }
  compute_plan(p, matrix, ok);
  if (p.wait_in_kernel && !wait_peers(in, kFlagDispatch, epoch, deadline)) deliver_nothing(p);
  grid_dependency_wait();  // the routing before us reported its status too
  allow_dependents();
  // An eager host (the one that saw the flags itself) waits for this word,
  // not for the stream: it needs only the output rows and the status, and
  // returns while the copy kernel runs. In a captured graph no host reads
  // it, and the system-scope fence would delay the copy kernel (about 1 us a
  // decode step).
  if (p.wait_in_kernel) return;
  __syncthreads();
  if (threadIdx.x == 0) signal_planned(p, epoch);
}

__device__ __forceinline__ const uint8_t* source_row(const Instance& in, const SenderPlan* senders, int s, int64_t j) {
  const Layout& l = in.layout;
  const size_t row = l.dispatch_row;
  const int64_t P = in.max_private;
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
__device__ __forceinline__ const uint8_t* row_source(const DispatchRecvParams& p, int s, int j, int row, bool note) {
  const Instance& in = p.inst;
  if (s != in.rank) return source_row(in, p.scratch.senders, s, j);
  if (note) p.scratch.self_row[j] = row;
  if (p.self_x == nullptr) return source_row(in, p.scratch.senders, s, j);
  const int64_t token = p.scratch.self_copy[j] / in.topk;
  return static_cast<const uint8_t*>(p.self_x) + token * in.payload_bytes;
}

// Output row `row`'s weight, copy (s, j)'s: from its row's tail, or for one
// of ours read in place from the send half's weights.
__device__ __forceinline__ void deliver_weight(const DispatchRecvParams& p, int s, int j, int row) {
  if (p.out_weight == nullptr) return;
  const Instance& in = p.inst;
  float w;
  if (s == in.rank && p.self_x != nullptr)
    w = p.self_weights != nullptr ? p.self_weights[p.scratch.self_copy[j]] : 0.0f;
  else
    w = load_f32(source_row(in, p.scratch.senders, s, j) + in.layout.dispatch_tail);
  p.out_weight[row] = w;
}

// One warp: chunk `chunk` of copy (s, j) into output row `row`.
__device__ __forceinline__ void copy_chunk(const DispatchRecvParams& p, int s, int j, int row, int chunk, int lane) {
  const Instance& in = p.inst;
  const int64_t payload = in.payload_bytes;
  const int64_t scale_bytes = static_cast<int64_t>(in.num_scales) * sizeof(float);
  const int64_t row_bytes = payload + scale_bytes;
  const uint8_t* src = row_source(p, s, j, row, chunk == 0 && lane == 0);
  if (chunk == 0 && lane == 0) deliver_weight(p, s, j, row);
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

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = kWarp / 2; offset > 0; offset /= 2) v += __shfl_xor_sync(kFullMask, v, offset);
  return v;
}

// A weighted receive (row_scale set; bf16 or fp32 rows): one warp stores row
// `row` as copy (s, j) times row_scale[row] and, with dot_y, sums
// <copy, dot_y[row]> into dot_out[row] (fp32 products and sums, the lane's
// pieces in order, then across lanes in a fixed order: the same every run).
// The weighted combine's backward in the pass that delivers its rows.
constexpr int kBf16 = static_cast<int>(DType::kBf16);
// What the copy kernels do to a row: each mode is a kernel of its own, so the
// plain copy keeps its registers.
enum RecvMode : int { kRecvCopy = 0, kRecvScaled = 1, kRecvDequant = 2 };
constexpr int kFp32 = static_cast<int>(DType::kFp32);

// kVec elements as loaded: 16 bytes of bf16 or 32 of fp32.
template <int kDtype>
struct Piece8 {
  static constexpr int kWords = kDtype == kFp32 ? 2 : 1;
  static constexpr int kBytes = 16 * kWords;
  uint4 w[kWords];
};

template <int kDtype>
__device__ __forceinline__ Piece8<kDtype> load8(const uint8_t* p) {
  Piece8<kDtype> r;
#pragma unroll
  for (int i = 0; i < Piece8<kDtype>::kWords; ++i) r.w[i] = ld_16_stream(p + 16 * i);
  return r;
}

template <int kDtype>
__device__ __forceinline__ void unpack8(const Piece8<kDtype>& r, float (&v)[kVec]) {
#pragma unroll
  for (int i = 0; i < kVec; ++i) {
    const uint4& q = r.w[kDtype == kFp32 ? i / 4 : 0];
    const int at = kDtype == kFp32 ? i % 4 : i / 2;
    const uint32_t word = at == 0 ? q.x : at == 1 ? q.y : at == 2 ? q.z : q.w;
    v[i] = kDtype == kFp32 ? __uint_as_float(word) : __uint_as_float(i % 2 == 0 ? word << 16 : word & 0xffff0000u);
  }
}

// One piece's products and sums: dot += v * y (with kDot), then v * w, stored.
template <int kSrc, int kY, bool kDot>
__device__ __forceinline__ void scale_piece(const Piece8<kSrc>& a, const Piece8<kY>& b, float w, uint8_t* dst,
                                            float& dot) {
  float v[kVec];
  unpack8<kSrc>(a, v);
  if constexpr (kDot) {
    float y[kVec];
    unpack8<kY>(b, y);
#pragma unroll
    for (int i = 0; i < kVec; ++i) dot = __fadd_rn(dot, __fmul_rn(v[i], y[i]));
  }
#pragma unroll
  for (int i = 0; i < kVec; ++i) v[i] = __fmul_rn(v[i], w);
  store_full_piece(dst, kSrc == kFp32 ? encode_fp32(v) : encode_bf16(v), kSrc == kFp32 ? 4 : 2);
}

// Whole, aligned rows: raw pieces, several a lane in flight before the first
// is used. As many as fit the copy kernel's 80 registers with no spill:
// three of bf16 (96 bytes a lane with their y), one where either is fp32.
template <int kSrc, int kY, bool kDot>
__device__ __forceinline__ void scale_row_fast(const uint8_t* src, uint8_t* dst, const uint8_t* y, float w,
                                               int pieces, int lane, float& dot) {
  constexpr int kUnroll = kSrc == kFp32 || kY == kFp32 ? 1 : 3;
  for (int base = lane; base < pieces; base += kUnroll * kWarp) {
    Piece8<kSrc> a[kUnroll];
    Piece8<kY> b[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int piece = base + u * kWarp;
      if (piece >= pieces) continue;
      a[u] = load8<kSrc>(src + static_cast<int64_t>(piece) * Piece8<kSrc>::kBytes);
      if constexpr (kDot) b[u] = load8<kY>(y + static_cast<int64_t>(piece) * Piece8<kY>::kBytes);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int piece = base + u * kWarp;
      if (piece < pieces)
        scale_piece<kSrc, kY, kDot>(a[u], b[u], w, dst + static_cast<int64_t>(piece) * Piece8<kSrc>::kBytes, dot);
    }
  }
}

template <int kSrc>
__device__ __forceinline__ void scale_row_fast_y(const DispatchRecvParams& p, const uint8_t* src, uint8_t* dst,
                                                 const uint8_t* y, float w, int pieces, int lane, float& dot) {
  if (y == nullptr) scale_row_fast<kSrc, kBf16, false>(src, dst, y, w, pieces, lane, dot);
  else if (p.dot_y_dtype == kFp32) scale_row_fast<kSrc, kFp32, true>(src, dst, y, w, pieces, lane, dot);
  else scale_row_fast<kSrc, kBf16, true>(src, dst, y, w, pieces, lane, dot);
}

// Any row: element by element where a piece is short or unaligned.
__device__ __forceinline__ void scale_row_any(const DispatchRecvParams& p, const uint8_t* src, uint8_t* dst,
                                              const uint8_t* y, float w, int lane, float& dot) {
  const int H = p.inst.hidden, dtype = p.inst.dispatch_dtype, elem = dtype_size(dtype);
  for (int piece = lane; piece < (H + kVec - 1) / kVec; piece += kWarp) {
    const int64_t first = static_cast<int64_t>(piece) * kVec;
    const int n = H - first < kVec ? static_cast<int>(H - first) : kVec;
    float v[kVec], yv[kVec];
    load_piece(src, dtype, first, n, v);
    if (y != nullptr) load_piece(y, p.dot_y_dtype, first, n, yv);
#pragma unroll
    for (int i = 0; i < kVec; ++i) {
      if (y != nullptr) dot = __fadd_rn(dot, __fmul_rn(v[i], yv[i]));  // zeros past the row
      v[i] = __fmul_rn(v[i], w);
    }
    store_piece(dst + first * elem, elem == 4 ? encode_fp32(v) : encode_bf16(v), elem, n);
  }
}

__device__ __forceinline__ void copy_row_scaled(const DispatchRecvParams& p, int s, int j, int row, int lane) {
  const Instance& in = p.inst;
  const int H = in.hidden;
  const uint8_t* src = row_source(p, s, j, row, lane == 0);
  if (lane == 0) deliver_weight(p, s, j, row);
  uint8_t* dst = static_cast<uint8_t*>(p.out_x) + static_cast<int64_t>(row) * in.payload_bytes;
  const uint8_t* y = p.dot_y == nullptr ? nullptr
                                        : static_cast<const uint8_t*>(p.dot_y) +
                                              static_cast<int64_t>(row) * H * dtype_size(p.dot_y_dtype);
  const float w = p.row_scale[row];
  float dot = 0.0f;
  if (H % kVec == 0 && aligned(src, 16) && aligned(dst, 16) && (y == nullptr || aligned(y, 16))) {
    if (in.dispatch_dtype == kFp32) scale_row_fast_y<kFp32>(p, src, dst, y, w, H / kVec, lane, dot);
    else scale_row_fast_y<kBf16>(p, src, dst, y, w, H / kVec, lane, dot);
  } else {
    scale_row_any(p, src, dst, y, w, lane, dot);
  }
  dot = warp_sum(dot);
  if (lane == 0 && p.dot_out != nullptr) p.dot_out[row] = dot;
}

// A dequantising receive (fp8 rows, DispatchRecvParams::dequant): one warp
// stores row `row` as float(q) * scale in out_dtype, rounded once. One of
// our copies left in place is read from x and quantised first, as the pack
// would have (the same bits: the block's amax over 16 lanes, then e4m3 of
// v / scale); the walks hand those to dequant_token, which does it once per
// token, so dequant_row's from_x branch serves no walk today.
__device__ __forceinline__ void decode_fp8(const Encoded& q, float scale, float (&v)[kVec]) {
  const uint32_t w[2] = {q.lo.x, q.lo.y};
#pragma unroll
  for (int i = 0; i < kVec; ++i) {
    const auto code = static_cast<__nv_fp8_storage_t>((w[i / 4] >> (8 * (i % 4))) & 0xffu);
    v[i] = __fmul_rn(__half2float(__half(__nv_cvt_fp8_to_halfraw(code, __NV_E4M3))), scale);
  }
}

// A piece of one of our rows of x as the pack would quantise it and the
// receive dequantise it. Every lane of the warp calls it (block_scale shuffles).
__device__ __forceinline__ void round_trip_fp8(const DispatchRecvParams& p, const uint8_t* x_row, int64_t first, int n,
                                               float (&v)[kVec]) {
  load_piece(x_row, p.self_x_dtype, first, n, v);  // zeros past the row, as the pack's lanes pass
  const float scale = block_scale(v);
  decode_fp8(encode_fp8(v, scale), scale, v);
}

__device__ __forceinline__ void dequant_row(const DispatchRecvParams& p, int s, int j, int row, int lane) {
  const Instance& in = p.inst;
  const int H = in.hidden, out_bytes = dtype_size(p.out_dtype);
  const bool from_x = s == in.rank && p.self_x != nullptr;  // warp-uniform
  const uint8_t* src = row_source(p, s, j, row, lane == 0);
  if (from_x) {  // row_source strides x by the fp8 payload; x holds bf16 or fp32
    const int64_t token = p.scratch.self_copy[j] / in.topk;
    src = static_cast<const uint8_t*>(p.self_x) + token * H * dtype_size(p.self_x_dtype);
  }
  if (lane == 0) deliver_weight(p, s, j, row);
  uint8_t* dst = static_cast<uint8_t*>(p.out_x) + static_cast<int64_t>(row) * H * out_bytes;
  const int pieces = (H + kVec - 1) / kVec;
  // Lanes 0-15 and 16-31 of a round each hold one whole fp8 block (rounds start at multiples of 32 pieces).
  for (int base = 0; base < pieces; base += kWarp) {
    const int64_t first = static_cast<int64_t>(base + lane) * kVec;
    const int n = first >= H ? 0 : (H - first < kVec ? static_cast<int>(H - first) : kVec);
    float v[kVec];
    if (from_x) {
      round_trip_fp8(p, src, first, n, v);
    } else if (n > 0) {
      const float scale = load_f32(src + in.payload_bytes + (first / kFp8Block) * sizeof(float));
      decode_fp8(load_fp8_piece(src, first, n), scale, v);
    }
    if (n > 0) store_piece(dst + first * out_bytes, out_bytes == 4 ? encode_fp32(v) : encode_bf16(v), out_bytes, n);
  }
}

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
template <int kMode>
__device__ __forceinline__ void receive_row(const DispatchRecvParams& p, int s, int j, int row, const ChunkWalk& walk) {
  if constexpr (kMode == kRecvScaled) copy_row_scaled(p, s, j, row, walk.lane);
  else if constexpr (kMode == kRecvDequant) dequant_row(p, s, j, row, walk.lane);
  else copy_chunk(p, s, j, row, walk.chunk, walk.lane);
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

// Items of the walk of our copies: tokens, or copies when weighted.
template <int kMode>
__device__ __forceinline__ int self_walk_items(const DispatchRecvParams& p) {
  return *p.scratch.num_tokens * (kMode == kRecvScaled ? p.inst.topk : 1);
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

// A dequantising receive: token t's row of x through fp8 and back, once,
// stored to each of its copies' rows.
__device__ __forceinline__ void dequant_token(const DispatchRecvParams& p, int t, const TokenRows& r, int lane) {
  const Instance& in = p.inst;
  const int H = in.hidden, out_bytes = dtype_size(p.out_dtype);
  const uint8_t* src = static_cast<const uint8_t*>(p.self_x) + static_cast<int64_t>(t) * H * dtype_size(p.self_x_dtype);
  uint8_t* out = static_cast<uint8_t*>(p.out_x);
  const int pieces = (H + kVec - 1) / kVec;
  for (int base = 0; base < pieces; base += kWarp) {  // as dequant_row's rounds
    const int64_t first = static_cast<int64_t>(base + lane) * kVec;
    const int n = first >= H ? 0 : (H - first < kVec ? static_cast<int>(H - first) : kVec);
    float v[kVec];
    round_trip_fp8(p, src, first, n, v);
    const Encoded e = out_bytes == 4 ? encode_fp32(v) : encode_bf16(v);
#pragma unroll 1
    for (int k = 0; k < in.topk; ++k) {
      const int row = r.of(k);
      if (row >= 0 && n > 0) store_piece(out + (static_cast<int64_t>(row) * H + first) * out_bytes, e, out_bytes, n);
    }
  }
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
template <int kMode>
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
    }
    receive_row<kMode>(p, s, j, row, walk);
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
  const int items = by_token ? self_walk_items<kMode>(p) : static_cast<int>(p.sender_end - p.sender_first);
  for (ChunkWalk walk(recv_row_chunks(p)); walk.row < items; walk.next()) {
    int j = static_cast<int>(p.sender_first) + walk.row, row;
    if (by_token) {
      if (!walk_self<kMode>(p, segs, 1, walk.row, p.sender_first, p.sender_end, walk, &j, &row)) continue;
    } else {
      row = sender_output_row(segs, 1, L, j);
    }
    receive_row<kMode>(p, s, j, row, walk);
  }
}

template <int kMode>
__global__ void __launch_bounds__(kCopyThreads, kCopyBlocksPerSm) copy_kernel(DispatchRecvParams p) {
  extern __shared__ Segment segs[];
  kernel_prologue();
  copy_rows<kMode>(p, segs);
}

template <int kMode>
__global__ void __launch_bounds__(kCopyThreads, kCopyBlocksPerSm) copy_sender_kernel(DispatchRecvParams p) {
  extern __shared__ Segment segs[];  // the sender's [local experts]
  kernel_prologue();  // the plan, and the copies of earlier senders
  copy_sender_rows<kMode>(p, segs);
}

// Eager calls: the first block to start plans while the others wait for its
// word in device scratch, then every block copies.
static_assert(kCopyThreads == kPlanThreads, "a block of plan_copy_kernel runs the plan");
template <int kMode>
__global__ void __launch_bounds__(kCopyThreads, kCopyBlocksPerSm) plan_copy_kernel(DispatchRecvParams p) {
  extern __shared__ int32_t smem[];  // the planner: the plan's matrix; then every block's segment table
  kernel_prologue();  // the routing before us reported its status
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
    compute_plan(p, smem, true);
    __threadfence();  // every thread's plan before thread 0's word
    __syncthreads();
    if (threadIdx.x == 0) {
      st_release_gpu(p.scratch.plan_ready, epoch);
      signal_planned(p, epoch);
    }
  }
  __shared__ int planned;
  if (threadIdx.x == 0) {
    planned = wait_geq<true, kPlanPollNs>(p.scratch.plan_ready, epoch, global_timer_ns() + in.timeout_ns);
    if (!planned) report(in, kStatusTimeout);
  }
  __syncthreads();
  if (!planned || ld_acquire_gpu(p.scratch.plan_ready) < epoch) return;  // each thread acquires the plan
  copy_rows<kMode>(p, reinterpret_cast<Segment*>(smem));
}

size_t plan_smem_bytes(const Instance& in) {
  return (static_cast<size_t>(in.world) * in.num_experts + 2 * in.local_experts) * sizeof(int32_t);
}

}  // namespace

cudaError_t launch_dispatch_plan(const DispatchRecvParams& p, cudaStream_t stream) {
  const size_t smem = plan_smem_bytes(p.inst);
  cudaError_t err = allow_dynamic_smem(reinterpret_cast<const void*>(plan_kernel), smem);
  if (err != cudaSuccess) return err;
  return launch_kernel(plan_kernel, 1, kPlanThreads, smem, stream, p);
}

cudaError_t launch_copy_sender(const DispatchRecvParams& p, cudaStream_t stream) {
  const Instance& in = p.inst;
  const int64_t rows = p.sender_end - p.sender_first;
  if (p.sender < 0 || p.sender >= in.world || p.sender_first < 0 || rows <= 0) return cudaErrorInvalidValue;
  const size_t smem = static_cast<size_t>(in.local_experts) * sizeof(Segment);
  const auto kernel = p.dequant ? copy_sender_kernel<kRecvDequant>
                      : p.row_scale != nullptr ? copy_sender_kernel<kRecvScaled>
                                               : copy_sender_kernel<kRecvCopy>;
  cudaError_t err = allow_dynamic_smem(reinterpret_cast<const void*>(kernel), smem);
  if (err != cudaSuccess) return err;
  const int blocks = persistent_blocks(rows * recv_row_chunks(p), kCopyThreads / kWarp, kCopyBlocksPerSm);
  return launch_kernel(kernel, blocks, kCopyThreads, smem, stream, p);
}

cudaError_t launch_dispatch_recv(const DispatchRecvParams& p, cudaStream_t stream) {
  const Instance& in = p.inst;
  const size_t plan_smem = plan_smem_bytes(in);
  const size_t seg_smem = static_cast<size_t>(in.num_experts) * sizeof(Segment);
  const int blocks = persistent_blocks(p.max_output_rows * recv_row_chunks(p), kCopyThreads / kWarp, kCopyBlocksPerSm);
  if (p.fused) {
    const size_t smem = plan_smem > seg_smem ? plan_smem : seg_smem;
    const auto kernel = p.dequant ? plan_copy_kernel<kRecvDequant>
                        : p.row_scale != nullptr ? plan_copy_kernel<kRecvScaled>
                                                 : plan_copy_kernel<kRecvCopy>;
    cudaError_t err = allow_dynamic_smem(reinterpret_cast<const void*>(kernel), smem);
    if (err != cudaSuccess) return err;
    return launch_kernel(kernel, blocks, kCopyThreads, smem, stream, p);
  }
  cudaError_t err = allow_dynamic_smem(reinterpret_cast<const void*>(plan_kernel), plan_smem);
  if (err != cudaSuccess) return err;
  if ((err = launch_kernel(plan_kernel, 1, kPlanThreads, plan_smem, stream, p)) != cudaSuccess) return err;
  const auto copy = p.dequant ? copy_kernel<kRecvDequant>
                    : p.row_scale != nullptr ? copy_kernel<kRecvScaled>
                                             : copy_kernel<kRecvCopy>;
  err = allow_dynamic_smem(reinterpret_cast<const void*>(copy), seg_smem);
  if (err != cudaSuccess) return err;
  return launch_kernel(copy, blocks, kCopyThreads, seg_smem, stream, p);
}

}  // namespace moe_a2a::a2a::cuda
