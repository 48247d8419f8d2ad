// Rows for remote peers, to the fabric peer by peer (Instance::staged). The
// pack kernels put those rows into the device workspace, at the offsets they
// have in the host workspace that the fabric reads; this kernel copies each
// remote peer's block of rows there in the proxy's serving order (rank + 1,
// rank + 2, ...) and raises that peer's flag as soon as its last chunk is
// in, so the proxy writes the first peers' rows while later ones are still
// being copied. Without it the proxy starts once every row of every peer is
// in host memory, and packing, the fabric and the read-back run one after
// another.
// Dispatch: our send rows [send_off[r], send_off[r] + c[us][r]) (from our
// routing row); combine: our combine_send rows [recv_base[s], + c[s][us])
// (from the plan).
#include <cuda_runtime.h>

#include "launch.h"
#include "memory.cuh"
#include "rows.cuh"

namespace moe_a2a::a2a::cuda {
namespace {

constexpr int kStageThreads = 256;
constexpr int kStageBlocksPerSm = 4;
constexpr int kStageUnroll = 4;  // 16-byte loads a thread issues before its stores
// Bytes of one work item, copied by one block: each ends with a system-scope
// fence and a count, so large enough to amortise them, small enough that a
// decode-sized peer (a few MB) spreads over many blocks.
constexpr int64_t kStageChunkBytes = 64 * 1024;

// A remote peer's block of the section, in serving order. Shared memory.
struct StagePeer {
  int64_t offset;       // bytes from the section's start
  int64_t bytes;
  int32_t rank;
  int32_t first_chunk;  // its first work item
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

// Thread 0: the remote peers' blocks in serving order; returns the work
// items in all. `first` [world + 1] is scratch.
__device__ int plan_peers(const StageParams& p, StagePeer* peers, int64_t* first, int* count) {
  const Instance& in = p.inst;
  const int N = in.world, L = in.local_experts;
  const size_t row = p.kind == kStageDispatch ? in.layout.dispatch_row : in.layout.combine_row;
  if (p.kind == kStageDispatch) {  // send_off[r] is over every rank, same-node ones included
    const uint32_t* counts = routing_row(in.device_ws, in.layout, in.rank, in.num_experts);
    first[0] = 0;
    for (int r = 0; r < N; ++r) {
      int64_t c = 0;
      for (int i = 0; i < L; ++i) c += counts[r * L + i];
      first[r + 1] = first[r] + c;
    }
  }
  int chunks = 0, m = 0;
  for (int d = 1; d <= N; ++d) {
    const int r = (in.rank + d) % N;
    if (same_node(in, r)) continue;
    const bool dispatch = p.kind == kStageDispatch;
    const int64_t begin = dispatch ? first[r] : p.scratch.senders[r].recv_base;
    const int64_t rows = dispatch ? first[r + 1] - first[r] : p.scratch.senders[r].copies;
    StagePeer& peer = peers[m++];
    peer.offset = begin * static_cast<int64_t>(row);
    peer.bytes = rows * static_cast<int64_t>(row);
    peer.rank = r;
    peer.first_chunk = chunks;
    chunks += static_cast<int>((peer.bytes + kStageChunkBytes - 1) / kStageChunkBytes);
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
  extern __shared__ int64_t stage_smem[];  // first rows [world + 1], then the peers
  kernel_prologue();  // the pack's rows, from here on
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
  for (int item = blockIdx.x; item < items; item += gridDim.x) {
    const StagePeer& peer = peers[find_peer(peers, count, item)];
    const int64_t begin = static_cast<int64_t>(item - peer.first_chunk) * kStageChunkBytes;
    const int64_t end = begin + kStageChunkBytes < peer.bytes ? begin + kStageChunkBytes : peer.bytes;
    const size_t at = section + peer.offset + begin;
    block_copy(in.fabric_ws + at, in.device_ws + at, end - begin);
    __syncthreads();  // the block's stores precede thread 0's fence
    if (threadIdx.x == 0) {
      fence_sys();  // our chunk is visible to the proxy and the NIC before it is counted
      const uint32_t chunks = static_cast<uint32_t>((peer.bytes + kStageChunkBytes - 1) / kStageChunkBytes);
      if (atomicAdd(p.scratch.stage_chunks + peer.rank, 1u) == chunks - 1) {
        p.scratch.stage_chunks[peer.rank] = 0;  // ready for the next launch (stream order)
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
  const int64_t items = max_bytes / kStageChunkBytes + in.world;  // each peer's last chunk may be partial
  cudaError_t err = allow_dynamic_smem(reinterpret_cast<const void*>(stage_kernel), smem);
  if (err != cudaSuccess) return err;
  return launch_kernel(stage_kernel, persistent_blocks(items, 1, kStageBlocksPerSm), kStageThreads, smem, stream, p);
}

}  // namespace moe_a2a::a2a::cuda
