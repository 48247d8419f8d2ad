// Dispatch, send half, compute steps: count copies per expert (and wire rows
// per rank), give each copy its send row, and pack rows where they go, one
// destination rank at a time.
#include <algorithm>
#include <cstring>
#include <vector>

#include "../row_tail.h"
#include "convert.h"
#include "kernels.h"

namespace moe_a2a::a2a::cpu {

void count_experts(const DispatchSendParams& p) {
  const A2AConfig& c = *p.cfg;
  std::memset(p.counts, 0, c.num_experts * sizeof(uint32_t));
  // A negative id is a dropped (token, k): its expert is on a masked rank (live_ranks.h).
  for (int64_t i = 0; i < static_cast<int64_t>(p.num_tokens) * c.topk; ++i)
    if (p.topk_ids[i] >= 0) ++p.counts[p.topk_ids[i]];
  count_wire_rows(c, p.topk_ids, p.num_tokens, p.counts);
}

void assign_rows(const DispatchSendParams& p) {
  const A2AConfig& c = *p.cfg;
  const int E = c.num_experts, K = c.topk, L = c.num_local_experts(), N = c.world;
  const RoutingView own{p.counts, 1, E, L, c.routing_width()};
  // First send row of each expert (a per-copy destination's rows go (local
  // expert, token, k)) and of each destination (a per-rank one's go by token).
  std::vector<uint64_t> next(E), next_rank(N);
  for (int r = 0; r < N; ++r) {
    uint64_t at = own.send_offset(0, r);
    next_rank[r] = at;
    for (int i = 0; i < L; ++i) {
      next[r * L + i] = at;
      at += p.counts[r * L + i];
    }
  }
  std::vector<int> last(N, -1);        // the last token given a row per rank
  std::vector<int16_t> entries(N, 0);  // its entries so far
  for (int t = 0; t < p.num_tokens; ++t)
    for (int k = 0; k < K; ++k) {
      const int64_t i = static_cast<int64_t>(t) * K + k;
      const int32_t e = p.topk_ids[i];
      if (e < 0) {  // dropped: no row, nothing back (combine skips slot -1)
        p.slots[i] = -1;
        p.entry_of_copy[i] = -1;
        continue;
      }
      const int r = c.wire_dest(c.rank, e / L);  // rows per node: the forwarder
      uint64_t slot;
      if (c.merged(c.rank, r)) {
        if (last[r] != t) {
          last[r] = t;
          entries[r] = 0;
          p.row_copy[next_rank[r]++] = static_cast<int32_t>(i);
        }
        slot = next_rank[r] - 1;
        p.entry_of_copy[i] = entries[r]++;
      } else {
        slot = next[e]++;
        p.row_copy[slot] = static_cast<int32_t>(i);
        p.entry_of_copy[i] = -1;
      }
      p.slots[i] = static_cast<int32_t>(slot);
    }
  std::fill(p.encoded, p.encoded + p.num_tokens, nullptr);
}

namespace {

// The tail of the row of copy `i` (rows per rank: of its token) for rank r
// (row_tail.h): narrow, the copy's weight; wide, route entries.
void write_tail(const DispatchSendParams& p, int r, int64_t i, uint8_t* tail) {
  const A2AConfig& c = *p.cfg;
  const int K = c.topk, L = c.num_local_experts(), m = c.max_entries();
  auto weight = [&](int64_t copy) { return p.weights != nullptr ? p.weights[copy] : 0.0f; };
  if (!c.wide_rows()) {
    const float w = weight(i);
    std::memcpy(tail, &w, sizeof(w));
    return;
  }
  auto put = [&](int e, const RouteEntry& v) { std::memcpy(tail + e * sizeof(RouteEntry), &v, sizeof(v)); };
  // A row per node's entries name the expert on the node (its rank's local index times L, plus
  // the expert on that rank); a row per rank's, on the rank.
  const bool node = c.per_node(c.rank, r);
  const int first = node ? c.node_of(r) * c.ranks_per_node * L : r * L;
  const int span = node ? c.ranks_per_node * L : L;
  auto entry = [&](int64_t copy) {
    return RouteEntry{weight(copy), static_cast<uint16_t>(p.topk_ids[copy] - first), static_cast<uint16_t>(copy % K)};
  };
  int used = 0;
  if (c.merged(c.rank, r)) {
    const int64_t t = i / K;
    for (int k = 0; k < K; ++k) {
      const int32_t e = p.topk_ids[t * K + k];
      if (e >= first && e < first + span) put(used++, entry(t * K + k));
    }
  } else {
    put(used++, entry(i));
  }
  for (; used < m; ++used) put(used, RouteEntry{0.0f, kNoExpert, 0});
}

}  // namespace

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
    write_tail(p, r, p.row_copy[slot], dst + l.dispatch_tail);       // the row's own, whatever its body
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
