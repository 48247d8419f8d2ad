#include "proxy.h"

#include <algorithm>
#include <chrono>
#include <exception>

#include "env.h"
#include "fabric/error.h"
#include "plan.h"
#include "wait.h"

namespace moe_a2a::a2a {

using fabric::ScatterItem;

namespace {
// Thrown by a wait when the proxy is being stopped (close after a failure).
struct Stopped {};
// Longest blocking wait for the compute side's next flag: the idle proxy's
// only wake-ups (32 idle instances used 0.09 CPU-s/s polling every 1 ms).
constexpr std::chrono::milliseconds kIdleBlock{100};

// Remote peers (group indices) in the order we write to them: rank + 1,
// rank + 2, ... (cyclic), so that the senders do not all start with the
// same receiver.
std::vector<size_t> serving_order(const ProxyContext& ctx) {
  const int n = ctx.config.world, me = ctx.config.rank;
  std::vector<size_t> order(ctx.remote_peers.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return (ctx.remote_peers[a] - me + n) % n < (ctx.remote_peers[b] - me + n) % n;
  });
  return order;
}

}  // namespace

Proxy::Proxy(ProxyContext ctx)
    : ctx_(std::move(ctx)), order_(serving_order(ctx_)), delay_ms_(env_count("MOE_A2A_TEST_DELAY_WRITES_MS")) {
  watch_ = PeerWatch(ctx_.config, ctx_.layout, ctx_.workspace, ctx_.engine, ctx_.remote_peers, ctx_.pids, ctx_.masked,
                     ctx_.peers);
  const A2AConfig& c = ctx_.config;
  group_index_.assign(c.world, -1);
  for (size_t i = 0; i < ctx_.remote_peers.size(); ++i) group_index_[ctx_.remote_peers[i]] = static_cast<int>(i);
  const uint64_t most_copies = static_cast<uint64_t>(c.max_tokens) * std::min(c.topk, c.num_local_experts());
  dispatch_max_ = dispatch_writes(most_copies, c.max_private_tokens);
  // Arrivals a failed instance of this tag slot left behind would pair with our first call.
  if (ctx_.engine != nullptr)
    for (Tag kind : kStampTags) ctx_.engine->forget_imm(tag(kind), kInstanceTagMask | ((1u << kTagKindBits) - 1));
  thread_ = std::thread([this] { run(); });
}

Proxy::~Proxy() {
  stop_.store(true);
  wake();
  thread_.join();
}

void Proxy::arm() {
  armed_.fetch_add(1, std::memory_order_acq_rel);
  wake();
}

void Proxy::wake() {
  {
    std::lock_guard<std::mutex> lock(wake_mu_);
    woken_ = true;
  }
  wake_cv_.notify_one();
}

bool Proxy::peer_failed() const {
  std::lock_guard<std::mutex> lock(mu_);
  return peer_failed_;
}

void Proxy::on_idle(bool node) {
  if (stop_.load(std::memory_order_relaxed)) throw Stopped{};
  watch_.check();
  check_stamps(false, node);
}

void Proxy::wait_imm(Tag kind, int peer, uint64_t count) {
  ctx_.engine->wait_imm(tag(kind), peer, count, ctx_.config.timeout_s, [this] { on_idle(); });
  if (const int k = stamp_kind(kind); k >= 0) taken_[group_index_[peer]][k] += count;
}

void Proxy::take_slice(Tag kind, int peer, int part, uint32_t index) {
  ctx_.engine->wait_imm(tag(kind, part, index), peer, 1, ctx_.config.timeout_s, [this] { on_idle(); });
  if (const int k = stamp_kind(kind); k >= 0 && index == 0) ++taken_[group_index_[peer]][k];
}

