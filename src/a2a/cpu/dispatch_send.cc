// Dispatch, send half, compute steps: count copies per expert, give each copy
// its send row, and pack rows where they go.
#include <cstring>
#include <vector>

#include "convert.h"
#include "kernels.h"

namespace moe_a2a::a2a::cpu {

void count_experts(const DispatchSendParams& p) {
  const A2AConfig& c = *p.cfg;
  std::memset(p.counts, 0, c.num_experts * sizeof(uint32_t));
  for (int64_t i = 0; i < static_cast<int64_t>(p.num_tokens) * c.topk; ++i) ++p.counts[p.topk_ids[i]];
}

void pack_dispatch(const DispatchSendParams& p) {
  const A2AConfig& c = *p.cfg;
  const Layout& l = *p.layout;
  const int E = c.num_experts, L = c.num_local_experts(), K = c.topk;
  const uint64_t P = c.max_private_tokens;
  const size_t row = l.dispatch_row;

  // First send row of each expert: send order is (rank, expert, token, k).
  std::vector<uint64_t> next(E), rank_start(c.world);
  uint64_t at = 0;
  for (int e = 0; e < E; ++e) {
    if (e % L == 0) rank_start[e / L] = at;
    next[e] = at;
    at += p.counts[e];
  }

  std::vector<uint8_t> encoded(row);
  std::vector<float> scratch(c.hidden);
  const size_t x_row_bytes = static_cast<size_t>(c.hidden) * dtype_bytes(p.x_dtype);
  for (int t = 0; t < p.num_tokens; ++t) {
    const void* x = static_cast<const uint8_t*>(p.x) + t * x_row_bytes;
    const float* scale = p.x_scale ? p.x_scale + static_cast<size_t>(t) * c.num_scales() : nullptr;
    encode_row(x, p.x_dtype, scale, c, encoded.data(), scratch.data());
    for (int k = 0; k < K; ++k) {
      int e = p.topk_ids[t * K + k];
      int r = e / L;
      uint64_t slot = next[e]++;
      p.slots[t * K + k] = static_cast<int32_t>(slot);
      uint64_t j = slot - rank_start[r];
      uint8_t* dst;
      if (c.same_node(r) && j < P) {
        dst = p.ws.of(r) + l.private_rows + (static_cast<size_t>(c.rank) * P + j) * row;
      } else {
        dst = p.ws.self + l.send + slot * row;  // fabric, or pulled by a same-node peer
      }
      std::memcpy(dst, encoded.data(), row);
    }
  }
}

}  // namespace moe_a2a::a2a::cpu
