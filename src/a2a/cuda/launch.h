// Host entry points of the CUDA kernels: each takes its parameter struct and
// a stream, enqueues its kernels and returns the launch error. None of them
// synchronises with the host, so each can be captured in a CUDA graph; counts
// that vary per call (tokens, received rows) are read by the kernels from
// device memory.
#pragma once

#include <cuda_runtime.h>

#include <utility>

#include "params.h"
#include "scratch.h"  // route_blocks
#include "tuning.h"

namespace moe_a2a::a2a::cuda {

// Routing row, send rows, and every copy packed where it goes; raises
// route_ready/packed for the proxy and the dispatch flag of same-node peers.
cudaError_t launch_dispatch_send(const DispatchSendParams& p, cudaStream_t stream);

// Waits for every sender, plans (tokens_per_expert, output rows) and copies
// into the expert-major, padded output.
cudaError_t launch_dispatch_recv(const DispatchRecvParams& p, cudaStream_t stream);

// Returns every expert output row to the rank and row it came from; raises
// combine_packed and the combine flag of same-node peers.
cudaError_t launch_combine_send(const CombineSendParams& p, cudaStream_t stream);

// Rows per node, before launch_combine_send: our outputs that a forwarder
// sums into fp32 y_stage, then our staged flag at every node rank (whose
// combine_send must wait for it: on the host, or with wait_in_kernel in a
// kernel after it). Nothing otherwise.
cudaError_t launch_stage_outputs(const CombineSendParams& p, cudaStream_t stream);

// Waits for every receiver, then the fp32 weighted sum per token.
cudaError_t launch_combine_recv(const CombineRecvParams& p, cudaStream_t stream);

// Staged calls (Instance::staged): rows for remote peers from the device
// workspace to the fabric's host memory, peer by peer, each slice's and each
// peer's flag raised for the proxy once its rows are there (stage.cu).
cudaError_t launch_stage(const StageParams& p, cudaStream_t stream);

// Eager receive, sender by sender (fabric peers): the plan alone, then copy
// launches as a sender's slices land (`p.sender`, its copies
// [p.sender_first, p.sender_end)).
cudaError_t launch_dispatch_plan(const DispatchRecvParams& p, cudaStream_t stream);
cudaError_t launch_copy_sender(const DispatchRecvParams& p, cudaStream_t stream);
// Rows per rank: where the entries of per-rank senders' rows go (after the
// plan, before the copies): every sender's (p.sender < 0), or p.sender's
// wire rows [p.sender_first, p.sender_end). Nothing without rows per rank.
cudaError_t launch_dispatch_entries(const DispatchRecvParams& p, cudaStream_t stream);
// Rows per node, receives that wait in kernels: the rows we forward from our
// host workspace to our device workspace, then forward[s] at the node's
// ranks; then one block waits for every forward[s] of ours. Nothing otherwise.
cudaError_t launch_dispatch_forward(const DispatchRecvParams& p, cudaStream_t stream);

// The routing step of large dispatch sends, in two launches (dispatch_route.cu).
cudaError_t launch_route(const DispatchSendParams& p, cudaStream_t stream);

// Packing of large dispatch sends through the bulk copy engine
// (dispatch_bulk.cu), after launch_route, where bulk_pack_fits.
bool bulk_pack_fits(const DispatchSendParams& p);
cudaError_t launch_bulk_pack(const DispatchSendParams& p, cudaStream_t stream);

// Rows of the dispatch output buffers that a call may fill.
MOE_A2A_HD inline int64_t max_output_rows(const Instance& in) {
  return in.max_recv + static_cast<int64_t>(in.local_experts) * (in.expert_padding - 1);
}

// Threads for `work` items of one block: whole warps, at most `limit`.
inline int round_up_threads(int work, int limit) {
  constexpr int kWarpSize = 32;
  int threads = (work + kWarpSize - 1) / kWarpSize * kWarpSize;
  if (threads < kWarpSize) threads = kWarpSize;
  return threads < limit ? threads : limit;
}

// Whether launches use programmatic dependent launch: on sm_90 and newer,
// unless MOE_A2A_CUDA_PDL=0 in the environment (read once per device).
bool use_pdl();

// Whether large dispatch sends pack through the bulk copy engine: on sm_90
// and newer, unless MOE_A2A_CUDA_BULK=0 (read once per device).
bool use_bulk_pack();

// kernel<<<grid, block, smem, stream>>>(args...), with programmatic dependent
// launch where use_pdl(): the kernel's blocks may be scheduled while the
// previous kernel of the stream runs (hiding the launch gap, which dominates
// decode-sized steps); each kernel calls kernel_prologue() (memory.cuh)
// first, which waits for that kernel. Works in stream capture.
template <typename... Params, typename... Args>
cudaError_t launch_kernel(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                          Args&&... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attribute;
  config.numAttrs = use_pdl() ? 1 : 0;
  return cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
}

// Raises a kernel's dynamic shared memory limit to `bytes` once per device
// (not again while a stream is being captured into a graph).
cudaError_t allow_dynamic_smem(const void* kernel, size_t bytes);

// Blocks of a persistent grid over `items` work items of `per_block` each:
// enough to fill the device (`per_sm` blocks on each multiprocessor), no
// more than the work needs.
constexpr int kDefaultBlocksPerSm = GridTuning::kDefaultBlocksPerSm;
int persistent_blocks(int64_t items, int per_block, int per_sm = kDefaultBlocksPerSm);

}  // namespace moe_a2a::a2a::cuda
