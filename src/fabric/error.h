// Errors raised by the transfer engine. Every message names the provider, the
// peer and the operation where they are known, so a failure on a cluster can be
// read without a debugger.
#pragma once

#include <stdexcept>
#include <string>

namespace moe_a2a::fabric {

class FabricError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A wait that ran out of time: a peer that never wrote, or died.
class TimeoutError : public FabricError {
 public:
  using FabricError::FabricError;
};

}  // namespace moe_a2a::fabric
