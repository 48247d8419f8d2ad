#include "worker.h"

#include <sched.h>
#include <algorithm>

#include "error.h"

namespace moe_a2a::fabric {
namespace {
constexpr int kPollBatch = 32;
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
    : backends_(backends), imms_(imms), idle_(idle), thread_([this] { run(); }) {}

Worker::~Worker() {
  {
    std::lock_guard<std::mutex> lock(queue_mu_);
    stop_.store(true);
  }
  queue_cv_.notify_all();
  if (blocked_.load()) (*backends_)[0]->wake();
  thread_.join();
}

void Worker::submit(std::vector<Job>&& jobs) {
  if (jobs.empty()) return;
  submitted_.fetch_add(jobs.size());
  {
    std::lock_guard<std::mutex> lock(queue_mu_);
    for (auto& j : jobs) queue_.push_back(std::move(j));
  }
  queue_cv_.notify_one();
  if (blocked_.load()) (*backends_)[0]->wake();
}

void Worker::nudge() {
  {
    std::lock_guard<std::mutex> lock(queue_mu_);
    nudged_ = true;
  }
  queue_cv_.notify_one();
  if (blocked_.load()) (*backends_)[0]->wake();
}

std::string Worker::error() const {
  std::lock_guard<std::mutex> lock(error_mu_);
  return error_;
}

void Worker::fail(const std::string& message) {
  {
    std::lock_guard<std::mutex> lock(error_mu_);
    if (error_.empty()) error_ = message;
  }
  {
    // Under idle_mu_, so a wait_idle() between its check and its sleep sees it.
    std::lock_guard<std::mutex> lock(idle_mu_);
    failed_.store(true);
  }
  idle_cv_.notify_all();
}

bool Worker::wait_idle(std::chrono::nanoseconds timeout) {
  std::unique_lock<std::mutex> lock(idle_mu_);
  return idle_cv_.wait_for(lock, timeout, [this] { return failed_.load() || completed_.load() >= submitted_.load(); });
}

void Worker::enqueue_piece(uint64_t job, OpKind op, const NicWrite& w, bool final_piece) {
  uint64_t id = next_id_++;
  NicWrite piece = w;
  piece.write.context = id;
  inflight_[id] = InFlight{job, op, w.write.peer, final_piece};
  pending_.emplace_back(id, piece);
}

bool Worker::take_new_jobs() {
  std::vector<Job> jobs;
  {
    std::lock_guard<std::mutex> lock(queue_mu_);
    if (queue_.empty()) return false;
    jobs.swap(queue_);
  }
  for (auto& job : jobs) {
    uint64_t id = next_job_++;
    if (job.lead.empty()) {
      enqueue_piece(id, job.op, job.last, true);
      continue;
    }
    splits_[id] = Split{static_cast<int>(job.lead.size()), job.last, job.op};
    for (const auto& piece : job.lead) enqueue_piece(id, job.op, piece, false);
  }
  return true;
}

bool Worker::post_pending() {
  bool progress = false;
  while (!pending_.empty()) {
    auto& [id, piece] = pending_.front();
    bool posted = false;
    try {
      posted = (*backends_)[piece.nic]->post_write(piece.write);
    } catch (const FabricError& e) {
      const InFlight& f = inflight_[id];
      fail(std::string(e.what()) + " [" + op_name(f.op) + " to peer " + std::to_string(f.peer) + "]");
      return progress;
    }
    if (!posted) break;  // queue full: completions first
    pending_.pop_front();
    progress = true;
  }
  return progress;
}

void Worker::piece_done(uint64_t id) {
  auto it = inflight_.find(id);
  if (it == inflight_.end()) return;
  InFlight f = it->second;
  inflight_.erase(it);
  if (f.final_piece) {
    {
      std::lock_guard<std::mutex> lock(idle_mu_);
      completed_.fetch_add(1);
    }
    idle_cv_.notify_all();
    return;
  }
  auto sit = splits_.find(f.job);
  if (sit != splits_.end() && --sit->second.remaining == 0) {
    Split s = sit->second;
    splits_.erase(sit);
    enqueue_piece(f.job, s.op, s.last, true);
  }
}

bool Worker::handle(int nic, const Completion* done, int n) {
  for (int i = 0; i < n; ++i) {
    const Completion& c = done[i];
    if (c.kind == CompletionKind::kArrived) {
      imms_->add(c.imm);
    } else if (c.kind == CompletionKind::kSent) {
      piece_done(c.context);
    } else {
      auto it = inflight_.find(c.context);
      std::string what = (*backends_)[nic]->last_error();
      if (it != inflight_.end())
        what += " [" + std::string(op_name(it->second.op)) + " to peer " + std::to_string(it->second.peer) + "]";
      fail(what);
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
  if (backends_->size() == 1 && nic.can_wait()) {
    // Block on the NIC: an arrival, a new job or a nudge (both wake us) ends it.
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
  // picked up within one), long ones when idle. A new job or a nudge wakes us.
  std::unique_lock<std::mutex> lock(queue_mu_);
  auto slice = expecting ? idle_.sleep : std::chrono::microseconds(block_ms * 1000);
  queue_cv_.wait_for(lock, slice, [this] { return stop_.load() || !queue_.empty() || nudged_; });
  nudged_ = false;
}

void Worker::run() {
  int idle_polls = 0;
  // Stops even with writes in flight (a peer may be gone for good).
  while (!stop_.load(std::memory_order_relaxed)) {
    bool progress = take_new_jobs();
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
    const bool expecting = !pending_.empty() || !inflight_.empty() || imms_->waiters() > 0;
    idle_wait(expecting);
  }
}

}  // namespace moe_a2a::fabric
