// What the bindings of the CPU and the CUDA implementation share: pointers
// cross as integers (tensor.data_ptr()), 0 for none.
#pragma once

#include <cstdint>

#include "a2a/config.h"

namespace moe_a2a::bindings {

template <typename T>
T* ptr(uintptr_t p) {
  return reinterpret_cast<T*>(p);
}

// A weighted receive's row math from its integers: none without a scale.
inline a2a::RowMath row_math(uintptr_t scale, uintptr_t dot_y, a2a::DType dot_y_dtype, uintptr_t dot_out) {
  a2a::RowMath m;
  if (scale == 0) return m;
  m.scale = ptr<const float>(scale);
  m.dot_y = ptr<const void>(dot_y);
  m.dot_y_dtype = dot_y_dtype;
  m.dot_out = ptr<float>(dot_out);
  return m;
}

}  // namespace moe_a2a::bindings
