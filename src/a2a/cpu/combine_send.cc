// Combine, send half: every copy's expert output goes back to the rank and row
// it came from; straight into same-node peers' combine_recv, into our
// combine_send staging for the proxy otherwise. One sender at a time, so the
// proxy writes each remote sender's rows while the next ones are converted.
#include <cstring>

#include "convert.h"
#include "kernels.h"

namespace moe_a2a::a2a::cpu {

void pack_combine_for(const CombineSendParams& p, int s) {
  const A2AConfig& c = *p.cfg;
  const Layout& l = *p.layout;
  const RecvPlan& plan = *p.plan;
  const size_t crow = l.combine_row;
  const size_t y_row = static_cast<size_t>(c.hidden) * dtype_bytes(p.y_dtype);
  for (uint64_t j = 0; j < plan.from[s]; ++j) {
    const int64_t src_row = p.row_of_copy[plan.recv_base[s] + j];
    uint8_t* dst = c.same_node(s) ? p.ws.of(s) + l.combine_recv + (plan.send_off_at[s] + j) * crow
                                  : p.ws.self + l.combine_send + (plan.recv_base[s] + j) * crow;
    encode_combine_row(static_cast<const uint8_t*>(p.y) + src_row * y_row, p.y_dtype, c.hidden, c.combine_dtype, dst);
    const float value = p.row_values != nullptr ? p.row_values[src_row] : 0.0f;
    std::memcpy(dst + l.combine_tail, &value, sizeof(value));
  }
}

}  // namespace moe_a2a::a2a::cpu
