// The CPU "kernels": the compute steps of dispatch and combine, run by the
// calling thread. Each takes one parameter struct of raw pointers and sizes,
// like its CUDA counterpart in ../cuda/.
#pragma once

#include <cstdint>
#include <vector>

#include "../config.h"
#include "../layout.h"
#include "../plan.h"

namespace moe_a2a::a2a::cpu {

// Where every rank's workspace is mapped here (nullptr for remote ranks).
struct Mappings {
  uint8_t* self = nullptr;
  const std::vector<uint8_t*>* node = nullptr;  // index = rank
  uint8_t* of(int r) const { return (*node)[r]; }
};

struct DispatchSendParams {
  const A2AConfig* cfg = nullptr;
  const Layout* layout = nullptr;
  Mappings ws;
  const void* x = nullptr;  // [T, hidden] in x_dtype
  DType x_dtype = DType::kBf16;
  const float* x_scale = nullptr;     // [T, num_scales] when x is fp8
  const int32_t* topk_ids = nullptr;  // [T, topk]
  const float* weights = nullptr;     // [T, topk]: each copy's weight, into its row's tail (null: zeros)
  int num_tokens = 0;
  uint32_t* counts = nullptr;   // out: [E + N], our routing row (copies per expert, wire rows per rank)
  int32_t* slots = nullptr;     // out: [T * topk], send row of each (t, k)
  int32_t* row_copy = nullptr;  // out: [T * topk], the copy t * topk + k at each send row (rows per rank: its first k)
  // out: [T * topk], where (t, k) travels in a row per rank, its entry there
  // (its index among t's k on that rank); -1 in a row of its own.
  int16_t* entry_of_copy = nullptr;
  const uint8_t** encoded = nullptr;  // scratch: [T], where token t's row was first stored (null: not yet)
};

// Counts copies per expert and wire rows per rank into `counts`.
void count_experts(const DispatchSendParams& p);
// Assigns send rows (send order of docs/protocol.md): `slots`, its inverse
// `row_copy` and `entry_of_copy`; clears `encoded`. After count_experts.
// Towards a per-rank destination (A2AConfig::per_rank) wire row j is the
// j-th token picking it, shared by all of that token's k there.
void assign_rows(const DispatchSendParams& p);
// Packs the copies for rank r, send rows [first_row, first_row + rows):
// same-node private slots straight into the peer's workspace, the rest into
// our send section. A token is encoded once, where its first copy goes;
// later copies are copied from there. Packing rank by rank lets each rank's
// rows go out while the next rank's are packed.
void pack_rank(const DispatchSendParams& p, int r, uint64_t first_row, uint64_t rows);

struct DispatchRecvParams {
  const A2AConfig* cfg = nullptr;
  const Layout* layout = nullptr;
  Mappings ws;
  const RoutingView* routing = nullptr;
  const RecvPlan* plan = nullptr;
  void* out_x = nullptr;        // [output_rows, hidden] in dispatch dtype
  float* out_scale = nullptr;   // [output_rows, num_scales] for fp8
  float* out_weight = nullptr;  // [output_rows]: each row's tail, its copy's weight (null: not wanted)
  // A weighted receive (bf16 or fp32 rows; null: a plain copy): output row r
  // is stored times row_scale[r] and, with dot_y, dot_out[r] = <row as
  // received, dot_y[r]> (summed in fp64, rounded once to fp32).
  const float* row_scale = nullptr;  // [output_rows]
  const void* dot_y = nullptr;       // [output_rows, hidden] in dot_y_dtype
  DType dot_y_dtype = DType::kBf16;
  float* dot_out = nullptr;  // [output_rows]
  // out: [total_wire * entries_per_row]: entry e of wire row (s, j) at (recv_base[s] + j) * entries + e,
  // its output row (-1: unused) and its weight from the tail.
  int64_t* row_of_entry = nullptr;
  float* weight_of_entry = nullptr;
  const uint64_t* sender_base = nullptr;  // [world][local experts]: output row of sender s's first copy of expert i
  // Rows per node (A2AConfig::node_rows): sender_base of every rank of our
  // node ([ranks_per_node][world][local experts], by local index), and for
  // each entry of the rows we forward (indexed as row_of_entry) the rank it
  // is for (-1: unused); row_of_entry then holds its output row there.
  const uint64_t* node_sender_base = nullptr;
  int32_t* rank_of_entry = nullptr;
};

// sender_base of DispatchRecvParams: start[i] plus the copies of expert i
// from the senders before s.
void sender_bases(const RoutingView& v, const RecvPlan& plan, int rank, uint64_t* out);
// Copies sender s's rows into the output (senders in any order).
void unpack_sender(const DispatchRecvParams& p, int s);
// Zeroes the padding rows; the other rows are any sender's.
void zero_padding(const DispatchRecvParams& p);

struct CombineSendParams {
  const A2AConfig* cfg = nullptr;
  const Layout* layout = nullptr;
  Mappings ws;
  const RecvPlan* plan = nullptr;
  const int64_t* row_of_entry = nullptr;   // DispatchRecvParams'
  const float* weight_of_entry = nullptr;  // DispatchRecvParams'
  const void* y = nullptr;                 // [output_rows, hidden]
  DType y_dtype = DType::kBf16;
  const float* row_values = nullptr;  // [output_rows]: into each returned row's tail (null: zeros)
  bool weighted = true;               // rows per rank: sum_e w_e * y_e (false: sum_e y_e)
  const int32_t* rank_of_entry = nullptr;  // DispatchRecvParams' (rows per node)
  const RoutingView* routing = nullptr;     // rows per node: the call's matrix ...
  const uint64_t* sender_base = nullptr;    // ... and DispatchRecvParams' sender_base
};

// Rows per node: the outputs (in y's dtype, noted in y_stage_dtype) and row
// values of the copies that came in rows per node forwarded by a node peer
// into our y_stage section, where it reads them (no one reads the other rows).
void stage_outputs(const CombineSendParams& p);

// Returns sender s's rows: into its combine_recv (same node) or our
// combine_send staging (remote), rank by rank so each can leave at once.
// Rows per node we forward: each row's entries summed from the y_stage of
// the ranks they are for (every node peer has staged); nothing where s's
// forwarder is another rank.
// A per-copy sender gets one row per copy; a per-rank one (A2AConfig::per_rank)
// one row per wire row, its entries' outputs summed in fp32 in k order.
void pack_combine_for(const CombineSendParams& p, int s);

struct CombineRecvParams {
  const A2AConfig* cfg = nullptr;
  const Layout* layout = nullptr;
  uint8_t* ws = nullptr;
  const int32_t* slots = nullptr;
  const int16_t* entry_of_copy = nullptr;  // DispatchSendParams'
  const float* weights = nullptr;          // [T, topk]
  int num_tokens = 0;
  void* out = nullptr;          // [T, hidden] in combine dtype
  float* values_out = nullptr;  // [T, topk]: the tail of each copy's returned row (null: not wanted)
};

void reduce_combine(const CombineRecvParams& p);

}  // namespace moe_a2a::a2a::cpu
