// Sections of the CUDA kernels' device scratch, in the order CudaAllToAll
// cuts them. Host C++ only (no CUDA headers), so the memory plan
// (memory_plan.h) sizes the scratch where no CUDA is built.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>

#include "params.h"

namespace moe_a2a::a2a::cuda {

// Copies that one block of the large calls' routing handles.
constexpr int kRouteBlockCopies = 1024;
inline int route_blocks(int64_t max_copies) {
  return static_cast<int>((max_copies + kRouteBlockCopies - 1) / kRouteBlockCopies);
}

constexpr size_t kScratchAlign = 256;
constexpr size_t kScratchSections = 17;

// Bytes of each section of Scratch (params.h), in the order of its fields.
inline std::array<size_t, kScratchSections> scratch_sizes(const A2AConfig& c) {
  const size_t copies = static_cast<size_t>(c.max_tokens) * c.topk;
  const size_t world = static_cast<size_t>(c.world);
  return {
      sizeof(int32_t),                                  // num_tokens
      copies * sizeof(int32_t),                         // slots
      copies * sizeof(int32_t),                         // copy_rank
      copies * sizeof(uint8_t*),                        // copy_dst
      static_cast<size_t>(route_blocks(static_cast<int64_t>(copies))) * c.num_experts * sizeof(int32_t),  // block_base
      sizeof(int32_t),                                  // dropped
      sizeof(uint32_t),                                 // done_blocks
      world * sizeof(SenderPlan),                       // senders
      static_cast<size_t>(c.num_experts) * sizeof(Segment),  // segments
      sizeof(int32_t),                                  // output_rows
      sizeof(uint64_t),                                 // plan_ready
      sizeof(uint32_t),                                 // plan_ticket
      world * sizeof(uint32_t),                         // stage_chunks
      world * kMaxPeerSlices * sizeof(uint32_t),        // stage_slices
      sizeof(uint64_t),                                 // epoch
      copies * sizeof(int32_t),                         // self_copy
      copies * sizeof(int32_t),                         // self_row
  };
}

inline size_t scratch_bytes(const A2AConfig& c) {
  size_t total = 0;
  for (size_t s : scratch_sizes(c)) total += align_up(s, kScratchAlign);
  return total;
}

}  // namespace moe_a2a::a2a::cuda
