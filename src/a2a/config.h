// Shape and policy of one dispatch/combine instance, shared by every
// implementation. Sizes of rows and sections derive from it (docs/protocol.md).
#pragma once

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>

namespace moe_a2a::a2a {

enum class DType : uint8_t { kBf16 = 0, kFp32 = 1, kFp8 = 2 };

// What one row on the fabric is (docs/protocol.md, "Rows per destination
// rank"). kExpert: one row per (token, k) copy, the combine returns one row
// per copy. kRank: towards a rank of another node a token crosses once,
// carrying its entries for that rank, and the combine comes back reduced,
// one row per (token, origin). Same-node peers always exchange copies.
// kNode (per-node forwarding) is reserved and refused.
enum class FabricRows : uint8_t { kExpert = 0, kRank = 1, kNode = 2 };

// Row math of a weighted dispatch receive (bf16 or fp32 rows), on the CPU and
// the GPU: each output row delivered times a per-row scale, and its dot
// product with a row of another tensor (the weighted combine's backward, in
// the pass that delivers its rows). Scale null: none.
struct RowMath {
  const float* scale = nullptr;  // [output rows]
  const void* dot_y = nullptr;   // [output rows, hidden], or null for no dot
  DType dot_y_dtype = DType::kBf16;
  float* dot_out = nullptr;  // [output rows] fp32, with dot_y
};

constexpr int kFp8Block = 128;        // elements per fp32 scale
constexpr float kFp8Max = 448.0f;     // largest finite e4m3fn value
constexpr size_t kRowAlign = 16;      // token rows start on 16 bytes
constexpr size_t kSectionAlign = 64;  // workspace sections start on a cache line
// Every row ends with a tail of its own after its body: a dispatch row's holds
// its copy's routing weight, a combine row's one value the expert side returns
// for it (fp32 each; docs/protocol.md, "Row tails"). A whole 16 bytes, so the
// body can leave in bulk copies and the tail in a store of its own. With
// FabricRows::kRank the tails are wider (row_tail.h, A2AConfig::*_tail_bytes).
constexpr size_t kRowTail = 16;
// Immediate tags are 16 bits: 3 for the kind of write, 5 for the slice of a
// peer's rows (slices.h: the part, then the slice in it), 8 for the instance.
constexpr int kTagKindBits = 3;
constexpr int kTagSliceBits = 5;
constexpr int kMaxInstances = 1 << (16 - kTagKindBits - kTagSliceBits);

inline size_t align_up(size_t n, size_t a) { return (n + a - 1) / a * a; }

inline size_t dtype_bytes(DType d) { return d == DType::kFp32 ? 4 : d == DType::kBf16 ? 2 : 1; }

struct A2AConfig {
  int rank = 0;
  int world = 1;
  int ranks_per_node = 1;  // node of rank r is r / ranks_per_node
  int max_tokens = 0;
  int hidden = 0;
  int num_experts = 0;
  int topk = 0;
  DType dispatch_dtype = DType::kBf16;
  DType combine_dtype = DType::kBf16;
  int expert_padding = 1;
  int max_private_tokens = 0;
  int max_recv_tokens = 0;
  double timeout_s = 60.0;
  // Index of this instance among those sharing one transfer engine, the same
  // on every rank: the high bits of each immediate tag (signals.h), so the
  // arrivals of instances on one engine are counted apart.
  int instance = 0;
  // Rows to one peer cross the fabric in writes of about this many bytes
  // (slices.h), at most 16 per part; 0: one write per part.
  uint64_t slice_bytes = 0;
  FabricRows fabric_rows = FabricRows::kRank;

  // The one deadline rule: how long the compute side (a host wait, a kernel)
  // waits for its proxy. The proxy's own waits last up to timeout_s each, and
  // it must time out first, to report which peer is late. A closed instance's
  // memory stays as long: peers' calls may still write to it.
  double caller_timeout_s() const { return 2.0 * timeout_s + 1.0; }