void Proxy::check_stamps(bool force, bool node) {
  const A2AConfig& c = ctx_.config;
  auto now = std::chrono::steady_clock::now();
  if (at_.epoch == 0 || (now < next_stamps_ && !force)) return;
  next_stamps_ = now + PeerWatch::kInterval;
  if (node)
    for (int s = 0; s < c.world; ++s)
      if (node_peer(s)) check_node_stamps(c, ctx_.layout, ctx_.workspace, at_, s);
  RoutingView view{routing_.data(), c.world, c.num_experts, c.num_local_experts()};
  for (size_t i = 0; i < ctx_.remote_peers.size(); ++i) {
    const int s = ctx_.remote_peers[i];
    StampCounts seen = taken_[i];
    for (int k = 0; k < kStampKinds; ++k)  // the first write of each part (slices.h)
      for (int part = 0; part < 2; ++part) seen[k] += ctx_.engine->imm_count(tag(kStampTags[k], part, 0), s);
    RemoteBounds b;
    b.dispatch = at_.routed ? dispatch_writes(view.rows(s, c.rank), c.max_private_tokens) : 0;
    b.dispatch_max = dispatch_max_;
    b.fed = posted_[i] == dispatch_writes(to_[s], c.max_private_tokens);
    check_remote_stamps(c, at_, s, seen, b);
  }
}

void Proxy::announce_failure(const std::string& text, uint64_t done) {
  const A2AConfig& c = ctx_.config;
  const Layout& l = ctx_.layout;
  announce_on_node(c, l, ctx_.workspace, ctx_.node_workspaces, text, done);
  if (ctx_.remote_peers.empty()) return;
  std::vector<ScatterItem> items;
  size_t at = l.abort_record(c.rank);
  // A peer known gone would never complete its write, and wait_tx below would hold our error a second.
  for (size_t i = 0; i < ctx_.remote_peers.size(); ++i)
    if (!ctx_.engine->peer_gone(ctx_.remote_peers[i]))
      items.push_back({static_cast<uint32_t>(i), at, kAbortStride, at});
  if (items.empty()) return;
  try {
    ctx_.engine->scatter(ctx_.group, ctx_.region, items.data(), items.size(), tag(kTagAbort));
    // Sent before we return: a close right after would otherwise drop them with the engine.
    ctx_.engine->wait_tx(std::min(1.0, ctx_.config.timeout_s));
  } catch (const std::exception&) {
    // The engine has failed: peers see their own errors, or time out.
  }
}

std::string Proxy::error() const {
  std::lock_guard<std::mutex> lock(mu_);
  return error_;
}

std::string Proxy::overflow_message() const {
  std::lock_guard<std::mutex> lock(mu_);
  return overflow_;
}

bool Proxy::wait_signal(const Seq& seq, uint64_t epoch, bool next_call) {
  Backoff backoff;
  const bool arms = next_call && ctx_.caller_arms;
  auto started = [&] { return !arms || armed_.load(std::memory_order_acquire) >= epoch; };
  while (seq.get() < epoch) {
    if (stop_.load(std::memory_order_relaxed)) return false;
    if ((ctx_.caller_wakes || !started()) && backoff.round >= Backoff::kShortSleeps) {
      // Idle for a while: sleep until the compute side raises a flag or starts
      // the call, and wakes us.
      std::unique_lock<std::mutex> lock(wake_mu_);
      wake_cv_.wait_for(lock, kIdleBlock,
                        [&] { return woken_ || stop_.load() || seq.get() >= epoch || (arms && started()); });
      woken_ = false;
      if (arms && started()) backoff = Backoff{};  // the call is under way: poll from the start
      continue;
    }
    backoff.pause();
  }
  return true;
}

void Proxy::run() {
  for (uint64_t epoch = ctx_.first_epoch + 1;; ++epoch) {
    try {
      if (!wait_signal(ctx_.signals->route_ready, epoch, true)) return;
      step(epoch);
    } catch (const Stopped&) {
      return;
    } catch (const std::exception& e) {
      std::lock_guard<std::mutex> lock(mu_);
      error_ = e.what();
      peer_failed_ = dynamic_cast<const PeerFailedError*>(&e) != nullptr;
      ctx_.signals->failed.set(epoch);
      return;
    }
  }
}

