#include "convert.h"

#include <algorithm>

namespace moe_a2a::a2a::cpu {

void encode_row(const void* x, DType x_dtype, const float* x_scale, const A2AConfig& cfg, uint8_t* row) {
  const int hidden = cfg.hidden;
  switch (cfg.dispatch_dtype) {
    case DType::kBf16: {
      auto* out = reinterpret_cast<uint16_t*>(row);
      if (x_dtype == DType::kBf16) {
        std::memcpy(out, x, hidden * sizeof(uint16_t));
      } else {
        for (int i = 0; i < hidden; ++i) out[i] = f32_to_bf16(load_element(x, x_dtype, i));
      }
      return;
    }
    case DType::kFp32: {
      auto* out = reinterpret_cast<float*>(row);
      for (int i = 0; i < hidden; ++i) out[i] = load_element(x, x_dtype, i);
      return;
    }
    case DType::kFp8: {
      auto* scales = reinterpret_cast<float*>(row + cfg.payload_bytes());
      if (x_dtype == DType::kFp8) {  // already quantised by the caller
        std::memcpy(row, x, hidden);
        std::memcpy(scales, x_scale, cfg.num_scales() * sizeof(float));
        return;
      }
      for (int b = 0; b < cfg.num_scales(); ++b) {
        int begin = b * kFp8Block, end = std::min(hidden, begin + kFp8Block);
        float amax = 0.0f;
        for (int i = begin; i < end; ++i) amax = std::max(amax, std::fabs(load_element(x, x_dtype, i)));
        float scale = amax > 0.0f ? amax / kFp8Max : 1.0f;
        scales[b] = scale;
        for (int i = begin; i < end; ++i) row[i] = f32_to_e4m3(load_element(x, x_dtype, i) / scale);
      }
      return;
    }
  }
}

void encode_combine_row(const void* y, DType y_dtype, int hidden, DType out_dtype, uint8_t* row) {
  if (out_dtype == y_dtype) {
    std::memcpy(row, y, hidden * dtype_bytes(y_dtype));
  } else if (out_dtype == DType::kBf16) {
    auto* out = reinterpret_cast<uint16_t*>(row);
    for (int i = 0; i < hidden; ++i) out[i] = f32_to_bf16(load_element(y, y_dtype, i));
  } else {
    auto* out = reinterpret_cast<float*>(row);
    for (int i = 0; i < hidden; ++i) out[i] = load_element(y, y_dtype, i);
  }
}

}  // namespace moe_a2a::a2a::cpu
