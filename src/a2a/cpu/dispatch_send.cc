// Dispatch, send half, compute steps: count copies per expert, give each copy
// its send row, and pack rows where they go, one destination rank at a time.
#include <algorithm>
#include <cstring>
#include <vector>

#include "convert.h"
#include "kernels.h"

namespace moe_a2a::a2a::cpu {

void count_experts(const DispatchSendParams& p) {
  const A2AConfig& c = *p.cfg;
  std::memset(p.counts, 0, c.num_experts * sizeof(uint32_t));
  for (int64_t i = 0; i < static_cast<int64_t>(p.num_tokens) * c.topk; ++i) ++p.counts[p.topk_ids[i]];
  count_wire_rows(c, p.topk_ids, p.num_tokens, p.counts);
}

void assign_rows(const DispatchSendParams& p) {
  const A2AConfig& c = *p.cfg;
  const int E = c.num_experts, K = c.topk;
  // First send row of each expert: send order is (rank, expert, token, k).
  std::vector<uint64_t> next(E);
  uint64_t at = 0;
  for (int e = 0; e < E; ++e) {
    next[e] = at;
    at += p.counts[e];
  }
  for (int64_t i = 0; i < static_cast<int64_t>(p.num_tokens) * K; ++i) {
    const uint64_t slot = next[p.topk_ids[i]]++;
    p.slots[i] = static_cast<int32_t>(slot);
    p.row_copy[slot] = static_cast<int32_t>(i);
  }
  std::fill(p.encoded, p.encoded + p.num_tokens, nullptr);
}

void pack_rank(const DispatchSendParams& p, int r, uint64_t first_row, uint64_t rows) {
  const A2AConfig& c = *p.cfg;
  const Layout& l = *p.layout;
  const uint64_t P = c.max_private_tokens;
  const size_t row = l.dispatch_row;
  const bool near = c.same_node(r);
  std::vector<float> scratch(c.hidden);
  const size_t x_row_bytes = static_cast<size_t>(c.hidden) * dtype_bytes(p.x_dtype);
  for (uint64_t j = 0; j < rows; ++j) {
    const uint64_t slot = first_row + j;
    const int t = p.row_copy[slot] / c.topk;
    uint8_t* dst = near && j < P ? p.ws.of(r) + l.private_rows + (static_cast<size_t>(c.rank) * P + j) * row
                                 : p.ws.self + l.send + slot * row;  // fabric, or pulled by a same-node peer
    const float weight = p.weights != nullptr ? p.weights[p.row_copy[slot]] : 0.0f;
    std::memcpy(dst + l.dispatch_tail, &weight, sizeof(weight));  // the copy's own, whatever its body
    if (p.encoded[t] != nullptr) {
      std::memcpy(dst, p.encoded[t], l.dispatch_tail);
      continue;
    }
    const void* x = static_cast<const uint8_t*>(p.x) + t * x_row_bytes;
    const float* scale = p.x_scale ? p.x_scale + static_cast<size_t>(t) * c.num_scales() : nullptr;
    encode_row(x, p.x_dtype, scale, c, dst, scratch.data());
    p.encoded[t] = dst;
  }
}

}  // namespace moe_a2a::a2a::cpu
