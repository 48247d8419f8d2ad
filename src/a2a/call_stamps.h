// Call stamps: a peer whose call sequence differs from ours fails the call at
// once instead of at the timeout, or of pairing with its next call. No bit of
// the wire is spent on it: a same-node peer's flags in our workspace hold the
// epoch of its last call of each kind, and the remote arrival counters count
// each kind's writes. A peer that runs the same sequence is at most one call
// ahead, and only once our combine (over capacity: our barrier) may have
// reached it; anything else they show is impossible (docs/protocol.md,
// "Call order"). The proxy checks its waits with these, the compute side its own.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "config.h"
#include "fabric/error.h"
#include "layout.h"
#include "signals.h"

namespace moe_a2a::a2a {

// Where this rank is in its calls, as far as the checks need it.
struct CallPosition {
  uint64_t epoch = 0;     // our call (0: none yet, nothing to check)
  bool cached = false;    // it runs along a cached routing: no routing rows
  bool routed = false;    // every routing row is in (cached: at once), so `overflow` is known
  bool overflow = false;  // over capacity: a barrier instead of a combine
  // Our combine (over capacity: barrier) of this call may have reached peers,
  // which may then be in the next call.
  bool combining = false;
  // Over capacity leaves no mark a peer can see (CUDA on one node: no proxy,
  // no barrier), so until `routed` a peer in our next call may have skipped
  // this call's combine rightly.
  bool silent_overflow = false;
  const char* phase() const { return combining ? "combine" : "dispatch"; }
};

[[noreturn]] inline void call_order_error(const A2AConfig& c, const CallPosition& at, int peer,
                                          const std::string& what) {
  throw fabric::FabricError("rank " + std::to_string(c.rank) + " is in the " + at.phase() + " of epoch " +
                            std::to_string(at.epoch) + (at.cached ? " (cached)" : " (uncached)") + "; peer " +
                            std::to_string(peer) + " " + what + ": the ranks' call sequences differ");
}

// Same-node peer s, from its flags in our workspace `self`. Flags are read in
// the reverse of the order s writes them within a call (route, dispatch, then
// combine or barrier), so what a later flag shows, the earlier ones show too.
inline void check_node_stamps(const A2AConfig& c, const Layout& l, uint8_t* self, const CallPosition& at, int s) {
  const uint64_t e = at.epoch;
  if (e == 0 || s == c.rank) return;
  auto get = [&](int sender, FlagKind k) { return flag_at(self, l, sender, k)->load(std::memory_order_acquire); };
  const uint64_t combine = get(s, kFlagCombine), barrier = get(s, kFlagBarrier);
  const uint64_t dispatch = get(s, kFlagDispatch), route = get(s, kFlagRoute);
  const uint64_t combined = get(s, kFlagCombine), met = get(s, kFlagBarrier);  // after the later call's flags
  // Read last: our own barrier flag, raised before any peer can pass an over-capacity call.
  const bool closed = at.combining || get(c.rank, kFlagBarrier) >= e;
  const uint64_t ahead = std::max({route, dispatch, barrier});
  const std::string call = "epoch " + std::to_string(e);
  const std::string next = "epoch " + std::to_string(e + 1);
  if (combine > e) call_order_error(c, at, s, "already combined epoch " + std::to_string(combine));
  if (ahead > e + 1 || (ahead == e + 1 && !closed))
    call_order_error(c, at, s, "is already in epoch " + std::to_string(ahead));
  // Over capacity nobody combines (and without a proxy, CUDA on one node, nobody meets either).
  const bool may_skip_combine = at.routed ? at.overflow : at.silent_overflow;
  if (ahead == e + 1 && combined < e && met < e && !may_skip_combine)
    call_order_error(c, at, s, "started " + next + " without combining " + call);
  if (at.cached && route == e) call_order_error(c, at, s, "sent a routing row for " + call + ", so it runs that epoch uncached");
  if (!at.cached && dispatch >= e && route < e)
    call_order_error(c, at, s, "packed its dispatch rows of " + call + " without a routing row, so it runs that epoch cached");
  if (at.routed && !at.overflow && barrier == e)
    call_order_error(c, at, s, "found " + call + " over capacity (its routing differs)");
  if (at.routed && at.overflow && combine == e)
    call_order_error(c, at, s, "combined " + call + ", which is over capacity here (its routing differs)");
}

// Kinds of remote writes the checks count, and their tags (signals.h).
enum StampKind : int {
  kStampRoute = 0,
  kStampDispatch = 1,
  kStampCombine = 2,
  kStampBarrier = 3,
  kStampRouting = 4,  // a cached call's routing stamp
  kStampKinds = 5
};
using StampCounts = std::array<uint64_t, kStampKinds>;
constexpr Tag kStampTags[kStampKinds] = {kTagRoute, kTagDispatch, kTagCombine, kTagBarrier, kTagStamp};
// The kind counted for writes of tag `t`; -1 for tags the checks do not count (ABORT).
constexpr int stamp_kind(Tag t) {
  for (int k = 0; k < kStampKinds; ++k)
    if (kStampTags[k] == t) return k;
  return -1;
}

// What a remote peer may have sent us of each kind, in our call and (once
// we combine) its next one.
struct RemoteBounds {
  uint64_t dispatch = 0;      // its dispatch writes to us in this call (once routed)
  uint64_t dispatch_max = 0;  // the most one call can have: private part, overflow part
  bool fed = false;           // every write of ours that its dispatch of this call waits for is posted
};

// Remote peer s: `seen` = writes of each kind taken in this call plus those
// counted and not yet taken.
inline void check_remote_stamps(const A2AConfig& c, const CallPosition& at, int s, const StampCounts& seen,
                                const RemoteBounds& b) {
  if (at.epoch == 0) return;
  const uint64_t next = at.combining ? 1 : 0;  // the next call's writes, once it may be there
  const std::string call = "epoch " + std::to_string(at.epoch);
  const std::string past = "epoch " + std::to_string(at.epoch + next + 1);
  auto too_many = [&](StampKind k, uint64_t most, const char* what, const std::string& means) {
    if (seen[k] > most)
      call_order_error(c, at, s,
                       "sent " + std::to_string(seen[k]) + " " + what + " where " + call +
                           (next ? " and the next allow " : " allows ") + std::to_string(most) + ": " + means);
  };
  too_many(kStampRoute, (at.cached ? 0 : 1) + next, "routing row(s)",
           at.cached && !next ? "it runs " + call + " uncached, or is already in " + past
                              : "it is already in " + past);
  const uint64_t dispatch = at.routed ? b.dispatch : b.dispatch_max;
  too_many(kStampDispatch, dispatch + next * b.dispatch_max, "dispatch write(s)",
           "it runs " + call + " along another routing, or is already in " + past);
  const uint64_t combine = (at.routed && at.overflow) || !b.fed ? 0 : 1;
  too_many(kStampCombine, combine + next, "combine write(s)",
           b.fed ? "it is already in " + past
                 : "it combined " + call + " before this rank sent it all its dispatch rows: it runs " + call +
                       (at.cached ? " uncached or" : " cached or") + " along another routing");
  const uint64_t barrier = at.routed && !at.overflow ? 0 : 1;
  too_many(kStampBarrier, barrier + next, "over-capacity barrier(s)",
           "it found " + call + " over capacity (its routing differs), or is already in " + past);
  // Sent first in every cached call, to every remote peer, whatever it needs from them.
  too_many(kStampRouting, (at.cached ? 1 : 0) + next, "routing stamp(s)",
           at.cached || next ? "it is already in " + past : "it runs " + call + " cached");
}

// Cached calls exchange no routing rows, so ranks that run one along
// different routings with the same per-peer counts would pair without any
// count telling. Each sender's matrix hash goes to every peer's
// routing_stamps slot: same-node peers' before the sender raises its dispatch
// flag (the receiver compares once that flag is up), remote peers' by a write
// of its own (the proxy compares once it arrived, before the rows are read).
inline uint64_t routing_hash(const uint32_t* matrix, size_t words) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a
  for (size_t i = 0; i < words; ++i) {
    h ^= matrix[i];
    h *= 1099511628211ull;
  }
  return h;
}

