// The tail of a row per destination rank (docs/protocol.md, "Rows per
// destination rank"): with FabricRows::kRank a token crosses to a rank of
// another node once, and its row's tail says which of that rank's experts it
// picked, in k order. Included by host C++ and by the CUDA kernels.
#pragma once

#include <cstdint>

namespace moe_a2a::a2a {

// One (token, k) of a row per rank. A row holds A2AConfig::max_entries() of
// them; unused ones have expert = kNoExpert. A per-copy row (same node, or
// mode expert) holds its copy's weight in entry 0, at the tail's first byte,
// as the narrow tail always has.
struct RouteEntry {
  float weight;     // the copy's routing weight (dispatch topk_weights)
  uint16_t expert;  // local expert index on the destination rank, or kNoExpert
  uint16_t k;       // the copy's index among the token's topk
};
static_assert(sizeof(RouteEntry) == 8, "a route entry is 8 bytes on the wire");

constexpr uint16_t kNoExpert = 0xFFFF;

// The expert id of a (token, k) dropped because its expert is on a masked
// rank (live_ranks.h; moe_a2a.masking writes it into topk_ids): no row, nothing
// back and no error, where any other id out of range is an error (the CUDA
// route kernel reports it; the CPU front end refuses it before the call).
constexpr int64_t kMaskedExpert = -2;

}  // namespace moe_a2a::a2a
