// Combine, receive half: waits for the combine flag of every same-node
// receiver and, with remote peers, the proxy's combine_done; then for each
// token out[t] = sum_k w[t,k] * row(slot[t,k]), in fp32 with k ascending and
// no fused multiply-add (round the product, then the sum, as the reference
// does), stored in the combine dtype. A row per rank (already weighted where
// the experts are) is added once, times 1, at the token's first k on that rank.
#include <cuda_runtime.h>

#include "launch.h"
#include "memory.cuh"
#include "rows.cuh"
#include "signal.cuh"
#include "tuning.h"

namespace moe_a2a::a2a::cuda {
namespace {

// Launch tuning: ReduceTuning (tuning.h).
constexpr int kReduceThreads = ReduceTuning::kThreads;
constexpr int kReduceWideThreads = ReduceTuning::kWideThreads;
constexpr int kWideBlocksPerSm = ReduceTuning::kWideBlocksPerSm;
constexpr int kRowsInFlight = ReduceTuning::kRowsInFlight;

__global__ void wait_kernel(CombineRecvParams p) {
  if (stale_replay(p.inst)) return;  // a graph captured before a mask
  grid_dependency_wait();  // dependents start when it ends (it spins on other processes)
  const Instance& in = p.inst;
  const uint64_t epoch = *reinterpret_cast<volatile uint64_t*>(in.epoch);
  const uint64_t deadline = global_timer_ns() + in.timeout_ns;
  for (int r = threadIdx.x; r < in.world; r += blockDim.x)
    if (r != in.rank && same_node(in, r) &&
        !wait_geq(flag_ptr(in.host_ws, in.layout, r, kFlagCombine), epoch, deadline))
      report(in, kStatusTimeout);
  if (threadIdx.x == 0 && in.has_remote) wait_proxy(in, in.proxy.combine_done, epoch, deadline);
}

// Up to 32 bytes of one combine row, as stored (bf16 or fp32).
template <int kDtype>
__device__ __forceinline__ Encoded load_raw(const uint8_t* row, int64_t first, int n) {
  constexpr int kBytes = kDtype == static_cast<int>(DType::kFp32) ? 4 : 2;
  const uint8_t* p = row + first * kBytes;
  Encoded e{make_uint4(0, 0, 0, 0), make_uint4(0, 0, 0, 0)};
  if (n == kVec && aligned(p, 16)) {
    e.lo = ld_16_stream(p);
    if (kBytes == 4) e.hi = ld_16_stream(p + 16);
    return e;
  }
  float v[kVec];
  load_piece(row, kDtype, first, n, v);
  return kBytes == 4 ? encode_fp32(v) : encode_bf16(v);
}

template <int kDtype>
__device__ __forceinline__ void decode_raw(const Encoded& e, float (&v)[kVec]) {
  const uint32_t w[8] = {e.lo.x, e.lo.y, e.lo.z, e.lo.w, e.hi.x, e.hi.y, e.hi.z, e.hi.w};
#pragma unroll
  for (int i = 0; i < kVec; ++i) {
    if (kDtype == static_cast<int>(DType::kFp32)) v[i] = __uint_as_float(w[i]);
    else v[i] = __uint_as_float(i % 2 == 0 ? w[i / 2] << 16 : w[i / 2] & 0xffff0000u);
  }
}

// One token per block (256 threads, looping over the row), so several tokens
// share a multiprocessor; each thread has the pieces of kRowsInFlight rows in
// flight as raw bytes before it converts and accumulates them.
template <int kDtype, int kMaxThreads>
__global__ void __launch_bounds__(kMaxThreads) reduce_kernel(CombineRecvParams p) {
  if (stale_replay(p.inst)) return;  // a graph captured before a mask
  const Instance& in = p.inst;
  const Layout& l = in.layout;
  const int K = in.topk, H = in.hidden;
  const int t = blockIdx.x;
  constexpr int kOutBytes = kDtype == static_cast<int>(DType::kFp32) ? 4 : 2;  // combine rows and out
  kernel_prologue();
  if (t >= *p.scratch.num_tokens) return;
  __shared__ const uint8_t* src[kMaxTopk];
  __shared__ float weight[kMaxTopk];
  for (int k = threadIdx.x; k < K; k += blockDim.x) {
    const int64_t i = static_cast<int64_t>(t) * K + k;
    const int slot = p.scratch.slots[i];
    const uint8_t* rows = nullptr;
    float value = 0.0f;  // the row's returned value: 0 for a dropped copy
    const int r = slot >= 0 ? p.scratch.copy_rank[i] : -1;
    if (r == in.rank && p.self_y != nullptr) {  // left in y: its row is the one our dispatch noted
      const int row = p.scratch.self_row[slot - p.scratch.senders[in.rank].send_off];
      if (row >= 0 && row < p.self_y_rows) {  // never past y, even after a failed dispatch
        rows = static_cast<const uint8_t*>(p.self_y) + static_cast<size_t>(row) * H * kOutBytes;
        if (p.self_values != nullptr) value = p.self_values[row];
      }
    } else if (slot >= 0) {
      const bool on_device = p.remote_on_device || same_node(in, r);
      const uint8_t* ws = on_device ? in.device_ws : in.fabric_ws;
      rows = ws + l.combine_recv + static_cast<size_t>(slot) * l.combine_row;
      // A row per rank (or node) came back weighted and summed over t's
      // copies to r (or r's node), its entries: it is added once, at entry 0,
      // times 1; each copy's value is its entry's.
      const int32_t word = wide(in) ? p.scratch.copy_entry[i] : -1;
      if (p.values_out != nullptr)
        value = load_f32(rows + l.combine_tail + (word < 0 ? 0 : word_entry(word)) * sizeof(float));
      if (word >= 0) {
        src[k] = word_entry(word) == 0 ? rows : nullptr;
        weight[k] = 1.0f;
        if (p.values_out != nullptr) p.values_out[i] = value;
        continue;
      }
    }
    src[k] = rows;
    weight[k] = p.weights[i];
    if (p.values_out != nullptr) p.values_out[i] = value;
  }
  __syncthreads();

  uint8_t* out_row = static_cast<uint8_t*>(p.out) + static_cast<size_t>(t) * H * kOutBytes;
  const int pieces = (H + kVec - 1) / kVec;
  for (int piece = threadIdx.x; piece < pieces; piece += blockDim.x) {
    const int64_t first = static_cast<int64_t>(piece) * kVec;
    const int n = H - first < kVec ? static_cast<int>(H - first) : kVec;
    float acc[kVec];
#pragma unroll
    for (int i = 0; i < kVec; ++i) acc[i] = 0.0f;
    for (int k0 = 0; k0 < K; k0 += kRowsInFlight) {
      Encoded raw[kRowsInFlight];
#pragma unroll
      for (int u = 0; u < kRowsInFlight; ++u)
        if (k0 + u < K && src[k0 + u] != nullptr) raw[u] = load_raw<kDtype>(src[k0 + u], first, n);
#pragma unroll
      for (int u = 0; u < kRowsInFlight; ++u) {  // k ascending, product then sum, as the reference
        if (k0 + u >= K || src[k0 + u] == nullptr) continue;
        const float w = weight[k0 + u];
        float v[kVec];
        decode_raw<kDtype>(raw[u], v);
#pragma unroll
        for (int i = 0; i < kVec; ++i) acc[i] = __fadd_rn(acc[i], __fmul_rn(w, v[i]));
      }
    }
    const Encoded enc = kOutBytes == 4 ? encode_fp32(acc) : encode_bf16(acc);
    store_piece(out_row + first * kOutBytes, enc, kOutBytes, n);
  }
}

}  // namespace

cudaError_t launch_combine_recv(const CombineRecvParams& p, cudaStream_t stream) {
  constexpr int kWaitThreads = 32;
  if (p.wait_in_kernel && p.inst.world > 1) {  // alone: nothing to wait for
    cudaError_t err = launch_kernel(wait_kernel, 1, kWaitThreads, 0, stream, p);
    if (err != cudaSuccess) return err;
  }
  constexpr int kBf16 = static_cast<int>(DType::kBf16), kFp32 = static_cast<int>(DType::kFp32);
  const int pieces = (p.inst.hidden + kVec - 1) / kVec;
  const int tokens = p.inst.max_tokens;
  // Fewer tokens than can fill the device at 256 threads each: one round per
  // row (latency), else small blocks (bandwidth). fp32 rows need the
  // registers of the small blocks.
  if (p.inst.combine_dtype == kFp32)
    return launch_kernel(reduce_kernel<kFp32, kReduceThreads>, tokens, round_up_threads(pieces, kReduceThreads), 0,
                         stream, p);
  if (persistent_blocks(tokens, 1, kWideBlocksPerSm) == tokens)
    return launch_kernel(reduce_kernel<kBf16, kReduceWideThreads>, tokens, round_up_threads(pieces, kReduceWideThreads),
                         0, stream, p);
  return launch_kernel(reduce_kernel<kBf16, kReduceThreads>, tokens, round_up_threads(pieces, kReduceThreads), 0,
                       stream, p);
}

}  // namespace moe_a2a::a2a::cuda
