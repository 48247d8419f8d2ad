// What the host proxy needs of a transfer engine: the whole contract between
// the dispatch/combine protocol (a2a/proxy.h) and the network.
//
// Read this first if you are adding a transport. Two implementations exist:
//  - TransferEngine (engine.h): the real one, libfabric underneath (tcp, shm,
//    efa, verbs), one worker thread per rank driving per-NIC Backends
//    (backend.h). A direct ibverbs RC transport would most likely be a Backend
//    under TransferEngine; it must keep every promise below all the same.
//  - MemoryEngine (memory_engine.h): every rank of a world in one process,
//    writes delivered by memcpy in an order a test chooses, failures injected
//    on demand. It is a test seam for the protocol, and the shortest complete
//    example of these semantics.
//
// The model: each rank registers one region (its workspace) and binds every
// remote peer to that peer's region in a group. The proxy then only posts
// one-sided writes into peers' regions, each carrying a 16-bit tag, and
// counts the tags that arrive from each peer. It never receives a message:
// a write's immediate is its only notification.
//
// Promises every implementation keeps:
//  1. A write's bytes are placed in the target region before its immediate is
//     counted there: a receiver that has counted (tag, peer) may read the bytes.
//  2. Nothing else is ordered. Writes to one peer may land in any order
//     (the protocol gives every write it must tell apart a tag of its own).
//  3. The source bytes are read at some time between posting and completion
//     (as an RDMA NIC does), so the caller keeps them unchanged until then.
//  4. Every wait takes a timeout and an `on_idle` callback, which runs every
//     few milliseconds while the wait blocks; what it throws ends the wait
//     (the proxy throws for a stop request, a peer that announced a failure,
//     a peer in another call). A wait that runs out of time throws
//     TimeoutError naming the peer(s) and what arrived; an engine that
//     failed (a write that could not be delivered) throws FabricError from
//     every later call and wait, with the cause.
//  5. Calls may come from two threads at once: the proxy's and the compute
//     side's (which only reads counts and error()); implementations lock what
//     they share.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "handles.h"

namespace moe_a2a::fabric {

// One destination of a scatter: `peer` indexes the group.
struct ScatterItem {
  uint32_t peer = 0;
  uint64_t src_offset = 0;
  uint64_t length = 0;
  uint64_t dst_offset = 0;
};

class ProxyEngine {
 public:
  virtual ~ProxyEngine() = default;

  virtual int rank() const = 0;
  virtual int world() const = 0;

  // Posts one write per item: `length` bytes at `src_offset` of our region
  // to `dst_offset` of group peer `items[i].peer`'s region, each with
  // immediate `tag` (receivers count (tag, our rank)); no tag: the write
  // notifies nobody. Does not block on the network: it returns once the
  // writes are queued. Items are checked first (peer index, both ranges,
  // tag <= 0xffff): a bad one throws FabricError and posts nothing.
  // Zero-byte items with a tag are posted (a notification alone).
  virtual void scatter(GroupId group, RegionId region, const ScatterItem* items, size_t count,
                       std::optional<uint32_t> tag) = 0;
  // One write to a remote region outside any group (tools, tests); as scatter.
  virtual void write(RegionId region, uint64_t src_offset, uint64_t length, RemoteRegionId remote,
                     uint64_t dst_offset, std::optional<uint32_t> tag) = 0;

  // Blocks until `count` arrivals of `tag` from `peer` are counted, then
  // consumes them. Arrivals counted before the call count: a fast peer is
  // never missed. Throws TimeoutError after `timeout_s`.
  virtual void wait_imm(uint32_t tag, int peer, uint64_t count, double timeout_s,
                        const std::function<void()>& on_idle = {}) = 0;
  // Blocks until some i has `counts[i]` arrivals of `tags[i]` from
  // `peers[i]`; returns that i and consumes nothing (wait_imm takes them).
  // Where several are ready, any may be returned. The proxy serves senders in
  // the order their data completes with it. Throws TimeoutError after `timeout_s`.
  virtual size_t wait_any_imm(const std::vector<uint32_t>& tags, const std::vector<int>& peers,
                              const std::vector<uint64_t>& counts, double timeout_s,
                              const std::function<void()>& on_idle = {}) = 0;
  // Arrivals of `tag` from `peer` counted and not consumed. Never blocks.
  virtual uint64_t imm_count(uint32_t tag, int peer) const = 0;
  // Drops arrivals, from every peer, counted and never consumed, of each tag
  // t with (t & mask) == tag: what a new user of a tag slot does, so that a
  // failed predecessor's leftovers cannot pair with its first call. Never blocks.
  virtual void forget_imm(uint32_t tag, uint32_t mask = 0xffffu) = 0;

  // Every write posted before it is placed, then a zero-byte write with `tag`
  // to each group peer, then a wait (wait_imm) for the same from each of
  // them. Blocks; `timeout_s` bounds each wait.
  virtual void barrier(GroupId group, uint32_t tag, double timeout_s, const std::function<void()>& on_idle = {}) = 0;

  // Blocks until every write posted so far has completed (its source may be
  // reused), or throws TimeoutError after `timeout_s`.
  virtual void wait_tx(double timeout_s) = 0;
  // Writes posted and completed so far (tests count the writes of a call).
  virtual uint64_t tx_submitted() const = 0;
  virtual uint64_t tx_completed() const = 0;

  // The first failure of the engine ("" while healthy); sticky. Never blocks.
  virtual std::string error() const = 0;
  // Throws FabricError with error() once the engine has failed.
  virtual void check() const = 0;

  // Whether `peer`'s process is known to be gone, by a means of the engine's
  // own (TransferEngine: the EOF of a control connection to a peer on another
  // host); false where it cannot tell. Never blocks; may be called from the
  // proxy's and the compute side's waits at once.
  virtual bool peer_gone(int /*peer*/) const { return false; }
  // Whether `peer` said goodbye before it went (TransferEngine::leave): its process
  // ended its script after its writes were on their way, which may still land.
  // Never blocks.
  virtual bool peer_left(int /*peer*/) const { return false; }

  // The group's size and the rank of its peer `index`.
  virtual size_t group_size(GroupId group) const = 0;
  virtual int group_peer(GroupId group, uint32_t index) const = 0;

  // Convenience: one tag for every peer.
  size_t wait_any_imm(uint32_t tag, const std::vector<int>& peers, const std::vector<uint64_t>& counts,
                      double timeout_s, const std::function<void()>& on_idle = {}) {
    return wait_any_imm(std::vector<uint32_t>(peers.size(), tag), peers, counts, timeout_s, on_idle);
  }
};

}  // namespace moe_a2a::fabric