// Ours, into every same-node peer's workspace (`node[r]`; null for remote ranks).
inline void publish_routing_stamp(const A2AConfig& c, const Layout& l, const std::vector<uint8_t*>& node,
                                  uint64_t epoch, uint64_t hash) {
  for (int r = 0; r < c.world && r < static_cast<int>(node.size()); ++r) {
    if (r == c.rank || node[r] == nullptr || !c.same_node(r)) continue;
    RoutingStamp* st = routing_stamp_at(node[r], l, c.rank);
    st->hash = hash;
    st->epoch.store(epoch, std::memory_order_release);
  }
}

// Sender s, whose stamp of `epoch` is in (same-node: its dispatch flag is up;
// remote: the proxy took the stamp's write): a cached call of that epoch along
// another routing than ours is an error.
inline void check_routing_stamp(const A2AConfig& c, const Layout& l, uint8_t* self, int s, uint64_t epoch,
                                uint64_t hash) {
  if (s == c.rank) return;
  const RoutingStamp* st = routing_stamp_at(self, l, s);
  if (st->epoch.load(std::memory_order_acquire) != epoch || st->hash == hash) return;
  char ours[20], theirs[20];
  snprintf(ours, sizeof(ours), "%016llx", static_cast<unsigned long long>(hash));
  snprintf(theirs, sizeof(theirs), "%016llx", static_cast<unsigned long long>(st->hash));
  throw fabric::FabricError("rank " + std::to_string(c.rank) + " runs the cached dispatch of epoch " +
                            std::to_string(epoch) + " along routing " + ours + "; peer " + std::to_string(s) +
                            " along routing " + theirs +
                            ": the ranks' call sequences differ (each rank must pass the Routing of the same call)");
}

}  // namespace moe_a2a::a2a
