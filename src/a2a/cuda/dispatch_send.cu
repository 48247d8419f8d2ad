// Dispatch, send half (docs/protocol.md, "Send order" and "Dispatch"):
// 1. routing (dispatch_route.cu): our routing row, published to same-node
//    peers and the proxy, and the send row of every copy;
// 2. pack_kernel (persistent, one slice of a token per warp at a time): reads
//    each piece once, converts or quantises it once, and stores it to each of
//    the token's top-k destinations, which routing wrote per copy: a
//    same-node peer's private slot, our device send section (same-node
//    overflow, pulled by the peer), or our fabric send section (remote).
//    Persistent blocks, because each block ends with a system-scope fence
//    before it is counted: one per resident block, not one per token.
#include <cuda_runtime.h>

#include "launch.h"
#include "memory.cuh"
#include "rows.cuh"
#include "signal.cuh"

namespace moe_a2a::a2a::cuda {
namespace {

constexpr int kPackThreads = 256;
// Blocks a multiprocessor: 40 warps of up to 48 registers. Warps run
// independently (no block barriers), each on its own (token, slice) items.
constexpr int kPackBlocksPerSm = 5;
constexpr int kPackWarps = kPackThreads / kWarp;

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

// What pack_kernel does to a piece; one instantiation each, so each holds
// only its own registers.
enum PackMode : int { kPackQuantize = 0, kPackFp8 = 1, kPackConvert = 2 };

// Piece `first` of token t in its stored form: converted or quantised (and
// the block's scale for fp8). Every lane of the warp calls it (the amax
// shuffles need all lanes).
template <int kMode>
__device__ __forceinline__ Encoded encode_piece(const DispatchSendParams& p, int t, int64_t first, int n,
                                                int out_bytes, float& scale) {
  const int H = p.inst.hidden;
  scale = 1.0f;
  if constexpr (kMode == kPackFp8) {
    if (n > 0 && first % kFp8Block == 0)
      scale = p.x_scale[static_cast<size_t>(t) * p.inst.num_scales + first / kFp8Block];
    return load_fp8_piece(static_cast<const uint8_t*>(p.x) + static_cast<size_t>(t) * H, first, n);
  } else {
    const size_t elem = p.x_dtype == static_cast<int>(DType::kBf16) ? 2 : 4;
    float v[kVec];
    load_piece(static_cast<const uint8_t*>(p.x) + static_cast<size_t>(t) * H * elem, p.x_dtype, first, n, v);
    if constexpr (kMode == kPackConvert) return out_bytes == 4 ? encode_fp32(v) : encode_bf16(v);
    float amax = 0.0f;
#pragma unroll
    for (int i = 0; i < kVec; ++i) amax = fmaxf(amax, fabsf(v[i]));
#pragma unroll
    for (int offset = kLanesPerScaleBlock / 2; offset > 0; offset /= 2)
      amax = fmaxf(amax, __shfl_xor_sync(kFullMask, amax, offset));
    scale = amax > 0.0f ? __fdiv_rn(amax, kFp8Max) : 1.0f;
    return encode_fp8(v, scale);
  }
}

// Work item: one warp, kWarp consecutive pieces of one token. The warp loads
// the token's destinations (lane k holds copy k's) alongside the piece,
// converts or quantises its piece once and stores it to every destination.
// (Writes are most of this kernel's traffic, and write bandwidth is what
// bounds it: prefetching the next item's load changed nothing measurable.)
template <int kMode>
__global__ void __launch_bounds__(kPackThreads, kPackBlocksPerSm) pack_kernel(DispatchSendParams p) {
  kernel_prologue();
  const Instance& in = p.inst;
  const int K = in.topk, H = in.hidden;
  const int tokens = *p.scratch.num_tokens;
  constexpr bool fp8 = kMode != kPackConvert;
  const int out_bytes = fp8 ? 1 : (in.dispatch_dtype == static_cast<int>(DType::kFp32) ? 4 : 2);
  const int pieces = (H + kVec - 1) / kVec;
  const int slices = (pieces + kWarp - 1) / kWarp;
  const int lane = threadIdx.x % kWarp;
  // Items advance by a fixed stride: (token, slice) is stepped, not divided
  // out of an item counter each time.
  const int stride = gridDim.x * kPackWarps;
  const int stride_t = stride / slices, stride_s = stride % slices;
  const int item = blockIdx.x * kPackWarps + threadIdx.x / kWarp;
  for (int t = item / slices, slice = item % slices; t < tokens;) {
    uint8_t* const* dst = p.scratch.copy_dst + static_cast<int64_t>(t) * K;
    uint8_t* mine = lane < K ? dst[lane] : nullptr;  // issued before the piece's load, used after it
    const int64_t first = static_cast<int64_t>(slice * kWarp + lane) * kVec;
    const int n = first >= H ? 0 : (H - first < kVec ? static_cast<int>(H - first) : kVec);
    float scale;
    const Encoded enc = encode_piece<kMode>(p, t, first, n, out_bytes, scale);
    const bool scale_lane = fp8 && n > 0 && first % kFp8Block == 0;
    for (int k0 = 0; k0 < K; k0 += kWarp) {
      if (k0 > 0) mine = k0 + lane < K ? dst[k0 + lane] : nullptr;  // topk > 32
      const int count = K - k0 < kWarp ? K - k0 : kWarp;
      for (int k = 0; k < count; ++k) {
        uint8_t* row = reinterpret_cast<uint8_t*>(__shfl_sync(kFullMask, reinterpret_cast<uintptr_t>(mine), k));
        if (row == nullptr) continue;  // dropped copy (warp-uniform)
        if (n > 0) store_piece(row + first * out_bytes, enc, out_bytes, n);
        if (scale_lane) store_f32(row + in.payload_bytes + (first / kFp8Block) * sizeof(float), scale);
      }
    }
    t += stride_t;
    slice += stride_s;
    if (slice >= slices) slice -= slices, ++t;
  }
  signal_when_grid_done(in, p.scratch.done_blocks, kFlagDispatch, in.proxy.packed);
}

}  // namespace

cudaError_t launch_dispatch_send(const DispatchSendParams& p, cudaStream_t stream) {
  if (p.inst.topk > kMaxTopk) return cudaErrorInvalidValue;
  cudaError_t err = launch_route(p, stream);
  if (err != cudaSuccess) return err;
  const int slices = ((p.inst.hidden + kVec - 1) / kVec + kWarp - 1) / kWarp;
  const int blocks = persistent_blocks(static_cast<int64_t>(p.inst.max_tokens) * slices, kPackWarps, kPackBlocksPerSm);
  if (p.inst.dispatch_dtype != static_cast<int>(DType::kFp8))
    return launch_kernel(pack_kernel<kPackConvert>, blocks, kPackThreads, 0, stream, p);
  if (p.x_dtype == static_cast<int>(DType::kFp8))
    return launch_kernel(pack_kernel<kPackFp8>, blocks, kPackThreads, 0, stream, p);
  return launch_kernel(pack_kernel<kPackQuantize>, blocks, kPackThreads, 0, stream, p);
}

}  // namespace moe_a2a::a2a::cuda
