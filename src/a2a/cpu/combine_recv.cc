// Combine, receive half: out[t] = sum_k w[t,k] * y(t,k), accumulated in fp32
// in k order, stored in the combine dtype. A row per rank came back already
// weighted and summed over t's k on that rank: added once, at its first k.
#include <cstring>
#include <vector>

#include "convert.h"
#include "kernels.h"

namespace moe_a2a::a2a::cpu {

void reduce_combine(const CombineRecvParams& p) {
  const A2AConfig& c = *p.cfg;
  const int H = c.hidden, K = c.topk;
  const size_t crow = p.layout->combine_row;
  const uint8_t* rows = p.ws + p.layout->combine_recv;
  std::vector<float> acc(H);
  for (int t = 0; t < p.num_tokens; ++t) {
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int k = 0; k < K; ++k) {
      const int i = t * K + k;
      if (p.slots[i] < 0) {  // dropped (a masked rank's expert): contributes nothing
        if (p.values_out != nullptr) p.values_out[i] = 0.0f;
        continue;
      }
      const uint8_t* row = rows + static_cast<size_t>(p.slots[i]) * crow;
      const int entry = p.entry_of_copy[i];  // -1: a row of its own
      if (entry <= 0) accumulate_row(acc.data(), entry < 0 ? p.weights[i] : 1.0f, row, c.combine_dtype, H);
      const size_t value = p.layout->combine_tail + (entry < 0 ? 0 : entry) * sizeof(float);
      if (p.values_out != nullptr) std::memcpy(p.values_out + i, row + value, sizeof(float));
    }
    if (c.combine_dtype == DType::kFp32) {
      std::memcpy(static_cast<float*>(p.out) + static_cast<size_t>(t) * H, acc.data(), H * sizeof(float));
    } else {
      auto* out = static_cast<uint16_t*>(p.out) + static_cast<size_t>(t) * H;
      for (int h = 0; h < H; ++h) out[h] = f32_to_bf16(acc[h]);
    }
  }
}

}  // namespace moe_a2a::a2a::cpu
