// The engine's worker thread: it alone posts writes and polls the NICs'
// completion queues. Callers hand it writes through a queue and wait on
// counters. When idle it spins briefly, then yields, then blocks on the NIC's
// completion queue (or sleeps in short slices where the NIC cannot block),
// so several ranks can share a couple of cores.
//
// Nothing here allocates per write once the queues have reached their size
// (reserve() at group registration): a write is a plain NicWrite copied into
// a vector that keeps its capacity, and its completion carries (op, peer) in
// its context instead of an entry in a table.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "backend.h"
#include "imm_counters.h"

namespace moe_a2a::fabric {

enum class OpKind : uint8_t { kWrite, kScatter, kBarrier };
const char* op_name(OpKind op);

// One posted write: a whole write, or one piece of a write split across NICs
// (each piece carries the immediate and completes on its own).
struct NicWrite {
  int nic = 0;
  OpKind op = OpKind::kWrite;
  WriteDesc write;
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

  // Writes handed over together, under the queue's lock; the worker is woken
  // when the batch closes. Validate before opening one: nothing is undone.
  class Batch {
   public:
    explicit Batch(Worker* w);
    ~Batch();
    Batch(const Batch&) = delete;
    Batch& operator=(const Batch&) = delete;
    void add(const NicWrite& w);

   private:
    Worker* w_;
    std::unique_lock<std::mutex> lock_;
    size_t added_ = 0;
  };

  // Room for `writes` queued writes without growing (called at registration).
  void reserve(size_t writes);
  // Ends an idle sleep at once: a caller is about to wait for arrivals, which
  // providers with manual progress deliver only while the worker polls.
  void nudge();
  // Writes (pieces) handed over, and those completed.
  uint64_t submitted() const { return submitted_.load(); }
  uint64_t completed() const { return completed_.load(); }
  // Immediates that arrived on each NIC.
  uint64_t arrivals(int nic) const { return arrivals_[nic].load(std::memory_order_relaxed); }
  // Times a hot-path queue had to grow (a heap allocation); stays 0 once reserved.
  uint64_t allocations() const { return allocations_.load(std::memory_order_relaxed); }
  // Empty while healthy; the first failure's message otherwise (sticky).
  std::string error() const;
  bool failed() const { return failed_.load(); }
  // `peer` is gone and masked by every survivor (moe_a2a.masking): its writes'
  // failures so far no longer fail the worker (they count as completed), its
  // writes posted and not completed count as completed now (a provider may
  // never complete a write to a dead process: shm), its later writes are not
  // posted (counted as completed), and the worker is healthy again unless
  // another peer failed. Never blocks.
  void forgive(int peer);
  // `peer`'s process was replaced: its writes fail the worker again.
  void unforgive(int peer);
  // Waits until every submitted write completed; false on timeout.
  bool wait_idle(std::chrono::nanoseconds timeout);

 private:
  void run();
  bool take_new_writes();
  bool post_pending();
  bool poll_all();
  bool handle(int nic, const Completion* done, int n);
  void idle_wait(bool expecting);
  // `peer`: the failed write's (-1: none, such as a failed poll); failures of
  // a forgiven peer count as completed instead.
  void fail(const std::string& message, int peer = -1);
  void write_done();
  void wake_locked_out();

  std::vector<std::unique_ptr<Backend>>* backends_;
  ImmCounters* imms_;
  IdlePolicy idle_;

  std::mutex queue_mu_;
  std::condition_variable queue_cv_;
  std::vector<NicWrite> queue_;  // under queue_mu_
  std::atomic<size_t> reserve_{0};
  std::atomic<bool> stop_{false};
  std::atomic<bool> blocked_{false};  // the worker sits in a NIC's wait_poll
  bool nudged_ = false;               // under queue_mu_: nudge() since the last idle sleep

  // Owned by the worker thread: writes taken from the queue, posted from head_ on.
  std::vector<NicWrite> pending_;
  size_t head_ = 0;

  std::atomic<uint64_t> submitted_{0};
  std::atomic<uint64_t> completed_{0};
  std::atomic<uint64_t> allocations_{0};
  std::unique_ptr<std::atomic<uint64_t>[]> arrivals_;
  // Per peer (index = rank): writes posted and not completed. forgive() takes
  // them as completed and zeroes the count; a completion that finds it at 0
  // was taken so and counts nothing (settle).
  std::unique_ptr<std::atomic<int64_t>[]> in_flight_;
  bool settle(int peer);
  std::atomic<bool> failed_{false};
  mutable std::mutex error_mu_;
  std::string error_;
  // Under error_mu_: each failure's peer (-1: none) and message, in order; the
  // forgiven peers; the writes of forgiven peers that failed before forgive().
  std::vector<std::pair<int, std::string>> failures_;
  std::vector<int> forgiven_;
  std::atomic<bool> any_forgiven_{false};  // the hot path takes error_mu_ only once a peer is forgiven
  bool is_forgiven(int peer) const;
  std::mutex idle_mu_;
  std::condition_variable idle_cv_;
  std::thread thread_;
};

}  // namespace moe_a2a::fabric
