#include "convert.h"

#include <algorithm>

namespace moe_a2a::a2a::cpu {

void load_row(const void* x, DType dtype, int n, float* out) {
  if (dtype == DType::kFp32) {
    std::memcpy(out, x, n * sizeof(float));
    return;
  }
  const auto* h = static_cast<const uint16_t*>(x);
  for (int i = 0; i < n; ++i) out[i] = bf16_to_f32(h[i]);
}

void encode_row(const void* x, DType x_dtype, const float* x_scale, const A2AConfig& cfg, uint8_t* row,
                float* scratch) {
  const int hidden = cfg.hidden;
  if (cfg.dispatch_dtype == DType::kFp8 && x_dtype == DType::kFp8) {  // already quantised by the caller
    std::memcpy(row, x, hidden);
    std::memcpy(row + cfg.payload_bytes(), x_scale, cfg.num_scales() * sizeof(float));
    return;
  }
  if (cfg.dispatch_dtype == x_dtype) {
    std::memcpy(row, x, cfg.payload_bytes());
    return;
  }
  load_row(x, x_dtype, hidden, scratch);
  switch (cfg.dispatch_dtype) {
    case DType::kBf16: {
      auto* out = reinterpret_cast<uint16_t*>(row);
      for (int i = 0; i < hidden; ++i) out[i] = f32_to_bf16(scratch[i]);
      return;
    }
    case DType::kFp32:
      std::memcpy(row, scratch, hidden * sizeof(float));
      return;
    case DType::kFp8: {
      auto* scales = reinterpret_cast<float*>(row + cfg.payload_bytes());
      for (int b = 0; b < cfg.num_scales(); ++b) {
        int begin = b * kFp8Block, end = std::min(hidden, begin + kFp8Block);
        float amax = 0.0f;
        for (int i = begin; i < end; ++i) amax = std::max(amax, std::fabs(scratch[i]));
        float scale = amax > 0.0f ? amax / kFp8Max : 1.0f;
        scales[b] = scale;
        for (int i = begin; i < end; ++i) row[i] = f32_to_e4m3(scratch[i] / scale);
      }
      return;
    }
  }
}

void encode_combine_row(const void* y, DType y_dtype, int hidden, DType out_dtype, uint8_t* row) {
  if (out_dtype == y_dtype) {
    std::memcpy(row, y, hidden * dtype_bytes(y_dtype));
  } else if (out_dtype == DType::kBf16) {  // fp32 -> bf16
    const auto* in = static_cast<const float*>(y);
    auto* out = reinterpret_cast<uint16_t*>(row);
    for (int i = 0; i < hidden; ++i) out[i] = f32_to_bf16(in[i]);
  } else {  // bf16 -> fp32
    load_row(y, y_dtype, hidden, reinterpret_cast<float*>(row));
  }
}

}  // namespace moe_a2a::a2a::cpu
