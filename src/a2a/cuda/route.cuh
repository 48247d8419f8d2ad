// The routing step of dispatch send, as device functions shared by its two
// forms: the large calls' three kernels (dispatch_route.cu) and the small
// calls' kernel that routes and packs in one launch (dispatch_send.cu).
//
// Send order is (rank, local expert, token, k) and experts are contiguous per
// rank, so a copy's send row is first[e] plus its rank among the copies of
// expert e in (t, k) order: a stable counting sort by expert. Each warp owns
// a contiguous run of copies (one id load a lane) and walks it twice: once to
// count (per-warp histograms in shared memory), once, after the counts of all
// earlier warps are known, to hand out rows in order. The second walk hands
// each copy's row to the caller: the large calls store where pack puts the
// copy (one pointer per copy for pack to read), route_pack its row and expert.
//
// Rows per rank (Instance::rank_rows, docs/protocol.md "Rows per destination
// rank"): towards a rank r of another node the send order is by token, one
// row per token that picks r, shared by its copies to r. The sort then has
// one key more per rank, E + r, counting only each token's first copy to r
// (its entry 0, which packs the row); a later copy of the token takes the row
// of its entry 0, the last one handed out before it. Keys are laid out in send
// order by key_at: per rank, its row key, then its experts.
// Rows per node (Instance::node_rows) use the same keys with the wire
// destination d = wire_dest(r), the forwarder of our local index on r's node:
// E + d counts the tokens with a copy on that node, entries the token's copies
// to the node (docs/cuda-fabric-rows.md).
#pragma once

#include "memory.cuh"
#include "rows.cuh"
#include "tuning.h"

