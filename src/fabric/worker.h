// The engine's worker thread: it alone posts writes and polls the NICs'
// completion queues. Callers hand it jobs through a queue and wait on
// counters. When idle it spins briefly, then yields, then blocks on the NIC's
// completion queue (or sleeps in short slices where the NIC cannot block),
// so several ranks can share a couple of cores.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "backend.h"
#include "imm_counters.h"

namespace moe_a2a::fabric {

enum class OpKind : uint8_t { kWrite, kScatter, kBarrier };
const char* op_name(OpKind op);

struct NicWrite {
  int nic = 0;
  WriteDesc write;
};

// One logical write: leading pieces (a write split across NICs) are posted at
// once with delivery completion; the final piece, which carries the
// immediate, only once they have landed, so the receiver never sees the
// immediate before all the bytes.
struct Job {
  OpKind op = OpKind::kWrite;
  std::vector<NicWrite> lead;
  NicWrite last;
};

struct IdlePolicy {
  int spin_polls = 256;
  int yield_polls = 1024;
  std::chrono::microseconds sleep{50};  // where the NIC cannot block
  // Longest sleep (blocking on the NIC, or between polls where it cannot
  // block) with nothing in flight and no caller waiting. submit() and nudge()
  // end it early; arrivals nobody waits for yet are picked up within it.
  int block_ms = 5;
  int busy_block_ms = 1;  // longest blocking wait on the NIC while bytes are in flight or a caller waits
};

class Worker {
 public:
  Worker(std::vector<std::unique_ptr<Backend>>* backends, ImmCounters* imms, IdlePolicy idle = {});
  ~Worker();
  Worker(const Worker&) = delete;
  Worker& operator=(const Worker&) = delete;

  void submit(std::vector<Job>&& jobs);
  // Ends an idle sleep at once: a caller is about to wait for arrivals, which
  // providers with manual progress deliver only while the worker polls.
  void nudge();
  uint64_t submitted() const { return submitted_.load(); }
  uint64_t completed() const { return completed_.load(); }
  // Empty while healthy; the first failure's message otherwise (sticky).
  std::string error() const;
  bool failed() const { return failed_.load(); }
  // Waits until every submitted job completed; false on timeout.
  bool wait_idle(std::chrono::nanoseconds timeout);

 private:
  struct InFlight {
    uint64_t job = 0;
    OpKind op = OpKind::kWrite;
    int peer = 0;
    bool final_piece = false;
  };
  struct Split {
    int remaining = 0;
    NicWrite last;
    OpKind op = OpKind::kWrite;
  };

  void run();
  bool take_new_jobs();
  bool post_pending();
  bool poll_all();
  bool handle(int nic, const Completion* done, int n);
  void idle_wait(bool expecting);
  void enqueue_piece(uint64_t job, OpKind op, const NicWrite& w, bool final_piece);
  void fail(const std::string& message);
  void piece_done(uint64_t id);

  std::vector<std::unique_ptr<Backend>>* backends_;
  ImmCounters* imms_;
  IdlePolicy idle_;

  std::mutex queue_mu_;
  std::condition_variable queue_cv_;
  std::vector<Job> queue_;
  std::atomic<bool> stop_{false};
  std::atomic<bool> blocked_{false};  // the worker sits in a NIC's wait_poll
  bool nudged_ = false;               // under queue_mu_: nudge() since the last idle sleep

  // Owned by the worker thread.
  std::deque<std::pair<uint64_t, NicWrite>> pending_;
  std::unordered_map<uint64_t, InFlight> inflight_;
  std::unordered_map<uint64_t, Split> splits_;
  uint64_t next_id_ = 1;
  uint64_t next_job_ = 1;

  std::atomic<uint64_t> submitted_{0};
  std::atomic<uint64_t> completed_{0};
  std::atomic<bool> failed_{false};
  mutable std::mutex error_mu_;
  std::string error_;
  std::mutex idle_mu_;
  std::condition_variable idle_cv_;
  std::thread thread_;
};

}  // namespace moe_a2a::fabric
