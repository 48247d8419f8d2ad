// The position formulas of docs/protocol.md, as pure functions of the routing
// matrix (count[s][e] and wire rows u[s][r], N x (E + N)). Every implementation (CPU loops, CUDA kernels,
// the proxy) places rows with these, so they agree by construction.
#pragma once

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "config.h"

namespace moe_a2a::a2a {

// Read-only view of the gathered routing matrix: row s is count[s][0..E),
// then u[s][0..N), the wire rows s sends each rank (docs/protocol.md, "Rows
// per destination rank"). Copies (to_rank, received) place the expert-major
// output and bound capacity; wire rows (rows) place everything on the wire.
struct RoutingView {
  const uint32_t* counts = nullptr;  // [world][width]
  int world = 0;
  int num_experts = 0;
  int local = 0;  // experts per rank
  int width = 0;  // words per row: num_experts + ranks

  RoutingView() = default;
  // The whole matrix, `world` rows of E + world words.
  RoutingView(const uint32_t* m, int n, int e, int l) : counts(m), world(n), num_experts(e), local(l), width(e + n) {}
  // `rows` rows of `w` words (w = E + N): one sender's own row is RoutingView(row, 1, E, L, E + N).
  RoutingView(const uint32_t* m, int rows, int e, int l, int w)
      : counts(m), world(rows), num_experts(e), local(l), width(w) {}

