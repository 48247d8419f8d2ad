// Counters of arrived immediates. The worker thread adds arrivals; callers
// wait for "n arrivals of immediate X" and consume them. Arrivals before the
// wait are counted, so a fast peer is never missed.
//
// Counts are kept in pieces: a whole write counts num_nics, each piece of a
// write split across the num_nics NICs counts 1 (imm.h), so a wait for n
// writes returns once n * num_nics have landed, in whatever order. A wait
// that covers every write of its tag the peer has posted (as the protocol's
// do) is exact; a wait for fewer than are in flight could be met by pieces of
// a later split write.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <unordered_map>

#include "imm.h"

namespace moe_a2a::fabric {

class ImmCounters {
 public:
  explicit ImmCounters(int num_nics = 1) : per_write_(static_cast<uint64_t>(num_nics < 1 ? 1 : num_nics)) {}

  // One arrival as it came off the wire (piece bit included).
  void add(uint32_t wire_imm) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      counts_[imm_key(wire_imm)] += imm_is_piece(wire_imm) ? 1 : per_write_;
    }
    // Every piece wakes the waiters, also one that completes no write: waking
    // only on whole writes made 1 MiB split writes over loopback tcp take 2 to
    // 5 ms instead of 0.2 ms, for reasons not understood yet.
    cv_.notify_all();
  }

  // Whole writes of `imm` counted and not yet consumed.
  uint64_t peek(uint32_t imm) const {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = counts_.find(imm);
    return it == counts_.end() ? 0 : it->second / per_write_;
  }

  // Drops the count of every immediate that `match`es (a user of a
  // shared engine that starts where a failed one left arrivals behind).
  template <typename Pred>
  void erase_if(Pred&& match) {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = counts_.begin(); it != counts_.end();) it = match(it->first) ? counts_.erase(it) : std::next(it);
  }

  // Waits until `n` writes of `imm` are counted, then consumes them.
  // `failed` is checked on every wake-up so an engine error ends the wait.
  // Returns false when time ran out, with the writes seen in *seen.
  bool wait(uint32_t imm, uint64_t n, std::chrono::nanoseconds timeout, const std::function<void()>& check_failed,
            uint64_t* seen) {
    WaiterScope scope(&waiters_);
    const uint64_t want = n * per_write_;
    auto deadline = std::chrono::steady_clock::now() + timeout;
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      uint64_t& count = counts_[imm];
      if (count >= want) {
        count -= want;
        return true;
      }
      lock.unlock();
      try {
        check_failed();
      } catch (...) {  // a peer that wrote and then left: what we waited for came
        lock.lock();
        if (counts_[imm] < want) throw;
        continue;
      }
      lock.lock();
      if (std::chrono::steady_clock::now() >= deadline) {
        *seen = counts_[imm] / per_write_;
        return false;
      }
      // Short slices so an engine error is noticed without a notification;
      // the count is read again under the lock first, so no arrival is missed.
      cv_.wait_for(lock, kCheckInterval, [&] { return counts_[imm] >= want; });
    }
  }

  // Waits until, for some i < n, `need[i]` writes of `imms[i]` are
  // counted (every piece of a split write in); returns that i without consuming anything, or -1 when time ran
  // out. What a receiver uses to take peers in the order they complete.
  int wait_any(const uint32_t* imms, const uint64_t* need, size_t n, std::chrono::nanoseconds timeout,
               const std::function<void()>& check_failed) {
    WaiterScope scope(&waiters_);
    auto deadline = std::chrono::steady_clock::now() + timeout;
    std::unique_lock<std::mutex> lock(mu_);
    auto first_ready = [&]() -> int {  // under the lock
      for (size_t i = 0; i < n; ++i) {
        auto it = counts_.find(imms[i]);
        if (it != counts_.end() && it->second >= need[i] * per_write_) return static_cast<int>(i);
      }
      return -1;
    };
    for (;;) {
      if (int i = first_ready(); i >= 0) return i;
      lock.unlock();
      try {
        check_failed();
      } catch (...) {  // as in wait()
        lock.lock();
        if (int i = first_ready(); i >= 0) return i;
        throw;
      }
      lock.lock();
      if (std::chrono::steady_clock::now() >= deadline) return -1;
      cv_.wait_for(lock, kCheckInterval);
    }
  }

  // Threads blocked in wait() or wait_any(): while any is, the worker keeps polling
  // instead of sleeping (providers with manual progress move bytes only then).
  int waiters() const { return waiters_.load(std::memory_order_relaxed); }

 private:
  struct WaiterScope {
    explicit WaiterScope(std::atomic<int>* n) : n_(n) { n_->fetch_add(1); }
    ~WaiterScope() { n_->fetch_sub(1); }
    std::atomic<int>* n_;
  };
  static constexpr std::chrono::milliseconds kCheckInterval{5};
  const uint64_t per_write_;
  std::atomic<int> waiters_{0};
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::unordered_map<uint32_t, uint64_t> counts_;  // key: imm_key; value: pieces
};

}  // namespace moe_a2a::fabric
