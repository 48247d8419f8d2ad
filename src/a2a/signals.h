// Flags between the compute side and the host proxy, in host memory: plain
// atomics for the CPU implementation, pinned mapped memory that kernels store
// to with system scope for the CUDA one. Each holds the epoch it last reached.
#pragma once

#include <atomic>
#include <cstdint>

#include "config.h"
#include "slices.h"

namespace moe_a2a::a2a {

struct alignas(64) Seq {
  std::atomic<uint64_t> value{0};
  uint64_t get() const { return value.load(std::memory_order_acquire); }
  void set(uint64_t v) { value.store(v, std::memory_order_release); }
};

struct ProxySignals {
  // compute -> proxy
  Seq route_ready;     // this rank's routing row is in its workspace
  Seq packed;          // the send section is packed
  Seq combine_packed;  // the combine_send section is packed
  // proxy -> compute
  Seq routed;          // every routing row is in and within capacity (or overflow is set): the plan can be made
  Seq dispatch_done;   // every expected remote write of the dispatch landed
  Seq combine_done;    // every remote combine write landed
  Seq overflow;        // epoch whose dispatch exceeded max_recv_tokens
  Seq failed;          // non-zero once the proxy stopped on an error
  // compute -> proxy, set before route_ready: the epoch of a cached call
  // (docs/protocol.md, "Cached calls"), which exchanges no routing row; its
  // matrix [world][E + N] is at cached_routing, memory of the compute
  // side left unchanged until that epoch's dispatch_done.
  Seq cached;
  const uint32_t* cached_routing = nullptr;
};

// Flags per peer (index = rank), so that rows are handed over peer by peer:
// the proxy writes a peer's rows as soon as they are packed, and the compute
// side copies a sender's rows out as soon as they have landed. Each array
// has `world` entries, in memory the owner keeps (plain host memory on CPUs,
// pinned mapped memory on GPUs: kernels store to it with system scope).
// The proxy also takes the whole-call flags above (packed, combine_packed)
// as "every peer packed", which is what the CUDA kernels raise.
struct PeerSignals {
  Seq* packed = nullptr;          // compute -> proxy: the dispatch rows for peer r are in the send section
  Seq* combine_packed = nullptr;  // compute -> proxy: the combine rows for peer r are staged
  Seq* landed = nullptr;          // proxy -> compute: every dispatch write from peer s has landed
  Seq* combine_landed = nullptr;  // proxy -> compute: the combine write from peer s has landed
  // proxy -> compute, slice by slice (slices.h): progress_word(epoch, k) once
  // sender s's first k slices (in row order) have landed.
  Seq* slices_landed = nullptr;
  Seq* combine_slices_landed = nullptr;
  // compute -> proxy, where the compute side stages slice by slice (CUDA):
  // [world][kMaxPeerSlices] epochs, slice k of peer r staged. Null: the
  // proxy takes packed[r] for every slice (the CPU backend).
  std::atomic<uint64_t>* slices_packed = nullptr;
  std::atomic<uint64_t>* combine_slices_packed = nullptr;
};
constexpr int kPeerSignalArrays = 6;

// The Seq arrays of PeerSignals in one block of kPeerSignalArrays * world Seqs.
inline PeerSignals peer_signals_in(Seq* block, int world) {
  PeerSignals p;
  p.packed = block;
  p.combine_packed = block + world;
  p.landed = block + 2 * world;
  p.combine_landed = block + 3 * world;
  p.slices_landed = block + 4 * world;
  p.combine_slices_landed = block + 5 * world;
  return p;
}

// Immediate tags of the protocol's writes (docs/protocol.md, "Signals").
// kTagStamp: a cached call's routing stamp (call_stamps.h) to each remote peer.
// kTagFence: after a loss, the survivors' zero-byte write behind everything
// else they sent, before they re-arm (moe_a2a.masking); never counted by the
// call checks.
enum Tag : uint32_t {
  kTagRoute = 1,
  kTagDispatch = 2,
  kTagCombine = 3,
  kTagBarrier = 4,
  kTagAbort = 5,
  kTagStamp = 6,
  kTagFence = 7
};

// The tag on the wire: the kind in the low bits, then the slice (slices.h:
// the part, then the slice in it), the instance above them (config.h), so
// instances that share an engine never count each other's writes, and a
// receiver counts each slice of a peer's rows apart.
static_assert(kTagSliceBits == kSliceBits + 1, "a part bit and the slice index");
constexpr int kTagInstanceShift = kTagKindBits + kTagSliceBits;
inline uint32_t slice_tag(int instance, Tag kind, int part, uint32_t slice) {
  return (static_cast<uint32_t>(instance) << kTagInstanceShift) |
         (static_cast<uint32_t>(part) << (kTagKindBits + kSliceBits)) | (slice << kTagKindBits) | kind;
}
// The first write of a part (of every write that is not sliced).
inline uint32_t wire_tag(int instance, Tag kind) { return slice_tag(instance, kind, 0, 0); }
// Every tag of one instance: what forget_imm drops (a mask of the tag's bits).
constexpr uint32_t kInstanceTagMask = ~((1u << kTagInstanceShift) - 1) & 0xffffu;

}  // namespace moe_a2a::a2a
