// Dispatch, send half (docs/protocol.md, "Send order" and "Dispatch"):
// 1. routing (dispatch_route.cu): our routing row, published to same-node
//    peers and the proxy, and the send row of every copy;
// 2. pack_kernel (persistent, one token per block at a time): reads the token
//    once, converts or quantises it once, and stores it to each of its top-k
//    destinations: a same-node peer's private slot, our device send section
//    (same-node overflow, pulled by the peer), or our fabric send section
//    (remote). Persistent blocks, because each block ends with a system-scope
//    fence before it is counted: one per resident block, not one per token.
#include <cuda_runtime.h>

#include "launch.h"
#include "memory.cuh"
#include "rows.cuh"
#include "signal.cuh"

namespace moe_a2a::a2a::cuda {
namespace {

constexpr int kPackMaxThreads = 1024;
constexpr int kPackBlocksPerSm = 2;  // 896-thread blocks (hidden 7168): two fit per multiprocessor

// Where copy (t, k) goes; nullptr when it was dropped.
__device__ __forceinline__ uint8_t* destination(const DispatchSendParams& p, int64_t i) {
  const Instance& in = p.inst;
  const Layout& l = in.layout;
  const int slot = p.scratch.slots[i];
  if (slot < 0) return nullptr;
  const int r = p.scratch.copy_rank[i];
  const int64_t j = slot - p.scratch.send_start[r];
  const size_t row = l.dispatch_row;
  if (!same_node(in, r)) return in.fabric_ws + l.send + slot * row;
  if (j < in.max_private)
    return in.peers[r].device + l.private_rows + (static_cast<size_t>(in.rank) * in.max_private + j) * row;
  return in.device_ws + l.send + slot * row;  // the peer pulls it
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

// What pack_kernel does to a piece; one instantiation each, so each holds
// only its own registers (two 896-thread blocks a multiprocessor need <= 32).
enum PackMode : int { kPackQuantize = 0, kPackFp8 = 1, kPackConvert = 2 };

// Piece `first` of an input row: floats to convert or quantise (v), or, for
// already-quantised input, its fp8 bytes (raw) and its block's scale.
template <int kMode>
__device__ __forceinline__ void load_input(const DispatchSendParams& p, const uint8_t* x_row, int t, int64_t first,
                                           int n, float (&v)[kVec], Encoded& raw, float& scale) {
  scale = 1.0f;
  if constexpr (kMode == kPackFp8) {
    raw = load_fp8_piece(x_row, first, n);
    if (n > 0 && first % kFp8Block == 0)
      scale = p.x_scale[static_cast<size_t>(t) * p.inst.num_scales + first / kFp8Block];
  } else {
    load_piece(x_row, p.x_dtype, first, n, v);
  }
}

// Converts or quantises one loaded piece and stores it to every destination.
// Every thread of the block calls it (the amax shuffles need all lanes).
template <int kMode>
__device__ __forceinline__ void store_copies(const Instance& in, uint8_t* const* dst, int64_t first, int n,
                                             int out_bytes, const float (&v)[kVec], Encoded enc, float scale) {
  constexpr bool fp8 = kMode != kPackConvert;
  if constexpr (kMode == kPackQuantize) {
    float amax = 0.0f;
#pragma unroll
    for (int i = 0; i < kVec; ++i) amax = fmaxf(amax, fabsf(v[i]));
#pragma unroll
    for (int offset = kLanesPerScaleBlock / 2; offset > 0; offset /= 2)
      amax = fmaxf(amax, __shfl_xor_sync(kFullMask, amax, offset));
    scale = amax > 0.0f ? __fdiv_rn(amax, kFp8Max) : 1.0f;
    enc = encode_fp8(v, scale);
  } else if constexpr (kMode == kPackConvert) {
    enc = out_bytes == 4 ? encode_fp32(v) : encode_bf16(v);
  }
  if (n == 0) return;
  for (int k = 0; k < in.topk; ++k) {
    uint8_t* row = dst[k];
    if (row == nullptr) continue;
    store_piece(row + first * out_bytes, enc, out_bytes, n);
    if (fp8 && first % kFp8Block == 0) store_f32(row + in.payload_bytes + (first / kFp8Block) * sizeof(float), scale);
  }
}

template <int kMode>
__global__ void __launch_bounds__(kPackMaxThreads) pack_kernel(DispatchSendParams p) {
  kernel_prologue();
  const Instance& in = p.inst;
  const int K = in.topk, H = in.hidden;
  const int tokens = *p.scratch.num_tokens;
  const int out_bytes = kMode != kPackConvert ? 1 : (in.dispatch_dtype == static_cast<int>(DType::kFp32) ? 4 : 2);
  const int pieces = (H + kVec - 1) / kVec;
  const int rounds = (pieces + blockDim.x - 1) / blockDim.x;  // block-uniform: shuffles need all lanes
  const size_t x_row_bytes = static_cast<size_t>(H) * dtype_size(p.x_dtype);
  __shared__ uint8_t* dst[kMaxTopk];
  for (int t = blockIdx.x; t < tokens; t += gridDim.x) {
    const uint8_t* x_row = static_cast<const uint8_t*>(p.x) + static_cast<size_t>(t) * x_row_bytes;
    // Round 0 of the token is loaded before the barriers, so that its latency
    // overlaps the destination lookups (dependent loads) of threads 0..K-1.
    const int64_t first0 = static_cast<int64_t>(threadIdx.x) * kVec;
    const int n0 = first0 >= H ? 0 : (H - first0 < kVec ? static_cast<int>(H - first0) : kVec);
    float v[kVec];
    Encoded raw{};
    float scale;
    load_input<kMode>(p, x_row, t, first0, n0, v, raw, scale);
    __syncthreads();  // the previous token's stores have read dst
    for (int k = threadIdx.x; k < K; k += blockDim.x) dst[k] = destination(p, static_cast<int64_t>(t) * K + k);
    __syncthreads();
    store_copies<kMode>(in, dst, first0, n0, out_bytes, v, raw, scale);
    for (int round = 1; round < rounds; ++round) {  // hidden > kVec * blockDim.x only
      const int64_t first = (static_cast<int64_t>(round) * blockDim.x + threadIdx.x) * kVec;
      const int n = first >= H ? 0 : (H - first < kVec ? static_cast<int>(H - first) : kVec);
      load_input<kMode>(p, x_row, t, first, n, v, raw, scale);
      store_copies<kMode>(in, dst, first, n, out_bytes, v, raw, scale);
    }
  }
  signal_when_grid_done(in, p.scratch.done_blocks, kFlagDispatch, in.proxy.packed);
}

}  // namespace

cudaError_t launch_dispatch_send(const DispatchSendParams& p, cudaStream_t stream) {
  if (p.inst.topk > kMaxTopk) return cudaErrorInvalidValue;
  cudaError_t err = launch_route(p, stream);
  if (err != cudaSuccess) return err;
  const int pieces = (p.inst.hidden + kVec - 1) / kVec;
  const int threads = round_up_threads(pieces, kPackMaxThreads);
  const int blocks = persistent_blocks(p.inst.max_tokens, 1, kPackBlocksPerSm);
  if (p.inst.dispatch_dtype != static_cast<int>(DType::kFp8))
    return launch_kernel(pack_kernel<kPackConvert>, blocks, threads, 0, stream, p);
  if (p.x_dtype == static_cast<int>(DType::kFp8))
    return launch_kernel(pack_kernel<kPackFp8>, blocks, threads, 0, stream, p);
  return launch_kernel(pack_kernel<kPackQuantize>, blocks, threads, 0, stream, p);
}

}  // namespace moe_a2a::a2a::cuda
