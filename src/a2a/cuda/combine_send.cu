// Combine, send half (docs/protocol.md, "Combine"): every filled output row
// (s, j) goes back, converted to the combine dtype, to sender s's
// combine_recv row send_off[s][rank] + j: directly for same-node senders
// (CUDA IPC), into our fabric combine_send staging at recv_base[s] + j for
// remote ones (the proxy writes those with one write per peer). The last
// block raises combine_packed and the combine flag of same-node peers.
#include <cuda_runtime.h>

#include "launch.h"
#include "rows.cuh"
#include "segments.cuh"
#include "signal.cuh"

namespace moe_a2a::a2a::cuda {
namespace {

constexpr int kReturnThreads = 256;
// Blocks a multiprocessor; the persistent grid is sized for this many, and
// __launch_bounds__ makes them all resident (a second wave would leave its
// rows to the end). Four: 64 registers, 8 x 16 bytes a lane in flight, and a
// decode-sized call's row chunks all in one round.
constexpr int kReturnBlocksPerSm = 4;

__device__ __forceinline__ uint8_t* return_row(const Instance& in, const SenderPlan* senders, int s, int64_t j) {
  const Layout& l = in.layout;
  const size_t row = l.combine_row;
  if (same_node(in, s)) return in.peers[s].device + l.combine_recv + (senders[s].send_off + j) * row;
  return in.fabric_ws + l.combine_send + (senders[s].recv_base + j) * row;
}

// Elements [e0, e1) of one row by one warp, converted from y_dtype to
// out_dtype (bf16 or fp32); e0 is a multiple of kVec.
__device__ __forceinline__ void convert_range(uint8_t* dst, const uint8_t* src, int e0, int e1, int y_dtype,
                                              int out_dtype, int lane) {
  const int out_bytes = dtype_size(out_dtype);
  if (y_dtype == out_dtype) {
    warp_copy(dst + static_cast<int64_t>(e0) * out_bytes, src + static_cast<int64_t>(e0) * out_bytes,
              static_cast<int64_t>(e1 - e0) * out_bytes, lane);
    return;
  }
  const int last = (e1 + kVec - 1) / kVec;
  for (int piece = e0 / kVec + lane; piece < last; piece += kWarp) {
    const int64_t first = static_cast<int64_t>(piece) * kVec;
    const int n = e1 - first < kVec ? static_cast<int>(e1 - first) : kVec;
    float v[kVec];
    load_piece(src, y_dtype, first, n, v);
    const Encoded enc = out_bytes == 4 ? encode_fp32(v) : encode_bf16(v);
    store_piece(dst + first * out_bytes, enc, out_bytes, n);
  }
}

__global__ void __launch_bounds__(kReturnThreads, kReturnBlocksPerSm) return_kernel(CombineSendParams p) {
  extern __shared__ Segment segs[];
  kernel_prologue();
  const Instance& in = p.inst;
  load_segments(segs, p.scratch.segments, in.num_experts);
  __syncthreads();
  const int rows = *p.scratch.output_rows;
  const int64_t y_row = static_cast<int64_t>(in.hidden) * dtype_size(p.y_dtype);
  const int out_bytes = dtype_size(in.combine_dtype);
  const int chunk_elems = static_cast<int>(chunk_bytes(static_cast<int64_t>(in.hidden) * out_bytes) / out_bytes);
  for (ChunkWalk walk(row_chunks(static_cast<int64_t>(in.hidden) * out_bytes)); walk.row < rows; walk.next()) {
    const int row = walk.row;
    const int e0 = walk.chunk * chunk_elems;
    const int e1 = e0 + chunk_elems < in.hidden ? e0 + chunk_elems : in.hidden;
    int s, j;
    if (!locate(segs, in.num_experts, row, &s, &j)) continue;  // padding rows go nowhere
    convert_range(return_row(in, p.scratch.senders, s, j), static_cast<const uint8_t*>(p.y) + row * y_row, e0, e1,
                  p.y_dtype, in.combine_dtype, walk.lane);
  }
  signal_when_grid_done(in, p.scratch.done_blocks, kFlagCombine, in.proxy.combine_packed);
}

}  // namespace

cudaError_t launch_combine_send(const CombineSendParams& p, cudaStream_t stream) {
  const Instance& in = p.inst;
  const size_t seg_smem = static_cast<size_t>(in.num_experts) * sizeof(Segment);
  cudaError_t err = allow_dynamic_smem(reinterpret_cast<const void*>(return_kernel), seg_smem);
  if (err != cudaSuccess) return err;
  const int chunks = row_chunks(static_cast<int64_t>(in.hidden) * dtype_bytes(static_cast<DType>(in.combine_dtype)));
  const int blocks = persistent_blocks(max_output_rows(in) * chunks, kReturnThreads / kWarp, kReturnBlocksPerSm);
  return launch_kernel(return_kernel, blocks, kReturnThreads, seg_smem, stream, p);
}

}  // namespace moe_a2a::a2a::cuda
