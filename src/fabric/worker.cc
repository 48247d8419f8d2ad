#include "worker.h"

#include <sched.h>

#include <algorithm>

#include "error.h"
#include "imm.h"

namespace moe_a2a::fabric {
namespace {
constexpr int kPollBatch = 32;
constexpr size_t kInitialQueue = 1024;

// A completion names its write by (op, peer), packed in the context.
uint64_t pack_context(OpKind op, int peer) {
  return (static_cast<uint64_t>(op) << 32) | static_cast<uint32_t>(peer);
}
std::string describe_context(uint64_t context) {
  return std::string(op_name(static_cast<OpKind>(context >> 32))) + " to peer " +
         std::to_string(static_cast<uint32_t>(context));
}
}  // namespace

const char* op_name(OpKind op) {
  switch (op) {
    case OpKind::kWrite:
      return "write";
    case OpKind::kScatter:
      return "scatter";
    case OpKind::kBarrier:
      return "barrier";
  }
  return "?";
}

Worker::Worker(std::vector<std::unique_ptr<Backend>>* backends, ImmCounters* imms, IdlePolicy idle)
    : backends_(backends),
      imms_(imms),
      idle_(idle),
      arrivals_(new std::atomic<uint64_t>[backends->size()]),
      in_flight_(new std::atomic<int64_t>[kMaxRanks]) {
  for (size_t i = 0; i < backends->size(); ++i) arrivals_[i].store(0);
  for (int r = 0; r < kMaxRanks; ++r) in_flight_[r].store(0, std::memory_order_relaxed);
  queue_.reserve(kInitialQueue);
  pending_.reserve(kInitialQueue);
  thread_ = std::thread([this] { run(); });
}

Worker::~Worker() {
  {
    std::lock_guard<std::mutex> lock(queue_mu_);
    stop_.store(true);
  }
  queue_cv_.notify_all();
  if (blocked_.load()) (*backends_)[0]->wake();
  thread_.join();
}

Worker::Batch::Batch(Worker* w) : w_(w), lock_(w->queue_mu_) {}

void Worker::Batch::add(const NicWrite& write) {
  if (w_->queue_.size() == w_->queue_.capacity()) w_->allocations_.fetch_add(1, std::memory_order_relaxed);
  w_->queue_.push_back(write);
  w_->queue_.back().write.context = pack_context(write.op, write.write.peer);
  ++added_;
}

Worker::Batch::~Batch() {
  if (added_ == 0) return;
  w_->submitted_.fetch_add(added_);
  lock_.unlock();
  w_->wake_locked_out();
}

void Worker::wake_locked_out() {
  queue_cv_.notify_one();
  if (blocked_.load()) (*backends_)[0]->wake();
}

void Worker::reserve(size_t writes) {
  {
    std::lock_guard<std::mutex> lock(queue_mu_);
    if (queue_.capacity() < writes) queue_.reserve(writes);
  }
  // pending_ is the worker's: it grows there, on its next turn.
  size_t want = reserve_.load();
  while (want < writes && !reserve_.compare_exchange_weak(want, writes)) {
  }
}

void Worker::nudge() {
  {
    std::lock_guard<std::mutex> lock(queue_mu_);
    nudged_ = true;
  }
  wake_locked_out();
}

std::string Worker::error() const {
  std::lock_guard<std::mutex> lock(error_mu_);
  return error_;
}

void Worker::fail(const std::string& message, int peer) {
  bool forgiven = false;
  {  // checked and recorded under one lock: a forgive() in between would miss this failure
    std::lock_guard<std::mutex> lock(error_mu_);
    forgiven = peer >= 0 && std::find(forgiven_.begin(), forgiven_.end(), peer) != forgiven_.end();
    if (!forgiven) {
      failures_.emplace_back(peer, message);
      if (error_.empty()) error_ = message;
      // Under idle_mu_, so a wait_idle() between its check and its sleep sees it; and still under
      // error_mu_ (forgive()'s order), so a forgive() cannot clear the failure before this flag
      // and leave the engine failed with no error.
      std::lock_guard<std::mutex> idle(idle_mu_);
      failed_.store(true);
    }
  }
  if (forgiven) {
    write_done();  // a write to a masked peer: done with, as far as waits go (and they are woken)
    return;
  }
  idle_cv_.notify_all();
}

bool Worker::is_forgiven(int peer) const {
  std::lock_guard<std::mutex> lock(error_mu_);
  return std::find(forgiven_.begin(), forgiven_.end(), peer) != forgiven_.end();
}

void Worker::unforgive(int peer) {
  std::lock_guard<std::mutex> lock(error_mu_);
  forgiven_.erase(std::remove(forgiven_.begin(), forgiven_.end(), peer), forgiven_.end());
  any_forgiven_.store(!forgiven_.empty());
}

void Worker::forgive(int peer) {
  uint64_t dropped = 0;
  {
    std::lock_guard<std::mutex> lock(error_mu_);
    if (std::find(forgiven_.begin(), forgiven_.end(), peer) == forgiven_.end()) forgiven_.push_back(peer);
    any_forgiven_.store(true);
    std::vector<std::pair<int, std::string>> left;
    for (auto& f : failures_) {
      if (f.first == peer) ++dropped;
      else left.push_back(std::move(f));
    }
    failures_ = std::move(left);
    error_ = failures_.empty() ? std::string() : failures_.front().second;
    // Posted and never completed (a dead process's endpoint may not fail them): done now.
    if (peer >= 0 && peer < kMaxRanks) dropped += static_cast<uint64_t>(in_flight_[peer].exchange(0));
    std::lock_guard<std::mutex> idle(idle_mu_);
    completed_.fetch_add(dropped);  // each failed write of the peer, never counted as completed
    failed_.store(!failures_.empty());
  }
  idle_cv_.notify_all();
}

bool Worker::wait_idle(std::chrono::nanoseconds timeout) {
  std::unique_lock<std::mutex> lock(idle_mu_);
  return idle_cv_.wait_for(lock, timeout, [this] { return failed_.load() || completed_.load() >= submitted_.load(); });
}

bool Worker::take_new_writes() {
  size_t want = reserve_.load(std::memory_order_relaxed);
  if (pending_.capacity() < want) pending_.reserve(want);
  std::lock_guard<std::mutex> lock(queue_mu_);
  if (queue_.empty()) return false;
  if (head_ == pending_.size()) {
    pending_.clear();
    head_ = 0;
  } else if (head_ > 0) {
    pending_.erase(pending_.begin(), pending_.begin() + static_cast<std::ptrdiff_t>(head_));  // moves, no allocation
    head_ = 0;
  }
  if (pending_.size() + queue_.size() > pending_.capacity()) allocations_.fetch_add(1, std::memory_order_relaxed);
  pending_.insert(pending_.end(), queue_.begin(), queue_.end());
  queue_.clear();
  return true;
}

bool Worker::post_pending() {
  bool progress = false;
  while (head_ < pending_.size()) {
    const NicWrite& piece = pending_[head_];
    if (any_forgiven_.load(std::memory_order_relaxed) && is_forgiven(piece.write.peer)) {
      ++head_;  // a masked peer's: never posted (its endpoint may no longer complete anything)
      write_done();
      progress = true;
      continue;
    }
    bool posted = false;
    try {
      posted = (*backends_)[piece.nic]->post_write(piece.write);
    } catch (const FabricError& e) {
      // Skipped, not retried: the worker has failed, or (forgiven) the peer is masked.
      fail(std::string(e.what()) + " [" + describe_context(piece.write.context) + "]", piece.write.peer);
      ++head_;
      return progress;
    }
    if (!posted) break;  // queue full: completions first
    if (piece.write.peer >= 0 && piece.write.peer < kMaxRanks)
      in_flight_[piece.write.peer].fetch_add(1, std::memory_order_relaxed);
    ++head_;
    progress = true;
  }
  if (head_ == pending_.size()) {
    pending_.clear();
    head_ = 0;
  }
  return progress;
}

bool Worker::settle(int peer) {
  if (peer < 0 || peer >= kMaxRanks) return true;
  if (in_flight_[peer].fetch_sub(1, std::memory_order_relaxed) > 0) return true;
  in_flight_[peer].fetch_add(1, std::memory_order_relaxed);
  // At 0: forgive() counted it already; or (peer not forgiven) a completion whose context names
  // no write of ours (a provider's error without one), which counts as before.
  return !(any_forgiven_.load(std::memory_order_relaxed) && is_forgiven(peer));
}

void Worker::write_done() {
  {
    std::lock_guard<std::mutex> lock(idle_mu_);
    completed_.fetch_add(1);
  }
  idle_cv_.notify_all();
}

bool Worker::handle(int nic, const Completion* done, int n) {
  for (int i = 0; i < n; ++i) {
    const Completion& c = done[i];
    if (c.kind == CompletionKind::kArrived) {
      arrivals_[nic].fetch_add(1, std::memory_order_relaxed);  // before a waiter can see the count
      imms_->add(c.imm);
    } else if (c.kind == CompletionKind::kSent) {
      if (settle(static_cast<int>(static_cast<uint32_t>(c.context)))) write_done();
    } else {
      const int peer = static_cast<int>(static_cast<uint32_t>(c.context));
      if (settle(peer)) fail((*backends_)[nic]->last_error() + " [" + describe_context(c.context) + "]", peer);
    }
  }
  return n > 0;
}

bool Worker::poll_all() {
  Completion done[kPollBatch];
  bool progress = false;
  for (size_t nic = 0; nic < backends_->size(); ++nic) {
    try {
      int n = (*backends_)[nic]->poll(done, kPollBatch);
      progress = handle(static_cast<int>(nic), done, n) || progress;
    } catch (const FabricError& e) {
      fail(e.what());
      return progress;
    }
  }
  return progress;
}

void Worker::idle_wait(bool expecting) {
  Backend& nic = *(*backends_)[0];
  const int block_ms = expecting ? idle_.busy_block_ms : idle_.block_ms;
  if (backends_->size() == 1 && nic.capabilities().blocking_wait) {
    // Block on the NIC: an arrival, a new write or a nudge (both wake us) ends it.
    blocked_.store(true);
    bool queued;
    {
      std::lock_guard<std::mutex> lock(queue_mu_);
      queued = stop_.load() || !queue_.empty() || nudged_;
      nudged_ = false;
    }
    if (!queued) {
      Completion done[kPollBatch];
      try {
        handle(0, done, nic.wait_poll(done, kPollBatch, block_ms));
      } catch (const FabricError& e) {
        fail(e.what());
      }
    }
    blocked_.store(false);
    return;
  }
  // Polled NICs: short slices while something is expected (arrivals are
  // picked up within one), long ones when idle. A new write or a nudge wakes us.
  std::unique_lock<std::mutex> lock(queue_mu_);
  auto slice = expecting ? idle_.sleep : std::chrono::microseconds(block_ms * 1000);
  queue_cv_.wait_for(lock, slice, [this] { return stop_.load() || !queue_.empty() || nudged_; });
  nudged_ = false;
}

void Worker::run() {
  int idle_polls = 0;
  // Stops even with writes in flight (a peer may be gone for good).
  while (!stop_.load(std::memory_order_relaxed)) {
    bool progress = take_new_writes();
    if (!failed_.load()) {
      progress = post_pending() || progress;
      progress = poll_all() || progress;
    }
    if (progress) {
      idle_polls = 0;
      continue;
    }
    ++idle_polls;
    if (idle_polls < idle_.spin_polls) continue;
    if (idle_polls < idle_.yield_polls) {
      sched_yield();
      continue;
    }
    // Then block on the NIC. With bytes in flight or a caller waiting for
    // arrivals, only briefly: not every provider wakes a blocked reader for
    // its own progress.
    const bool expecting = head_ < pending_.size() || completed_.load() < submitted_.load() || imms_->waiters() > 0;
    idle_wait(expecting);
  }
}

}  // namespace moe_a2a::fabric