namespace moe_a2a::a2a::cuda {

constexpr int kIdsInFlight = RouteTuning::kIdsInFlight;  // id loads a lane issues before the first is used
constexpr int kWarpCopies = kIdsInFlight * kWarp;        // copies one warp walks: one load each lane

// The call's token count, clamped to [0, max_tokens].
__device__ __forceinline__ int resolve_tokens(const DispatchSendParams& p) {
  const int t = p.num_tokens_ptr != nullptr ? *p.num_tokens_ptr : p.num_tokens;
  return t < 0 ? 0 : (t > p.inst.max_tokens ? p.inst.max_tokens : t);
}

// The experts of one warp's copies [begin, end) (at most kWarpCopies): copy
// begin + u * kWarp + lane in e[u], -1 past the end or for an id out of range
// (that copy is dropped), and peers[u], the lanes holding the same e[u].
// Loaded and matched once, walked twice (count, then slots).
struct WarpIds {
  int e[kIdsInFlight];
  unsigned peers[kIdsInFlight];
  bool dropped = false;  // this lane saw an id out of range
};

// The raw ids of one warp's copies, loads in flight (nothing waits on them
// until match_ids): a caller may issue other loads in between.
struct RawIds {
  int64_t id[kIdsInFlight];
};

__device__ __forceinline__ RawIds load_raw_ids(const DispatchSendParams& p, int64_t begin, int64_t end, int lane) {
  // Every load is issued before any is used (one branch on the id width, not one per id).
  RawIds r;
  if (p.ids_are_64bit) {
    const int64_t* ids = static_cast<const int64_t*>(p.topk_ids);
#pragma unroll
    for (int u = 0; u < kIdsInFlight; ++u) r.id[u] = begin + u * kWarp + lane < end ? ids[begin + u * kWarp + lane] : 0;
  } else {
    const int32_t* ids = static_cast<const int32_t*>(p.topk_ids);
#pragma unroll
    for (int u = 0; u < kIdsInFlight; ++u) r.id[u] = begin + u * kWarp + lane < end ? ids[begin + u * kWarp + lane] : 0;
  }
  return r;
}

// Peers by one ballot per bit of the key e + 1 (0 for no expert), keeping the
// lanes that agree on every bit: at decode size 1.4 us less per route_pack
// than __match_any_sync, whose latency the walks then wait on.
__device__ __forceinline__ WarpIds match_ids(const DispatchSendParams& p, const RawIds& raw, int64_t begin, int64_t end,
                                             int lane) {
  WarpIds w;
  unsigned key[kIdsInFlight];
#pragma unroll
  for (int u = 0; u < kIdsInFlight; ++u) {
    const bool live = begin + u * kWarp + lane < end;
    const bool valid = raw.id[u] >= 0 && raw.id[u] < p.inst.num_experts;
    w.e[u] = live && valid ? static_cast<int>(raw.id[u]) : -1;
    const bool masked = p.inst.any_masked && raw.id[u] == kMaskedExpert;  // a masked rank's copy: no error
    w.dropped = w.dropped || (live && !valid && !masked);
    key[u] = static_cast<unsigned>(w.e[u] + 1);
    w.peers[u] = kFullMask;
  }
  const int bits = 32 - __clz(p.inst.num_experts);  // keys lie in [0, num_experts]
  for (int b = 0; b < bits; ++b) {
#pragma unroll
    for (int u = 0; u < kIdsInFlight; ++u) {  // independent ballots, issued together
      const bool set = (key[u] >> b) & 1u;
      const unsigned lanes = __ballot_sync(kFullMask, set);
      w.peers[u] &= set ? lanes : ~lanes;
    }
  }
  return w;
}

__device__ __forceinline__ WarpIds load_ids(const DispatchSendParams& p, int64_t begin, int64_t end, int lane) {
  return match_ids(p, load_raw_ids(p, begin, end, lane), begin, end, lane);
}

// Rows per rank: the place of each of a warp's copies in its token's row for
// a per-rank peer (entry word, rows.cuh; -1 for a row of its own), the lanes
// whose copies go to the same per-rank peer, and those of them that are
// their token's entry 0.
struct RankIds {
  int32_t word[kIdsInFlight];
  unsigned group[kIdsInFlight];
  unsigned leads[kIdsInFlight];
};

// The rank of copy c's expert from the call's ids; -1 when out of range.
__device__ __forceinline__ int id_rank(const DispatchSendParams& p, int64_t c) {
  const int64_t id = p.ids_are_64bit ? static_cast<const int64_t*>(p.topk_ids)[c]
                                     : static_cast<const int32_t*>(p.topk_ids)[c];
  return id >= 0 && id < p.inst.num_experts ? static_cast<int>(id / p.inst.local_experts) : -1;
}

// Each copy's entry reads its token's other ids (from L1/L2: the warps just
// loaded them), K loads a copy; only calls with rows per rank pay it.
__device__ __forceinline__ RankIds match_ranks(const DispatchSendParams& p, const WarpIds& ids, int64_t begin,
                                               int lane) {
  const Instance& in = p.inst;
  const int L = in.local_experts;
  RankIds q;
  unsigned key[kIdsInFlight];
#pragma unroll
  for (int u = 0; u < kIdsInFlight; ++u) {
    const int e = ids.e[u];
    const int r = e >= 0 ? e / L : -1;
    const int d = r >= 0 ? wire_dest(in, r) : -1;  // r, or its node's forwarder for us
    q.word[u] = -1;
    if (r >= 0 && wide_remote(in, r)) {
      int entry, count;
      token_entries(
          begin + u * kWarp + lane, in.topk, d,
          [&](int64_t c) {
            const int rc = id_rank(p, c);
            return rc >= 0 ? wire_dest(in, rc) : -1;
          },
          &entry, &count);
      q.word[u] = entry_word(entry, count, e - dest_first_expert(in, d));
    }
    key[u] = q.word[u] >= 0 ? static_cast<unsigned>(d + 1) : 0u;
    q.group[u] = kFullMask;
  }
  const int bits = 32 - __clz(in.world);  // keys lie in [0, world]
  for (int b = 0; b < bits; ++b) {
#pragma unroll
    for (int u = 0; u < kIdsInFlight; ++u) {
      const bool set = (key[u] >> b) & 1u;
      const unsigned lanes = __ballot_sync(kFullMask, set);
      q.group[u] &= set ? lanes : ~lanes;
    }
  }
#pragma unroll
  for (int u = 0; u < kIdsInFlight; ++u)
    q.leads[u] = q.group[u] & __ballot_sync(kFullMask, q.word[u] >= 0 && word_entry(q.word[u]) == 0);
  return q;
}

// First walk, rows per rank or node: hist[E + d] += this warp's tokens whose
// row goes to d (a per-rank peer, or a node's forwarder).
__device__ __forceinline__ void count_ranks(const Instance& in, const WarpIds& ids, const RankIds& q, int32_t* hist,
                                            int lane) {
#pragma unroll
  for (int u = 0; u < kIdsInFlight; ++u) {
    if (q.word[u] >= 0 && lane == __ffs(q.leads[u]) - 1)
      hist[in.num_experts + wire_dest(in, ids.e[u] / in.local_experts)] += __popc(q.leads[u]);
    __syncwarp();
  }
}

// Routing keys: experts, and with rows per rank or node one per rank (E + r).
__device__ __forceinline__ int route_keys(const Instance& in) {
  return in.num_experts + (wide(in) ? in.world : 0);
}

// The key at position o of the send order: per rank its row key (rows per
// rank), then its experts; without rows per rank the experts alone. kWide
// here and below: the instance may have rows per rank or node (false: a
// kernel launched without them, which leaves their paths out of its code).
template <bool kWide = true>
__device__ __forceinline__ int key_at(const Instance& in, int o) {
  if (!kWide || !wide(in)) return o;
  const int L = in.local_experts, r = o / (L + 1), i = o % (L + 1);
  return i == 0 ? in.num_experts + r : r * L + i - 1;
}

// Send rows of a key: a remote peer's row key its tokens (rows per node:
// those with a copy on its node, where it is our forwarder; 0 for the node's
// other ranks), its experts none; a same-node rank's experts their copies,
// its row key none.
template <bool kWide = true>
__device__ __forceinline__ int32_t key_rows(const Instance& in, const int32_t* counts, int key) {
  if (!kWide) return counts[key];
  const int E = in.num_experts;
  if (key >= E) return wide_remote(in, key - E) ? counts[key] : 0;
  return wide_remote(in, key / in.local_experts) ? 0 : counts[key];
}

// u[r]: wire rows to rank r (routing row words E + r), from the send order's
// row starts (first: by key, total: every key's rows): rank r's keys are
// contiguous there, so its rows are the next rank's start less its own. Not
// a sum over r's experts: alone on a node that is one thread adding all E.
template <bool kWide = true>
__device__ __forceinline__ uint32_t wire_rows(const Instance& in, const int32_t* first, int32_t total, int r) {
  const auto start = [&](int q) {
    if (q == in.world) return total;
    return kWide && wide(in) ? first[in.num_experts + q] : first[q * in.local_experts];
  };
  return static_cast<uint32_t>(start(r + 1) - start(r));
}

// First walk: hist[e] += this warp's copies of e.
__device__ __forceinline__ void count_ids(const WarpIds& ids, int32_t* hist, int lane) {
#pragma unroll
  for (int u = 0; u < kIdsInFlight; ++u) {
    if (ids.e[u] >= 0 && lane == __ffs(ids.peers[u]) - 1) hist[ids.e[u]] += __popc(ids.peers[u]);
    __syncwarp();
  }
}

// Where pack stores copy (slot, rank r): a same-node peer's private row, our
// device send section (same-node overflow, which the peer pulls), or our
// fabric send section (remote peers; staged: the same rows of the device
// send section, which stage_kernel copies there peer by peer).
// send_start: the send row of rank r's first copy.
__device__ __forceinline__ uint8_t* destination(const Instance& in, int slot, int r, int64_t send_start) {
  const Layout& l = in.layout;
  const size_t row = l.dispatch_row;
  const int64_t j = slot - send_start;
  if (!same_node(in, r)) return (in.staged ? in.device_ws : in.fabric_ws) + l.send + slot * row;
  if (j < in.max_private)
    return in.peers[r].device + l.private_rows + (static_cast<size_t>(in.rank) * in.max_private + j) * row;
  return in.device_ws + l.send + slot * row;
}

// Second walk: hist[e] (+ first[e] when given) is the send row of this warp's
// next copy of e. Hands each copy i to sink(i, slot, e), with slot and e -1
// for a dropped copy.
template <typename Sink>
__device__ __forceinline__ void slot_ids(const WarpIds& ids, int64_t begin, int64_t end, int32_t* hist,
                                         const int32_t* first, Sink sink, int lane) {
  const unsigned lanes_below = (1u << lane) - 1;
#pragma unroll
  for (int u = 0; u < kIdsInFlight; ++u) {  // in order: ranks stay stable
    const int e = ids.e[u];
    const unsigned same = ids.peers[u];
    const int slot = e >= 0 ? hist[e] + (first != nullptr ? first[e] : 0) + __popc(same & lanes_below) : -1;
    __syncwarp();
    if (e >= 0 && lane == __ffs(same) - 1) hist[e] += __popc(same);
    __syncwarp();
    const int64_t i = begin + u * kWarp + lane;
    if (i < end) sink(i, slot, e);
  }
}

// Second walk with rows per rank: as slot_ids, a per-rank copy taking its
// token's row (key E + r), and sink(i, slot, e, word).
template <typename Sink>
__device__ __forceinline__ void slot_ids_ranked(const Instance& in, const WarpIds& ids, const RankIds& q,
                                                int64_t begin, int64_t end, int32_t* hist, const int32_t* first,
                                                Sink sink, int lane) {
  const unsigned lanes_below = (1u << lane) - 1;
#pragma unroll
  for (int u = 0; u < kIdsInFlight; ++u) {  // in order: ranks stay stable
    const int e = ids.e[u];
    const int32_t word = q.word[u];
    const int key = word >= 0 ? in.num_experts + wire_dest(in, e / in.local_experts) : e;
    // A copy after its token's entry 0 takes the row handed out last before it: that entry's.
    const int own = word >= 0 ? __popc(q.leads[u] & lanes_below) - (word_entry(word) == 0 ? 0 : 1)
                              : __popc(ids.peers[u] & lanes_below);
    const int slot = e >= 0 ? hist[key] + (first != nullptr ? first[key] : 0) + own : -1;
    __syncwarp();
    if (word >= 0) {
      if (lane == __ffs(q.leads[u]) - 1) hist[key] += __popc(q.leads[u]);
    } else if (e >= 0 && lane == __ffs(ids.peers[u]) - 1) {
      hist[key] += __popc(ids.peers[u]);
    }
    __syncwarp();
    const int64_t i = begin + u * kWarp + lane;
    if (i < end) sink(i, slot, e, word);
  }
}

// Per expert, across the block's first `warps` warps: hist[w][e] becomes
// base[e] (when given) plus the copies of warps before w; writes the block's
// total of e to totals[e] when asked.
__device__ __forceinline__ void warp_offsets(int32_t* hist, int warps, int E, const int32_t* base, int32_t* totals) {
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    int32_t acc = base != nullptr ? base[e] : 0;
    for (int w = 0; w < warps; ++w) {
      const int32_t c = hist[w * E + e];
      hist[w * E + e] = acc;
      acc += c;
    }
    if (totals != nullptr) totals[e] = acc;
  }
}

