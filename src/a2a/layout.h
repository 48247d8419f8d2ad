// Sections of a rank's workspace (docs/protocol.md, "Workspace of rank r"),
// as byte offsets from its start. Same-node peers and the fabric address the
// workspace with these offsets.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>

#include "config.h"

namespace moe_a2a::a2a {

// Same-node signals: sender s stores the epoch into flag(s, kind) of the
// receiver's workspace. Each flag has a cache line of its own.
// Rows per node (A2AConfig::node_rows) add two: kFlagForward[s], raised in
// every node peer's workspace by the proxy of s's forwarder once all of s's
// rows are in its workspace; kFlagStaged[r], raised by r once its expert
// outputs are in its y_stage section for the forwarders to sum.
enum FlagKind : int {
  kFlagRoute = 0,
  kFlagDispatch = 1,
  kFlagCombine = 2,
  kFlagBarrier = 3,
  kFlagForward = 4,
  kFlagStaged = 5,
  kNumFlagKinds = 6
};
constexpr size_t kFlagStride = 64;
// A failing rank's note to its peers (peer_watch.h): sender s writes record s
// of each peer's workspace, the text first and `state` last.
constexpr size_t kAbortStride = 512;
struct AbortRecord {
  std::atomic<uint64_t> state;  // 0: nothing; otherwise the sender has failed
  // The last phase the sender completed (dispatch_phase, peer_watch.h): a peer
  // still in that phase or an earlier one finishes it first.
  uint64_t done;
  char text[kAbortStride - 2 * sizeof(uint64_t)];
};
static_assert(sizeof(AbortRecord) == kAbortStride);

// The routing a sender ran a cached call along (call_stamps.h): same-node
// peers compare it with their own before reading the sender's rows. `epoch`
// is stored last.
struct RoutingStamp {
  std::atomic<uint64_t> epoch;
  uint64_t hash;
};

struct Layout {
  size_t flags = 0;
  size_t routing = 0;
  size_t private_rows = 0;
  size_t shared_rows = 0;
  size_t send = 0;
  size_t combine_send = 0;
  size_t combine_recv = 0;
  size_t aborts = 0;
  size_t routing_stamps = 0;
  size_t votes = 0;  // this rank's proposal when survivors agree on the live ranks (live_ranks.h)
  // Rows per node only (else empty): this rank's expert outputs, one y_stride
  // row per output row (room for fp32), one fp32 row value each after them,
  // then the DType the CPU backend staged them in (its y's: a bf16 y moves
  // half the bytes; the CUDA backend stages fp32).
  size_t y_stage = 0;
  size_t y_values = 0;
  size_t y_stage_dtype = 0;
  size_t y_stride = 0;
  size_t total = 0;
  size_t dispatch_row = 0;
  size_t combine_row = 0;
  size_t dispatch_tail = 0;  // offset of a dispatch row's tail (its copy's weight, fp32; rank rows: RouteEntry[m])
  size_t combine_tail = 0;   // offset of a combine row's tail (its returned value, fp32; rank rows: m of them)
  size_t dispatch_tail_bytes = 0;
  size_t combine_tail_bytes = 0;
  size_t routing_width = 0;  // words of a routing row: E + N

  static Layout of(const A2AConfig& c) {
    Layout l;
    l.dispatch_row = c.dispatch_row_bytes();
    l.combine_row = c.combine_row_bytes();
    l.dispatch_tail = c.dispatch_body_bytes();
    l.combine_tail = c.combine_body_bytes();
    l.dispatch_tail_bytes = c.dispatch_tail_bytes();
    l.combine_tail_bytes = c.combine_tail_bytes();
    l.routing_width = c.routing_width();
    size_t at = 0;
    auto section = [&at](size_t bytes) {
      size_t start = at;
      at = align_up(at + bytes, kSectionAlign);
      return start;
    };
    size_t world = c.world, max_copies = static_cast<size_t>(c.max_tokens) * c.topk;
    l.flags = section(world * kNumFlagKinds * kFlagStride);
    l.routing = section(world * l.routing_width * sizeof(uint32_t));
    l.private_rows = section(world * c.max_private_tokens * l.dispatch_row);
    l.shared_rows = section(static_cast<size_t>(c.max_recv_tokens) * l.dispatch_row);
    l.send = section(max_copies * l.dispatch_row);
    l.combine_send = section(static_cast<size_t>(c.max_recv_tokens) * l.combine_row);
    l.combine_recv = section(max_copies * l.combine_row);
    l.aborts = section(world * kAbortStride);
    l.routing_stamps = section(world * kFlagStride);
    l.votes = section(2 * sizeof(uint64_t) + (world + 63) / 64 * sizeof(uint64_t));
    const size_t out_rows = c.node_rows() ? static_cast<size_t>(c.max_output_rows()) : 0;
    l.y_stride = static_cast<size_t>(c.hidden) * sizeof(float);
    l.y_stage = section(out_rows * l.y_stride);
    l.y_values = section(out_rows * sizeof(float) + (out_rows > 0 ? sizeof(uint64_t) : 0));
    l.y_stage_dtype = l.y_values + out_rows * sizeof(float);
    l.total = at;
    return l;
  }

  size_t flag(int sender, FlagKind kind) const { return flags + (static_cast<size_t>(sender) * kNumFlagKinds + kind) * kFlagStride; }
  size_t abort_record(int sender) const { return aborts + static_cast<size_t>(sender) * kAbortStride; }
  size_t routing_row(int sender) const { return routing + static_cast<size_t>(sender) * routing_width * sizeof(uint32_t); }
};

inline RoutingStamp* routing_stamp_at(uint8_t* workspace, const Layout& l, int sender) {
  return reinterpret_cast<RoutingStamp*>(workspace + l.routing_stamps + static_cast<size_t>(sender) * kFlagStride);
}

inline AbortRecord* abort_at(uint8_t* workspace, const Layout& l, int sender) {
  return reinterpret_cast<AbortRecord*>(workspace + l.abort_record(sender));
}

inline std::atomic<uint64_t>* flag_at(uint8_t* workspace, const Layout& l, int sender, FlagKind kind) {
  return reinterpret_cast<std::atomic<uint64_t>*>(workspace + l.flag(sender, kind));
}

}  // namespace moe_a2a::a2a
