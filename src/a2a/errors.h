#pragma once

#include <stdexcept>

namespace moe_a2a::a2a {

// A call needed more receive slots than the buffers hold; the instance stays
// usable for the next call.
class CapacityError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

}  // namespace moe_a2a::a2a