  int num_local_experts() const { return num_experts / world; }
  int node_of(int r) const { return r / ranks_per_node; }
  bool same_node(int r) const { return node_of(r) == node_of(rank); }
  // Words of a routing row: count[s][0..E), then the wire rows u[s][0..N).
  int routing_width() const { return num_experts + world; }
  // Rows of the padded, expert-major output at most.
  int64_t max_output_rows() const {
    return static_cast<int64_t>(max_recv_tokens) + static_cast<int64_t>(num_local_experts()) * (expert_padding - 1);
  }
  // Rows per destination rank are in use: mode rank with a peer on another
  // node. Without one, mode rank is mode expert bit for bit, narrow tails too.
  bool rank_rows() const { return fabric_rows == FabricRows::kRank && world > ranks_per_node; }
  // Whether s and r exchange one row per (token, destination rank) rather
  // than one per copy: mode rank and different nodes.
  bool per_rank(int s, int r) const { return rank_rows() && node_of(s) != node_of(r); }
  // Rows per destination node are in use: mode node with a peer on another
  // node (docs/protocol.md, "Rows per destination node"). Sender s sends one
  // row per (token, node) to the node's rank with its own local index, the
  // forwarder, whose node peers read their entries from its workspace.
  bool node_rows() const { return fabric_rows == FabricRows::kNode && world > ranks_per_node; }
  // Whether s sends r's copies in rows per node (to r's forwarder for s).
  bool per_node(int s, int r) const { return node_rows() && node_of(s) != node_of(r); }
  // The rank of r's node that takes sender s's rows per node: s's local index there.
  int forwarder(int s, int r) const { return node_of(r) * ranks_per_node + s % ranks_per_node; }
  // The rank sender s writes r's copies to: r, or its forwarder.
  int wire_dest(int s, int r) const { return per_node(s, r) ? forwarder(s, r) : r; }
  // Whether s's rows to d are one per token (route entries in the tail), not one per copy.
  bool merged(int s, int d) const { return per_rank(s, d) || (per_node(s, d) && d == forwarder(s, d)); }
  // Tails with route entries: rows per rank or per node.
  bool wide_rows() const { return rank_rows() || node_rows(); }
  // m: the most entries one row per rank carries. K, not min(K, L): a token
  // may pick one expert more than once, each pick an entry of its own.
  int max_entries() const { return topk; }
  // Entries a receiver keeps per wire row (output row, weight of each): m with rank rows, else 1.
  int entries_per_row() const { return wide_rows() ? max_entries() : 1; }
  // Tail bytes (row_tail.h): mode expert 16; rank rows m entries of 8 bytes
  // (dispatch) and m fp32 values (combine), each to a whole 16 bytes. One
  // width for every row of an instance, so each section has one stride.
  size_t dispatch_tail_bytes() const {
    return wide_rows() ? align_up(8 * static_cast<size_t>(max_entries()), 16) : kRowTail;
  }
  size_t combine_tail_bytes() const {
    return wide_rows() ? align_up(4 * static_cast<size_t>(max_entries()), 16) : kRowTail;
  }
  int num_scales() const { return dispatch_dtype == DType::kFp8 ? (hidden + kFp8Block - 1) / kFp8Block : 0; }
  size_t payload_bytes() const { return static_cast<size_t>(hidden) * dtype_bytes(dispatch_dtype); }
  size_t dispatch_body_bytes() const { return align_up(payload_bytes() + num_scales() * sizeof(float), kRowAlign); }
  size_t dispatch_row_bytes() const { return dispatch_body_bytes() + dispatch_tail_bytes(); }
  size_t combine_body_bytes() const {
    return align_up(static_cast<size_t>(hidden) * dtype_bytes(combine_dtype), kRowAlign);
  }
  size_t combine_row_bytes() const { return combine_body_bytes() + combine_tail_bytes(); }

  // The Python layer validates with friendlier messages; this guards the core.
  void validate() const {
    auto bad = [](const std::string& what) { throw std::invalid_argument(what); };
    if (world < 1) bad("world size must be >= 1, got " + std::to_string(world));
    if (rank < 0 || rank >= world) bad("rank " + std::to_string(rank) + " outside [0, world)");
    if (ranks_per_node < 1 || world % ranks_per_node != 0)
      bad("ranks_per_node " + std::to_string(ranks_per_node) + " must divide world size " + std::to_string(world));
    if (max_tokens < 1 || hidden < 1 || topk < 1) bad("max_tokens, hidden and topk must be >= 1");
    if (num_experts < world || num_experts % world != 0)
      bad("num_experts " + std::to_string(num_experts) + " must be a multiple of world size " + std::to_string(world));
    if (topk > num_experts) bad("topk " + std::to_string(topk) + " exceeds num_experts");
    if (expert_padding < 1) bad("expert_padding must be >= 1");
    if (max_private_tokens < 0 || max_recv_tokens < 1) bad("max_private_tokens >= 0 and max_recv_tokens >= 1 expected");
    if (combine_dtype == DType::kFp8) bad("combine_dtype must be bf16 or fp32");
    if (fabric_rows != FabricRows::kExpert && fabric_rows != FabricRows::kRank && fabric_rows != FabricRows::kNode)
      bad("fabric_rows " + std::to_string(static_cast<int>(fabric_rows)) +
          " unknown; expected 'rank', 'node' or 'expert'");
    // A route entry holds its expert (rank rows: on the rank; node rows: on the node) and k in 16 bits.
    const int64_t entry_experts = static_cast<int64_t>(num_local_experts()) * (node_rows() ? ranks_per_node : 1);
    if (wide_rows() && (entry_experts >= 0xFFFF || topk > 0xFFFF))
      bad("fabric_rows holds expert and k in 16 bits: " + std::to_string(entry_experts) + " experts per " +
          (node_rows() ? "node" : "rank") + " and topk " + std::to_string(topk) + " must be below 65535");
    if (instance < 0 || instance >= kMaxInstances)
      bad("instance " + std::to_string(instance) + " outside [0, " + std::to_string(kMaxInstances) + ")");
  }
};

}  // namespace moe_a2a::a2a