void Proxy::wait_node_flags(FlagKind kind, uint64_t epoch, const char* what) {
  const A2AConfig& c = ctx_.config;
  auto deadline = deadline_after(c.timeout_s);
  for (int s = 0; s < c.world; ++s) {
    if (!node_peer(s)) continue;
    auto* flag = flag_at(ctx_.workspace, ctx_.layout, s, kind);
    if (!wait_at_least(flag, epoch, deadline, [this] { on_idle(true); }))
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
    for (int s : ctx_.remote_peers) wait_imm(kTagRoute, s, 1);
    wait_node_flags(kFlagRoute, epoch, "routing row");
  } catch (const fabric::TimeoutError& e) {
    throw fabric::TimeoutError(e.what() + std::string(kCachedMismatchHint));
  }
  int same_node_peers = 0;
  for (int r = 0; r < c.world; ++r) same_node_peers += r != c.rank && node_peer(r);
  rows_received_.fetch_add(ctx_.remote_peers.size() + same_node_peers, std::memory_order_relaxed);
}

void Proxy::node_barrier(uint64_t epoch) {
  const A2AConfig& c = ctx_.config;
  at_.combining = true;  // from here a peer may pass this call
  for (int r = 0; r < c.world; ++r)
    if (node_peer(r)) flag_at(ctx_.node_workspaces[r], ctx_.layout, c.rank, kFlagBarrier)->store(epoch, std::memory_order_release);
  wait_node_flags(kFlagBarrier, epoch, "barrier");
  if (ctx_.remote_peers.empty()) return;
  ctx_.engine->barrier(ctx_.group, tag(kTagBarrier), c.timeout_s, [this] { on_idle(); });
  for (StampCounts& t : taken_) ++t[kStampBarrier];
}

void Proxy::step(uint64_t epoch) {
  const A2AConfig& c = ctx_.config;
  const Layout& l = ctx_.layout;
  const size_t routing_bytes = l.routing_width * sizeof(uint32_t);
  // A cached call brings the whole matrix and exchanges no routing row.
  watch_.phase = dispatch_phase(epoch);
  cached_ = ctx_.signals->cached.get() == epoch;
  if (cached_) {
    const size_t matrix_words = static_cast<size_t>(c.world) * l.routing_width;
    routing_.assign(ctx_.signals->cached_routing, ctx_.signals->cached_routing + matrix_words);
  }
  at_ = CallPosition{};
  at_.epoch = epoch;
  at_.cached = at_.routed = cached_;
  taken_.assign(ctx_.remote_peers.size(), StampCounts{});
  posted_.assign(ctx_.remote_peers.size(), 0);
  // 1. Our routing row, to every remote peer at once (final once route_ready
  //    is raised). No engine is opened when every peer shares our node.
  if (!ctx_.remote_peers.empty() && !cached_) {
    std::vector<ScatterItem> items;
    const size_t my_row = l.routing_row(c.rank);
    for (size_t i = 0; i < ctx_.remote_peers.size(); ++i)
      items.push_back({static_cast<uint32_t>(i), my_row, routing_bytes, my_row});
    ctx_.engine->scatter(ctx_.group, ctx_.region, items.data(), items.size(), tag(kTagRoute));
    rows_sent_.fetch_add(ctx_.remote_peers.size(), std::memory_order_relaxed);
  }
  if (!ctx_.remote_peers.empty() && cached_) send_routing_stamp(epoch);
  if (!dispatch(epoch)) return;
  if (ctx_.signals->overflow.get() == epoch) return;  // no combine follows a call over capacity
  watch_.phase = combine_phase(epoch);
  combine(epoch);
}

bool Proxy::wait_slice_packed(const std::atomic<uint64_t>* slices, const Seq& peer, const Seq& all, int r,
                              uint32_t k, uint64_t epoch) {
  const std::atomic<uint64_t>* slice =
      slices != nullptr ? slices + static_cast<size_t>(r) * kMaxPeerSlices + k : nullptr;
  Backoff backoff;
  for (;;) {
    // Read before the packed flags: our compute side raises them before it can start the next call.
    const uint64_t started = ctx_.signals->route_ready.get();
    if ((slice != nullptr && slice->load(std::memory_order_acquire) >= epoch) || peer.get() >= epoch ||
        all.get() >= epoch)
      return true;
    if (stop_.load(std::memory_order_relaxed)) return false;
    if (started > epoch) skipped_own(epoch, started);
    check_stamps(false);  // peers' writes keep arriving while our compute side works
    backoff.pause();
  }
}

