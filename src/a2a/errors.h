#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

namespace moe_a2a::a2a {

// A call needed more receive slots than the buffers hold; the instance stays
// usable for the next call.
class CapacityError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A peer announced that it failed (a bad argument, a timeout, any error): this
// instance cannot pair its calls with that peer's any more.
class PeerFailedError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A CUDA graph captured before ranks were masked was replayed: its kernels
// did nothing (no row sent, no flag awaited); capture the step again. The
// instance stays usable.
class StaleGraphError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

}  // namespace moe_a2a::a2a
