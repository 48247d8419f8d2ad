// Layout of the 32-bit immediate that travels with a write: a 16-bit tag that
// says what the write is, and the sender's rank, so that a receiver counts
// arrivals per peer and a timeout names the peer that is late.
#pragma once

#include <cstdint>
#include <string>

namespace moe_a2a::fabric {

constexpr uint32_t kImmPeerBits = 16;
constexpr uint32_t kImmPeerMask = (1u << kImmPeerBits) - 1;
constexpr int kMaxRanks = 1 << kImmPeerBits;

constexpr uint32_t make_imm(uint32_t tag, uint32_t peer) { return (tag << kImmPeerBits) | (peer & kImmPeerMask); }
constexpr uint32_t imm_tag(uint32_t imm) { return imm >> kImmPeerBits; }
constexpr uint32_t imm_peer(uint32_t imm) { return imm & kImmPeerMask; }

inline std::string describe_imm(uint32_t imm) {
  char buf[64];
  snprintf(buf, sizeof(buf), "immediate 0x%08x (tag %u from peer %u)", imm, imm_tag(imm), imm_peer(imm));
  return buf;
}

}  // namespace moe_a2a::fabric
