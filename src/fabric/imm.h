// Layout of the 32-bit immediate that travels with a write: a 16-bit tag that
// says what the write is, a piece bit, and the sender's rank, so that a
// receiver counts arrivals per peer and a timeout names the peer that is late.
//
// A write split across all NICs carries the immediate on every piece, with
// the piece bit set; the receiver counts a piece as 1/num_nics of a write
// (imm_counters.h), so no piece waits for another to land first.
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>

namespace moe_a2a::fabric {

constexpr uint32_t kImmTagShift = 16;
constexpr uint32_t kImmPieceBit = 1u << 15;
constexpr uint32_t kImmPeerBits = 15;
constexpr uint32_t kImmPeerMask = (1u << kImmPeerBits) - 1;
constexpr int kMaxRanks = 1 << kImmPeerBits;

// What receivers count and wait for: (tag, sender), without the piece bit.
constexpr uint32_t make_imm(uint32_t tag, uint32_t peer) { return (tag << kImmTagShift) | (peer & kImmPeerMask); }
constexpr uint32_t imm_tag(uint32_t imm) { return imm >> kImmTagShift; }
constexpr uint32_t imm_peer(uint32_t imm) { return imm & kImmPeerMask; }
constexpr bool imm_is_piece(uint32_t imm) { return (imm & kImmPieceBit) != 0; }
constexpr uint32_t imm_key(uint32_t imm) { return imm & ~kImmPieceBit; }

inline std::string describe_imm(uint32_t imm) {
  char buf[64];
  snprintf(buf, sizeof(buf), "immediate 0x%08x (tag %u from peer %u)", imm_key(imm), imm_tag(imm), imm_peer(imm));
  return buf;
}

}  // namespace moe_a2a::fabric
