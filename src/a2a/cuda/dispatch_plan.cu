// Dispatch, receive half, step 1: plan_kernel (one block, beside our pack
// kernel) waits for the route flag of every same-node sender and, with
// remote peers, for the proxy's dispatch_done; plans (recv_plan.cuh); then
// waits for the packs, whose rows the copy kernel after it reads.
// With rows per rank or node, entry_kernel then places the entries of each
// wide sender's rows (their tails) in the output, before any copy reads them.
#include <cuda_runtime.h>

#include "launch.h"
#include "recv_plan.cuh"
#include "recv_rows.cuh"
#include "route.cuh"
#include "signal.cuh"

namespace moe_a2a::a2a::cuda {
namespace {

// The plan runs beside our pack kernel, so it must fit beside its blocks: at
// most PlanTuning::kMaxRegisters a thread, which a multiprocessor holding
// four pack blocks still has free.
constexpr int kRegistersPerSm = 65536;                                                        // sm_90
constexpr int kPlanMinBlocks = kRegistersPerSm / (kPlanThreads * PlanTuning::kMaxRegisters);  // for __launch_bounds__

// The plan needs only routing rows, which our dispatch send published (with
// the call's epoch) before it let this kernel be scheduled, so this kernel
// does not start by waiting for the kernel before it (our pack): with
// programmatic dependent launch it runs beside it. It waits for the packs
// (ours through the grid dependency, the peers' through their dispatch
// flags) only before it ends, because the copy kernel after it reads their
// rows.
// kWide: as source_row's (recv_rows.cuh); kCheck: as stale_replay's (rows.cuh).
template <bool kWide, bool kCheck>
__global__ void __launch_bounds__(kPlanThreads, kPlanMinBlocks) plan_kernel(DispatchRecvParams p) {
  if (stale_replay<kCheck>(p.inst)) return;  // a graph captured before a mask
  extern __shared__ int32_t matrix[];
  const Instance& in = p.inst;
  const uint64_t epoch = *reinterpret_cast<volatile uint64_t*>(in.epoch);  // published before we were scheduled
  const uint64_t deadline = global_timer_ns() + in.timeout_ns;
  // Waiting on no flag (eager calls, whose host saw them all, or a rank
  // alone), the plan lets the copy kernel's blocks in at once: they wait in
  // hardware for this grid to end and start without a launch gap. Otherwise
  // only after its waits (see allow_dependents in memory.cuh).
  if (!p.wait_in_kernel || (in.world == 1 && !in.has_remote)) allow_dependents();
  bool ok = true;
  if (p.wait_in_kernel) {
    ok = p.routing != nullptr || wait_peers(in, kFlagRoute, epoch, deadline);  // a cached call has no route flags
    __shared__ int proxy_ok;
    if (threadIdx.x == 0) {
      proxy_ok = 1;
      if (in.has_remote) {  // remote routing rows: the proxy says everything arrived
        if (!wait_proxy(in, in.proxy.dispatch_done, epoch, deadline)) proxy_ok = 0;
        else if (ld_acquire_sys(in.proxy.overflow) == epoch) proxy_ok = 0, report(in, kStatusCapacity);
      }
    }
    __syncthreads();
    ok = ok && proxy_ok;
  }
  compute_plan<kWide>(p, matrix, ok);
  if (p.wait_in_kernel && !wait_peers(in, kFlagDispatch, epoch, deadline)) deliver_nothing(p);
  grid_dependency_wait();  // the routing before us reported its status too
  allow_dependents();
  // An eager host (the one that saw the flags itself) waits for this word,
  // not for the stream: it needs only the output rows and the status, and
  // returns while the copy kernel runs. In a captured graph no host reads
  // it, and the system-scope fence would delay the copy kernel (about 1 us a
  // decode step).
  if (p.wait_in_kernel) return;
  __syncthreads();
  if (threadIdx.x == 0) signal_planned(p, epoch);
}

// Rows per rank (docs/protocol.md, "Rows per destination rank"): sender s's
// wire rows [first, end), each holding up to m entries in its tail, walked in
// (row, entry) order; entry (j, e) of local expert i gets output row
// segment(i, s).out_row + q, q counting s's entries of i so far
// (Scratch::entry_next, zeroed by the plan, kept across launches for a
// sender's later slices). That is each expert's copies of s in (token, k)
// order, where rows per copy would have put them. The walk is a stable
// counting sort, as routing's (route.cuh): each warp matches its entries'
// experts, counts them, and hands out q in order. One block per sender.
// Rows per node ("Rows per destination node"): a sender's rows for our node
// are read whole from its forwarder's device workspace; each rank keeps the
// entries of its own experts (row_wire, row_weight), and the forwarder also
// those of its node peers, with their output rows (node_segs), for the
// combine's sums.
constexpr int kEntryThreads = EntryTuning::kThreads;
constexpr int kEntryWarps = kEntryThreads / kWarp;
constexpr int kEntriesInFlight = EntryTuning::kEntriesInFlight;
constexpr int kEntryWarpItems = kEntriesInFlight * kWarp;

__global__ void __launch_bounds__(kEntryThreads) entry_kernel(DispatchRecvParams p) {
  if (stale_replay(p.inst)) return;  // a graph captured before a mask
  extern __shared__ int32_t entry_smem[];  // hist [warps][K], then next [K]
  kernel_prologue();                       // the plan, and the rows (landed before this launch)
  const Instance& in = p.inst;
  const Scratch& sc = p.scratch;
  const int s = p.sender >= 0 ? p.sender : static_cast<int>(blockIdx.x);
  if (s >= in.world) return;
  const bool noded = node_sender(in, s);
  if (!per_rank(in, s) && !noded) return;
  // No plan (capacity, a failed wait): rows per rank see no output rows; rows
  // per node the plan's word, since a forwarder may have rows and no copies.
  if (noded ? *reinterpret_cast<volatile uint64_t*>(sc.plan_ok) != *in.epoch : *sc.output_rows == 0) return;
  const int L = in.local_experts, N = in.world, m = in.max_entries, rpn = in.ranks_per_node;
  const SenderPlan plan = sc.senders[s];
  // Rows per node: every key of the node where we forward s's rows, else ours
  // only (key i of our local index, the other entries skipped).
  const bool forwards = noded && plan.fwd == in.rank;
  const int K = forwards ? rpn * L : L, own = in.rank % rpn;
  // Rows per node are read whole (their forwarder raised forward[s] for all of them).
  const int64_t rows = noded ? plan.read_rows : plan.wire;
  const int64_t first = p.sender >= 0 && !noded ? p.sender_first : 0;
  const int64_t end = p.sender >= 0 && !noded ? (p.sender_end < rows ? p.sender_end : rows) : rows;
  const int64_t entries = end > first ? (end - first) * m : 0;
  int32_t* hist = entry_smem;
  int32_t* next = hist + kEntryWarps * K;
  int32_t* next_base = sc.entry_next + static_cast<size_t>(s) * (in.node_rows ? rpn * L : L);
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const unsigned lanes_below = (1u << lane) - 1;
  for (int i = threadIdx.x; i < K; i += kEntryThreads) next[i] = next_base[i];
  __shared__ int bad;
  if (threadIdx.x == 0) bad = 0;
  __syncthreads();  // bad and next before any round
  for (int64_t base = 0; base < entries; base += kEntryWarps * kEntryWarpItems) {
    for (int i = threadIdx.x; i < kEntryWarps * K; i += kEntryThreads) hist[i] = 0;
    // The warp's entries, their loads in flight together: expert (key, -1 for
    // none) and weight.
    int key[kEntriesInFlight];
    float weight[kEntriesInFlight];
    unsigned peers[kEntriesInFlight];
#pragma unroll
    for (int u = 0; u < kEntriesInFlight; ++u) {
      const int64_t idx = base + warp * kEntryWarpItems + u * kWarp + lane;
      key[u] = -1;
      weight[u] = 0.0f;
      if (idx >= entries) continue;
      const int64_t j = first + idx / m;
      const uint8_t* tail = source_row(in, sc.senders, s, j) + in.layout.dispatch_tail;
      // As the plan reads routing rows the proxy put in host memory: from L2,
      // not L1 (rows per node: a peer's device memory, over IPC).
      const uint2 raw = __ldcg(reinterpret_cast<const uint2*>(tail + (idx % m) * sizeof(RouteEntry)));
      const int expert = static_cast<int>(raw.y & 0xffffu);
      weight[u] = __uint_as_float(raw.x);
      if (expert == kNoExpert) continue;
      if (!noded) {
        if (expert < L) key[u] = expert;
        else bad = 1;
      } else if (expert >= rpn * L) {
        bad = 1;
      } else if (forwards) {
        key[u] = expert;
      } else if (expert / L == own) {
        key[u] = expert % L;
      }
    }
#pragma unroll
    for (int u = 0; u < kEntriesInFlight; ++u) peers[u] = __match_any_sync(kFullMask, key[u]);
    __syncthreads();  // hist zeroed
#pragma unroll
    for (int u = 0; u < kEntriesInFlight; ++u) {
      if (key[u] >= 0 && lane == __ffs(peers[u]) - 1) hist[warp * K + key[u]] += __popc(peers[u]);
      __syncwarp();
    }
    __syncthreads();
    warp_offsets(hist, kEntryWarps, K, next, next);  // next: past this round
    __syncthreads();
#pragma unroll
    for (int u = 0; u < kEntriesInFlight; ++u) {  // in order: q stays stable
      const int q = key[u] >= 0 ? hist[warp * K + key[u]] + __popc(peers[u] & lanes_below) : -1;
      __syncwarp();
      if (key[u] >= 0 && lane == __ffs(peers[u]) - 1) hist[warp * K + key[u]] += __popc(peers[u]);
      __syncwarp();
      const int64_t idx = base + warp * kEntryWarpItems + u * kWarp + lane;
      if (idx >= entries) continue;
      const int64_t j = first + idx / m;
      int row = -1;  // the output row, on node rank key / L where we forward
      if (key[u] >= 0) {
        int32_t out_row, count;
        if (forwards) {
          const NodeSegment g = sc.node_segs[static_cast<size_t>(key[u]) * N + s];
          out_row = g.out_row, count = g.count;
        } else {
          const Segment g = sc.segments[key[u] * N + s];
          out_row = g.out_row, count = g.count;
        }
        if (q < count) row = out_row + q;
        else bad = 1;  // more entries for this expert than the sender's routing row says
      }
      if (!noded || forwards) {  // the entries of the rows we received (combine_send sums them)
        const int64_t at = (plan.recv_base + j) * m + idx % m;  // (w, e): w = recv_base + j
        sc.entry_row[at] = row;
        sc.entry_weight[at] = row >= 0 ? weight[u] : 0.0f;
        if (noded) sc.entry_rank[at] = row >= 0 ? key[u] / L : -1;
        else if (row >= 0) sc.row_entry[row] = static_cast<int32_t>(at);
      }
      if (noded && row >= 0 && (!forwards || key[u] / L == own)) {  // one of our own output rows
        sc.row_wire[row] = static_cast<int32_t>(j);
        sc.row_weight[row] = weight[u];
      }
    }
    __syncthreads();  // hist is zeroed again
  }
  for (int i = threadIdx.x; i < K; i += kEntryThreads) next_base[i] = next[i];
  if (threadIdx.x == 0 && bad) report(in, kStatusBadRow);
}

// Rows per node, calls that wait in kernels (graph-safe): copies the rows of
// every remote sender we forward from our host workspace, where the proxy
// wrote them, to the same offsets of our device workspace, where our node's
// ranks read them, then raises forward[s] at every rank of the node (the
// proxy does this in eager calls: ProxyContext::before_forward). No plan
// (capacity, a failed wait): nothing, and every rank's entry_kernel returns
// before waiting, as all planned alike.
__global__ void __launch_bounds__(kEntryThreads) forward_kernel(DispatchRecvParams p) {
  if (stale_replay(p.inst)) return;  // a graph captured before a mask
  kernel_prologue();                 // the plan, after the proxy saw every row land
  const Instance& in = p.inst;
  const Scratch& sc = p.scratch;
  const uint64_t epoch = *reinterpret_cast<volatile uint64_t*>(in.epoch);
  if (*reinterpret_cast<volatile uint64_t*>(sc.plan_ok) != epoch) return;
  const Layout& l = in.layout;
  const int64_t P = in.max_private, row = static_cast<int64_t>(l.dispatch_row);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const auto copy = [&](size_t offset, int64_t bytes) {  // 16-byte pieces (rows and sections are aligned)
    const uint4* src = reinterpret_cast<const uint4*>(in.host_ws + offset);
    uint4* dst = reinterpret_cast<uint4*>(in.device_ws + offset);
    for (int64_t i = first; i < bytes / 16; i += stride) dst[i] = ld_16_stream(reinterpret_cast<const uint8_t*>(src + i));
  };
  for (int s = 0; s < in.world; ++s) {
    const SenderPlan sp = sc.senders[s];
    if (!node_sender(in, s) || sp.fwd != in.rank || sp.read_rows == 0) continue;
    const int64_t own = sp.read_rows < P ? sp.read_rows : P;
    copy(l.private_rows + static_cast<size_t>(s * P * row), own * row);
    copy(l.shared_rows + static_cast<size_t>(sp.read_shared_off * row), (sp.read_rows - own) * row);
  }
  if (!last_block_done(sc.done_blocks)) return;
  const int rpn = in.ranks_per_node, node0 = in.rank / rpn * rpn;
  for (int s = 0; s < in.world; ++s) {
    if (!node_sender(in, s) || forwarder_of(in, s) != in.rank) continue;  // 0 rows too: the peers wait for it
    for (int t = node0; t < node0 + rpn; ++t)
      if (same_node(in, t)) st_release_sys(flag_ptr(in.peers[t].host, l, s, kFlagForward), epoch);
  }
}

// Rows per node, calls that wait in kernels: one block waits for forward[s]
// of every remote sender of our node (forward_kernel at s's forwarder), so
// that no block of entry_kernel's wide grid ever spins: spinning blocks could
// hold every multiprocessor that the forwarder's kernel needs where ranks
// share a GPU (MPS, or the kernel tests' ranks in one process). A timeout
// delivers nothing, with the status set.
__global__ void forward_wait_kernel(DispatchRecvParams p) {
  if (stale_replay(p.inst)) return;  // a graph captured before a mask
  grid_dependency_wait();            // dependents start when it ends (it spins on other ranks)
  const Instance& in = p.inst;
  const uint64_t epoch = *reinterpret_cast<volatile uint64_t*>(in.epoch);
  if (*reinterpret_cast<volatile uint64_t*>(p.scratch.plan_ok) != epoch) return;  // no plan: no forwarder raises
  const uint64_t deadline = global_timer_ns() + in.timeout_ns;
  if (!wait_flags(in, kFlagForward, epoch, deadline, [&](int s) { return node_sender(in, s); })) deliver_nothing(p);
}

}  // namespace

cudaError_t launch_dispatch_forward(const DispatchRecvParams& p, cudaStream_t stream) {
  const Instance& in = p.inst;
  if (!in.node_rows || !in.has_remote) return cudaSuccess;
  const int64_t rows = in.max_recv;  // the most wire rows we forward (capacity)
  const int64_t pieces = rows * static_cast<int64_t>(in.layout.dispatch_row) / 16;
  int blocks = static_cast<int>((pieces + kEntryThreads - 1) / kEntryThreads);
  blocks = blocks < 1 ? 1 : (blocks > 264 ? 264 : blocks);  // two waves of an H200's 132 multiprocessors
  const cudaError_t err = launch_kernel(forward_kernel, blocks, kEntryThreads, 0, stream, p);
  return err != cudaSuccess ? err : launch_kernel(forward_wait_kernel, 1, kWarp, 0, stream, p);
}

cudaError_t launch_dispatch_entries(const DispatchRecvParams& p, cudaStream_t stream) {
  const Instance& in = p.inst;
  if (!wide(in)) return cudaSuccess;
  const int keys = in.local_experts * (in.node_rows ? in.ranks_per_node : 1);  // entry_kernel's K, at most
  const size_t smem = static_cast<size_t>(kEntryWarps + 1) * keys * sizeof(int32_t);
  cudaError_t err = allow_dynamic_smem(reinterpret_cast<const void*>(entry_kernel), smem);
  if (err != cudaSuccess) return err;
  return launch_kernel(entry_kernel, p.sender >= 0 ? 1 : in.world, kEntryThreads, smem, stream, p);
}

cudaError_t launch_dispatch_plan(const DispatchRecvParams& p, cudaStream_t stream) {
  const size_t smem = plan_smem_bytes(p.inst);
  const bool check = p.inst.maskable != 0;
  const auto kernel = wide(p.inst) ? (check ? plan_kernel<true, true> : plan_kernel<true, false>)
                                   : (check ? plan_kernel<false, true> : plan_kernel<false, false>);
  cudaError_t err = allow_dynamic_smem(reinterpret_cast<const void*>(kernel), smem);
  if (err != cudaSuccess) return err;
  return launch_kernel(kernel, 1, kPlanThreads, smem, stream, p);
}

}  // namespace moe_a2a::a2a::cuda
