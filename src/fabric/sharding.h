// Which NIC carries what: peers are sharded across a rank's NICs, and one
// large write is split into a piece per NIC. Pure functions, unit-tested
// without a fabric.
#pragma once

#include <cstdint>
#include <vector>

namespace moe_a2a::fabric {

// Most NICs (endpoints) one engine opens.
constexpr int kMaxNics = 16;

// Pieces of a split write start on this boundary, so each piece stays aligned.
constexpr uint64_t kSplitAlign = 4096;

// Peer p is served by NIC p mod n on both sides, so the sender's NIC k always
// talks to the receiver's NIC k.
inline int nic_for_peer(int peer, int num_nics) { return peer % num_nics; }

struct Piece {
  int nic;
  uint64_t offset;
  uint64_t length;
};

// One piece on the peer's NIC below `threshold` (or with one NIC); otherwise
// exactly one piece per NIC (the receiver counts a split write as num_nics
// pieces, imm.h), each a multiple of kSplitAlign but the last, which takes the
// rest (less than num_nics * kSplitAlign more than the others). Lengths sum
// to `length`; no piece is empty unless the write is.
// Writes the pieces to `out` (room for num_nics) and returns how many: the
// engine's hot path, which allocates nothing.
inline int split_pieces(int peer, uint64_t length, int num_nics, uint64_t threshold, Piece* out) {
  if (num_nics <= 1 || length < threshold || length < kSplitAlign * num_nics) {
    out[0] = {nic_for_peer(peer, num_nics), 0, length};
    return 1;
  }
  const uint64_t chunk = length / num_nics / kSplitAlign * kSplitAlign;  // >= kSplitAlign here
  for (int i = 0; i < num_nics; ++i) {
    uint64_t offset = chunk * i;
    // Rotate the starting NIC by peer so a scatter spreads its pieces.
    out[i] = {(nic_for_peer(peer, num_nics) + i) % num_nics, offset, i == num_nics - 1 ? length - offset : chunk};
  }
  return num_nics;
}

inline std::vector<Piece> split_write(int peer, uint64_t length, int num_nics, uint64_t threshold) {
  std::vector<Piece> pieces(num_nics < 1 ? 1 : num_nics);
  pieces.resize(split_pieces(peer, length, num_nics, threshold, pieces.data()));
  return pieces;
}

}  // namespace moe_a2a::fabric
