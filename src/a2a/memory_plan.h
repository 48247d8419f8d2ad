// What one rank's instance allocates, known before anything is: from the
// Layout its workspaces are cut by and the CUDA kernels' scratch sections.
// Workspace and CudaAllToAll allocate by these same functions.
#pragma once

#include <cstddef>

#include "config.h"
#include "cuda/scratch.h"
#include "layout.h"
#include "shm.h"

namespace moe_a2a::a2a {

constexpr size_t kPageBytes = 4096;

// share_rows=false: the row sections, page-aligned inside, are private
// memory of the creator (workspace.h); otherwise nothing is.
inline PrivateRange private_rows_range(const Layout& l, bool share_rows) {
  if (share_rows) return {};
  return {align_up(l.private_rows, kPageBytes), l.aborts / kPageBytes * kPageBytes};
}

// Bytes per rank. Host memory is touched as rows are written, so a call
// that fills fewer rows than the maxima uses less; the CUDA backend pins its
// whole host workspace, and device memory is allocated whole.
struct MemoryPlan {
  size_t workspace = 0;             // one host workspace (Layout::total)
  // The workspace in whole pages: a POSIX shared-memory file (/dev/shm) the
  // node's ranks map, and private memory (rows no peer reads).
  size_t host_shared = 0;
  size_t host_private = 0;
  size_t fabric_registered = 0;     // registered with the transfer engine (0 without remote peers)
  size_t cuda_pinned = 0;           // host memory registered with CUDA: our workspace and peers' heads
  size_t peer_mapped = 0;           // same-node peers' workspaces mapped here (their memory, not ours)
  size_t device_workspace = 0;      // cudaMalloc: the device workspace
  size_t device_scratch = 0;        // cudaMalloc: the kernels' scratch
  size_t host() const { return host_shared + host_private; }
  size_t device() const { return device_workspace + device_scratch; }
};

// `cuda`: the CUDA backend (its rows stay private, `share_rows` is ignored);
// `has_remote`: some peer is on another node (the workspace is registered).
inline MemoryPlan plan_memory(const A2AConfig& c, bool cuda, bool share_rows, bool has_remote) {
  const Layout l = Layout::of(c);
  const PrivateRange rows = private_rows_range(l, share_rows && !cuda);
  const size_t same_node_peers = static_cast<size_t>(c.ranks_per_node) - 1;
  MemoryPlan p;
  p.workspace = l.total;
  p.host_private = rows.empty() ? 0 : rows.end - rows.begin;
  p.host_shared = align_up(l.total, kPageBytes) - p.host_private;  // whole pages, as the kernel counts them
  p.fabric_registered = has_remote ? l.total : 0;
  p.peer_mapped = same_node_peers * l.total;
  if (cuda) {
    p.cuda_pinned = l.total + same_node_peers * l.private_rows;  // CudaAllToAll: peers' heads up to their rows
    p.device_workspace = l.total;
    p.device_scratch = cuda::scratch_bytes(c);
  }
  return p;
}

}  // namespace moe_a2a::a2a
