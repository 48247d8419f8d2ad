// "This launch has finished writing": the last block of a grid to finish
// raises the epoch in every same-node peer's flag and in the proxy's flag.
// Flags live in the host workspaces (mapped shared memory), as in the CPU
// implementation, so a waiting rank can poll them from its CPU with a timeout
// as well as from a kernel. One launch fewer than a separate signalling
// kernel, which matters at decode sizes. A rank never waits for its own flag:
// its kernels that read what it wrote run later on the same stream. Here too
// the one wait of a kernel for a flag of the proxy.
#pragma once

#include "memory.cuh"
#include "rows.cuh"
#include "tuning.h"

namespace moe_a2a::a2a::cuda {

// Every thread of the grid calls it: true on thread 0 of the block that
// finishes last, once every block's stores are visible system-wide.
__device__ __forceinline__ bool last_block_done(uint32_t* done_blocks) {
  __syncthreads();  // the block's stores precede thread 0's fence
  if (threadIdx.x != 0) return false;
  fence_sys();  // our rows are visible everywhere before we are counted
  const uint32_t finished = atomicAdd(done_blocks, 1u);
  if (finished != gridDim.x - 1) return false;
  *done_blocks = 0;  // ready for the next launch (stream order)
  fence_sys();       // every other block's rows, observed through the count, before the flags
  return true;
}

__device__ __forceinline__ void signal_when_grid_done(const Instance& in, uint32_t* done_blocks, int kind,
                                                      uint64_t* proxy_flag) {
  if (in.world == 1) return;  // nobody to tell: our own later kernels follow in stream order
  if (!last_block_done(done_blocks)) return;
  const uint64_t epoch = *reinterpret_cast<volatile uint64_t*>(in.epoch);
  for (int r = 0; r < in.world; ++r)
    if (same_node(in, r)) st_release_sys(flag_ptr(in.peers[r].host, in.layout, in.rank, kind), epoch);
  if (proxy_flag != nullptr) st_release_sys(proxy_flag, epoch);
}

// Waits (every thread of the block) for flag `kind` of every sender s that
// `from(s)` names, in our host workspace; false, with the status set, on a
// timeout.
template <typename From>
__device__ inline bool wait_flags(const Instance& in, int kind, uint64_t epoch, uint64_t deadline, From from) {
  bool ok = true;
  for (int s = threadIdx.x; s < in.world; s += blockDim.x)
    if (from(s) && !wait_geq(flag_ptr(in.host_ws, in.layout, s, kind), epoch, deadline)) {
      report(in, kStatusTimeout);
      ok = false;
    }
  return __syncthreads_and(ok);
}

// wait_flags for every same-node peer but ourselves.
__device__ inline bool wait_peers(const Instance& in, int kind, uint64_t epoch, uint64_t deadline) {
  return wait_flags(in, kind, epoch, deadline, [&](int s) { return s != in.rank && same_node(in, s); });
}

// Waits (one thread) until the proxy's `flag` reaches `epoch`; false, with
// the status set, once the proxy failed or at the deadline.
__device__ inline bool wait_proxy(const Instance& in, const uint64_t* flag, uint64_t epoch, uint64_t deadline) {
  while (ld_acquire_sys(flag) < epoch) {
    if (ld_acquire_sys(in.proxy.failed) != 0) {
      report(in, kStatusProxyFailed);
      return false;
    }
    if (global_timer_ns() > deadline) {
      report(in, kStatusTimeout);
      return false;
    }
    __nanosleep(WaitTuning::kProxySleepNs);
  }
  return true;
}

// The proxy's flag a pack raises when its grid is done: none when staged
// (stage_kernel raises it, peer by peer, once the rows are in host memory).
__device__ __forceinline__ uint64_t* packed_flag(const Instance& in, uint64_t* proxy_flag) {
  return in.staged ? nullptr : proxy_flag;
}

}  // namespace moe_a2a::a2a::cuda
