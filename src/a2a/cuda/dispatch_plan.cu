// Dispatch, receive half, step 1: plan_kernel (one block, beside our pack
// kernel) waits for the route flag of every same-node sender and, with
// remote peers, for the proxy's dispatch_done; plans (recv_plan.cuh); then
// waits for the packs, whose rows the copy kernel after it reads.
#include <cuda_runtime.h>

#include "launch.h"
#include "recv_plan.cuh"
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
__global__ void __launch_bounds__(kPlanThreads, kPlanMinBlocks) plan_kernel(DispatchRecvParams p) {
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
  compute_plan(p, matrix, ok);
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

}  // namespace

cudaError_t launch_dispatch_plan(const DispatchRecvParams& p, cudaStream_t stream) {
  const size_t smem = plan_smem_bytes(p.inst);
  cudaError_t err = allow_dynamic_smem(reinterpret_cast<const void*>(plan_kernel), smem);
  if (err != cudaSuccess) return err;
  return launch_kernel(plan_kernel, 1, kPlanThreads, smem, stream, p);
}

}  // namespace moe_a2a::a2a::cuda
