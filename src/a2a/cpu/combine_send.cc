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

// One entry's expert output as a reduced row reads it (null row: an unused entry).
struct EntryOutput {
  const uint8_t* row = nullptr;
  DType dtype = DType::kFp32;
  float value = 0.0f;  // its row value, into the tail
};

// Wire row j of sender s whose rows carry route entries: acc = sum_e coeff_e *
// output of entry e, fp32 in entry (k) order, stored once in the combine
// dtype; tail value e is entry e's row value (0 where unused). `output(i)`
// gives entry i's (indexed as row_of_entry).
template <typename Output>
void pack_summed(const CombineSendParams& p, int s, Output&& output) {
  const A2AConfig& c = *p.cfg;
  const Layout& l = *p.layout;
  const RecvPlan& plan = *p.plan;
  const int H = c.hidden, m = c.max_entries();
  std::vector<float> acc(H), values(m);
  for (uint64_t j = 0; j < plan.wire[s]; ++j) {
    const size_t first = (plan.recv_base[s] + j) * m;
    std::fill(acc.begin(), acc.end(), 0.0f);
    std::fill(values.begin(), values.end(), 0.0f);
    for (int e = 0; e < m; ++e) {
      const EntryOutput out = output(first + e);
      if (out.row == nullptr) continue;
      accumulate_row(acc.data(), p.weighted ? p.weight_of_entry[first + e] : 1.0f, out.row, out.dtype, H);
      values[e] = out.value;
    }
    uint8_t* dst = p.ws.self + l.combine_send + (plan.recv_base[s] + j) * l.combine_row;
    encode_combine_row(acc.data(), DType::kFp32, H, c.combine_dtype, dst);
    std::memcpy(dst + l.combine_tail, values.data(), m * sizeof(float));
  }
}

// A per-rank sender's rows: our own outputs.
void pack_reduced(const CombineSendParams& p, int s) {
  const size_t y_row = static_cast<size_t>(p.cfg->hidden) * dtype_bytes(p.y_dtype);
  pack_summed(p, s, [&](size_t i) {
    const int64_t row = p.row_of_entry[i];
    if (row < 0) return EntryOutput{};
    const float value = p.row_values != nullptr ? p.row_values[row] : 0.0f;
    return EntryOutput{static_cast<const uint8_t*>(p.y) + row * y_row, p.y_dtype, value};
  });
}

// A sender whose rows per node we forward: each entry's output from our y,
// or from the y_stage of the node peer it went to.
void pack_node_reduced(const CombineSendParams& p, int s) {
  const Layout& l = *p.layout;
  const size_t y_row = static_cast<size_t>(p.cfg->hidden) * dtype_bytes(p.y_dtype);
  pack_summed(p, s, [&](size_t i) {
    const int t = p.rank_of_entry[i];
    if (t < 0) return EntryOutput{};
    const int64_t row = p.row_of_entry[i];
    if (t == p.cfg->rank) {
      const float value = p.row_values != nullptr ? p.row_values[row] : 0.0f;
      return EntryOutput{static_cast<const uint8_t*>(p.y) + row * y_row, p.y_dtype, value};
    }
    const uint8_t* ws = p.ws.of(t);
    float value;
    std::memcpy(&value, ws + l.y_values + row * sizeof(float), sizeof(value));
    const auto dtype = static_cast<DType>(ws[l.y_stage_dtype]);  // t's y's, written before kFlagStaged
    return EntryOutput{ws + l.y_stage + row * l.y_stride, dtype, value};
  });
}

}  // namespace

void stage_outputs(const CombineSendParams& p) {
  const A2AConfig& c = *p.cfg;
  const Layout& l = *p.layout;
  const size_t y_row = static_cast<size_t>(c.hidden) * dtype_bytes(p.y_dtype);
  const int L = c.num_local_experts();
  auto* values = reinterpret_cast<float*>(p.ws.self + l.y_values);
  // As y holds them: the forwarder widens to fp32 as it sums, the same values either way.
  p.ws.self[l.y_stage_dtype] = static_cast<uint8_t>(p.y_dtype);
  auto stage = [&](uint64_t row) {
    std::memcpy(p.ws.self + l.y_stage + row * l.y_stride, static_cast<const uint8_t*>(p.y) + row * y_row, y_row);
    values[row] = p.row_values != nullptr ? p.row_values[row] : 0.0f;
  };
  // A sender's copies of expert i are rows sender_base[s][i] onwards (dispatch_recv.cc); those of a
  // sender we forward we read from y ourselves.
  for (int s = 0; s < c.world; ++s) {
    if (!c.per_node(s, c.rank) || c.forwarder(s, c.rank) == c.rank) continue;
    for (int i = 0; i < L; ++i) {
      const uint64_t first = p.sender_base[static_cast<size_t>(s) * L + i];
      for (uint32_t q = 0; q < p.routing->count(s, c.rank * L + i); ++q) stage(first + q);
    }
  }
}

void pack_combine_for(const CombineSendParams& p, int s) {
  const A2AConfig& c = *p.cfg;
  if (c.per_node(s, c.rank)) {
    if (c.forwarder(s, c.rank) == c.rank) pack_node_reduced(p, s);
    return;
  }
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
