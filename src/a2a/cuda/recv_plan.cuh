// Dispatch, receive half: the plan (docs/protocol.md, "Dispatch at receiver
// r"). From the routing matrix (same-node rows from the device workspace,
// remote ones from the host workspace, where the proxy put them; a cached
// call's from its handle) it checks max_recv_tokens on every rank (each rank
// holds the whole matrix, so all decide alike) and computes
// tokens_per_expert, the padded expert starts and the segment table the
// copies walk. plan_kernel (dispatch_plan.cu) runs it alone, beside our pack;
// plan_copy_kernel (dispatch_recv.cu) in the block that starts first.
#pragma once

#include "memory.cuh"
#include "rows.cuh"
#include "scan.cuh"
#include "tuning.h"

namespace moe_a2a::a2a::cuda {

constexpr int kPlanThreads = PlanTuning::kThreads;
constexpr int kPlanWarps = kPlanThreads / kWarp;

__device__ __forceinline__ int64_t warp_sum(int64_t v) {
#pragma unroll
  for (int offset = kWarp / 2; offset > 0; offset /= 2) v += __shfl_xor_sync(kFullMask, v, offset);
  return v;
}

// After a failed wait or over capacity: no rows; the host raises the status.
// Every thread of the block calls it.
__device__ inline void deliver_nothing(const DispatchRecvParams& p) {
  for (int i = threadIdx.x; i < p.inst.local_experts; i += blockDim.x) p.tokens_per_expert[i] = 0;
  if (threadIdx.x == 0) *p.scratch.output_rows = *p.scratch.output_rows_host = 0;
  if (threadIdx.x == 0 && p.inst.node_rows) *p.scratch.plan_ok = 0;  // no plan: nothing to forward or sum
}

// Where the eager host waits: the plan is final (output rows, status).
// Thread 0, after every thread's plan writes.
__device__ __forceinline__ void signal_planned(const DispatchRecvParams& p, uint64_t epoch) {
  fence_sys();
  st_release_sys(p.scratch.planned_host, epoch);
}

// Rows per node: the output rows of every rank of our node, per sender and
// local expert (Scratch::node_segs), as that rank's own plan places them: the
// entries of the rows we forward name them. n and start: [L] of shared memory.
__device__ inline void node_segments(const DispatchRecvParams& p, const int32_t* matrix, int32_t* n, int32_t* start) {
  const Instance& in = p.inst;
  const int N = in.world, E = in.num_experts, L = in.local_experts, W = E + N, rpn = in.ranks_per_node;
  const int node0 = in.rank / rpn * rpn, pad = in.expert_padding;
  for (int l = 0; l < rpn; ++l) {
    const int32_t* col = matrix + (node0 + l) * L;  // col[s * W + i]: copies of s for expert i of rank node0 + l
    __syncthreads();  // n and start of the last round are read
    for (int i = threadIdx.x; i < L; i += kPlanThreads) {
      int32_t total = 0;
      for (int s = 0; s < N; ++s) total += col[s * W + i];
      n[i] = total;
    }
    __syncthreads();
    block_exclusive_scan<kPlanThreads, int32_t>(
        L, [&](int i) { return (n[i] + pad - 1) / pad * pad; }, [&](int i, int32_t v) { start[i] = v; });
    __syncthreads();
    for (int i = threadIdx.x; i < L; i += kPlanThreads) {
      int32_t at = start[i];
      for (int s = 0; s < N; ++s) {
        NodeSegment& g = p.scratch.node_segs[(l * L + i) * N + s];
        g.out_row = at;
        g.count = col[s * W + i];
        at += g.count;
      }
    }
  }
}

// The plan from the routing matrix: capacity for every rank, per-sender
// placement, tokens_per_expert, expert starts and the segment table; with
// `ok` false (a wait failed) or over capacity it delivers nothing. Rows of
// the matrix are count[s][0..E) then u[s][0..N): positions on the wire
// count wire rows, the output copies.
// Shared memory: matrix [world][E + world], n[L], start[L]. kWide: as
// source_row's (recv_rows.cuh).
template <bool kWide = true>
__device__ inline void compute_plan(const DispatchRecvParams& p, int32_t* matrix, bool ok_in) {
  const Instance& in = p.inst;
  const Layout& l = in.layout;
  const int N = in.world, E = in.num_experts, L = in.local_experts, rank = in.rank;
  const int W = E + N;  // routing_width
  const int64_t P = in.max_private;
  int32_t* n = matrix + N * W;
  int32_t* start = n + L;
  __shared__ int ok;
  const int tid = threadIdx.x, warp = tid / kWarp, lane = tid % kWarp;
  if (tid == 0) ok = ok_in;
  __syncthreads();
  if (ok) {  // rows of same-node senders from our device workspace, the others' where the proxy put them
    for (int i = tid; i < N * W; i += kPlanThreads) {
      const int s = i / W;
      const uint32_t* row = p.routing != nullptr ? p.routing + static_cast<size_t>(s) * W  // a cached call's
                                                 : routing_row(same_node(in, s) ? in.device_ws : in.host_ws, l, s);
      matrix[i] = static_cast<int32_t>(__ldcg(row + i % W));
      if (p.routing_out != nullptr) p.routing_out[i] = static_cast<uint32_t>(matrix[i]);
    }
  }
  __syncthreads();
  // Capacity, for every rank (the same decision everywhere).
  if (ok) {
    for (int r = warp; r < N; r += kPlanWarps) {
      int64_t received = 0;
      for (int i = lane; i < N * L; i += kWarp) received += matrix[(i / L) * W + r * L + i % L];
      received = warp_sum(received);
      int64_t wire = 0;  // rows per node: a forwarder's wire rows may outnumber its copies (plan.h worst_overflow)
      if (kWide && in.node_rows) {
        for (int q = lane; q < N; q += kWarp) wire += matrix[q * W + E + r];
        wire = warp_sum(wire);
      }
      if (lane == 0 && (received > in.max_recv || wire > in.max_recv)) ok = 0, report(in, kStatusCapacity);
    }
  }
  __syncthreads();
  if (!ok) return deliver_nothing(p);

  const int32_t* mine = matrix + rank * L;  // column block of our experts: mine[s * W + i]
  for (int s = warp; s < N; s += kPlanWarps) {
    int64_t copies = 0, before = 0;
    for (int i = lane; i < L; i += kWarp) copies += mine[s * W + i];
    for (int q = lane; q < rank; q += kWarp) before += matrix[s * W + E + q];
    copies = warp_sum(copies);
    before = warp_sum(before);
    // Rows per node: where s's rows for our node sit, at its forwarder here.
    const int fwd = kWide && node_sender(in, s) ? forwarder_of(in, s) : -1;
    int64_t read_shared_off = 0;
    if (fwd >= 0) {
      for (int q = lane; q < s; q += kWarp) {
        const int64_t u = matrix[q * W + E + fwd];
        read_shared_off += u > P ? u - P : 0;
      }
      read_shared_off = warp_sum(read_shared_off);
    }
    if (lane == 0) {
      SenderPlan& sp = p.scratch.senders[s];
      sp.copies = copies;
      sp.wire = matrix[s * W + E + rank];
      sp.send_off = before;
      sp.fwd = fwd;
      sp.read_rows = fwd >= 0 ? matrix[s * W + E + fwd] : 0;
      sp.read_shared_off = read_shared_off;
    }
  }
  if (kWide && wide(in)) {  // entry_kernel hands out each wide sender's rows from here
    const int keys = N * L * (in.node_rows ? in.ranks_per_node : 1);
    for (int i = tid; i < keys; i += kPlanThreads) p.scratch.entry_next[i] = 0;
  }
  for (int i = tid; i < L; i += kPlanThreads) {
    int32_t total = 0;
    for (int s = 0; s < N; ++s) total += mine[s * W + i];
    n[i] = total;
    p.tokens_per_expert[i] = total;
  }
  __syncthreads();

  SenderPlan* senders = p.scratch.senders;
  block_exclusive_scan<kPlanThreads, int64_t>(
      N, [&](int s) { return senders[s].wire; }, [&](int s, int64_t v) { senders[s].recv_base = v; });
  block_exclusive_scan<kPlanThreads, int64_t>(
      N, [&](int s) { return senders[s].wire > P ? senders[s].wire - P : int64_t{0}; },
      [&](int s, int64_t v) { senders[s].shared_off = v; });
  const int pad = in.expert_padding;
  const int32_t rows_out = block_exclusive_scan<kPlanThreads, int32_t>(
      L, [&](int i) { return (n[i] + pad - 1) / pad * pad; }, [&](int i, int32_t v) { start[i] = v; });

  Segment* segs = p.scratch.segments;
  for (int s = 0; s < N; ++s) {
    block_exclusive_scan<kPlanThreads, int32_t>(
        L, [&](int i) { return mine[s * W + i]; },
        [&](int i, int32_t v) {
          Segment& g = segs[i * N + s];
          g.first_j = v;
          g.count = mine[s * W + i];
          g.sender = s;
        });
  }
  for (int i = tid; i < L; i += kPlanThreads) {
    int32_t at = start[i];
    for (int s = 0; s < N; ++s) {
      segs[i * N + s].out_row = at;
      at += mine[s * W + i];
    }
  }
  if (kWide && in.node_rows) {
    node_segments(p, matrix, n, start);
    __syncthreads();  // every thread's segments before plan_ok
  }
  if (tid == 0) {
    *p.scratch.output_rows = rows_out;
    // Only an eager host reads the mapped copy (CudaAllToAll::output_rows); a
    // store to host memory delays the end of a graph's replay (about 0.3 us).
    if (!p.wait_in_kernel) *p.scratch.output_rows_host = rows_out;
    if (kWide && in.node_rows) *p.scratch.plan_ok = *in.epoch;
  }
}

// Shared memory of compute_plan: matrix [world][E + world], n[L], start[L].
inline size_t plan_smem_bytes(const Instance& in) {
  return (static_cast<size_t>(in.world) * (in.num_experts + in.world) + 2 * in.local_experts) * sizeof(int32_t);
}

}  // namespace moe_a2a::a2a::cuda
