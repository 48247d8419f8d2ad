// Combine, send half (docs/protocol.md, "Combine"): every filled output row
// (s, j) goes back, converted to the combine dtype, to sender s's
// combine_recv row send_off[s][rank] + j: directly for same-node senders
// (CUDA IPC), into our fabric combine_send staging at recv_base[s] + j for
// remote ones (the proxy writes those with one write per peer; staged: into
// the device workspace's combine_send, which stage_kernel copies to the
// fabric's peer by peer). The last block raises the combine flag of
// same-node peers, and combine_packed unless staged. Rows per node first
// stage the outputs the forwarders sum (stage_outputs_kernel).
#include <cuda_runtime.h>

#include "launch.h"
#include "rows.cuh"
#include "segments.cuh"
#include "signal.cuh"
#include "tuning.h"

namespace moe_a2a::a2a::cuda {
namespace {

// Launch tuning: ReturnTuning (tuning.h).
constexpr int kReturnThreads = ReturnTuning::kThreads;
constexpr int kReturnBlocksPerSm = ReturnTuning::kBlocksPerSm;

// The sender whose wire rows hold staging row w: the last one starting at or
// before it (senders with no rows start where the next one does).
__device__ __forceinline__ int wire_sender(const SenderPlan* senders, int world, int64_t w) {
  int lo = 0, hi = world;
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (senders[mid].recv_base <= w) lo = mid;
    else hi = mid;
  }
  return lo;
}

// Rows per rank or node (docs/protocol.md, "Rows per destination rank",
// "... node"): each wire row w of a wide sender goes back as one row, the sum
// of its entries' outputs, each times its dispatch weight (weighted) or 1, in
// fp32 in entry (k) order, product then sum; its tail holds each entry's row
// value (0 for none). Rows per rank read our own y; rows per node, which we
// forward, the fp32 outputs that our node's ranks staged (stage_outputs_kernel),
// each entry's on its rank. One warp a chunk of a row, like the rows per copy.
__device__ void return_summed_rows(const CombineSendParams& p, int chunk_elems, int rows) {
  const Instance& in = p.inst;
  const Layout& l = in.layout;
  const SenderPlan* senders = p.scratch.senders;
  const int N = in.world, m = in.max_entries, H = in.hidden;
  const int out_bytes = dtype_size(in.combine_dtype);
  const int64_t y_row = static_cast<int64_t>(H) * dtype_size(p.y_dtype);
  const int64_t total = senders[N - 1].recv_base + senders[N - 1].wire;
  const int32_t* entry_row = p.scratch.entry_row;
  const float* entry_weight = p.scratch.entry_weight;
  const uint8_t* y = static_cast<const uint8_t*>(p.y);
  const int node0 = in.rank / in.ranks_per_node * in.ranks_per_node;
  const int row_end = in.node_rows ? static_cast<int>(max_output_rows(in)) : rows;  // a node peer's: its buffers'
  // Entry e's row of outputs and its dtype: ours in y, or a node rank's staged row.
  const auto source = [&](int64_t at, int row, int* dtype) -> const uint8_t* {
    if (!in.node_rows) {
      *dtype = p.y_dtype;
      return y + row * y_row;
    }
    *dtype = static_cast<int>(DType::kFp32);
    return in.peers[node0 + p.scratch.entry_rank[at]].device + l.y_stage + static_cast<size_t>(row) * l.y_stride;
  };
  for (ChunkWalk walk(row_chunks(static_cast<int64_t>(H) * out_bytes)); walk.row < total; walk.next()) {
    const int64_t w = walk.row;
    const int s = wire_sender(senders, N, w);
    if (!per_rank(in, s) && !node_sender(in, s)) continue;  // rows per copy went back above
    uint8_t* dst = (in.staged ? in.device_ws : in.fabric_ws) + l.combine_send + w * l.combine_row;
    const int e0 = walk.chunk * chunk_elems;
    const int e1 = e0 + chunk_elems < H ? e0 + chunk_elems : H;
    for (int piece = e0 / kVec + walk.lane; piece < (e1 + kVec - 1) / kVec; piece += kWarp) {
      const int64_t first = static_cast<int64_t>(piece) * kVec;
      const int n = e1 - first < kVec ? static_cast<int>(e1 - first) : kVec;
      float acc[kVec];
#pragma unroll
      for (int i = 0; i < kVec; ++i) acc[i] = 0.0f;
      for (int e = 0; e < m; ++e) {  // the same entry on every lane: broadcast loads
        const int row = entry_row[w * m + e];
        if (row < 0 || row >= row_end) continue;
        const float coeff = p.weighted ? entry_weight[w * m + e] : 1.0f;
        int dtype;
        const uint8_t* src = source(w * m + e, row, &dtype);
        float v[kVec];
        load_piece(src, dtype, first, n, v);
#pragma unroll
        for (int i = 0; i < kVec; ++i) acc[i] = __fadd_rn(acc[i], __fmul_rn(coeff, v[i]));
      }
      store_piece(dst + first * out_bytes, out_bytes == 4 ? encode_fp32(acc) : encode_bf16(acc), out_bytes, n);
    }
    if (walk.chunk != 0) continue;
    for (int e = walk.lane; e < m; e += kWarp) {  // each entry's value into the tail
      const int row = entry_row[w * m + e];
      float value = 0.0f;
      if (row >= 0 && row < row_end) {
        if (in.node_rows)
          value = load_f32(in.peers[node0 + p.scratch.entry_rank[w * m + e]].device + l.y_values +
                           static_cast<size_t>(row) * sizeof(float));
        else if (p.row_values != nullptr)
          value = p.row_values[row];
      }
      store_f32(dst + l.combine_tail + e * sizeof(float), value);
    }
  }
}

__device__ __forceinline__ uint8_t* return_row(const Instance& in, const SenderPlan* senders, int s, int64_t j) {
  const Layout& l = in.layout;
  const size_t row = l.combine_row;
  if (same_node(in, s)) return in.peers[s].device + l.combine_recv + (senders[s].send_off + j) * row;
  return (in.staged ? in.device_ws : in.fabric_ws) + l.combine_send + (senders[s].recv_base + j) * row;
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

// Rows per node: our outputs of copies that came in rows per node, in fp32
// (exact from bf16), with their row values, into our device workspace's
// y_stage, where the forwarder that received them sums them
// (return_summed_rows); then raises our staged flag at every node rank.
__global__ void __launch_bounds__(kReturnThreads, kReturnBlocksPerSm) stage_outputs_kernel(CombineSendParams p) {
  if (stale_replay(p.inst)) return;  // a graph captured before a mask
  extern __shared__ Segment segs[];
  kernel_prologue();  // our copy kernels, which read the forwarders' rows, are done (the rows' reuse)
  const Instance& in = p.inst;
  const Layout& l = in.layout;
  const int H = in.hidden;
  const int64_t y_row = static_cast<int64_t>(H) * dtype_size(p.y_dtype);
  const uint8_t* y = static_cast<const uint8_t*>(p.y);
  const bool planned = *reinterpret_cast<volatile uint64_t*>(p.scratch.plan_ok) == *in.epoch;
  const int filled = planned ? *p.scratch.output_rows : 0;
  const int rows = filled < p.y_rows ? filled : static_cast<int>(p.y_rows);
  load_segments(segs, p.scratch.segments, in.num_experts);
  __syncthreads();
  const int chunk_elems = static_cast<int>(chunk_bytes(static_cast<int64_t>(H) * 4) / 4);
  for (ChunkWalk walk(row_chunks(static_cast<int64_t>(H) * 4)); walk.row < rows; walk.next()) {
    int s, j;
    if (!locate(segs, in.num_experts, walk.row, &s, &j) || !node_sender(in, s)) continue;
    uint8_t* dst = in.device_ws + l.y_stage + static_cast<size_t>(walk.row) * l.y_stride;
    const int e0 = walk.chunk * chunk_elems;
    const int e1 = e0 + chunk_elems < H ? e0 + chunk_elems : H;
    convert_range(dst, y + walk.row * y_row, e0, e1, p.y_dtype, static_cast<int>(DType::kFp32), walk.lane);
    if (walk.chunk == 0 && walk.lane == 0)
      store_f32(in.device_ws + l.y_values + static_cast<size_t>(walk.row) * sizeof(float),
                p.row_values != nullptr ? p.row_values[walk.row] : 0.0f);
  }
  signal_when_grid_done(in, p.scratch.done_blocks, kFlagStaged, nullptr);
}

// Rows per node, graph-safe calls: waits (one block) for the staged flag of
// every node peer; return_kernel, next, reads their y_stage.
__global__ void staged_wait_kernel(CombineSendParams p) {
  if (stale_replay(p.inst)) return;  // a graph captured before a mask
  grid_dependency_wait();  // dependents start when it ends (it spins on other processes)
  const Instance& in = p.inst;
  const uint64_t epoch = *reinterpret_cast<volatile uint64_t*>(in.epoch);
  wait_peers(in, kFlagStaged, epoch, global_timer_ns() + in.timeout_ns);
}

__global__ void __launch_bounds__(kReturnThreads, kReturnBlocksPerSm) return_kernel(CombineSendParams p) {
  if (stale_replay(p.inst)) return;  // a graph captured before a mask
  extern __shared__ Segment segs[];
  kernel_prologue();
  const Instance& in = p.inst;
  const int64_t y_row = static_cast<int64_t>(in.hidden) * dtype_size(p.y_dtype);
  const int out_bytes = dtype_size(in.combine_dtype);
  const int chunk_elems = static_cast<int>(chunk_bytes(static_cast<int64_t>(in.hidden) * out_bytes) / out_bytes);
  const uint8_t* y = static_cast<const uint8_t*>(p.y);
  ChunkWalk walk(row_chunks(static_cast<int64_t>(in.hidden) * out_bytes));
  const auto chunk_end = [&](int e0) { return e0 + chunk_elems < in.hidden ? e0 + chunk_elems : in.hidden; };
  // A plain copy (y already in the combine dtype) moves a chunk in one round
  // (combine rows are 16-byte aligned): the warp loads its next chunk as soon
  // as it knows it, the first one before reading the plan, so that its memory
  // latency passes under the plan's (at decode sizes it is the warp's only
  // chunk).
  const bool plain = p.y_dtype == in.combine_dtype && aligned(y, 16) && y_row % 16 == 0;
  CopyRound v;
  const auto round_pieces = [&] {  // the walk's chunk in 16-byte pieces, less the lane
    const int e0 = walk.chunk * chunk_elems;
    return (chunk_end(e0) - e0) * out_bytes / 16 - walk.lane;
  };
  const int64_t chunk_stride = static_cast<int64_t>(chunk_elems) * out_bytes;
  const auto y_chunk = [&] { return y + walk.row * y_row + walk.chunk * chunk_stride; };
  if (plain && walk.row < p.y_rows) load_round(v, y_chunk(), round_pieces(), walk.lane);
  const int filled = *p.scratch.output_rows;
  const int rows = filled < p.y_rows ? filled : static_cast<int>(p.y_rows);  // never past y (the caller's contract)
  load_segments(segs, p.scratch.segments, in.num_experts);
  __syncthreads();
  // nullptr: a padding row, which goes nowhere, or one of ours left in place
  // (the reduction reads it from y).
  const auto destination = [&]() -> uint8_t* {
    int s, j;
    if (!locate(segs, in.num_experts, walk.row, &s, &j) || (s == in.rank && p.self_in_place)) return nullptr;
    if (per_rank(in, s) || node_sender(in, s)) return nullptr;  // summed into a wire row (return_summed_rows)
    return return_row(in, p.scratch.senders, s, j);
  };
  // The row's value into its tail, once per row (its first chunk's lane 0).
  const auto store_value = [&](uint8_t* dst) {
    if (walk.chunk == 0 && walk.lane == 0)
      store_f32(dst + in.layout.combine_tail, p.row_values != nullptr ? p.row_values[walk.row] : 0.0f);
  };
  if (plain) {
    uint8_t* dst = walk.row < rows ? destination() : nullptr;
    while (walk.row < rows) {
      if (dst != nullptr) {
        store_round(dst + walk.chunk * chunk_stride, v, round_pieces(), walk.lane);
        store_value(dst);
      }
      walk.next();
      if (walk.row >= rows) break;
      dst = destination();
      if (dst != nullptr) load_round(v, y_chunk(), round_pieces(), walk.lane);
    }
  } else {
    for (; walk.row < rows; walk.next()) {
      const int e0 = walk.chunk * chunk_elems;
      if (uint8_t* dst = destination()) {
        convert_range(dst, y + walk.row * y_row, e0, chunk_end(e0), p.y_dtype, in.combine_dtype, walk.lane);
        store_value(dst);
      }
    }
  }
  // No plan (capacity, a failed wait): rows per rank see no rows; rows per
  // node the plan's word, since a forwarder may have rows to sum and no copies.
  if (in.node_rows ? *reinterpret_cast<volatile uint64_t*>(p.scratch.plan_ok) == *in.epoch
                   : in.rank_rows && rows > 0)
    return_summed_rows(p, chunk_elems, rows);
  signal_when_grid_done(in, p.scratch.done_blocks, kFlagCombine, packed_flag(in, in.proxy.combine_packed));
}

}  // namespace

cudaError_t launch_stage_outputs(const CombineSendParams& p, cudaStream_t stream) {
  const Instance& in = p.inst;
  if (!in.node_rows) return cudaSuccess;
  const size_t seg_smem = static_cast<size_t>(in.num_experts) * sizeof(Segment);
  cudaError_t err = allow_dynamic_smem(reinterpret_cast<const void*>(stage_outputs_kernel), seg_smem);
  if (err != cudaSuccess) return err;
  const int chunks = row_chunks(static_cast<int64_t>(in.hidden) * 4);
  const int blocks = persistent_blocks(max_output_rows(in) * chunks, kReturnThreads / kWarp, kReturnBlocksPerSm);
  err = launch_kernel(stage_outputs_kernel, blocks, kReturnThreads, seg_smem, stream, p);
  if (err != cudaSuccess || !p.wait_in_kernel) return err;
  return launch_kernel(staged_wait_kernel, 1, kWarp, 0, stream, p);
}

cudaError_t launch_combine_send(const CombineSendParams& p, cudaStream_t stream) {
  const Instance& in = p.inst;
  if (p.self_in_place && in.world == 1) return cudaSuccess;  // alone, every row stays where it is
  const size_t seg_smem = static_cast<size_t>(in.num_experts) * sizeof(Segment);
  cudaError_t err = allow_dynamic_smem(reinterpret_cast<const void*>(return_kernel), seg_smem);
  if (err != cudaSuccess) return err;
  const int chunks = row_chunks(static_cast<int64_t>(in.hidden) * dtype_bytes(static_cast<DType>(in.combine_dtype)));
  const int blocks = persistent_blocks(max_output_rows(in) * chunks, kReturnThreads / kWarp, kReturnBlocksPerSm);
  err = launch_kernel(return_kernel, blocks, kReturnThreads, seg_smem, stream, p);
  if (err != cudaSuccess || !in.staged) return err;
  StageParams stage;
  stage.inst = in;
  stage.scratch = p.scratch;
  stage.kind = kStageCombine;
  return launch_stage(stage, stream);
}

}  // namespace moe_a2a::a2a::cuda
