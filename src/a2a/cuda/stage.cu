// Rows for remote peers, to the fabric peer by peer (Instance::staged). The
// pack kernels put those rows into the device workspace, at the offsets they
// have in the host workspace that the fabric reads; this kernel copies each
// remote peer's block of rows there in the proxy's serving order (rank + 1,
// rank + 2, ...) and raises that peer's flag as soon as its last chunk is
// in, so the proxy writes the first peers' rows while later ones are still
// being copied. Without it the proxy starts once every row of every peer is
// in host memory, and packing, the fabric and the read-back run one after
// another.
// Dispatch: our send rows [send_off[r], send_off[r] + u[us][r]) (from our
// routing row's wire rows); combine: our combine_send rows [recv_base[s],
// + u[s][us]) (from the plan). Within a peer's block, each slice of it (slices.h: the
// proxy's writes) gets its own flag once its chunks are in, so the proxy
// posts a peer's first rows while its later ones are still being copied.
#include <cuda_runtime.h>

#include "launch.h"
#include "memory.cuh"
#include "rows.cuh"
#include "tuning.h"

namespace moe_a2a::a2a::cuda {
namespace {

// Launch tuning: StageTuning (tuning.h).
constexpr int kStageThreads = StageTuning::kThreads;
constexpr int kStageBlocksPerSm = StageTuning::kBlocksPerSm;
constexpr int kStageUnroll = StageTuning::kUnroll;
constexpr int64_t kStageChunkBytes = StageTuning::kChunkBytes;

// A remote peer's block of the section, in serving order. Shared memory.
struct StagePeer {
  int64_t offset;  // bytes from the section's start
  int64_t bytes;
  DispatchSlices cut;    // its rows as the proxy writes them
  int32_t per_slice[2];  // work items of each slice of a part (the last slice may use fewer bytes)
  int32_t rank;
  int32_t first_chunk;  // its first work item
  int32_t chunks;       // its work items
};

__device__ __forceinline__ void block_copy(uint8_t* dst, const uint8_t* src, int64_t bytes) {
  const int64_t vecs = bytes / 16;  // rows are whole 16-byte pieces
  for (int64_t base = threadIdx.x; base < vecs; base += kStageUnroll * kStageThreads) {
    uint4 v[kStageUnroll];
#pragma unroll
    for (int u = 0; u < kStageUnroll; ++u)
      if (base + u * kStageThreads < vecs) v[u] = ld_16_stream(src + (base + u * kStageThreads) * 16);
#pragma unroll
    for (int u = 0; u < kStageUnroll; ++u)
      if (base + u * kStageThreads < vecs) st_16(dst + (base + u * kStageThreads) * 16, v[u]);
  }
}

__device__ __forceinline__ uint64_t* peer_flag(const StageParams& p, int r) {
  uint64_t* base = p.kind == kStageDispatch ? p.inst.proxy.peer_packed : p.inst.proxy.peer_combine_packed;
  return base + static_cast<size_t>(r) * kPeerFlagStride;
}

__device__ __forceinline__ uint64_t* slice_flag(const StageParams& p, int r, uint32_t k) {
  uint64_t* base = p.kind == kStageDispatch ? p.inst.proxy.slices_packed : p.inst.proxy.combine_slices_packed;
  return base + static_cast<size_t>(r) * kMaxPeerSlices + k;
}

// Thread 0: the remote peers' blocks in serving order; returns the work
// items in all. `first` [world + 1] is scratch.
__device__ int plan_peers(const StageParams& p, StagePeer* peers, int64_t* first, int* count) {
  const Instance& in = p.inst;
  const int N = in.world;
  const size_t row = p.kind == kStageDispatch ? in.layout.dispatch_row : in.layout.combine_row;
  if (p.kind == kStageDispatch) {  // send_off[r] is over every rank's wire rows, same-node ones included
    const uint32_t* wire = routing_row(in.device_ws, in.layout, in.rank) + in.num_experts;  // u[0..N)
    first[0] = 0;
    for (int r = 0; r < N; ++r) first[r + 1] = first[r] + wire[r];
  }
  int chunks = 0, m = 0;
  for (int d = 1; d <= N; ++d) {
    const int r = (in.rank + d) % N;
    if (same_node(in, r)) continue;
    const bool dispatch = p.kind == kStageDispatch;
    const int64_t begin = dispatch ? first[r] : p.scratch.senders[r].recv_base;
    const int64_t rows = dispatch ? first[r + 1] - first[r] : p.scratch.senders[r].wire;
    StagePeer& peer = peers[m++];
    peer.offset = begin * static_cast<int64_t>(row);
    peer.bytes = rows * static_cast<int64_t>(row);
    peer.cut = dispatch ? dispatch_slices(rows, in.max_private, row, in.slice_bytes)
                        : combine_slices(rows, row, in.slice_bytes);
    peer.rank = r;
    peer.first_chunk = chunks;
    peer.chunks = 0;
    for (int part = 0; part < 2; ++part) {
      const Slices& sl = peer.cut.part[part];
      peer.per_slice[part] = static_cast<int32_t>((sl.per * row + kStageChunkBytes - 1) / kStageChunkBytes);
      peer.chunks += peer.per_slice[part] * static_cast<int32_t>(sl.count);
    }
    chunks += peer.chunks;
  }
  *count = m;
  return chunks;
}

// The peer whose chunks hold work item `item`: the last one starting at or
// before it (peers with no bytes start where the next one does).
__device__ __forceinline__ int find_peer(const StagePeer* peers, int count, int item) {
  int lo = 0, hi = count;
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (peers[mid].first_chunk <= item) lo = mid;
    else hi = mid;
  }
  return lo;
}

__global__ void __launch_bounds__(kStageThreads, kStageBlocksPerSm) stage_kernel(StageParams p) {
  if (stale_replay(p.inst)) return;  // a graph captured before a mask
  extern __shared__ int64_t stage_smem[];  // first rows [world + 1], then the peers
  kernel_prologue();                       // the pack's rows, from here on
  const Instance& in = p.inst;
  auto* peers = reinterpret_cast<StagePeer*>(stage_smem + in.world + 1);
  __shared__ int items, count;
  if (threadIdx.x == 0) items = plan_peers(p, peers, stage_smem, &count);
  __syncthreads();
  const uint64_t epoch = *reinterpret_cast<volatile uint64_t*>(in.epoch);
  // Peers we send nothing still hear "packed" (the combine writes to every
  // peer, even empty; the proxy waits for each peer's flag).
  if (blockIdx.x == 0 && threadIdx.x == 0)
    for (int k = 0; k < count; ++k)
      if (peers[k].bytes == 0) st_release_sys(peer_flag(p, peers[k].rank), epoch);
  const size_t section = p.kind == kStageDispatch ? in.layout.send : in.layout.combine_send;
  const size_t row = p.kind == kStageDispatch ? in.layout.dispatch_row : in.layout.combine_row;
  for (int item = blockIdx.x; item < items; item += gridDim.x) {
    const StagePeer& peer = peers[find_peer(peers, count, item)];
    // The slice (k among the peer's) and the chunk in it that this item copies.
    const int local = item - peer.first_chunk;
    const int in_first = peer.per_slice[0] * static_cast<int>(peer.cut.part[0].count);
    const int part = local < in_first ? 0 : 1;
    const int rest = part == 0 ? local : local - in_first;
    const uint32_t index = static_cast<uint32_t>(rest / peer.per_slice[part]);
    const uint32_t k = part == 0 ? index : peer.cut.part[0].count + index;
    const Slices& sl = peer.cut.part[part];
    const int64_t slice_begin = static_cast<int64_t>(sl.begin(index) * row);
    const int64_t slice_end = static_cast<int64_t>(sl.end(index) * row);
    const int64_t begin = slice_begin + static_cast<int64_t>(rest % peer.per_slice[part]) * kStageChunkBytes;
    const int64_t end = begin + kStageChunkBytes < slice_end ? begin + kStageChunkBytes : slice_end;
    const size_t at = section + peer.offset + begin;
    // GPU-direct (fabric_ws is device_ws): the rows are where the fabric reads
    // them; only the flags below are raised, after the fence.
    if (end > begin && in.fabric_ws != in.device_ws) block_copy(in.fabric_ws + at, in.device_ws + at, end - begin);
    __syncthreads();  // the block's stores precede thread 0's fence
    if (threadIdx.x == 0) {
      fence_sys();  // our chunk is visible to the proxy and the NIC before it is counted
      uint32_t* slice_count = p.scratch.stage_slices + static_cast<size_t>(peer.rank) * kMaxPeerSlices + k;
      if (atomicAdd(slice_count, 1u) == static_cast<uint32_t>(peer.per_slice[part]) - 1) {
        *slice_count = 0;  // ready for the next launch (stream order)
        fence_sys();       // the slice's other chunks, observed through the count, before its flag
        st_release_sys(slice_flag(p, peer.rank, k), epoch);
      }
      if (atomicAdd(p.scratch.stage_chunks + peer.rank, 1u) == static_cast<uint32_t>(peer.chunks) - 1) {
        p.scratch.stage_chunks[peer.rank] = 0;
        fence_sys();  // the other blocks' chunks, observed through the count, before the flag
        st_release_sys(peer_flag(p, peer.rank), epoch);
      }
    }
  }
  // The last block raises the whole call's flag too (what a stand-in for the
  // proxy, or a proxy that waits for all, reads).
  __syncthreads();
  if (threadIdx.x != 0) return;
  fence_sys();
  if (atomicAdd(p.scratch.done_blocks, 1u) != gridDim.x - 1) return;
  *p.scratch.done_blocks = 0;
  fence_sys();
  st_release_sys(p.kind == kStageDispatch ? in.proxy.packed : in.proxy.combine_packed, epoch);
}

}  // namespace

cudaError_t launch_stage(const StageParams& p, cudaStream_t stream) {
  const Instance& in = p.inst;
  const size_t smem = (in.world + 1) * sizeof(int64_t) + static_cast<size_t>(in.world) * sizeof(StagePeer);
  const int64_t max_bytes = p.kind == kStageDispatch
                                ? static_cast<int64_t>(in.max_tokens) * in.topk * in.layout.dispatch_row
                                : in.max_recv * static_cast<int64_t>(in.layout.combine_row);
  // Each slice's last chunk may be partial.
  const int64_t items = max_bytes / kStageChunkBytes + static_cast<int64_t>(in.world) * kMaxPeerSlices;
  cudaError_t err = allow_dynamic_smem(reinterpret_cast<const void*>(stage_kernel), smem);
  if (err != cudaSuccess) return err;
  return launch_kernel(stage_kernel, persistent_blocks(items, 1, kStageBlocksPerSm), kStageThreads, smem, stream, p);
}

}  // namespace moe_a2a::a2a::cuda
