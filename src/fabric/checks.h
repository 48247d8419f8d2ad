// Checks and error texts every ProxyEngine implementation shares: the range
// of a write, and what a wait that ran out of time says.
#pragma once

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "error.h"
#include "imm.h"

namespace moe_a2a::fabric {

inline std::string byte_range(uint64_t offset, uint64_t length) {
  return "[" + std::to_string(offset) + ", " + std::to_string(offset + length) + ")";
}

// `where` names the engine ("rank 3 (provider 'tcp')"), `op` the call.
inline void check_write(const std::string& where, const char* op, int peer, uint64_t src_length, uint64_t src_offset,
                        uint64_t length, uint64_t dst_length, uint64_t dst_offset, std::optional<uint32_t> tag) {
  const std::string head = where + ": " + op + " to peer " + std::to_string(peer) + ": ";
  if (src_offset > src_length || length > src_length - src_offset)
    throw FabricError(head + "source range " + byte_range(src_offset, length) +
                      " is outside the registered region of " + std::to_string(src_length) + " bytes");
  if (dst_offset > dst_length || length > dst_length - dst_offset)
    throw FabricError(head + "destination range " + byte_range(dst_offset, length) +
                      " is outside the peer's registered region of " + std::to_string(dst_length) + " bytes");
  if (tag && *tag > 0xffff) throw FabricError(where + ": immediate tag " + std::to_string(*tag) + " exceeds 16 bits");
}

inline TimeoutError wait_imm_timeout(const std::string& where, double timeout_s, uint64_t count, uint32_t imm,
                                     uint64_t seen, int peer) {
  return TimeoutError(where + ": timed out after " + std::to_string(timeout_s) + " s waiting for " +
                      std::to_string(count) + " arrival(s) of " + describe_imm(imm) + "; " + std::to_string(seen) +
                      " arrived. Is peer " + std::to_string(peer) + " alive and in the same step?");
}

// `seen[k]`: what had arrived of (tags[k], peers[k]).
inline TimeoutError wait_any_timeout(const std::string& where, double timeout_s, const std::vector<uint32_t>& tags,
                                     const std::vector<int>& peers, const std::vector<uint64_t>& counts,
                                     const std::vector<uint64_t>& seen) {
  std::string missing;
  for (size_t k = 0; k < peers.size(); ++k)
    missing += (k ? ", " : "") + std::to_string(peers[k]) + " (tag " + std::to_string(tags[k]) + ": " +
               std::to_string(seen[k]) + " of " + std::to_string(counts[k]) + ")";
  return TimeoutError(where + ": timed out after " + std::to_string(timeout_s) +
                      " s waiting for arrivals from any of peers " + missing + ". Are they alive and in the same step?");
}

inline void check_wait_any(const std::string& where, size_t tags, size_t peers, size_t counts) {
  if (peers == 0 || peers != counts || peers != tags)
    throw std::invalid_argument(where + ": wait_any_imm: got " + std::to_string(tags) + " tags, " +
                                std::to_string(peers) + " peers and " + std::to_string(counts) +
                                " counts; expected as many of each, at least one");
}

}  // namespace moe_a2a::fabric