// The routing row into every same-node host workspace (ours too, where the
// proxy scatters it to remote peers, and the host reads it) and device
// workspace (where their plan reads it, without a trip over PCIe). Every
// thread of the block calls it.
// The row is count[0..E) then u[0..N) (counts: the routing keys' totals;
// first and total: their send rows, block_exclusive_scan's).
template <bool kWide = true>
__device__ __forceinline__ void write_routing(const DispatchSendParams& p, const int32_t* counts, const int32_t* first,
                                              int32_t total) {
  const Instance& in = p.inst;
  const int E = in.num_experts, words = E + in.world;
  const auto word = [&](int w) {
    return w < E ? static_cast<uint32_t>(counts[w]) : wire_rows<kWide>(in, first, total, w - E);
  };
  if (p.cached) {
    // Every receiver plans from its handle's matrix: nothing is published. Our
    // own device row still gets this call's counts, because stage_kernel sizes
    // each remote peer's block from it (a fresh instance's row is all zeros).
    uint32_t* own = routing_row(in.device_ws, in.layout, in.rank);
    for (int w = threadIdx.x; w < words; w += blockDim.x) own[w] = word(w);
    return;
  }
  for (int w = threadIdx.x; w < words; w += blockDim.x) {
    const uint32_t v = word(w);
    for (int r = 0; r < in.world; ++r) {
      if (!same_node(in, r)) continue;
      routing_row(in.peers[r].host, in.layout, in.rank)[w] = v;
      routing_row(in.peers[r].device, in.layout, in.rank)[w] = v;
    }
  }
}

