// Number formats on the CPU: bf16 and e4m3fn (fp8) to and from fp32, with
// round-to-nearest-even exactly as torch does it, so the CPU path and the
// reference agree bit for bit.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "../config.h"

namespace moe_a2a::a2a::cpu {

inline float bf16_to_f32(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

constexpr uint8_t kE4m3Nan = 0x7f;
constexpr uint8_t kE4m3MaxCode = 0x7e;  // 448
constexpr int kE4m3Bias = 7;
constexpr int kE4m3MantissaBits = 3;
constexpr float kE4m3MinNormal = 0.015625f;   // 2^-6
constexpr float kE4m3SubnormalStep = 0.001953125f;  // 2^-9

// fp32 -> e4m3fn, round to nearest even, saturating at +-448.
inline uint8_t f32_to_e4m3(float v) {
  if (std::isnan(v)) return kE4m3Nan;
  uint8_t sign = std::signbit(v) ? 0x80 : 0;
  float a = std::fabs(v);
  if (a >= kFp8Max) return sign | kE4m3MaxCode;
  if (a < kE4m3MinNormal) {
    // Subnormals (and zero) are multiples of 2^-9; 8 steps is the smallest normal.
    return sign | static_cast<uint8_t>(std::nearbyint(a / kE4m3SubnormalStep));
  }
  int exp = 0;
  float frac = std::frexp(a, &exp);  // a = frac * 2^exp, frac in [0.5, 1)
  int e = exp - 1;                   // a = (2 * frac) * 2^e
  int m = static_cast<int>(std::nearbyint((2.0f * frac - 1.0f) * (1 << kE4m3MantissaBits)));
  if (m == (1 << kE4m3MantissaBits)) {
    m = 0;
    ++e;
  }
  int code = ((e + kE4m3Bias) << kE4m3MantissaBits) | m;
  if (code > kE4m3MaxCode) code = kE4m3MaxCode;
  return sign | static_cast<uint8_t>(code);
}

inline float load_element(const void* base, DType dtype, size_t i) {
  if (dtype == DType::kFp32) return static_cast<const float*>(base)[i];
  return bf16_to_f32(static_cast<const uint16_t*>(base)[i]);
}

// One token into one dispatch row (payload, then fp8 scales).
void encode_row(const void* x, DType x_dtype, const float* x_scale, const A2AConfig& cfg, uint8_t* row);

// One expert output row into one combine row (combine_dtype).
void encode_combine_row(const void* y, DType y_dtype, int hidden, DType out_dtype, uint8_t* row);

}  // namespace moe_a2a::a2a::cpu
