// Sections of the CUDA kernels' device scratch, in the order CudaResources
// cuts them. Host C++ only (no CUDA headers), so the memory plan
// (memory_plan.h) sizes the scratch where no CUDA is built.
#pragma once

#include <cstddef>
#include <cstdint>

#include "params.h"
#include "tuning.h"

namespace moe_a2a::a2a::cuda {

// Copies that one block of the large calls' routing handles.
constexpr int kRouteBlockCopies = RouteTuning::kBlockCopies;
inline int route_blocks(int64_t max_copies) {
  return static_cast<int>((max_copies + kRouteBlockCopies - 1) / kRouteBlockCopies);
}

constexpr size_t kScratchAlign = 256;

// Every section of the device scratch, in order: `section(pointer, count)`
// names the pointer a section is carved for and its element count. Carving
// walks it twice: once to add up the sizes, once to hand out the addresses.
template <typename Section>
void scratch_sections(const A2AConfig& cfg, Scratch& s, uint64_t*& epoch, Section&& section) {
  const size_t copies = static_cast<size_t>(cfg.max_tokens) * cfg.topk;
  // Routing keys: experts, and with rows per rank or node one more per rank (route.cuh).
  const size_t keys = static_cast<size_t>(cfg.num_experts) + (cfg.wide_rows() ? cfg.world : 0);
  const size_t route_blocks_experts = static_cast<size_t>(route_blocks(static_cast<int64_t>(copies))) * keys;
  // Rows per rank or node only (A2AConfig::wide_rows): otherwise these sections are empty.
  const bool ranked = cfg.wide_rows();
  const bool noded = cfg.node_rows();  // rows per node only
  const size_t entries = ranked ? static_cast<size_t>(cfg.max_recv_tokens) * cfg.max_entries() : 0;
  const size_t out_rows = ranked ? static_cast<size_t>(cfg.max_output_rows()) : 0;
  const size_t node_keys = static_cast<size_t>(cfg.ranks_per_node) * cfg.num_local_experts();
  section(s.num_tokens, 1);
  section(s.slots, copies);
  section(s.copy_rank, copies);
  section(s.copy_dst, copies);
  section(s.block_base, route_blocks_experts);
  section(s.dropped, 1);
  section(s.done_blocks, 1);
  section(s.senders, static_cast<size_t>(cfg.world));
  section(s.segments, static_cast<size_t>(cfg.num_experts));
  section(s.output_rows, 1);
  section(s.plan_ready, 1);
  section(s.plan_ticket, 1);
  section(s.stage_chunks, static_cast<size_t>(cfg.world));
  section(s.stage_slices, static_cast<size_t>(cfg.world) * kMaxPeerSlices);
  section(epoch, 2);  // the epoch, then the generation (Instance::generation)
  section(s.self_copy, copies);
  section(s.self_row, copies);
  section(s.copy_entry, ranked ? copies : 0);
  section(s.entry_row, entries);
  section(s.entry_weight, entries);
  section(s.row_entry, out_rows);
  section(s.entry_next, !ranked ? 0 : static_cast<size_t>(cfg.world) * (noded ? node_keys : cfg.num_local_experts()));
  section(s.entry_rank, noded ? entries : 0);
  section(s.row_wire, noded ? out_rows : 0);
  section(s.row_weight, noded ? out_rows : 0);
  section(s.node_segs, noded ? node_keys * cfg.world : 0);
  section(s.plan_ok, noded ? 1 : 0);
}

template <typename T>
size_t scratch_section_bytes(T* /*typed*/, size_t count) {
  return align_up(sizeof(T) * count, kScratchAlign);
}

// Bytes of the whole scratch.
inline size_t scratch_bytes(const A2AConfig& cfg) {
  Scratch s{};
  uint64_t* epoch = nullptr;
  size_t total = 0;
  scratch_sections(cfg, s, epoch, [&](auto*& p, size_t count) { total += scratch_section_bytes(p, count); });
  return total;
}

}  // namespace moe_a2a::a2a::cuda