// Our compute side started call `started` while this one still waits for its
// rows: it skipped this call's dispatch rows or combine (possible below the
// Python front end: graph replays, the backend directly). Remote peers cannot
// tell, as we send them nothing of the next call; they would wait for the timeout.
void Proxy::skipped_own(uint64_t epoch, uint64_t started) {
  const char* skipped = watch_.phase == combine_phase(epoch) ? "combining" : "packing its dispatch rows of";
  throw fabric::FabricError("rank " + std::to_string(ctx_.config.rank) + " started epoch " + std::to_string(started) +
                            " without " + skipped + " epoch " + std::to_string(epoch) +
                            ": the ranks' call sequences differ");
}

void Proxy::delay_writes() {
  if (delay_ms_ > 0) std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms_));
}

// 2.-3. Each remote peer's rows as soon as the compute side has packed them,
// in our serving order: the private part at once, the overflow once every
// routing row is in (it lands at an offset that depends on the other
// senders' counts), so the fabric moves one peer's rows while the next
// peer's are packed. 4. Each sender's arrivals, in the order they complete.
bool Proxy::dispatch(uint64_t epoch) {
  const A2AConfig& c = ctx_.config;
  const auto* live = reinterpret_cast<const uint32_t*>(ctx_.workspace + ctx_.layout.routing);
  RoutingView own{cached_ ? routing_.data() : live, c.world, c.num_experts, c.num_local_experts()};
  to_.assign(c.world, 0);
  send_off_.assign(c.world, 0);
  for (int r = 0, off = 0; r < c.world; ++r) {  // wire rows: what crosses
    to_[r] = own.rows(c.rank, r);
    send_off_[r] = off;
    off += static_cast<int>(to_[r]);
  }
  enum { kRoutesOut, kRouted, kOverCapacity } state = kRoutesOut;
  size_t overflow_posted = 0;  // order_[0, overflow_posted) have their overflow under way
  for (size_t k = 0; k < order_.size(); ++k) {
    if (k == 0) delay_writes();
    if (!post_part(order_[k], 0, epoch)) return false;
    if (state == kRoutesOut && routes_in(epoch)) state = take_routes(epoch) ? kRouted : kOverCapacity;
    if (state == kRouted)
      for (; overflow_posted <= k; ++overflow_posted)
        if (!post_part(order_[overflow_posted], 1, epoch)) return false;
  }
  if (state == kRoutesOut) state = take_routes(epoch) ? kRouted : kOverCapacity;  // waits for them
  if (state == kOverCapacity) {
    dispatch_overflow(epoch);
    return true;
  }
  ctx_.signals->routed.set(epoch);
  for (; overflow_posted < order_.size(); ++overflow_posted)
    if (!post_part(order_[overflow_posted], 1, epoch)) return false;
  wait_dispatch_arrivals(epoch);
  check_stamps(true);  // before the compute side reads the rows: also where no wait ran
  ctx_.signals->dispatch_done.set(epoch);
  return true;
}

// A cached call: the hash of its matrix to every remote peer, from our own
// slot (which same-node peers never write), so that a peer running the call
// along another routing with the same counts fails instead of misplacing rows.
void Proxy::send_routing_stamp(uint64_t epoch) {
  const A2AConfig& c = ctx_.config;
  const Layout& l = ctx_.layout;
  cached_hash_ = routing_hash(routing_.data(), routing_.size());
  RoutingStamp* own = routing_stamp_at(ctx_.workspace, l, c.rank);
  own->hash = cached_hash_;
  own->epoch.store(epoch, std::memory_order_release);
  const size_t at = static_cast<size_t>(reinterpret_cast<uint8_t*>(own) - ctx_.workspace);
  std::vector<ScatterItem> items;
  for (size_t i = 0; i < ctx_.remote_peers.size(); ++i)
    items.push_back({static_cast<uint32_t>(i), at, sizeof(RoutingStamp), at});
  ctx_.engine->scatter(ctx_.group, ctx_.region, items.data(), items.size(), tag(kTagStamp));
}

