// Dispatch, receive half: gather every received copy into the expert-major,
// padded output, one sender at a time, in whatever order their rows land; a
// row per rank holds several copies (its route entries).
// Same-node overflow is pulled from the sender's send section.
#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "../row_tail.h"
#include "convert.h"
#include "fabric/error.h"
#include "kernels.h"

namespace moe_a2a::a2a::cpu {

void sender_bases(const RoutingView& v, const RecvPlan& plan, int rank, uint64_t* out) {
  const int L = v.local;
  for (int i = 0; i < L; ++i) {
    uint64_t at = plan.expert_start[i];
    for (int s = 0; s < v.world; ++s) {
      out[static_cast<size_t>(s) * L + i] = at;
      at += v.count(s, rank * L + i);
    }
  }
}

namespace {

// Row `out_row` from `src` (bf16 or fp32), times its scale, with its dot
// product: the weighted combine's backward in the pass that delivers the row.
void scale_row(const DispatchRecvParams& p, const uint8_t* src, uint64_t out_row) {
  const A2AConfig& c = *p.cfg;
  const int H = c.hidden;
  const float w = p.row_scale[out_row];
  const void* y =
      p.dot_y != nullptr ? static_cast<const uint8_t*>(p.dot_y) + out_row * H * dtype_bytes(p.dot_y_dtype) : nullptr;
  double dot = 0.0;
  if (c.dispatch_dtype == DType::kFp32) {
    const auto* in = reinterpret_cast<const float*>(src);
    auto* out = static_cast<float*>(p.out_x) + out_row * H;
    for (int h = 0; h < H; ++h) {
      if (y != nullptr) dot += static_cast<double>(in[h]) * load_element(y, p.dot_y_dtype, h);
      out[h] = in[h] * w;
    }
  } else {
    const auto* in = reinterpret_cast<const uint16_t*>(src);
    auto* out = static_cast<uint16_t*>(p.out_x) + out_row * H;
    for (int h = 0; h < H; ++h) {
      const float v = bf16_to_f32(in[h]);
      if (y != nullptr) dot += static_cast<double>(v) * load_element(y, p.dot_y_dtype, h);
      out[h] = f32_to_bf16(v * w);
    }
  }
  if (p.dot_out != nullptr) p.dot_out[out_row] = static_cast<float>(dot);
}

}  // namespace

namespace {

// One received row's body (and weight) into output row `out_row`.
void deliver(const DispatchRecvParams& p, const uint8_t* src, uint64_t out_row, float weight) {
  const A2AConfig& c = *p.cfg;
  const size_t payload = c.payload_bytes(), scale_bytes = c.num_scales() * sizeof(float);
  if (p.row_scale != nullptr) scale_row(p, src, out_row);
  else std::memcpy(static_cast<uint8_t*>(p.out_x) + out_row * payload, src, payload);
  if (scale_bytes > 0) std::memcpy(p.out_scale + out_row * c.num_scales(), src + payload, scale_bytes);
  if (p.out_weight != nullptr) p.out_weight[out_row] = weight;
}

// Rows per rank from remote sender s: wire row j carries token j's entries
// for us in k order; each goes to its expert's next output row, which gives
// the (token, k) order per expert of rows per copy.
void unpack_rank_rows(const DispatchRecvParams& p, int s) {
  const A2AConfig& c = *p.cfg;
  const Layout& l = *p.layout;
  const RecvPlan& plan = *p.plan;
  const int L = c.num_local_experts(), m = c.max_entries();
  const uint64_t P = c.max_private_tokens;
  std::vector<uint32_t> next(L, 0);
  for (uint64_t j = 0; j < plan.wire[s]; ++j) {
    const uint8_t* src = j < P ? p.ws.self + l.private_rows + (static_cast<size_t>(s) * P + j) * l.dispatch_row
                               : p.ws.self + l.shared_rows + (plan.shared_off[s] + j - P) * l.dispatch_row;
    const size_t first = (plan.recv_base[s] + j) * m;
    for (int e = 0; e < m; ++e) {
      RouteEntry entry;
      std::memcpy(&entry, src + l.dispatch_tail + e * sizeof(RouteEntry), sizeof(entry));
      p.row_of_entry[first + e] = -1;
      p.weight_of_entry[first + e] = 0.0f;
      if (entry.expert == kNoExpert) continue;
      const int i = entry.expert;
      if (i >= L || next[i] >= p.routing->count(s, c.rank * L + i))
        throw fabric::FabricError("rank " + std::to_string(c.rank) + ": sender " + std::to_string(s) + "'s row " +
                                  std::to_string(j) + " names local expert " + std::to_string(i) +
                                  " past its routing row's copies: the rows do not match the routing");
      const uint64_t out_row = p.sender_base[static_cast<size_t>(s) * L + i] + next[i]++;
      deliver(p, src, out_row, entry.weight);
      p.row_of_entry[first + e] = static_cast<int64_t>(out_row);
      p.weight_of_entry[first + e] = entry.weight;
    }
  }
}

// Rows per node from remote sender s, in the workspace of its forwarder on
// our node (ourselves, or a node peer whose proxy raised our kFlagForward[s]):
// wire row j carries token j's entries for the node in k order; ours go to
// our output as rows per rank's do. The forwarder also notes, for every
// entry, the rank and output row it went to, which its combine sums from.
void unpack_node_rows(const DispatchRecvParams& p, int s) {
  const A2AConfig& c = *p.cfg;
  const Layout& l = *p.layout;
  const RoutingView& v = *p.routing;
  const int L = c.num_local_experts(), m = c.max_entries(), rpn = c.ranks_per_node, N = c.world;
  const int f = c.forwarder(s, c.rank), node0 = c.node_of(c.rank) * rpn;
  const bool forwarding = f == c.rank;
  const uint64_t P = c.max_private_tokens, u = v.rows(s, f), shared = v.shared_offset(s, f, P);
  const uint8_t* ws = p.ws.of(f);
  std::vector<uint32_t> next(static_cast<size_t>(rpn) * L, 0);  // entries so far per expert of the node
  for (uint64_t j = 0; j < u; ++j) {
    const uint8_t* src = j < P ? ws + l.private_rows + (static_cast<size_t>(s) * P + j) * l.dispatch_row
                               : ws + l.shared_rows + (shared + j - P) * l.dispatch_row;
    const size_t first = forwarding ? (p.plan->recv_base[s] + j) * m : 0;
    for (int e = 0; e < m; ++e) {
      RouteEntry entry;
      std::memcpy(&entry, src + l.dispatch_tail + e * sizeof(RouteEntry), sizeof(entry));
      if (forwarding) {
        p.row_of_entry[first + e] = -1;
        p.weight_of_entry[first + e] = 0.0f;
        p.rank_of_entry[first + e] = -1;
      }
      if (entry.expert == kNoExpert) continue;
      const int x = entry.expert, local = x / L, i = x % L, t = node0 + local;
      if (x >= rpn * L || next[x] >= v.count(s, t * L + i))
        throw fabric::FabricError("rank " + std::to_string(c.rank) + ": sender " + std::to_string(s) +
                                  "'s row per node " + std::to_string(j) + " names expert " + std::to_string(x) +
                                  " of the node past its routing row's copies: the rows do not match the routing");
      const uint64_t q = next[x]++;
      if (t == c.rank) deliver(p, src, p.sender_base[static_cast<size_t>(s) * L + i] + q, entry.weight);
      if (forwarding) {
        const size_t base = (static_cast<size_t>(local) * N + s) * L + i;
        p.row_of_entry[first + e] = static_cast<int64_t>(p.node_sender_base[base] + q);
        p.weight_of_entry[first + e] = entry.weight;
        p.rank_of_entry[first + e] = t;
      }
    }
  }
}

}  // namespace

void unpack_sender(const DispatchRecvParams& p, int s) {
  const A2AConfig& c = *p.cfg;
  if (c.per_node(s, c.rank)) {
    unpack_node_rows(p, s);
    return;
  }
  if (c.per_rank(s, c.rank)) {
    unpack_rank_rows(p, s);
    return;
  }
  const Layout& l = *p.layout;
  const RoutingView& v = *p.routing;
  const RecvPlan& plan = *p.plan;
  const int L = c.num_local_experts(), stride = c.entries_per_row();
  const uint64_t P = c.max_private_tokens;
  const size_t row = l.dispatch_row;
  uint64_t j = 0;
  for (int i = 0; i < L; ++i) {
    const uint32_t n = v.count(s, c.rank * L + i);
    const uint64_t base = p.sender_base[static_cast<size_t>(s) * L + i];
    for (uint32_t q = 0; q < n; ++q, ++j) {
      const uint8_t* src;
      if (j < P) {
        src = p.ws.self + l.private_rows + (static_cast<size_t>(s) * P + j) * row;
      } else if (c.same_node(s)) {
        src = p.ws.of(s) + l.send + (plan.send_off_at[s] + j) * row;
      } else {
        src = p.ws.self + l.shared_rows + (plan.shared_off[s] + j - P) * row;
      }
      const uint64_t out_row = base + q;
      float weight;  // the first 4 bytes of every tail (row_tail.h)
      std::memcpy(&weight, src + l.dispatch_tail, sizeof(weight));
      deliver(p, src, out_row, weight);
      const size_t first = (plan.recv_base[s] + j) * stride;
      for (int e = 0; e < stride; ++e) p.row_of_entry[first + e] = e == 0 ? static_cast<int64_t>(out_row) : -1;
      p.weight_of_entry[first] = weight;
    }
  }
}

// Padding rows are zeros, not the output buffer's leftover bytes: a grouped
// GEMM over padded segments reads them, and NaN patterns there would reach
// the weight gradients.
void zero_padding(const DispatchRecvParams& p) {
  const A2AConfig& c = *p.cfg;
  const RecvPlan& plan = *p.plan;
  const int L = c.num_local_experts();
  const size_t payload = c.payload_bytes();
  const size_t scale_bytes = c.num_scales() * sizeof(float);
  for (int i = 0; i < L; ++i) {
    const uint64_t begin = plan.expert_start[i] + static_cast<uint64_t>(plan.tokens_per_expert[i]);
    const uint64_t end = i + 1 < L ? plan.expert_start[i + 1] : plan.output_rows;
    if (end <= begin) continue;
    std::memset(static_cast<uint8_t*>(p.out_x) + begin * payload, 0, (end - begin) * payload);
    if (scale_bytes > 0) std::memset(p.out_scale + begin * c.num_scales(), 0, (end - begin) * scale_bytes);
    if (p.out_weight != nullptr) std::fill(p.out_weight + begin, p.out_weight + end, 0.0f);
    if (p.dot_out != nullptr) std::fill(p.dot_out + begin, p.dot_out + end, 0.0f);
  }
}

}  // namespace moe_a2a::a2a::cpu
