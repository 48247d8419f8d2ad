// Parameters of the CUDA kernels: plain structs of raw pointers and sizes,
// passed by value to each launch. Host C++ includes this without CUDA.
//
// Two copies of the protocol's workspace (docs/protocol.md) exist per rank,
// with the same Layout offsets:
// - the host workspace (POSIX shared memory, registered with CUDA as mapped
//   memory): routing rows and route/barrier flags, which the proxy reads, and
//   every row that travels over the fabric (send, private/shared rows from
//   remote senders, combine_send, combine_recv from remote receivers);
// - the device workspace (cudaMalloc, mapped by same-node ranks through CUDA
//   IPC): rows between ranks of one node, and a copy of their routing rows
//   (read by the plan kernel without a trip over PCIe). All flags stay in the host
//   workspace, where a rank's CPU can poll them with a timeout (eager calls)
//   and its kernels can poll them too (captured graphs).
// Where the provider reads GPU memory (FI_HMEM), `fabric` can be the device
// workspace itself; the kernels only ever use the `fabric` pointer for rows
// that cross the fabric.
#pragma once

#include <cstddef>
#include <cstdint>

#include "../config.h"
#include "../layout.h"
#include "../slices.h"

namespace moe_a2a::a2a::cuda {

// One rank's workspaces as this process reaches them (device pointers);
// both null for ranks of other nodes.
struct PeerWorkspaces {
  uint8_t* device = nullptr;  // its device workspace (ours, or a CUDA IPC mapping)
  uint8_t* host = nullptr;    // its host workspace (mapped shared memory)
};

// Flags of the host proxy (signals.h) as device pointers into pinned, mapped
// host memory; all null when no peer is remote (nothing to wait for).
struct ProxyFlags {
  uint64_t* route_ready = nullptr;     // kernel -> proxy
  uint64_t* packed = nullptr;          // kernel -> proxy
  uint64_t* combine_packed = nullptr;  // kernel -> proxy
  const uint64_t* dispatch_done = nullptr;  // proxy -> kernel
  const uint64_t* combine_done = nullptr;   // proxy -> kernel
  const uint64_t* overflow = nullptr;       // proxy -> kernel: epoch that exceeded max_recv_tokens
  const uint64_t* failed = nullptr;         // proxy -> kernel: non-zero once the proxy stopped
  // Per-peer flags (signals.h, PeerSignals), kPeerFlagStride u64s apart:
  // peer r's rows are in the fabric's host memory (stage_kernel -> proxy).
  uint64_t* peer_packed = nullptr;
  uint64_t* peer_combine_packed = nullptr;
  // Per slice (slices.h): [world][kMaxPeerSlices] epochs, slice k of peer r's
  // rows is in the fabric's host memory (stage_kernel -> proxy).
  uint64_t* slices_packed = nullptr;
  uint64_t* combine_slices_packed = nullptr;
};
constexpr int kPeerFlagStride = 8;  // a Seq is one 64-byte cache line

// Outcome of the last call, written by kernels into mapped host memory so the
// host can read it after synchronising, without another copy.
enum Status : int32_t {
  kStatusOk = 0,
  kStatusCapacity = 1,     // some rank would receive more than max_recv_tokens copies
  kStatusProxyFailed = 2,  // the proxy reported an error
  kStatusTimeout = 3,      // a flag did not arrive within timeout_ns
  kStatusBadExpert = 4,    // a topk id outside [0, num_experts): that copy was dropped
  kStatusBadRow = 5,       // a received row per rank named an expert or entry beyond the routing: dropped
  kStatusStaleGraph = 6,   // a graph captured before a mask replayed: nothing was done
};

// What every kernel knows about the instance. Section offsets come from the
// protocol's Layout, so positions agree with the CPU implementation.
struct Instance {
  Layout layout;
  int32_t rank = 0;
  int32_t world = 1;
  int32_t num_experts = 0;
  int32_t local_experts = 0;
  int32_t topk = 0;
  int32_t hidden = 0;
  int32_t max_tokens = 0;
  int32_t max_private = 0;   // P
  int64_t max_recv = 0;      // Rmax
  int32_t expert_padding = 1;
  int32_t dispatch_dtype = 0;  // DType
  int32_t combine_dtype = 0;   // DType
  int32_t num_scales = 0;      // fp8: ceil(hidden / 128)
  int64_t payload_bytes = 0;   // dispatch payload of one row (scales follow it)
  int32_t has_remote = 0;      // some peer is on another node: wait for the proxy
  // Rows for remote peers are packed into the device workspace, then copied
  // to the fabric's host memory peer by peer (stage_kernel), each peer handed
  // to the proxy as soon as its rows are there (MOE_A2A_CUDA_OVERLAP).
  int32_t staged = 0;
  int64_t slice_bytes = 0;     // A2AConfig::slice_bytes: how the proxy cuts a peer's rows into writes
  int64_t timeout_ns = 0;      // how long a kernel waits for a flag
  // Rows per destination rank (A2AConfig::rank_rows): towards a rank of
  // another node a token crosses once, its row's tail holding up to
  // max_entries RouteEntry (row_tail.h), and its combine comes back reduced.
  // Same-node peers keep one row per copy. 0: every row is a copy.
  int32_t rank_rows = 0;
  // Rows per destination node (A2AConfig::node_rows): towards another node a
  // token crosses once, to the rank of our local index there (its
  // forwarder), its tail's entries naming experts of the whole node; the
  // forwarder's node peers read their entries from its device workspace
  // (docs/protocol.md "Rows per destination node").
  int32_t node_rows = 0;
  int32_t ranks_per_node = 1;
  int32_t max_entries = 1;     // m: entries of a row per rank or node
  // Some rank is masked (live_ranks.h): an id of kMaskedExpert (row_tail.h)
  // is a dropped copy, not an error. 0: every id out of range is one.
  int32_t any_masked = 0;