// A cached call: remote sender s's stamp is in; it must name our routing.
void Proxy::take_routing_stamp(uint64_t epoch, int s) {
  wait_imm(kTagStamp, s, 1);
  check_routing_stamp(ctx_.config, ctx_.layout, ctx_.workspace, s, epoch, cached_hash_);
}

// Every routing row has arrived (nothing consumed).
bool Proxy::routes_in(uint64_t epoch) const {
  const A2AConfig& c = ctx_.config;
  if (cached_) return true;
  for (int s : ctx_.remote_peers)
    if (ctx_.engine->imm_count(tag(kTagRoute), s) < 1) return false;
  for (int s = 0; s < c.world; ++s)
    if (node_peer(s) && flag_at(ctx_.workspace, ctx_.layout, s, kFlagRoute)->load(std::memory_order_acquire) < epoch)
      return false;
  return true;
}

// Takes every routing row (waiting for those not yet in) into a snapshot (same-node peers rewrite theirs as
// soon as our combine flag frees them, before this step is over) and checks
// capacity for every rank, as every rank does alike.
bool Proxy::take_routes(uint64_t epoch) {
  const A2AConfig& c = ctx_.config;
  if (!cached_) {
    exchange_routing(epoch);
    const auto* live = reinterpret_cast<const uint32_t*>(ctx_.workspace + ctx_.layout.routing);
    routing_.assign(live, live + static_cast<size_t>(c.world) * ctx_.layout.routing_width);
    zero_masked_rows();
  }
  at_.routed = true;
  const Overflow worst = worst_overflow(c, routing_.data());
  if (worst.rank < 0) return true;
  at_.overflow = true;
  std::lock_guard<std::mutex> lock(mu_);
  overflow_ = capacity_message(c, worst);
  return false;
}

void Proxy::zero_masked_rows() {
  const size_t width = ctx_.layout.routing_width;
  for (int s = 0; s < ctx_.config.world; ++s)
    if (is_masked(ctx_.masked, s)) std::fill_n(routing_.begin() + static_cast<std::ptrdiff_t>(s * width), width, 0u);
}

// Over capacity: every peer still gets its private part (receivers expect
// one from every sender with private copies, whether or not the call
// overflows), nobody's overflow; then the private writes to us land and
// everyone meets, so nobody's next call overwrites buffers still being read.
void Proxy::dispatch_overflow(uint64_t epoch) {
  const A2AConfig& c = ctx_.config;
  RoutingView view{routing_.data(), c.world, c.num_experts, c.num_local_experts()};
  for (int s : ctx_.remote_peers) {
    const Slices& own = dispatch_slices_of(view.rows(s, c.rank)).part[0];
    for (uint32_t k = 0; k < own.count; ++k) take_slice(kTagDispatch, s, 0, k);
  }
  node_barrier(epoch);
  // Every cached call takes each remote peer's stamp, or the next call would count it.
  if (cached_)
    for (int s : ctx_.remote_peers) take_routing_stamp(epoch, s);
  ctx_.signals->overflow.set(epoch);
  ctx_.signals->dispatch_done.set(epoch);
  ctx_.signals->routed.set(epoch);
}

