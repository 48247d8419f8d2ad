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
// landed on NIC 0). With `per_host` ranks on each host (in blocks of rank
// numbers), peers on other hosts are numbered by local-index distance, then
// host distance: the peers a rank writes to may be only those with its own
// local index on other hosts (rows per node, DeepEP's rails), whose plain
// distances are all multiples of per_host, and so all on one NIC with
// per_host NICs (measured: the testbed's rows per node took 1.75x longer than
// rows per rank, one of its two NICs idle); numbered so, they take slots 0, 1,
// ..., and all peers on other hosts take each slot once. Same-host peers come
// after them (the fabric does not carry their rows). per_host 1: the plain distance.
inline int peer_slot(int rank, int peer, int world, int per_host = 1) {
  if (per_host <= 1 || world % per_host != 0) return ((peer - rank - 1) % world + world) % world;
  const int hosts = world / per_host;
  const int host = ((peer / per_host - rank / per_host) % hosts + hosts) % hosts;
  const int local = ((peer % per_host - rank % per_host) % per_host + per_host) % per_host;
  if (host == 0) return (hosts - 1) * per_host + local - 1;
  return local * (hosts - 1) + host - 1;
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
