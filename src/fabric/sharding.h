// Which NIC carries what: peers are sharded across a rank's NICs, and one
// large write is split into a piece per NIC. Pure functions, unit-tested
// without a fabric.
#pragma once

#include <cstdint>
#include <vector>

namespace moe_a2a::fabric {

// Pieces of a split write start on this boundary, so each piece stays aligned.
constexpr uint64_t kSplitAlign = 4096;

// A peer's slot is its distance from us, counted from the next rank: 0 for
// rank + 1, world - 2 for rank - 1. Sharding by slot spreads every rank's peers
// evenly over its NICs, on the sending side and on the receiving side (sharding
// by rank number did not: with 3 ranks and 2 NICs, rank 1's peers 0 and 2 both
// landed on NIC 0).
inline int peer_slot(int rank, int peer, int world) { return ((peer - rank - 1) % world + world) % world; }

// The peer in slot s is served by NIC s mod n; the write lands on the
// receiver's NIC of the same index.
inline int nic_for_peer(int slot, int num_nics) { return slot % num_nics; }

struct Piece {
  int nic;
  uint64_t offset;
  uint64_t length;
};

// One piece on the peer's NIC below `threshold` (or with one NIC); otherwise
// at most one piece per NIC, each a multiple of kSplitAlign but the last. Lengths sum to
// `length`; no piece is empty unless the write is.
inline std::vector<Piece> split_write(int slot, uint64_t length, int num_nics, uint64_t threshold) {
  if (num_nics <= 1 || length < threshold || length < kSplitAlign * num_nics)
    return {{nic_for_peer(slot, num_nics), 0, length}};
  uint64_t per_nic = (length + num_nics - 1) / num_nics;
  uint64_t chunk = (per_nic + kSplitAlign - 1) / kSplitAlign * kSplitAlign;
  std::vector<Piece> pieces;
  uint64_t offset = 0;
  for (int i = 0; i < num_nics && offset < length; ++i) {
    uint64_t len = (i == num_nics - 1 || offset + chunk > length) ? length - offset : chunk;
    // Rotate the starting NIC by slot so a scatter spreads its pieces.
    pieces.push_back({(nic_for_peer(slot, num_nics) + i) % num_nics, offset, len});
    offset += len;
  }
  return pieces;
}

}  // namespace moe_a2a::fabric