// Part `part` of group peer i's rows, slice by slice as each is staged:
// the private part (rows [0, min(c, P)) of ours into its private section),
// or the overflow (the rest, into its shared section after the overflow of
// the senders before us, known once every routing row is in).
bool Proxy::post_part(size_t i, int part, uint64_t epoch) {
  const A2AConfig& c = ctx_.config;
  const Layout& l = ctx_.layout;
  const int r = ctx_.remote_peers[i];
  const uint64_t P = c.max_private_tokens;
  const DispatchSlices slices = dispatch_slices_of(to_[r]);
  const Slices& sl = slices.part[part];
  if (sl.count == 0) return true;
  const size_t row = l.dispatch_row;
  // Where the part's first row lands at the peer.
  size_t dst = l.private_rows + static_cast<size_t>(c.rank) * P * row;
  if (part == 1) {
    RoutingView view{routing_.data(), c.world, c.num_experts, c.num_local_experts()};
    dst = l.shared_rows + view.shared_offset(c.rank, r, P) * row;
  }
  for (uint32_t k = 0; k < sl.count; ++k) {
    const uint32_t at = part == 0 ? k : slices.part[0].count + k;  // the slice's flag among the peer's
    if (!wait_slice_packed(ctx_.peers.slices_packed, ctx_.peers.packed[r], ctx_.signals->packed, r, at, epoch))
      return false;
    const uint64_t b = sl.begin(k), e = sl.end(k);
    ScatterItem item{static_cast<uint32_t>(i), l.send + (send_off_[r] + b) * row, (e - b) * row,
                     dst + (b - sl.first) * row};
    ctx_.engine->scatter(ctx_.rows_group, ctx_.rows_region, &item, 1, tag(kTagDispatch, part, k));
  }
  ++posted_[i];
  return true;
}

// Raises landed[s] for each remote sender once all its writes are in, in the
// order they complete (and its progress word slice by slice), so the compute
// side copies a sender's rows out while later ones are still on the wire.
void Proxy::wait_dispatch_arrivals(uint64_t epoch) {
  const A2AConfig& c = ctx_.config;
  RoutingView view{routing_.data(), c.world, c.num_experts, c.num_local_experts()};
  std::vector<int> senders;
  std::vector<DispatchSlices> slices;
  for (int s : ctx_.remote_peers) {
    senders.push_back(s);
    slices.push_back(dispatch_slices_of(view.rows(s, c.rank)));
  }
  const bool forwarding = c.node_rows() && ctx_.raises_forward;
  auto stamp = [&](int s) {
    if (cached_) take_routing_stamp(epoch, s);
    // Rows per node of a sender whose forwarder we are: all in our workspace, so every rank of
    // our node may read its entries (docs/protocol.md, "Rows per destination node").
    if (forwarding && c.per_node(s, c.rank) && c.forwarder(s, c.rank) == c.rank) {
      const uint64_t u = view.rows(s, c.rank);
      if (ctx_.before_forward && u > 0) {
        const Layout& l = ctx_.layout;
        const uint64_t P = static_cast<uint64_t>(c.max_private_tokens);
        const uint64_t in_private = std::min(u, P);
        ctx_.before_forward(s, l.private_rows + static_cast<size_t>(s) * P * l.dispatch_row,
                            in_private * l.dispatch_row, l.shared_rows + view.shared_offset(s, c.rank, P) * l.dispatch_row,
                            (u - in_private) * l.dispatch_row);
      }
      for (int q = 0; q < c.world; ++q)
        if (node_peer(q) || q == c.rank)
          flag_at(ctx_.node_workspaces[q], ctx_.layout, s, kFlagForward)->store(epoch, std::memory_order_release);
    }
  };
  wait_slices(kTagDispatch, senders, slices, ctx_.peers.slices_landed, ctx_.peers.landed, epoch, stamp);
}

