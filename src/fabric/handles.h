// Typed handles of the engine's tables: a local region, a peer's region as
// described to us, and a peer group. Plain structs, so one cannot be passed
// where another is expected (they were all bare uint32_t).
#pragma once

#include <cstdint>

namespace moe_a2a::fabric {

struct RegionId {
  uint32_t value = 0;
};

struct RemoteRegionId {
  uint32_t value = 0;
};

struct GroupId {
  uint32_t value = 0;
};

}  // namespace moe_a2a::fabric
