// How dispatch send turns a piece of a token into its stored form, shared by
// its two packers: lanes storing to every destination (dispatch_send.cu) and
// rows built in shared memory for the bulk copy engine (dispatch_bulk.cu).
// Both give the same bits as reference.quantize_fp8.
#pragma once

#include "rows.cuh"

namespace moe_a2a::a2a::cuda {

// What a packer does to a piece; one instantiation each, so each holds only
// its own registers.
enum PackMode : int { kPackQuantize = 0, kPackFp8 = 1, kPackConvert = 2 };

// Bytes of one element as stored in a dispatch row.
__device__ __forceinline__ int pack_out_bytes(const Instance& in, int mode) {
  if (mode != kPackConvert) return 1;
  return in.dispatch_dtype == static_cast<int>(DType::kFp32) ? 4 : 2;
}

// Raw fp8 bytes [first, first + n) of an already-quantised row.
__device__ __forceinline__ Encoded load_fp8_piece(const uint8_t* row, int64_t first, int n) {
  const uint8_t* p = row + first;
  if (n == kVec && aligned(p, 8)) {
    const uint2 v = *reinterpret_cast<const uint2*>(p);
    return {make_uint4(v.x, v.y, 0, 0), make_uint4(0, 0, 0, 0)};
  }
  uint32_t w[2] = {0, 0};
#pragma unroll
  for (int i = 0; i < kVec; ++i)
    if (i < n) w[i / 4] |= static_cast<uint32_t>(p[i]) << (8 * (i % 4));
  return {make_uint4(w[0], w[1], 0, 0), make_uint4(0, 0, 0, 0)};
}

// The scale of the fp8 block holding this lane's piece: amax over the block's
// kLanesPerScaleBlock lanes over kFp8Max. Every lane of the warp calls it
// (lanes past the row pass zeros, which leave an amax unchanged).
__device__ __forceinline__ float block_scale(const float (&v)[kVec]) {
  float amax = 0.0f;
#pragma unroll
  for (int i = 0; i < kVec; ++i) amax = fmaxf(amax, fabsf(v[i]));
#pragma unroll
  for (int offset = kLanesPerScaleBlock / 2; offset > 0; offset /= 2)
    amax = fmaxf(amax, __shfl_xor_sync(kFullMask, amax, offset));
  return amax > 0.0f ? __fdiv_rn(amax, kFp8Max) : 1.0f;
}

// Values of a bf16 or fp32 piece in their stored form: converted, or
// quantised with the block's scale.
template <int kMode>
__device__ __forceinline__ Encoded encode_values(const float (&v)[kVec], int out_bytes, float& scale) {
  static_assert(kMode != kPackFp8, "fp8 input is stored as it is");
  scale = 1.0f;
  if constexpr (kMode == kPackConvert) return out_bytes == 4 ? encode_fp32(v) : encode_bf16(v);
  scale = block_scale(v);
  return encode_fp8(v, scale);
}

// Piece `first` of token t in its stored form (and the block's scale for
// fp8). Every lane of the warp calls it (the amax shuffles need all lanes).
template <int kMode>
__device__ __forceinline__ Encoded encode_piece(const DispatchSendParams& p, int t, int64_t first, int n,
                                                int out_bytes, float& scale) {
  const int H = p.inst.hidden;
  if constexpr (kMode == kPackFp8) {
    scale = 1.0f;
    if (n > 0 && first % kFp8Block == 0)
      scale = p.x_scale[static_cast<size_t>(t) * p.inst.num_scales + first / kFp8Block];
    return load_fp8_piece(static_cast<const uint8_t*>(p.x) + static_cast<size_t>(t) * H, first, n);
  } else {
    const size_t elem = p.x_dtype == static_cast<int>(DType::kBf16) ? 2 : 4;
    float v[kVec];
    load_piece(static_cast<const uint8_t*>(p.x) + static_cast<size_t>(t) * H * elem, p.x_dtype, first, n, v);
    return encode_values<kMode>(v, out_bytes, scale);
  }
}

}  // namespace moe_a2a::a2a::cuda
