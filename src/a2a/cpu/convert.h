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

// fp32 -> e4m3fn, round to nearest even, saturating at +-448. Bit arithmetic
// on the fp32 encoding (the hot loop of fp8 dispatch), checked against torch
// in the unit tests.
inline uint8_t f32_to_e4m3(float v) {
  uint32_t u;
  std::memcpy(&u, &v, sizeof(u));
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80);
  u &= 0x7fffffffu;
  if (u > 0x7f800000u) return kE4m3Nan;
  float a;
  std::memcpy(&a, &u, sizeof(a));
  if (a >= kFp8Max) return sign | kE4m3MaxCode;
  if (a < kE4m3MinNormal) {
    // Subnormals are multiples of 2^-9: adding 2^23 rounds a * 2^9 to an
    // integer (nearest even) in the low mantissa bits.
    constexpr float kRound = 8388608.0f;  // 2^23
    float t = a * (1.0f / kE4m3SubnormalStep) + kRound;
    uint32_t tb;
    std::memcpy(&tb, &t, sizeof(tb));
    return sign | static_cast<uint8_t>(tb - 0x4b000000u);  // 0x4b000000 encodes 2^23
  }
  // Round the 23-bit mantissa to 3 bits (nearest even); a carry moves into
  // the exponent by itself.
  constexpr int kDrop = 23 - kE4m3MantissaBits;
  u += ((1u << (kDrop - 1)) - 1) + ((u >> kDrop) & 1u);
  int exponent = static_cast<int>(u >> 23) - 127 + kE4m3Bias;
  int code = (exponent << kE4m3MantissaBits) | static_cast<int>((u >> kDrop) & 7u);
  if (code > kE4m3MaxCode) code = kE4m3MaxCode;
  return sign | static_cast<uint8_t>(code);
}

// Hot loops, compiled for AVX2 as well where the CPU has it (chosen at load
// time, so one binary runs everywhere).
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define MOE_A2A_VECTOR_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define MOE_A2A_VECTOR_CLONES
#endif

// q[i] = e4m3(x[i] / scale) for a block whose values are finite and within
// +-448 * scale: the same codes as f32_to_e4m3, without branches.
void quantize_block(const float* x, int n, float scale, uint8_t* q);

// max |x[i]|; NaN if any element is NaN.
float abs_max(const float* x, int n);

// acc[i] += w * row[i] for a bf16 or fp32 row.
void accumulate_row(float* acc, float w, const void* row, DType dtype, int n);

inline float load_element(const void* base, DType dtype, size_t i) {
  if (dtype == DType::kFp32) return static_cast<const float*>(base)[i];
  return bf16_to_f32(static_cast<const uint16_t*>(base)[i]);
}

// A row of bf16 or fp32 into fp32.
void load_row(const void* x, DType dtype, int n, float* out);

// One token into one dispatch row (payload, then fp8 scales). `scratch`
// holds `hidden` floats.
void encode_row(const void* x, DType x_dtype, const float* x_scale, const A2AConfig& cfg, uint8_t* row,
                float* scratch);

// One expert output row into one combine row (combine_dtype).
void encode_combine_row(const void* y, DType y_dtype, int hidden, DType out_dtype, uint8_t* row);

}  // namespace moe_a2a::a2a::cpu