// A new call: epoch and status. Thread 0 only, before the routing row.
__device__ __forceinline__ uint64_t begin_call(const DispatchSendParams& p, int tokens) {
  const Instance& in = p.inst;
  const uint64_t epoch = *in.epoch + 1;
  *in.epoch = epoch;
  *p.scratch.num_tokens = tokens;
  *reinterpret_cast<volatile int32_t*>(in.status) = kStatusOk;
  return epoch;
}

// Thread 0, after write_routing and a block barrier: reports dropped ids,
// then makes the call's epoch and routing row visible before anything that
// follows (our plan kernel reads both, possibly before this grid ends; see
// route_pack_kernel) and raises the route flags of same-node peers and
// the proxy (a rank alone has nobody to tell). A cached call raises none:
// it published no row, and its host raised the proxy's route_ready.
__device__ __forceinline__ void publish_routing(const Instance& in, uint64_t epoch, bool dropped, bool cached) {
  if (dropped) report(in, kStatusBadExpert);
  if (in.world == 1 || cached) {  // only our own kernels read them: the device scope is enough
    __threadfence();
    return;
  }
  fence_sys();
  for (int r = 0; r < in.world; ++r)
    if (same_node(in, r)) st_release_sys(flag_ptr(in.peers[r].host, in.layout, in.rank, kFlagRoute), epoch);
  if (in.proxy.route_ready != nullptr) st_release_sys(in.proxy.route_ready, epoch);
}

}  // namespace moe_a2a::a2a::cuda
