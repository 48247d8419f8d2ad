#include "proxy.h"

#include <exception>

#include "fabric/error.h"
#include "plan.h"
#include "wait.h"

namespace moe_a2a::a2a {

using fabric::ScatterItem;

Proxy::Proxy(ProxyContext ctx) : ctx_(std::move(ctx)), thread_([this] { run(); }) {}

Proxy::~Proxy() {
  stop_.store(true);
  thread_.join();
}

std::string Proxy::error() const {
  std::lock_guard<std::mutex> lock(mu_);
  return error_;
}

std::string Proxy::overflow_message() const {
  std::lock_guard<std::mutex> lock(mu_);
  return overflow_;
}

bool Proxy::wait_signal(const Seq& seq, uint64_t epoch) {
  Backoff backoff;
  while (seq.get() < epoch) {
    if (stop_.load(std::memory_order_relaxed)) return false;
    backoff.pause();
  }
  return true;
}

void Proxy::run() {
  for (uint64_t epoch = 1;; ++epoch) {
    try {
      if (!wait_signal(ctx_.signals->route_ready, epoch)) return;
      step(epoch);
    } catch (const std::exception& e) {
      std::lock_guard<std::mutex> lock(mu_);
      error_ = e.what();
      ctx_.signals->failed.set(epoch);
      return;
    }
  }
}

void Proxy::wait_node_flags(FlagKind kind, uint64_t epoch, const char* what) {
  const A2AConfig& c = ctx_.config;
  auto deadline = deadline_after(c.timeout_s);
  for (int s = 0; s < c.world; ++s) {
    if (!c.same_node(s)) continue;
    auto* flag = flag_at(ctx_.workspace, ctx_.layout, s, kind);
    if (!wait_at_least(flag, epoch, deadline, [] {}))
      throw fabric::TimeoutError("rank " + std::to_string(c.rank) + ": timed out after " +
                                 std::to_string(c.timeout_s) + " s waiting for the " + what + " of same-node peer " +
                                 std::to_string(s) + " (epoch " + std::to_string(epoch) + ")");
  }
}

// Step 3 of an uncached call: every peer's routing row has arrived.
void Proxy::exchange_routing(uint64_t epoch) {
  const A2AConfig& c = ctx_.config;
  // A peer running this call cached sends no row: say so, rather than only that it timed out.
  try {
    for (int s : ctx_.remote_peers) ctx_.engine->wait_imm(tag(kTagRoute), s, 1, c.timeout_s);
    wait_node_flags(kFlagRoute, epoch, "routing row");
  } catch (const fabric::TimeoutError& e) {
    throw fabric::TimeoutError(e.what() + std::string(kCachedMismatchHint));
  }
  int same_node_peers = 0;
  for (int r = 0; r < c.world; ++r) same_node_peers += r != c.rank && c.same_node(r);
  rows_received_.fetch_add(ctx_.remote_peers.size() + same_node_peers, std::memory_order_relaxed);
}

void Proxy::node_barrier(uint64_t epoch) {
  const A2AConfig& c = ctx_.config;
  for (int r = 0; r < c.world; ++r)
    if (c.same_node(r)) flag_at(ctx_.node_workspaces[r], ctx_.layout, c.rank, kFlagBarrier)->store(epoch, std::memory_order_release);
  wait_node_flags(kFlagBarrier, epoch, "barrier");
  if (!ctx_.remote_peers.empty()) ctx_.engine->barrier(ctx_.group, tag(kTagBarrier), c.timeout_s);
}

void Proxy::step(uint64_t epoch) {
  const A2AConfig& c = ctx_.config;
  const Layout& l = ctx_.layout;
  fabric::TransferEngine* engine = ctx_.engine;  // used only with remote peers
  const auto& remotes = ctx_.remote_peers;
  const uint64_t P = c.max_private_tokens;
  const size_t row = l.dispatch_row;
  const size_t routing_bytes = static_cast<size_t>(c.num_experts) * sizeof(uint32_t);
  // Our own row is final once route_ready is raised; the others are read once
  // they have all arrived, into a snapshot (same-node peers rewrite their rows
  // as soon as our combine flag frees them, before this step is over). A
  // cached call brings the whole matrix and exchanges no row.
  const bool cached = ctx_.signals->cached.get() == epoch;
  const size_t matrix_words = static_cast<size_t>(c.world) * c.num_experts;
  if (cached) routing_.assign(ctx_.signals->cached_routing, ctx_.signals->cached_routing + matrix_words);
  const auto* live = reinterpret_cast<const uint32_t*>(ctx_.workspace + l.routing);
  RoutingView own{cached ? routing_.data() : live, c.world, c.num_experts, c.num_local_experts()};

  // 1. Our routing row, to every remote peer at once.
  std::vector<ScatterItem> items;
  // No engine is opened when every peer shares our node (nothing to move).
  auto scatter = [&](uint32_t t) {
    if (!remotes.empty()) engine->scatter(ctx_.group, ctx_.region, items.data(), items.size(), t);
  };
  if (!cached) {
    const size_t my_row = l.routing_row(c.rank, c.num_experts);
    for (size_t i = 0; i < remotes.size(); ++i) items.push_back({static_cast<uint32_t>(i), my_row, routing_bytes, my_row});
    scatter(tag(kTagRoute));
    rows_sent_.fetch_add(remotes.size(), std::memory_order_relaxed);
  }

  // 2. The private part of every remote peer's tokens, without waiting for
  //    anyone's routing.
  if (!wait_signal(ctx_.signals->packed, epoch)) return;
  items.clear();
  std::vector<uint64_t> to(c.world), send_off(c.world);
  for (int r = 0, off = 0; r < c.world; ++r) {
    to[r] = own.to_rank(c.rank, r);
    send_off[r] = off;
    off += static_cast<int>(to[r]);
  }
  for (size_t i = 0; i < remotes.size(); ++i) {
    int r = remotes[i];
    uint64_t n = private_copies(to[r], P);
    if (n == 0) continue;  // nothing private (also every call when P = 0): no write, none expected
    items.push_back({static_cast<uint32_t>(i), l.send + send_off[r] * row, n * row,
                     l.private_rows + static_cast<size_t>(c.rank) * P * row});
  }
  scatter(tag(kTagDispatch));

  // 3. Everyone's routing rows; then the plan, the capacity check and the
  //    overflow writes into each peer's shared section.
  if (!cached) {
    exchange_routing(epoch);
    routing_.assign(live, live + matrix_words);
  }
  RoutingView view{routing_.data(), c.world, c.num_experts, c.num_local_experts()};
  int worst_rank = -1;
  uint64_t worst = 0;
  for (int r = 0; r < c.world; ++r) {
    uint64_t n = view.received(r);
    if (n > static_cast<uint64_t>(c.max_recv_tokens) && n > worst) {
      worst = n;
      worst_rank = r;
    }
  }
  if (worst_rank >= 0) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      overflow_ = "dispatch would deliver " + std::to_string(worst) + " token copies to rank " +
                  std::to_string(worst_rank) + ", more than max_recv_tokens=" + std::to_string(c.max_recv_tokens) +
                  "; raise max_recv_tokens in Config (nothing was delivered; the next call can proceed)";
    }
    // Let the private writes already under way land, then meet everyone so
    // nobody's next call overwrites buffers that are still being read.
    for (int s : remotes)
      if (private_copies(view.to_rank(s, c.rank), P) > 0) engine->wait_imm(tag(kTagDispatch), s, 1, c.timeout_s);
    node_barrier(epoch);
    ctx_.signals->overflow.set(epoch);
    ctx_.signals->dispatch_done.set(epoch);
    return;
  }
  items.clear();
  for (size_t i = 0; i < remotes.size(); ++i) {
    int r = remotes[i];
    if (to[r] <= P) continue;
    uint64_t dst_row = view.shared_offset(c.rank, r, P);
    items.push_back({static_cast<uint32_t>(i), l.send + (send_off[r] + P) * row, (to[r] - P) * row,
                     l.shared_rows + dst_row * row});
  }
  scatter(tag(kTagDispatch));

  // 4. Every expected remote write has landed.
  for (int s : remotes) {
    uint64_t expected = dispatch_writes(view.to_rank(s, c.rank), P);
    if (expected > 0) engine->wait_imm(tag(kTagDispatch), s, expected, c.timeout_s);
  }
  ctx_.signals->dispatch_done.set(epoch);

  // 5. Combine: one write back to every remote peer (empty when it sent us
  //    nothing), then every peer's write to us.
  if (!wait_signal(ctx_.signals->combine_packed, epoch)) return;
  const size_t crow = l.combine_row;
  items.clear();
  uint64_t base = 0;
  std::vector<uint64_t> recv_base(c.world);
  for (int s = 0; s < c.world; ++s) {
    recv_base[s] = base;
    base += view.to_rank(s, c.rank);
  }
  for (size_t i = 0; i < remotes.size(); ++i) {
    int s = remotes[i];
    items.push_back({static_cast<uint32_t>(i), l.combine_send + recv_base[s] * crow, view.to_rank(s, c.rank) * crow,
                     l.combine_recv + view.send_offset(s, c.rank) * crow});
  }
  scatter(tag(kTagCombine));
  for (int s : remotes) engine->wait_imm(tag(kTagCombine), s, 1, c.timeout_s);
  ctx_.signals->combine_done.set(epoch);
}

}  // namespace moe_a2a::a2a
