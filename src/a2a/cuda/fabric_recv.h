// The eager receive halves of a rank with fabric peers: rows are taken as
// they land, sender by sender and slice by slice (slices.h), while later
// ones are still on the wire. Dispatch launches a copy kernel for each
// sender's landed slices; combine copies each remote peer's landed rows from
// the host workspace (where the fabric put them) to the same offsets of the
// device workspace with the copy engine, so the reduction reads GPU memory
// only (MOE_A2A_CUDA_COMBINE_DMA, on unless 0).
#pragma once

#include <cuda_runtime.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <vector>

#include "../plan.h"
#include "../signals.h"
#include "params.h"

namespace moe_a2a::a2a::cuda {

// What the fabric receive reads of its rank during one call.
struct LandingView {
  const A2AConfig* cfg = nullptr;
  const Layout* layout = nullptr;
  uint8_t* host_ws_cpu = nullptr;  // our host workspace (host address): flags, rows from the fabric
  uint8_t* device_ws = nullptr;    // our device workspace
  const ProxySignals* signals = nullptr;
  PeerSignals peer;
  uint64_t epoch = 0;
  std::chrono::steady_clock::time_point deadline;
  std::function<void()> check;  // raises the proxy's or a peer's failure
  // GPU-direct through a NIC: run before launching a copy of rows the host
  // saw land (CudaResources::flush_fabric_writes); empty otherwise.
  std::function<void()> before_read;
};

class FabricReceive {
 public:
  // Dispatch: launches `p` (after the plan) for each sender's copies as its
  // slices land, ourselves first, until every sender's are copied. `matrix`
  // is the call's routing matrix on the host; `on_first(s)` runs before
  // sender s's first copy (a cached call checks its routing stamp there).
  void copy_dispatch(const LandingView& v, DispatchRecvParams p, const uint32_t* matrix, bool cached,
                     const std::function<void(int)>& on_first, cudaStream_t stream);

  // Combine: where each remote peer's rows will land, from the dispatch's
  // matrix (peers may rewrite it by then), kept for the call's combine.
  void note_combine_blocks(const LandingView& v, const RoutingView& matrix);
  // Whether combine_recv of `epoch` copies remote rows to the device.
  bool combine_on_device(uint64_t epoch) const { return blocks_epoch_ == epoch; }
  // Each remote peer's combine rows to the device workspace as they land.
  void copy_combine(const LandingView& v, cudaStream_t stream);

 private:
  struct CombineBlock {
    int peer;
    size_t offset, bytes;  // in the combine_recv section, the same in both workspaces
  };
  uint64_t blocks_epoch_ = 0;  // the call they were taken for
  std::vector<CombineBlock> blocks_;
};

// Which of remote sender s's slices have landed in call `epoch`: every one
// when its whole flag (or the call's) is up, else its progress word.
uint32_t slices_landed(const Seq& progress, const Seq& whole, const Seq& all, uint64_t epoch, uint32_t count);

}  // namespace moe_a2a::a2a::cuda
