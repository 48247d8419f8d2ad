// Combine, receive half: waits for the combine flag of every same-node
// receiver and, with remote peers, the proxy's combine_done; then for each
// token out[t] = sum_k w[t,k] * row(slot[t,k]), in fp32 with k ascending and
// no fused multiply-add (round the product, then the sum, as the reference
// does), stored in the combine dtype.
#include <cuda_runtime.h>

#include "launch.h"
#include "memory.cuh"
#include "rows.cuh"

namespace moe_a2a::a2a::cuda {
namespace {

constexpr int kReduceMaxThreads = 1024;
constexpr int kRowsInFlight = 4;  // loads issued before the first is used

__global__ void wait_kernel(CombineRecvParams p) {
  const Instance& in = p.inst;
  const uint64_t epoch = *reinterpret_cast<volatile uint64_t*>(in.epoch);
  const uint64_t deadline = global_timer_ns() + in.timeout_ns;
  for (int r = threadIdx.x; r < in.world; r += blockDim.x)
    if (same_node(in, r) && !wait_geq(flag_ptr(in.device_ws, in.layout, r, kFlagCombine), epoch, deadline))
      report(in, kStatusTimeout);
  if (threadIdx.x != 0 || !in.has_remote) return;
  constexpr unsigned kSleepNs = 256;
  while (ld_acquire_sys(in.proxy.combine_done) < epoch) {
    if (ld_acquire_sys(in.proxy.failed) != 0) return report(in, kStatusProxyFailed);
    if (global_timer_ns() > deadline) return report(in, kStatusTimeout);
    __nanosleep(kSleepNs);
  }
}

__global__ void __launch_bounds__(kReduceMaxThreads) reduce_kernel(CombineRecvParams p) {
  const Instance& in = p.inst;
  const Layout& l = in.layout;
  const int K = in.topk, H = in.hidden;
  const int t = blockIdx.x;
  if (t >= *p.scratch.num_tokens) return;
  __shared__ const uint8_t* src[kMaxTopk];
  __shared__ float weight[kMaxTopk];
  if (threadIdx.x < K) {
    const int64_t i = static_cast<int64_t>(t) * K + threadIdx.x;
    const int slot = p.scratch.slots[i];
    const uint8_t* rows = nullptr;
    if (slot >= 0) {
      const uint8_t* ws = same_node(in, p.scratch.copy_rank[i]) ? in.device_ws : in.fabric_ws;
      rows = ws + l.combine_recv + static_cast<size_t>(slot) * l.combine_row;
    }
    src[threadIdx.x] = rows;
    weight[threadIdx.x] = p.weights[i];
  }
  __syncthreads();

  const int out_bytes = dtype_size(in.combine_dtype);
  uint8_t* out_row = static_cast<uint8_t*>(p.out) + static_cast<size_t>(t) * H * out_bytes;
  const int pieces = (H + kVec - 1) / kVec;
  for (int piece = threadIdx.x; piece < pieces; piece += blockDim.x) {
    const int64_t first = static_cast<int64_t>(piece) * kVec;
    const int n = H - first < kVec ? static_cast<int>(H - first) : kVec;
    float acc[kVec];
#pragma unroll
    for (int i = 0; i < kVec; ++i) acc[i] = 0.0f;
    for (int k0 = 0; k0 < K; k0 += kRowsInFlight) {
      float v[kRowsInFlight][kVec];
#pragma unroll
      for (int u = 0; u < kRowsInFlight; ++u)
        if (k0 + u < K && src[k0 + u] != nullptr) load_piece(src[k0 + u], in.combine_dtype, first, n, v[u]);
#pragma unroll
      for (int u = 0; u < kRowsInFlight; ++u) {
        if (k0 + u >= K || src[k0 + u] == nullptr) continue;
        const float w = weight[k0 + u];
#pragma unroll
        for (int i = 0; i < kVec; ++i) acc[i] = __fadd_rn(acc[i], __fmul_rn(w, v[u][i]));
      }
    }
    const Encoded enc = out_bytes == 4 ? encode_fp32(acc) : encode_bf16(acc);
    store_piece(out_row + first * out_bytes, enc, out_bytes, n);
  }
}

}  // namespace

cudaError_t launch_combine_recv(const CombineRecvParams& p, cudaStream_t stream) {
  constexpr int kWaitThreads = 32;
  wait_kernel<<<1, kWaitThreads, 0, stream>>>(p);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  const int pieces = (p.inst.hidden + kVec - 1) / kVec;
  reduce_kernel<<<p.inst.max_tokens, round_up_threads(pieces, kReduceMaxThreads), 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace moe_a2a::a2a::cuda