  uint32_t count(int s, int e) const { return counts[static_cast<size_t>(s) * width + e]; }
  // u[s][r]: wire rows from sender s to rank r.
  uint64_t rows(int s, int r) const { return counts[static_cast<size_t>(s) * width + num_experts + r]; }
  // c[s][r]: copies from sender s to rank r.
  uint64_t to_rank(int s, int r) const {
    uint64_t n = 0;
    for (int i = 0; i < local; ++i) n += count(s, r * local + i);
    return n;
  }
  // send_off[s][r]: first send-buffer (and combine_recv) row of s's wire rows for r.
  uint64_t send_offset(int s, int r) const {
    uint64_t n = 0;
    for (int q = 0; q < r; ++q) n += rows(s, q);
    return n;
  }
  // Copies rank r receives in all (what max_recv_tokens bounds).
  uint64_t received(int r) const {
    uint64_t n = 0;
    for (int s = 0; s < world; ++s) n += to_rank(s, r);
    return n;
  }
  // shared_off[s] at receiver r: overflow wire rows of the senders before s.
  uint64_t shared_offset(int s, int r, uint64_t private_slots) const {
    uint64_t n = 0;
    for (int q = 0; q < s; ++q) {
      uint64_t u = rows(q, r);
      n += u > private_slots ? u - private_slots : 0;
    }
    return n;
  }
};

// u[0..N) of a sender's routing row from its topk_ids (counts[0..E) already
// counted): towards a per-rank peer (A2AConfig::per_rank) the tokens with at
// least one k on it; towards a forwarder (A2AConfig::per_node) the tokens
// with at least one k on its node, and 0 towards the node's other ranks;
// towards the others the copies.
inline void count_wire_rows(const A2AConfig& c, const int32_t* topk_ids, int num_tokens, uint32_t* row) {
  const int E = c.num_experts, L = c.num_local_experts(), N = c.world, K = c.topk;
  uint32_t* u = row + E;
  for (int r = 0; r < N; ++r) {
    u[r] = 0;
    if (!c.per_rank(c.rank, r) && !c.per_node(c.rank, r))
      for (int i = 0; i < L; ++i) u[r] += row[r * L + i];
  }
  if (!c.wide_rows()) return;
  std::vector<int> last(N, -1);  // the last token counted towards each destination
  for (int t = 0; t < num_tokens; ++t)
    for (int k = 0; k < K; ++k) {
      const int32_t e = topk_ids[static_cast<size_t>(t) * K + k];
      if (e < 0 || e >= E) continue;
      const int d = c.wire_dest(c.rank, e / L);
      if (c.merged(c.rank, d) && last[d] != t) {
        last[d] = t;
        ++u[d];
      }
    }
}

// Fabric writes (DISPATCH immediates) that `rows` wire rows (u) from one
// sender take: one for the private part when any row goes there (none when
// P = 0), one more for the overflow past P. Sender and receiver both count
// with this.
inline uint64_t private_copies(uint64_t rows, uint64_t private_slots) { return std::min(rows, private_slots); }
inline uint64_t dispatch_writes(uint64_t rows, uint64_t private_slots) {
  return (private_copies(rows, private_slots) > 0 ? 1 : 0) + (rows > private_slots ? 1 : 0);
}

// Everything receiver `rank` needs to place what it received.
// Copies (from, tokens_per_expert, expert_start) place the output; wire rows
// (wire, recv_base, shared_off, send_off_at) place rows on the wire.
struct RecvPlan {
  std::vector<uint64_t> from;              // c[s][rank]: copies
  std::vector<uint64_t> wire;              // u[s][rank]: wire rows
  std::vector<uint64_t> recv_base;         // sum_{s' < s} u[s'][rank]: combine_send staging row of (s, 0)
  std::vector<uint64_t> shared_off;        // shared row of (s, P)
  std::vector<uint64_t> send_off_at;       // send_off[s][rank]: where (s, 0) sits in s's send buffer / combine_recv
  std::vector<int32_t> tokens_per_expert;  // n[i], unpadded
  std::vector<uint64_t> expert_start;      // start[i] of the padded, expert-major output
  uint64_t total_received = 0;             // copies
  uint64_t total_wire = 0;                 // wire rows
  uint64_t output_rows = 0;                // padded
};

inline RecvPlan make_recv_plan(const RoutingView& v, int rank, uint64_t private_slots, int expert_padding) {
  RecvPlan p;
  p.from.resize(v.world);
  p.wire.resize(v.world);
  p.recv_base.resize(v.world);
  p.shared_off.resize(v.world);
  p.send_off_at.resize(v.world);
  uint64_t base = 0, shared = 0, copies = 0;
  for (int s = 0; s < v.world; ++s) {
    const uint64_t u = v.rows(s, rank);
    p.from[s] = v.to_rank(s, rank);
    p.wire[s] = u;
    p.recv_base[s] = base;
    p.shared_off[s] = shared;
    p.send_off_at[s] = v.send_offset(s, rank);
    base += u;
    copies += p.from[s];
    shared += u > private_slots ? u - private_slots : 0;
  }
  p.total_received = copies;
  p.total_wire = base;
  p.tokens_per_expert.resize(v.local);
  p.expert_start.resize(v.local);
  uint64_t start = 0;
  for (int i = 0; i < v.local; ++i) {
    uint64_t n = 0;
    for (int s = 0; s < v.world; ++s) n += v.count(s, rank * v.local + i);
    p.tokens_per_expert[i] = static_cast<int32_t>(n);
    p.expert_start[i] = start;
    start += (n + expert_padding - 1) / expert_padding * expert_padding;
  }
  p.output_rows = start;
  return p;
}

// Whether some rank would receive more than max_recv_tokens copies: a cached
// call knows it from its matrix when it starts, before any peer's stamp about
// it can arrive (the proxy and the kernels find the same).
// The rank that would receive the most copies past max_recv_tokens, and how
// many (rank -1: no rank is over).
struct Overflow {
  int rank = -1;
  uint64_t copies = 0;
};
inline Overflow worst_overflow(const A2AConfig& c, const uint32_t* routing) {
  RoutingView v{routing, c.world, c.num_experts, c.num_local_experts()};
  Overflow worst;
  for (int r = 0; r < c.world; ++r) {
    uint64_t load = v.received(r);
    if (c.node_rows()) {  // a forwarder's rows per node may outnumber its own copies: they share its sections
      uint64_t wire = 0;
      for (int s = 0; s < c.world; ++s) wire += v.rows(s, r);
      load = std::max(load, wire);
    }
    if (load > static_cast<uint64_t>(c.max_recv_tokens) && load > worst.copies) worst = {r, load};
  }
  return worst;
}
inline bool over_capacity(const A2AConfig& c, const uint32_t* routing) { return worst_overflow(c, routing).rank >= 0; }

// What every rank's CapacityError says of an over-capacity call; `o` from
// worst_overflow, or {} where the host does not know the matrix (CUDA within one node).
inline std::string capacity_message(const A2AConfig& c, const Overflow& o = {}) {
  const std::string what = c.node_rows() ? " token copies or rows per node" : " token copies";  // node: either
  const std::string over =
      o.rank < 0 ? "more" + what + " to some rank than"
                 : std::to_string(o.copies) + what + " to rank " + std::to_string(o.rank) + ", more than";
  return "dispatch would deliver " + over + " max_recv_tokens=" + std::to_string(c.max_recv_tokens) +
         "; raise max_recv_tokens in Config (nothing was delivered; the next call can proceed)";
}

// Appended to a timeout waiting for a routing row: a peer running the call
// cached publishes none (docs/protocol.md, "Cached calls", Agreement).
inline constexpr const char* kCachedMismatchHint =
    " (a peer that runs this dispatch along a cached routing sends none: every rank must run a call cached, or none)";

// A cached call's matrix ([world][E + N], docs/protocol.md "Cached calls"),
// before anything is published: every row fits a send section, holds wire
// rows that can be its copies' (u <= c, u > 0 exactly where c > 0, u = c
// towards per-copy peers), and ours holds as many copies as the call has and,
// where `own` (our row counted from this call's topk_ids, E + N words) is
// given, its wire rows. So no position computed from it leaves its section.
// The front end passes only matrices the core produced; this guards the
// memory if one was changed.
inline void check_cached_routing(const A2AConfig& c, const uint32_t* routing, int num_tokens,
                                 const uint32_t* own = nullptr) {
  RoutingView v{routing, c.world, c.num_experts, c.num_local_experts()};
  const uint64_t max_copies = static_cast<uint64_t>(c.max_tokens) * c.topk;
  auto bad = [](int s, const std::string& what) {
    throw std::invalid_argument("dispatch: routing: row " + std::to_string(s) + " " + what);
  };
  for (int s = 0; s < c.world; ++s) {
    uint64_t n = 0, wire = 0;
    for (int r = 0; r < c.world; ++r) {
      const uint64_t u = v.rows(s, r);
      n += v.to_rank(s, r);
      wire += u;
      // Rows per node carry the copies to the forwarder's whole node.
      uint64_t copies = 0;
      if (c.per_node(s, r)) {
        const int node0 = c.node_of(r) * c.ranks_per_node;
        if (r == c.forwarder(s, r))
          for (int q = node0; q < node0 + c.ranks_per_node; ++q) copies += v.to_rank(s, q);
      } else {
        copies = v.to_rank(s, r);
      }
      const bool fits = c.merged(s, r) ? u <= copies && (u > 0) == (copies > 0) : u == copies;
      if (!fits)
        bad(s, "holds " + std::to_string(u) + " wire rows for rank " + std::to_string(r) + " with " +
                   std::to_string(copies) + " copies" + (c.per_node(s, r) ? " on its node" : "") + "; expected " +
                   (c.merged(s, r) ? "between 1 and the copies (0 with none)" : "the copies"));
      if (s == c.rank && own != nullptr && u != own[c.num_experts + r])
        bad(s, "holds " + std::to_string(u) + " wire rows for rank " + std::to_string(r) +
                   "; this call's topk_ids make " + std::to_string(own[c.num_experts + r]));
    }
    if (wire > max_copies)
      bad(s, "holds " + std::to_string(wire) +
                 " wire rows; expected at most max_tokens x topk = " + std::to_string(max_copies));
    const bool wrong = s == c.rank ? n != static_cast<uint64_t>(num_tokens) * c.topk : n > max_copies;
    if (wrong)
      bad(s,
          "holds " + std::to_string(n) + " copies; expected " +
              (s == c.rank ? std::to_string(static_cast<uint64_t>(num_tokens) * c.topk) + " (this call's tokens x topk)"
                           : "at most max_tokens x topk = " + std::to_string(max_copies)));
  }
}

}  // namespace moe_a2a::a2a
