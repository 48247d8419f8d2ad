#include "convert.h"

#include <algorithm>

namespace moe_a2a::a2a::cpu {

MOE_A2A_VECTOR_CLONES
void quantize_block(const float* x, int n, float scale, uint8_t* q) {
  constexpr uint32_t kTwo23Bits = 0x4b000000u;  // 2^23 as fp32
  constexpr uint32_t kExponentShift = 23 - kE4m3MantissaBits;
  // (biased fp32 exponent - 127 + 7) << 3 | mantissa == (bits >> 20) - 960.
  constexpr uint32_t kRebias = (127 - kE4m3Bias) << kE4m3MantissaBits;
  for (int i = 0; i < n; ++i) {
    float v = x[i] / scale;
    uint32_t u;
    std::memcpy(&u, &v, sizeof(u));
    uint32_t sign = (u >> 24) & 0x80u;
    u &= 0x7fffffffu;
    float a;
    std::memcpy(&a, &u, sizeof(a));
    float t = a * (1.0f / kE4m3SubnormalStep) + 8388608.0f;
    uint32_t tb;
    std::memcpy(&tb, &t, sizeof(tb));
    uint32_t sub = tb - kTwo23Bits;
    uint32_t r = u + ((1u << (kExponentShift - 1)) - 1) + ((u >> kExponentShift) & 1u);
    uint32_t normal = (r >> kExponentShift) - kRebias;
    normal = normal > kE4m3MaxCode ? kE4m3MaxCode : normal;
    uint32_t code = a < kE4m3MinNormal ? sub : normal;
    q[i] = static_cast<uint8_t>(code | sign);
  }
}

MOE_A2A_VECTOR_CLONES
float abs_max(const float* x, int n) {
  // On |x| as integers: the same order as the floats, NaN above infinity,
  // and a loop the compiler vectorises.
  uint32_t best = 0;
  for (int i = 0; i < n; ++i) {
    uint32_t u;
    std::memcpy(&u, x + i, sizeof(u));
    u &= 0x7fffffffu;
    best = u > best ? u : best;
  }
  float out;
  std::memcpy(&out, &best, sizeof(out));
  return out;
}

MOE_A2A_VECTOR_CLONES
void accumulate_row(float* acc, float w, const void* row, DType dtype, int n) {
  if (dtype == DType::kFp32) {
    const auto* y = static_cast<const float*>(row);
    for (int i = 0; i < n; ++i) acc[i] += w * y[i];
    return;
  }
  const auto* y = static_cast<const uint16_t*>(row);
  for (int i = 0; i < n; ++i) {
    uint32_t bits = static_cast<uint32_t>(y[i]) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof(f));
    acc[i] += w * f;
  }
}

MOE_A2A_VECTOR_CLONES
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
        float amax = abs_max(scratch + begin, end - begin);
        float scale = amax > 0.0f ? amax / kFp8Max : 1.0f;
        scales[b] = scale;
        if (std::isfinite(amax)) {
          quantize_block(scratch + begin, end - begin, scale, row + begin);
        } else {  // NaN or infinity in the block: the careful path
          for (int i = begin; i < end; ++i) row[i] = f32_to_e4m3(scratch[i] / scale);
        }
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
