#include "fabric_recv.h"

#include <string>
#include <vector>

#include "../layout.h"
#include "../slices.h"
#include "../wait.h"
#include "fabric/error.h"
#include "launch.h"
#include "resources.h"

namespace moe_a2a::a2a::cuda {

uint32_t slices_landed(const Seq& progress, const Seq& whole, const Seq& all, uint64_t epoch, uint32_t count) {
  if (whole.get() >= epoch || all.get() >= epoch) return count;
  const uint64_t v = progress.get();
  if (v < progress_word(epoch, 0)) return 0;  // an earlier call's
  const uint64_t in = v - progress_word(epoch, 0);
  return in < count ? static_cast<uint32_t>(in) : count;
}

namespace {

// One source of rows, slice by slice: `landed()` says how many of its
// slices are in, `take(first, end)` copies slices [first, end) once.
struct Pending {
  int peer;
  DispatchSlices cut;
  uint32_t next;  // slices copied
};

// Until every pending source is copied: each pass takes what landed since the
// last; between passes that moved nothing, backs off, checks the rank and
// the deadline (`late(pending)` names the sources still out).
template <typename Landed, typename Take, typename Late>
void take_as_they_land(const LandingView& v, std::vector<Pending>& pending, Landed&& landed, Take&& take, Late&& late) {
  Backoff backoff;
  while (!pending.empty()) {
    size_t kept = 0;
    bool moved = false;
    for (Pending& q : pending) {
      const uint32_t in = landed(q);
      if (in > q.next) {
        take(q, in);
        q.next = in;
        moved = true;
      }
      if (q.next < q.cut.count()) pending[kept++] = q;
    }
    pending.resize(kept);
    if (moved) {
      backoff = Backoff{};
      continue;
    }
    if (pending.empty()) break;
    if ((backoff.round & 63) == 0) {
      v.check();
      if (std::chrono::steady_clock::now() >= v.deadline) late(pending);
    }
    backoff.pause();
  }
}

}  // namespace

// Each sender's copies in the slices they land in (slices.h): a remote
// sender's as the proxy wrote them, anyone else's in one piece. A cached call
// copies a remote sender's rows once the proxy took its routing stamp (with
// its last slice), so no row of another routing is ever copied out.
void FabricReceive::copy_dispatch(const LandingView& v, DispatchRecvParams p, const uint32_t* matrix, bool cached,
                                  const std::function<void(int)>& on_first, cudaStream_t stream) {
  const A2AConfig& cfg = *v.cfg;
  const RoutingView view{matrix, cfg.world, cfg.num_experts, cfg.num_local_experts()};
  std::vector<Pending> pending;
  std::vector<int64_t> own(cfg.world, 0);  // rows per node: our copies of each node sender
  for (int d = 0; d < cfg.world; ++d) {  // ourselves first: our rows are there in stream order
    const int s = (cfg.rank + d) % cfg.world;
    if (cfg.per_node(s, cfg.rank)) {
      // Its rows for our node, at its forwarder here (maybe us), readable once the
      // forwarder's proxy raised forward[s]: in one piece. A forwarder with no
      // copies of its own still notes the entries (combine_send sums them).
      own[s] = static_cast<int64_t>(view.to_rank(s, cfg.rank));
      const bool forwards = cfg.forwarder(s, cfg.rank) == cfg.rank && view.rows(s, cfg.rank) > 0;
      if (own[s] > 0 || forwards) pending.push_back({s, one_piece(1), 0});
      continue;
    }
    const uint64_t c = view.rows(s, cfg.rank);  // wire rows
    if (c == 0) continue;
    const bool sliced = !cfg.same_node(s) && !cached;
    pending.push_back(
        {s, sliced ? dispatch_slices(c, cfg.max_private_tokens, v.layout->dispatch_row, cfg.slice_bytes) : one_piece(c),
         0});
  }
  const auto landed = [&](const Pending& q) -> uint32_t {
    const int s = q.peer;
    const uint32_t all = q.cut.count();
    if (s == cfg.rank) return all;
    if (cfg.per_node(s, cfg.rank)) {
      const bool forwarded =
          flag_at(v.host_ws_cpu, *v.layout, s, kFlagForward)->load(std::memory_order_acquire) >= v.epoch;
      // A cached call's stamp check (on_first) needs our proxy to have taken s's stamp too.
      return forwarded && (!cached || v.peer.landed[s].get() >= v.epoch) ? all : 0;
    }
    if (cfg.same_node(s))
      return flag_at(v.host_ws_cpu, *v.layout, s, kFlagDispatch)->load(std::memory_order_acquire) >= v.epoch ? all : 0;
    // A cached call takes a remote sender's rows in one piece, but the proxy still counts its
    // slices as they land: only the whole sender (or the whole call) means all of them are in.
    // (Counting its progress word here copied the rows once the first slice was in, and the
    // later slices' rows were the previous call's: seen on the H200 at 4 ranks.)
    if (cached) return v.peer.landed[s].get() >= v.epoch || v.signals->dispatch_done.get() >= v.epoch ? all : 0;
    return slices_landed(v.peer.slices_landed[s], v.peer.landed[s], v.signals->dispatch_done, v.epoch, all);
  };
  const auto take = [&](const Pending& q, uint32_t in) {
    p.sender = q.peer;
    if (q.next == 0) on_first(q.peer);
    if (cfg.per_node(q.peer, cfg.rank)) {  // the whole sender: its entries, then our copies
      p.sender_first = 0;
      p.sender_end = own[q.peer];
      check_cuda(launch_dispatch_entries(p, stream), "dispatch entries");
      if (own[q.peer] > 0) check_cuda(launch_copy_sender(p, stream), "dispatch copy");
      return;
    }
    if (v.before_read && !cfg.same_node(q.peer)) v.before_read();
    p.sender_first = static_cast<int64_t>(q.cut.begin(q.next));  // consecutive slices are consecutive copies
    p.sender_end = static_cast<int64_t>(q.cut.end(in - 1));
    // Rows per rank: their entries' output rows first, slice after slice.
    if (cfg.per_rank(q.peer, cfg.rank)) check_cuda(launch_dispatch_entries(p, stream), "dispatch entries");
    check_cuda(launch_copy_sender(p, stream), "dispatch copy");
  };
  const auto late = [&](const std::vector<Pending>& out) {
    std::string senders;
    for (const Pending& q : out) senders += (senders.empty() ? "" : ", ") + std::to_string(q.peer);
    throw fabric::TimeoutError("rank " + std::to_string(cfg.rank) + ": timed out waiting for the tokens of sender(s) " +
                               senders + " (epoch " + std::to_string(v.epoch) + ")");
  };
  take_as_they_land(v, pending, landed, take, late);
}

void FabricReceive::note_combine_blocks(const LandingView& v, const RoutingView& view) {
  const A2AConfig& cfg = *v.cfg;
  const Layout& l = *v.layout;
  blocks_.clear();
  for (int s = 0; s < cfg.world; ++s) {
    const uint64_t c = view.rows(cfg.rank, s);  // wire rows
    if (cfg.same_node(s) || c == 0) continue;
    blocks_.push_back(
        {s, l.combine_recv + view.send_offset(cfg.rank, s) * l.combine_row, static_cast<size_t>(c) * l.combine_row});
  }
  blocks_epoch_ = v.epoch;
}

// With the copy engine as soon as the proxy saw them land (combine_landed),
// while later peers' are still on the wire.
void FabricReceive::copy_combine(const LandingView& v, cudaStream_t stream) {
  const A2AConfig& cfg = *v.cfg;
  const size_t row = v.layout->combine_row;
  std::vector<Pending> pending;
  std::vector<size_t> offset(cfg.world, 0);
  for (const CombineBlock& b : blocks_) {
    pending.push_back({b.peer, combine_slices(b.bytes / row, row, cfg.slice_bytes), 0});
    offset[b.peer] = b.offset;
  }
  const auto landed = [&](const Pending& q) {
    return slices_landed(v.peer.combine_slices_landed[q.peer], v.peer.combine_landed[q.peer], v.signals->combine_done,
                         v.epoch, q.cut.count());
  };
  const auto take = [&](const Pending& q, uint32_t in) {
    const size_t at = offset[q.peer] + q.cut.begin(q.next) * row;
    const size_t bytes = (q.cut.end(in - 1) - q.cut.begin(q.next)) * row;
    check_cuda(cudaMemcpyAsync(v.device_ws + at, v.host_ws_cpu + at, bytes, cudaMemcpyHostToDevice, stream),
               "combine rows to the device");
  };
  const auto late = [&](const std::vector<Pending>& out) {
    throw fabric::TimeoutError("rank " + std::to_string(cfg.rank) +
                               ": timed out waiting for the combine rows of peer " + std::to_string(out.front().peer) +
                               " (epoch " + std::to_string(v.epoch) + ")");
  };
  take_as_they_land(v, pending, landed, take, late);
}

}  // namespace moe_a2a::a2a::cuda
