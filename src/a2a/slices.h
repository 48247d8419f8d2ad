// Slices: a peer's rows crossing the fabric, cut into several writes, so that
// staging, the fabric and the receiver's read-back of one peer's rows
// overlap instead of running one after another (docs/protocol.md, "Slices").
//
// A part of a peer's rows (dispatch: the private part [0, min(n, P)), then
// the overflow [P, n); combine: all n rows) of `rows` rows is cut into at
// most kMaxSlices writes of equal rows (the last may be shorter), each about
// `slice_bytes`. Sender and receiver cut alike from the routing matrix and
// the configuration, so each knows every write's rows. Slice i of part p
// carries its own tag (signals.h, slice_tag): the receiver counts and waits
// for each apart, whatever order they land in. Included by host C++ and by
// the CUDA kernels.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define MOE_A2A_HD __host__ __device__
#else
#define MOE_A2A_HD
#endif

namespace moe_a2a::a2a {

constexpr int kSliceBits = 4;                    // slices of one part, in the tag
constexpr int kMaxSlices = 1 << kSliceBits;      // per part
constexpr int kMaxPeerSlices = 2 * kMaxSlices;   // per peer and call: both parts of a dispatch

struct Slices {
  uint64_t first = 0;  // the part's first row among the peer's rows
  uint64_t rows = 0;   // the part's rows
  uint64_t per = 0;    // rows of each slice but the last
  uint32_t count = 0;  // slices (0: the part is empty)

  MOE_A2A_HD uint64_t begin(uint32_t i) const { return first + i * per; }
  MOE_A2A_HD uint64_t end(uint32_t i) const {
    const uint64_t e = (i + 1) * per;
    return first + (e < rows ? e : rows);
  }
};

// `rows` rows of `row_bytes` from row `first` on, in slices of about `slice_bytes`.
MOE_A2A_HD inline Slices slices_of(uint64_t first, uint64_t rows, uint64_t row_bytes, uint64_t slice_bytes) {
  Slices s;
  s.first = first;
  s.rows = rows;
  if (rows == 0) return s;
  const uint64_t bytes = rows * row_bytes;
  uint64_t k = slice_bytes == 0 ? 1 : (bytes + slice_bytes - 1) / slice_bytes;
  k = k < 1 ? 1 : k > kMaxSlices ? kMaxSlices : k;
  s.per = (rows + k - 1) / k;
  s.count = static_cast<uint32_t>((rows + s.per - 1) / s.per);
  return s;
}

// The two parts of a dispatch to one peer: `n` copies, `P` private slots.
struct DispatchSlices {
  Slices part[2];  // 0: private rows [0, min(n, P)); 1: overflow [P, n)
  MOE_A2A_HD uint32_t count() const { return part[0].count + part[1].count; }
  // Slice k of both parts in row order (the private part's first).
  MOE_A2A_HD int part_of(uint32_t k) const { return k < part[0].count ? 0 : 1; }
  MOE_A2A_HD uint32_t index_in_part(uint32_t k) const { return k < part[0].count ? k : k - part[0].count; }
  MOE_A2A_HD uint64_t begin(uint32_t k) const { return part[part_of(k)].begin(index_in_part(k)); }
  MOE_A2A_HD uint64_t end(uint32_t k) const { return part[part_of(k)].end(index_in_part(k)); }
};

MOE_A2A_HD inline DispatchSlices dispatch_slices(uint64_t n, uint64_t P, uint64_t row_bytes, uint64_t slice_bytes) {
  const uint64_t priv = n < P ? n : P;
  DispatchSlices d;
  d.part[0] = slices_of(0, priv, row_bytes, slice_bytes);
  d.part[1] = slices_of(priv, n - priv, row_bytes, slice_bytes);
  return d;
}

// `n` rows in one piece (rows that do not cross the fabric).
MOE_A2A_HD inline DispatchSlices one_piece(uint64_t n) {
  DispatchSlices d;
  d.part[0] = slices_of(0, n, 1, 0);
  return d;
}

// Combine: one part.
MOE_A2A_HD inline DispatchSlices combine_slices(uint64_t n, uint64_t row_bytes, uint64_t slice_bytes) {
  DispatchSlices d;
  d.part[0] = slices_of(0, n, row_bytes, slice_bytes);
  return d;
}

// Progress words (signals.h, PeerSignals::*_slices_landed): epoch * kProgressScale
// + slices of that epoch landed in row order, so the word only grows across calls.
constexpr uint64_t kProgressScale = 64;
static_assert(kMaxPeerSlices < kProgressScale, "a progress word holds every slice of one call");
MOE_A2A_HD constexpr uint64_t progress_word(uint64_t epoch, uint32_t slices) { return epoch * kProgressScale + slices; }

}  // namespace moe_a2a::a2a
