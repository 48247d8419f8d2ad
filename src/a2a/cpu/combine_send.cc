// Combine, send half: expert outputs go back to the rank and rows they came
// from; straight into same-node peers' combine_recv, into our combine_send
// staging for the proxy otherwise. One sender at a time, so the proxy writes
// each remote sender's rows while the next ones are converted. A per-copy
// sender gets a row per copy; a per-rank one a row per wire row, its entries'
// outputs summed here (docs/protocol.md, "Rows per destination rank").
#include <algorithm>
#include <cstring>
#include <vector>

#include "convert.h"
#include "kernels.h"

namespace moe_a2a::a2a::cpu {

namespace {

// Wire row j of per-rank sender s: acc = sum_e coeff_e * y[row of entry e],
// fp32 in entry (k) order, stored once in the combine dtype; tail value e is
// entry e's row value (0 where unused).
void pack_reduced(const CombineSendParams& p, int s) {
  const A2AConfig& c = *p.cfg;
  const Layout& l = *p.layout;
  const RecvPlan& plan = *p.plan;
  const int H = c.hidden, m = c.max_entries();
  const size_t y_row = static_cast<size_t>(H) * dtype_bytes(p.y_dtype);
  std::vector<float> acc(H), values(m);
  for (uint64_t j = 0; j < plan.wire[s]; ++j) {
    const size_t first = (plan.recv_base[s] + j) * m;
    std::fill(acc.begin(), acc.end(), 0.0f);
    std::fill(values.begin(), values.end(), 0.0f);
    for (int e = 0; e < m; ++e) {
      const int64_t row = p.row_of_entry[first + e];
      if (row < 0) continue;
      const float coeff = p.weighted ? p.weight_of_entry[first + e] : 1.0f;
      accumulate_row(acc.data(), coeff, static_cast<const uint8_t*>(p.y) + row * y_row, p.y_dtype, H);
      if (p.row_values != nullptr) values[e] = p.row_values[row];
    }
    uint8_t* dst = p.ws.self + l.combine_send + (plan.recv_base[s] + j) * l.combine_row;
    encode_combine_row(acc.data(), DType::kFp32, H, c.combine_dtype, dst);
    std::memcpy(dst + l.combine_tail, values.data(), m * sizeof(float));
  }
}

}  // namespace

void pack_combine_for(const CombineSendParams& p, int s) {
  const A2AConfig& c = *p.cfg;
  if (c.per_rank(s, c.rank)) {
    pack_reduced(p, s);
    return;
  }
  const Layout& l = *p.layout;
  const RecvPlan& plan = *p.plan;
  const size_t crow = l.combine_row;
  const size_t y_row = static_cast<size_t>(c.hidden) * dtype_bytes(p.y_dtype);
  const int stride = c.entries_per_row();
  for (uint64_t j = 0; j < plan.wire[s]; ++j) {
    const int64_t src_row = p.row_of_entry[(plan.recv_base[s] + j) * stride];
    uint8_t* dst = c.same_node(s) ? p.ws.of(s) + l.combine_recv + (plan.send_off_at[s] + j) * crow
                                  : p.ws.self + l.combine_send + (plan.recv_base[s] + j) * crow;
    encode_combine_row(static_cast<const uint8_t*>(p.y) + src_row * y_row, p.y_dtype, c.hidden, c.combine_dtype, dst);
    const float value = p.row_values != nullptr ? p.row_values[src_row] : 0.0f;
    std::memcpy(dst + l.combine_tail, &value, sizeof(value));
  }
}

}  // namespace moe_a2a::a2a::cpu
