// Memory ordering and wide accesses for the kernels: the only file with inline
// PTX. Flags between ranks, GPUs and the host proxy are 64-bit sequence
// numbers (epochs) written with system-scope release stores and read with
// system-scope acquire loads, because their readers are other processes,
// other GPUs (CUDA IPC) or a CPU thread polling pinned host memory.
#pragma once

#include <cstdint>

namespace moe_a2a::a2a::cuda {

// ld_acquire_<scope> and st_release_<scope> of a 64-bit flag: scope sys for
// the readers above, gpu for a flag between blocks of one grid.
#define MOE_A2A_FLAG_ACCESS(scope)                                                            \
  __device__ __forceinline__ uint64_t ld_acquire_##scope(const uint64_t* p) {                 \
    uint64_t v;                                                                               \
    asm volatile("ld.acquire." #scope ".global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory"); \
    return v;                                                                                 \
  }                                                                                           \
  __device__ __forceinline__ void st_release_##scope(uint64_t* p, uint64_t v) {               \
    asm volatile("st.release." #scope ".global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");   \
  }
MOE_A2A_FLAG_ACCESS(sys)
MOE_A2A_FLAG_ACCESS(gpu)
#undef MOE_A2A_FLAG_ACCESS

// Makes this thread's earlier writes (to device, peer and host memory) visible
// to every observer before its later ones.
__device__ __forceinline__ void fence_sys() { asm volatile("fence.sc.sys;" ::: "memory"); }

// Nanoseconds since an arbitrary origin, the same on every SM: deadlines.
__device__ __forceinline__ uint64_t global_timer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// 16-byte accesses. Rows are 16-byte aligned (protocol.md); callers check
// alignment of the rest before taking these paths.
// Streaming load: read once, so do not keep it in L1.
__device__ __forceinline__ uint4 ld_16_stream(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

// Asks L2 for the line holding p; nothing waits for it.
__device__ __forceinline__ void prefetch_l2(const void* p) { asm volatile("prefetch.global.L2 [%0];" ::"l"(p)); }

__device__ __forceinline__ void st_16(void* p, uint4 v) {
  asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
}

__device__ __forceinline__ void st_8(void* p, uint2 v) {
  asm volatile("st.global.v2.u32 [%0], {%1, %2};" ::"l"(p), "r"(v.x), "r"(v.y) : "memory");
}

// The bulk copy engine (sm_90): a thread hands whole shared-memory buffers to
// cp.async.bulk, which writes them to global memory while the block goes on.
// Buffers are written by ordinary stores first: each writing thread fences
// (fence_proxy_async_shared) before the barrier after which one thread
// issues the copies. Before a buffer is refilled, the thread that issued its
// copies waits until at most `kPending` of its groups still read shared memory.
__device__ __forceinline__ void fence_proxy_async_shared() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

__device__ __forceinline__ void bulk_store(void* dst, const void* src_smem, uint32_t bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst),
               "r"(static_cast<uint32_t>(__cvta_generic_to_shared(src_smem))), "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }

template <int kPending>
__device__ __forceinline__ void bulk_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(kPending) : "memory");
}

// Every copy this thread issued has been written; then ordered before this
// thread's later ordinary accesses (the flags that announce the rows).
__device__ __forceinline__ void bulk_wait_written() {
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
  asm volatile("fence.proxy.async.global;" ::: "memory");
}

// Programmatic dependent launch (sm_90). A kernel launched with
// launch_kernel (launch.h) may start while the previous kernel of its stream
// still runs, so every kernel calls grid_dependency_wait() before its first
// access to global memory: it returns once the grids it depends on have
// completed with their writes visible (at once for a launch without the
// attribute). allow_dependents() lets the next kernel's blocks be scheduled
// (they wait in turn). A kernel that spins on another process's flag allows
// its dependents only after the wait, so that their resident blocks never
// hold the multiprocessors that the other process's kernel needs (ranks
// sharing a GPU under MPS).
__device__ __forceinline__ void grid_dependency_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void allow_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// The start of a kernel that waits for no other process.
__device__ __forceinline__ void kernel_prologue() {
  grid_dependency_wait();
  allow_dependents();
}

// Waits until *flag >= target or the deadline passes; false on timeout. Backs
// off with __nanosleep so a spinning thread leaves issue slots to others.
// kGpuScope: a flag raised by another block of the same grid. kMaxSleepNs
// bounds how late a waiter may see the flag.
template <bool kGpuScope = false, unsigned kMaxSleepNs = 1024>
__device__ __forceinline__ bool wait_geq(const uint64_t* flag, uint64_t target, uint64_t deadline_ns) {
  unsigned sleep_ns = 32;
  while ((kGpuScope ? ld_acquire_gpu(flag) : ld_acquire_sys(flag)) < target) {
    if (global_timer_ns() > deadline_ns) return false;
    __nanosleep(sleep_ns);
    if (sleep_ns < kMaxSleepNs) sleep_ns *= 2;
  }
  return true;
}

}  // namespace moe_a2a::a2a::cuda