void Proxy::wait_slices(Tag kind, const std::vector<int>& senders, const std::vector<DispatchSlices>& slices,
                        Seq* progress, Seq* landed, uint64_t epoch, const std::function<void(int)>& on_sender) {
  std::vector<int> peers;
  std::vector<DispatchSlices> cut;
  std::vector<uint32_t> done;  // slices taken, in row order
  auto finish = [&](int s) {
    if (on_sender) on_sender(s);
    landed[s].set(epoch);
  };
  for (size_t i = 0; i < senders.size(); ++i) {
    if (slices[i].count() == 0) {
      finish(senders[i]);  // it sends us nothing
      continue;
    }
    peers.push_back(senders[i]);
    cut.push_back(slices[i]);
    done.push_back(0);
  }
  std::vector<uint32_t> tags;
  while (!peers.empty()) {
    tags.resize(peers.size());  // each sender's next slice
    for (size_t k = 0; k < peers.size(); ++k)
      tags[k] = tag(kind, cut[k].part_of(done[k]), cut[k].index_in_part(done[k]));
    const size_t k = ctx_.engine->wait_any_imm(tags, peers, std::vector<uint64_t>(peers.size(), 1),
                                               ctx_.config.timeout_s, [this] { on_idle(); });
    const int s = peers[k];
    take_slice(kind, s, cut[k].part_of(done[k]), cut[k].index_in_part(done[k]));  // there already
    if (ctx_.after_landing) ctx_.after_landing();
    ++done[k];
    if (progress != nullptr) progress[s].set(progress_word(epoch, done[k]));
    if (done[k] < cut[k].count()) continue;
    finish(s);
    peers.erase(peers.begin() + static_cast<std::ptrdiff_t>(k));
    cut.erase(cut.begin() + static_cast<std::ptrdiff_t>(k));
    done.erase(done.begin() + static_cast<std::ptrdiff_t>(k));
  }
}

// 5. Combine: one write back to every remote peer as soon as its rows are
//    staged (empty when it sent us nothing), then every peer's write to us,
//    in the order they land.
bool Proxy::combine(uint64_t epoch) {
  const A2AConfig& c = ctx_.config;
  const Layout& l = ctx_.layout;
  const size_t crow = l.combine_row;
  RoutingView view{routing_.data(), c.world, c.num_experts, c.num_local_experts()};
  std::vector<uint64_t> recv_base(c.world);
  uint64_t base = 0;
  for (int s = 0; s < c.world; ++s) {
    recv_base[s] = base;
    base += view.rows(s, c.rank);
  }
  for (size_t k = 0; k < order_.size(); ++k) {
    const size_t i = order_[k];
    const int s = ctx_.remote_peers[i];
    const uint64_t n = view.rows(s, c.rank);  // reduced rows back, for rows per rank
    const Slices sl = combine_slices_of(n).part[0];
    const uint64_t src = l.combine_send + recv_base[s] * crow, dst = l.combine_recv + view.send_offset(s, c.rank) * crow;
    // A peer that sent us nothing still gets one (empty) write: it waits for every peer's.
    for (uint32_t j = 0; j < std::max(sl.count, 1u); ++j) {
      if (!wait_slice_packed(ctx_.peers.combine_slices_packed, ctx_.peers.combine_packed[s],
                             ctx_.signals->combine_packed, s, j, epoch))
        return false;
      if (k == 0 && j == 0) {
        check_stamps(true);  // the last look at peers that cannot be past this call yet
        at_.combining = true;
      }
      const uint64_t b = sl.count ? sl.begin(j) : 0, e = sl.count ? sl.end(j) : 0;
      ScatterItem item{static_cast<uint32_t>(i), src + b * crow, (e - b) * crow, dst + b * crow};
      ctx_.engine->scatter(ctx_.rows_group, ctx_.rows_region, &item, 1, tag(kTagCombine, 0, j));
    }
  }
  if (ctx_.remote_peers.empty() && !wait_signal(ctx_.signals->combine_packed, epoch)) return false;
  at_.combining = true;
  std::vector<DispatchSlices> slices;
  for (int r : ctx_.remote_peers) {
    DispatchSlices d = combine_slices_of(view.rows(c.rank, r));
    if (d.part[0].count == 0) d.part[0].count = 1;  // the empty write
    slices.push_back(d);
  }
  wait_slices(kTagCombine, ctx_.remote_peers, slices, ctx_.peers.combine_slices_landed, ctx_.peers.combine_landed,
              epoch, {});
  ctx_.signals->combine_done.set(epoch);
  return true;
}

}  // namespace moe_a2a::a2a
