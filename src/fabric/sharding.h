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

// A peer's slot is its distance from us, counted from the next rank: 0 for
// rank + 1, world - 2 for rank - 1. Sharding by slot spreads every rank's peers
// evenly over its NICs, on the sending side and on the receiving side (sharding
// by rank number did not: with 3 ranks and 2 NICs, rank 1's peers 0 and 2 both
// landed on NIC 0).
inline int peer_slot(int rank, int peer, int world) { return ((peer - rank - 1) % world + world) % world; }

// The slot of a rail peer, a peer with our local index on another node
// (`per_node` ranks a node, in blocks of rank numbers), in a group of rails
// (rows per node write to nothing else: DeepEP's rails): the node distance
// minus one, after local index times (nodes - 1). A rank's rails then take
// consecutive slots, and a node's rails every slot once, so both spread over
// the NICs (starting each rank one apart did not: 3 nodes of 2, 4 NICs).
// By plain distance every rail is a multiple of per_node away: all on one
// NIC where the NICs divide per_node (measured on the testbed, 2 NICs a
// host: rows per node took 1.75x longer than rows per rank, one NIC idle).
// Not for groups of every peer: plain distances spread those in both
// directions, which no one numbering does for both kinds of group.
inline int rail_slot(int rank, int peer, int world, int per_node) {
  const int nodes = world / per_node;
  const int node = ((peer / per_node - rank / per_node) % nodes + nodes) % nodes;
  return (rank % per_node) * (nodes - 1) + (node + nodes - 1) % nodes;
}

// The peer in slot s is served by NIC s mod n; the write lands on the
// receiver's NIC of the same index.
inline int nic_for_peer(int slot, int num_nics) { return slot % num_nics; }

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
inline int split_pieces(int slot, uint64_t length, int num_nics, uint64_t threshold, Piece* out) {
  if (num_nics <= 1 || length < threshold || length < kSplitAlign * num_nics) {
    out[0] = {nic_for_peer(slot, num_nics), 0, length};
    return 1;
  }
  const uint64_t chunk = length / num_nics / kSplitAlign * kSplitAlign;  // >= kSplitAlign here
  for (int i = 0; i < num_nics; ++i) {
    uint64_t offset = chunk * i;
    // Rotate the starting NIC by slot so a scatter spreads its pieces.
    out[i] = {(nic_for_peer(slot, num_nics) + i) % num_nics, offset, i == num_nics - 1 ? length - offset : chunk};
  }
  return num_nics;
}

inline std::vector<Piece> split_write(int slot, uint64_t length, int num_nics, uint64_t threshold) {
  std::vector<Piece> pieces(num_nics < 1 ? 1 : num_nics);
  pieces.resize(split_pieces(slot, length, num_nics, threshold, pieces.data()));
  return pieces;
}

}  // namespace moe_a2a::fabric
