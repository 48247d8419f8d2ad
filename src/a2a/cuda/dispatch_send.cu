// Dispatch, send half (docs/protocol.md, "Send order" and "Dispatch"):
// 1. route_kernel (one block): copies per expert (our routing row), published
//    to every same-node peer and the proxy; then the send row of every copy.
//    Send order is (rank, local expert, token, k), and experts are contiguous
//    per rank, so a copy's send row is first[e] + its rank among the copies of
//    expert e in (t, k) order: a stable counting sort by expert.
// 2. pack_kernel (one block per token): reads the token once, converts or
//    quantises it once, and stores it to each of its top-k destinations:
//    a same-node peer's private slot, our device send section (same-node
//    overflow, pulled by the peer), or our fabric send section (remote).
#include <cuda_runtime.h>

#include "launch.h"
#include "memory.cuh"
#include "rows.cuh"
#include "scan.cuh"
#include "signal.cuh"

namespace moe_a2a::a2a::cuda {
namespace {

constexpr int kRouteThreads = 1024;
constexpr int kRouteWarps = kRouteThreads / kWarp;
constexpr int kPackMaxThreads = 1024;

__device__ __forceinline__ int expert_of(const DispatchSendParams& p, int64_t i) {
  const int64_t e = p.ids_are_64bit ? static_cast<const int64_t*>(p.topk_ids)[i] : static_cast<const int32_t*>(p.topk_ids)[i];
  return e >= 0 && e < p.inst.num_experts ? static_cast<int>(e) : -1;
}

// hist: [kRouteWarps][E] in dynamic shared memory, then counts [E], first [E].
__global__ void __launch_bounds__(kRouteThreads) route_kernel(DispatchSendParams p) {
  extern __shared__ int32_t smem[];
  const Instance& in = p.inst;
  const int E = in.num_experts, K = in.topk, L = in.local_experts;
  int32_t* hist = smem;
  int32_t* counts = hist + kRouteWarps * E;
  int32_t* first = counts + E;
  __shared__ uint64_t epoch;
  __shared__ int tokens;
  __shared__ int dropped;
  const int tid = threadIdx.x, warp = tid / kWarp, lane = tid % kWarp;

  if (tid == 0) {
    epoch = *in.epoch + 1;
    *in.epoch = epoch;
    int t = p.num_tokens_ptr != nullptr ? *p.num_tokens_ptr : p.num_tokens;
    tokens = t < 0 ? 0 : (t > in.max_tokens ? in.max_tokens : t);
    *p.scratch.num_tokens = tokens;
    *reinterpret_cast<volatile int32_t*>(in.status) = kStatusOk;  // a new call
    dropped = 0;
  }
  for (int i = tid; i < kRouteWarps * E; i += kRouteThreads) hist[i] = 0;
  __syncthreads();

  // Each warp owns a contiguous chunk of the copies, so walking it twice in
  // order gives stable ranks.
  const int64_t copies = static_cast<int64_t>(tokens) * K;
  const int64_t chunk = (copies + kRouteWarps - 1) / kRouteWarps;
  const int64_t begin = warp * chunk, end = begin + chunk < copies ? begin + chunk : copies;
  const unsigned lanes_below = (1u << lane) - 1;

  for (int64_t base = begin; base < end; base += kWarp) {  // warp-uniform bounds
    const int64_t i = base + lane;
    const int e = i < end ? expert_of(p, i) : -1;
    if (i < end && e < 0) dropped = 1;
    const unsigned same = __match_any_sync(kFullMask, e);
    if (e >= 0 && lane == __ffs(same) - 1) hist[warp * E + e] += __popc(same);
  }
  __syncthreads();

  // Per expert: where each warp's copies start among the expert's copies.
  for (int e = tid; e < E; e += kRouteThreads) {
    int32_t acc = 0;
    for (int w = 0; w < kRouteWarps; ++w) {
      const int32_t c = hist[w * E + e];
      hist[w * E + e] = acc;
      acc += c;
    }
    counts[e] = acc;
  }
  __syncthreads();
  block_exclusive_scan<kRouteThreads, int32_t>(
      E, [&](int e) { return counts[e]; }, [&](int e, int32_t v) { first[e] = v; });

  // Publish the routing row: into every same-node host workspace (ours too,
  // where the proxy scatters it to remote peers).
  for (int r = 0; r < in.world; ++r) {
    if (!same_node(in, r)) continue;
    uint32_t* row = routing_row(in.peers[r].host, in.layout, in.rank, E);
    for (int e = tid; e < E; e += kRouteThreads) row[e] = static_cast<uint32_t>(counts[e]);
  }
  for (int r = tid; r <= in.world; r += kRouteThreads)
    p.scratch.send_start[r] = r < in.world ? first[r * L] : static_cast<int64_t>(copies);
  __syncthreads();
  if (tid == 0) {
    fence_sys();
    for (int r = 0; r < in.world; ++r)
      if (same_node(in, r)) st_release_sys(flag_ptr(in.peers[r].host, in.layout, in.rank, kFlagRoute), epoch);
    if (in.proxy.route_ready != nullptr) st_release_sys(in.proxy.route_ready, epoch);
    if (dropped) report(in, kStatusBadExpert);
  }

  // Second walk: send rows.
  for (int e = tid; e < E; e += kRouteThreads)
    for (int w = 0; w < kRouteWarps; ++w) hist[w * E + e] += first[e];
  __syncthreads();
  for (int64_t base = begin; base < end; base += kWarp) {
    const int64_t i = base + lane;
    const int e = i < end ? expert_of(p, i) : -1;
    const unsigned same = __match_any_sync(kFullMask, e);
    const int slot = e >= 0 ? hist[warp * E + e] + __popc(same & lanes_below) : -1;
    __syncwarp();
    if (e >= 0 && lane == __ffs(same) - 1) hist[warp * E + e] += __popc(same);
    __syncwarp();
    if (i < end) {
      p.scratch.slots[i] = slot;
      p.scratch.copy_rank[i] = e >= 0 ? e / L : -1;
    }
  }
}

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

__global__ void __launch_bounds__(kPackMaxThreads) pack_kernel(DispatchSendParams p) {
  const Instance& in = p.inst;
  const int K = in.topk, H = in.hidden;
  const int t = blockIdx.x;
  __shared__ uint8_t* dst[kMaxTopk];
  if (t < *p.scratch.num_tokens) {
    if (threadIdx.x < K) dst[threadIdx.x] = destination(p, static_cast<int64_t>(t) * K + threadIdx.x);
    __syncthreads();

    const bool fp8 = in.dispatch_dtype == static_cast<int>(DType::kFp8);
    const int out_bytes = fp8 ? 1 : (in.dispatch_dtype == static_cast<int>(DType::kFp32) ? 4 : 2);
    const uint8_t* x_row = static_cast<const uint8_t*>(p.x) + static_cast<size_t>(t) * H * dtype_size(p.x_dtype);
    const int pieces = (H + kVec - 1) / kVec;
    const int rounds = (pieces + blockDim.x - 1) / blockDim.x;  // block-uniform: shuffles below need all lanes
    for (int round = 0; round < rounds; ++round) {
      const int64_t first = (static_cast<int64_t>(round) * blockDim.x + threadIdx.x) * kVec;
      const int n = first >= H ? 0 : (H - first < kVec ? static_cast<int>(H - first) : kVec);
      Encoded enc;
      float scale = 1.0f;
      if (fp8 && p.x_dtype == static_cast<int>(DType::kFp8)) {
        enc = load_fp8_piece(x_row, first, n);
        if (n > 0 && first % kFp8Block == 0) scale = p.x_scale[static_cast<size_t>(t) * in.num_scales + first / kFp8Block];
      } else {
        float v[kVec];
        load_piece(x_row, p.x_dtype, first, n, v);
        if (fp8) {
          float amax = 0.0f;
#pragma unroll
          for (int i = 0; i < kVec; ++i) amax = fmaxf(amax, fabsf(v[i]));
#pragma unroll
          for (int offset = kLanesPerScaleBlock / 2; offset > 0; offset /= 2)
            amax = fmaxf(amax, __shfl_xor_sync(kFullMask, amax, offset));
          scale = amax > 0.0f ? __fdiv_rn(amax, kFp8Max) : 1.0f;
          enc = encode_fp8(v, scale);
        } else {
          enc = out_bytes == 4 ? encode_fp32(v) : encode_bf16(v);
        }
      }
      if (n == 0) continue;
      for (int k = 0; k < K; ++k) {
        uint8_t* row = dst[k];
        if (row == nullptr) continue;
        store_piece(row + first * out_bytes, enc, out_bytes, n);
        if (fp8 && first % kFp8Block == 0) store_f32(row + in.payload_bytes + (first / kFp8Block) * sizeof(float), scale);
      }
    }
  }
  signal_when_grid_done(in, p.scratch.done_blocks, kFlagDispatch, in.proxy.packed);
}

}  // namespace

cudaError_t launch_dispatch_send(const DispatchSendParams& p, cudaStream_t stream) {
  if (p.inst.topk > kMaxTopk) return cudaErrorInvalidValue;
  const size_t route_smem = (static_cast<size_t>(kRouteWarps) + 2) * p.inst.num_experts * sizeof(int32_t);
  cudaError_t err = cudaFuncSetAttribute(route_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(route_smem));
  if (err != cudaSuccess) return err;
  route_kernel<<<1, kRouteThreads, route_smem, stream>>>(p);
  if ((err = cudaGetLastError()) != cudaSuccess) return err;
  const int pieces = (p.inst.hidden + kVec - 1) / kVec;
  const int threads = round_up_threads(pieces, kPackMaxThreads);
  pack_kernel<<<p.inst.max_tokens, threads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace moe_a2a::a2a::cuda