  const PeerWorkspaces* peers = nullptr;  // [world], device memory
  uint8_t* device_ws = nullptr;           // ours
  uint8_t* host_ws = nullptr;             // ours, mapped
  uint8_t* fabric_ws = nullptr;           // rows crossing the fabric: host_ws (or device_ws with FI_HMEM)
  ProxyFlags proxy;
  uint64_t* epoch = nullptr;   // device: raised by each dispatch, read by every later kernel
  // The masks so far (CudaAllToAll::mask) when this Instance was made; the
  // current count is the device word after `epoch`. A graph captured before a
  // mask holds an older one: its kernels do nothing (stale_replay, rows.cuh).
  uint64_t generation = 0;
  // 0: this instance is never masked (on_peer_loss="stop"), so its kernels
  // skip that read (about 1.3 us of a one-rank decode step replayed on an H100).
  int32_t maskable = 0;
  int32_t* status = nullptr;   // mapped host: Status of the last call
};

// Receiver-side placement of the copies from one sender (plan.h's RecvPlan,
// per sender).
// Positions on the wire count wire rows (u: copies, except from a per-rank
// sender, which sends a row per token); the output counts copies.
struct SenderPlan {
  int64_t copies = 0;      // c[s][rank]
  int64_t wire = 0;        // u[s][rank]: wire rows
  int64_t recv_base = 0;   // sum_{s' < s} u[s'][rank]: combine_send staging row of (s, 0)
  int64_t shared_off = 0;  // shared row of (s, P)
  int64_t send_off = 0;    // send_off[s][rank] (over u): (s, 0) in s's send section and combine_recv
  // Rows per node, a sender on another node: its rows for our node sit in
  // the device workspace of its forwarder here (fwd, maybe us), read_rows of
  // them (u[s][fwd]), the shared ones from read_shared_off on.
  int32_t fwd = -1;
  int64_t read_rows = 0;
  int64_t read_shared_off = 0;
};

// Output rows [out_row, out_row + count) of local expert `expert` hold copies
// first_j.. of `sender`. Segments are stored expert-major (expert * world +
// sender), so out_row never decreases with the index.
struct Segment {
  int32_t out_row = 0;
  int32_t count = 0;
  int32_t sender = 0;
  int32_t first_j = 0;
};

// Rows per node: output rows [out_row, out_row + count) of a node rank's
// local expert hold its copies from one sender (Scratch::node_segs).
struct NodeSegment {
  int32_t out_row = 0;
  int32_t count = 0;
};

// Device scratch of one instance: what a dispatch leaves for its receive half
// and for the combine.
struct Scratch {
  int32_t* num_tokens = nullptr;   // [1] live T of the last dispatch_send
  int32_t* slots = nullptr;        // [max_tokens * topk] send row of (t, k); -1 if dropped
  int32_t* copy_rank = nullptr;    // [max_tokens * topk] destination rank of (t, k)
  uint8_t** copy_dst = nullptr;    // [max_tokens * topk] where pack stores (t, k); null if dropped
  int32_t* block_base = nullptr;   // [route blocks][num_experts] routing step of large calls
  int32_t* dropped = nullptr;      // [1] a large call's routing saw an id out of range
  uint32_t* done_blocks = nullptr; // [1] blocks of the running launch that finished (reset by the last)
  SenderPlan* senders = nullptr;   // [world]
  Segment* segments = nullptr;     // [num_experts] = [local_experts][world]
  int32_t* output_rows = nullptr;  // [1] padded output rows of the last dispatch_recv (device)
  uint64_t* plan_ready = nullptr;  // [1] epoch whose plan plan_copy_kernel's planning block finished (device)
  uint32_t* plan_ticket = nullptr; // [1] plan_copy_kernel's blocks that started this launch (reset by the last)
  uint32_t* stage_chunks = nullptr; // [world] stage_kernel: chunks of each peer copied this launch (reset by the last)
  uint32_t* stage_slices = nullptr; // [world][kMaxPeerSlices] the same per slice
  int32_t* output_rows_host = nullptr;  // [1] the same, in mapped host memory
  uint64_t* planned_host = nullptr;     // [1] mapped host: epoch whose plan is final (HostWords)
  // Our copies to ourselves, by j (their index among them): the copy t *
  // topk + k each one is (written by routing when the call sends them in
  // place), and the output row the receive half gave it (written by every
  // copy kernel).
  int32_t* self_copy = nullptr;    // [max_tokens * topk]
  int32_t* self_row = nullptr;     // [max_tokens * topk]
  // Rows per rank (Instance::rank_rows; empty sections otherwise).
  // Send side, by copy t * topk + k: -1 for a row of its own (same node,
  // dropped), else its entry in its token's row for that rank (bits 0-7) and
  // how many entries that row holds (bits 8-15). Entry 0 packs the row.
  int32_t* copy_entry = nullptr;   // [max_tokens * topk]
  // Receive side, from the tails of per-rank senders' rows (entry_kernel):
  // entry e of wire row w = recv_base[s] + j goes to output row
  // entry_row[w * m + e] (-1: unused) with weight entry_weight[w * m + e];
  // output row r holds entry row_entry[r] (w * m + e).
  int32_t* entry_row = nullptr;    // [max_recv * max_entries]
  float* entry_weight = nullptr;   // [max_recv * max_entries]
  int32_t* row_entry = nullptr;    // [max_output_rows]
  int32_t* entry_next = nullptr;   // [world][local_experts] entries handed out per (sender, expert) so far
  // Rows per node (Instance::node_rows; empty sections otherwise). entry_row
  // and entry_weight above then hold, for the rows we forward, the output row
  // on node rank entry_rank[w * m + e] (its index in the node, -1: unused);
  // entry_next is [world][ranks_per_node * local_experts]. Each output row
  // that came in a row per node: its wire row at the forwarder and its weight.
  int32_t* entry_rank = nullptr;   // [max_recv * max_entries]
  int32_t* row_wire = nullptr;     // [max_output_rows]
  float* row_weight = nullptr;     // [max_output_rows]
  // Output rows of every node rank's copies from each sender, as segments:
  // node_segs[(l * L + i) * world + s] = {out_row, count} of node rank l's
  // local expert i (the forwarder's entries name them).
  NodeSegment* node_segs = nullptr;  // [ranks_per_node * local_experts * world]
  uint64_t* plan_ok = nullptr;     // [1] epoch of the last plan that delivered (rows per node)
};

struct DispatchSendParams {
  Instance inst;
  Scratch scratch;
  const void* x = nullptr;       // [T, hidden] in x_dtype
  int32_t x_dtype = 0;           // DType; kFp8 means already quantised, with x_scale
  const float* x_scale = nullptr;  // [T, num_scales] when x is fp8
  const void* topk_ids = nullptr;  // [T, topk], int32 or int64
  int32_t ids_are_64bit = 0;
  const float* weights = nullptr;  // [T, topk]: each copy's weight, into its row's tail (null: zeros)
  int32_t num_tokens = 0;                  // T, unless num_tokens_ptr is set
  const int32_t* num_tokens_ptr = nullptr; // device T (graph replays with a varying T)
  int32_t cached = 0;  // along a cached routing: publish no routing row, raise no route flag
  // Our copies to ourselves are not packed: the receive half reads them from
  // x where they are (DispatchRecvParams::self_x), one pass instead of a
  // pack and a copy. Only where x is already in the dispatch dtype.
  int32_t self_in_place = 0;
};

struct DispatchRecvParams {
  Instance inst;
  Scratch scratch;
  void* out_x = nullptr;          // [max_output_rows, hidden] in dispatch dtype
  float* out_scale = nullptr;     // [max_output_rows, num_scales] for fp8
  int32_t* tokens_per_expert = nullptr;  // [local_experts], unpadded
  int64_t max_output_rows = 0;    // rows of out_x: max_recv + local_experts * (expert_padding - 1)
  int32_t wait_in_kernel = 1;     // 0: the host already saw every flag up (eager calls)
  int32_t fused = 0;              // eager only: plan and copy in one launch (plan_copy_kernel)
  int32_t sender = -1;            // >= 0: copy only this sender's rows (copy_sender_kernel), after the plan
  int64_t sender_first = 0;       // ... its copies [sender_first, sender_end) (a slice, slices.h)
  int64_t sender_end = 0;
  // Cached calls: the handle's matrix [world][num_experts] (mapped host), read
  // instead of the workspace's routing rows.
  const uint32_t* routing = nullptr;
  // When set (mapped host, [world][num_experts]): the plan's matrix, for a
  // handle to keep; final once the plan signals the host.
  uint32_t* routing_out = nullptr;
  // The send half's x when it left our copies to ourselves in place
  // (DispatchSendParams::self_in_place): [T, hidden] in the dispatch dtype.
  const void* self_x = nullptr;
  // Each output row's weight, from its row's tail (null: not wanted); our
  // copies read in place take theirs from the send half's weights.
  float* out_weight = nullptr;          // [max_output_rows]
  const float* self_weights = nullptr;  // [T, topk]
  // A dequantising receive (fp8 rows): out_x is [max_output_rows, hidden] in
  // out_dtype (bf16 or fp32), each row float(q) * its block's scale; out_scale
  // is unused. Our copies left in place are read from self_x (in
  // self_x_dtype) and go through the same quantisation as packed ones.
  int32_t dequant = 0;
  int32_t out_dtype = 0;     // DType
  int32_t self_x_dtype = 0;  // DType of self_x
  // A weighted receive (bf16 or fp32 rows; RowMath): output row r is stored
  // times row_scale[r], and with dot_y, dot_out[r] = <row as received, dot_y[r]>.
  const float* row_scale = nullptr;  // [output rows]
  const void* dot_y = nullptr;       // [output rows, hidden] in dot_y_dtype (bf16 or fp32)
  int32_t dot_y_dtype = 0;
  float* dot_out = nullptr;          // [output rows]
};

// What stage_kernel copies from the device workspace to the fabric's host
// memory, peer by peer: our dispatch send rows, or our combine_send staging.
enum StageKind : int32_t { kStageDispatch = 0, kStageCombine = 1 };

struct StageParams {
  Instance inst;
  Scratch scratch;
  int32_t kind = kStageDispatch;  // StageKind
};

struct CombineSendParams {
  Instance inst;
  Scratch scratch;
  const void* y = nullptr;  // [y_rows, hidden] in y_dtype (bf16 or fp32); y_rows >= output rows
  int64_t y_rows = 0;
  int32_t y_dtype = 0;
  // Rows that go back to ourselves are not returned: the reduction reads
  // them from y where the expert left them (CombineRecvParams::self_y).
  int32_t self_in_place = 0;
  const float* row_values = nullptr;  // [y_rows]: one per row, into its tail (null: zeros)
  // Rows per rank are summed here over their entries: each times its
  // dispatch weight (1), or plainly (0, the unweighted combine).
  int32_t weighted = 1;
  // Rows per node: the staged outputs of node peers are awaited in a kernel
  // (graph-safe calls), not on the host.
  int32_t wait_in_kernel = 0;
};

struct CombineRecvParams {
  Instance inst;
  Scratch scratch;
  const float* weights = nullptr;  // [T, topk]
  void* out = nullptr;             // [T, hidden] in combine dtype
  int32_t wait_in_kernel = 1;      // 0: the host already saw every flag up (eager calls)
  int32_t remote_on_device = 0;    // 1: remote peers' rows were copied to the device workspace (combine DMA)
  // The send half's y when it left our own rows in place
  // (CombineSendParams::self_in_place): [self_y_rows, hidden], combine dtype.
  const void* self_y = nullptr;
  int64_t self_y_rows = 0;
  // Each copy's returned value, unreduced (null: not wanted); our rows left
  // in place take theirs from the send half's row_values (null: zeros).
  float* values_out = nullptr;         // [T, topk]
  const float* self_values = nullptr;  // [self_y_rows]
};

}  // namespace moe_a2a::a2a::cuda
