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

// What a CapacityError says: `worst` copies for rank `worst_rank` where the
// caller knows them (worst_rank < 0: it does not), and what to do.
inline std::string capacity_message(int64_t max_recv_tokens, int worst_rank = -1, uint64_t worst = 0) {
  const std::string what =
      worst_rank < 0 ? "more token copies to some rank"
                     : std::to_string(worst) + " token copies to rank " + std::to_string(worst_rank) + ", more";
  return "dispatch would deliver " + what + " than max_recv_tokens=" + std::to_string(max_recv_tokens) +
         "; raise max_recv_tokens in Config (nothing was delivered; the next call can proceed)";
}

// A peer announced that it failed (a bad argument, a timeout, any error): this
// instance cannot pair its calls with that peer's any more.
class PeerFailedError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

}  // namespace moe_a2a::a2a
