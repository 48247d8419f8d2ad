// Waiting on a 64-bit sequence number written by another thread, process or
// GPU: spin briefly, then yield, then sleep in short slices, then (after a few
// milliseconds) in longer ones, with a deadline. Several ranks share few
// cores, so an idle waiter must get out of the way: 20 us slices alone cost an
// idle proxy a quarter of a core.
#pragma once

#include <sched.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <thread>

namespace moe_a2a::a2a {

// Signals while a caller waits (docs/process.md, "Signals"): the Python
// bindings install a check that, on the thread that runs Python's signal
// handlers, runs them and throws what they raise (KeyboardInterrupt for
// Ctrl-C), so a blocked call ends as a failed call. Other threads (the proxy,
// the fabric worker) and a core used without Python never see it.
using InterruptCheck = void (*)();
inline std::atomic<InterruptCheck> interrupt_check{nullptr};
// How often a wait looks: the check takes the GIL, so a wait shorter than
// this never does.
constexpr std::chrono::milliseconds kInterruptInterval{50};

inline void check_interrupt() {
  if (InterruptCheck check = interrupt_check.load(std::memory_order_acquire)) check();
}

struct Backoff {
  static constexpr int kSpins = 128;
  static constexpr int kYields = 512;
  static constexpr std::chrono::microseconds kSleep{20};
  static constexpr int kShortSleeps = kYields + 256;  // about 5 ms of short slices
  static constexpr std::chrono::microseconds kLongSleep{1000};
  int round = 0;
  std::chrono::steady_clock::time_point next_interrupt{};  // the first look: kInterruptInterval into the wait
  void pause() {
    ++round;
    if (round < kSpins) return;
    if (round >= kYields || (round & 63) == 0) poll_interrupt();
    if (round < kYields) {
      sched_yield();
      return;
    }
    std::this_thread::sleep_for(round < kShortSleeps ? kSleep : kLongSleep);
  }
  void poll_interrupt() {
    const auto now = std::chrono::steady_clock::now();
    if (next_interrupt == std::chrono::steady_clock::time_point{}) {
      next_interrupt = now + kInterruptInterval;
    } else if (now >= next_interrupt) {
      next_interrupt = now + kInterruptInterval;
      check_interrupt();
    }
  }
};

// True once `*seq >= target`; false at the deadline. `on_idle` runs between
// polls (it may throw to abort the wait, unless `*seq` reached `target` meanwhile).
template <typename OnIdle>
bool wait_at_least(const std::atomic<uint64_t>* seq, uint64_t target, std::chrono::steady_clock::time_point deadline,
                   OnIdle&& on_idle) {
  Backoff backoff;
  while (seq->load(std::memory_order_acquire) < target) {
    if ((backoff.round & 63) == 0) {
      try {
        on_idle();
      } catch (...) {  // a peer that raised `seq` and then left: what we waited for came
        if (seq->load(std::memory_order_acquire) >= target) return true;
        throw;
      }
      if (std::chrono::steady_clock::now() >= deadline) return false;
    }
    backoff.pause();
  }
  return true;
}

inline std::chrono::steady_clock::time_point deadline_after(double seconds) {
  return std::chrono::steady_clock::now() + std::chrono::nanoseconds(static_cast<int64_t>(seconds * 1e9));
}

}  // namespace moe_a2a::a2a
