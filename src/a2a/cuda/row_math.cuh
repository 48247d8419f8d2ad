// Dispatch, receive half: the training row math, one warp a row. A weighted
// receive (row_scale: the weighted combine's backward) stores each row
// scaled and its dot product with a row of another tensor; a dequantising
// receive (fp8 rows) stores each row as float(q) * scale in bf16 or fp32.
#pragma once

#include "recv_rows.cuh"

namespace moe_a2a::a2a::cuda {

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
__device__ __forceinline__ void scale_row_fast(const uint8_t* src, uint8_t* dst, const uint8_t* y, float w, int pieces,
                                               int lane, float& dot) {
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

template <bool kWide = true>  // recv_rows.cuh's source_row
__device__ __forceinline__ void copy_row_scaled(const DispatchRecvParams& p, int s, int j, int row, int lane) {
  const Instance& in = p.inst;
  const int H = in.hidden;
  const uint8_t* src = row_source<kWide>(p, s, j, row, lane == 0);
  if (lane == 0) deliver_weight<kWide>(p, s, j, row);
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
// stores row `row` as float(q) * scale in out_dtype, rounded once. Our
// copies left in place in x never come here: the walks hand them to
// dequant_token, which quantises each token's row once, as the pack would
// have (the same bits: the block's amax over 16 lanes, then e4m3 of v /
// scale), and dequantises it.
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

template <bool kWide = true>  // recv_rows.cuh's source_row
__device__ __forceinline__ void dequant_row(const DispatchRecvParams& p, int s, int j, int row, int lane) {
  const Instance& in = p.inst;
  const int H = in.hidden, out_bytes = dtype_size(p.out_dtype);
  const uint8_t* src = row_source<kWide>(p, s, j, row, lane == 0);
  if (lane == 0) deliver_weight<kWide>(p, s, j, row);
  uint8_t* dst = static_cast<uint8_t*>(p.out_x) + static_cast<int64_t>(row) * H * out_bytes;
  for (int64_t first = static_cast<int64_t>(lane) * kVec; first < H; first += kWarp * kVec) {
    const int n = H - first < kVec ? static_cast<int>(H - first) : kVec;
    const float scale = load_f32(src + in.payload_bytes + (first / kFp8Block) * sizeof(float));
    float v[kVec];
    decode_fp8(load_fp8_piece(src, first, n), scale, v);
    store_piece(dst + first * out_bytes, out_bytes == 4 ? encode_fp32(v) : encode_bf16(v), out_bytes, n);
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
  // Every lane takes part in each round (block_scale shuffles): lanes 0-15 and
  // 16-31 of a round each hold one whole fp8 block (rounds start at multiples
  // of 32 pieces).
  for (int base = 0; base < pieces; base += kWarp) {
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

}  // namespace moe_a2a::a2a::cuda
