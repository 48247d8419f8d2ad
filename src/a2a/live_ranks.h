// Masked ranks and the survivors' agreement on them (docs/reliability.md,
// "Mask and continue"). With Config.on_peer_loss="mask", a rank whose process
// is gone is masked: no routing row, rows, flag or barrier is awaited from it
// or sent to it. The survivors agree on who is masked without the launcher's
// communicator (whose collectives would wait for the dead rank): each one
// publishes a proposal in its own workspace, which every survivor of the node
// reads from its mapping, and they repeat rounds until one in which every
// proposal read is the same. One slot per rank, one writer, read in place by
// everyone: a rank that dies before or after writing its proposal of a round
// is seen alike by every reader (its slot can no longer change).
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <string>
#include <thread>
#include <vector>

#include "config.h"
#include "fabric/error.h"
#include "layout.h"
#include "row_tail.h"  // kMaskedExpert

namespace moe_a2a::a2a {

// index = rank: 1 where that rank is masked; empty: nobody is.
using Masked = std::vector<uint8_t>;
inline bool is_masked(const Masked& m, int r) { return !m.empty() && m[static_cast<size_t>(r)] != 0; }

// A rank's proposal: `seq` is 2 * round while the proposal of `round` is
// whole, odd while it is being written (readers retry).
struct VoteSlot {
  std::atomic<uint64_t> seq;
  uint64_t epoch;  // the dispatches the proposer had started
  // then a bit per rank (ceil(N / 64) words): the ranks it holds gone
  uint64_t* dead() { return reinterpret_cast<uint64_t*>(this + 1); }
  const uint64_t* dead() const { return reinterpret_cast<const uint64_t*>(this + 1); }
};

inline VoteSlot* vote_slot(uint8_t* workspace, const Layout& l) {
  return reinterpret_cast<VoteSlot*>(workspace + l.votes);
}

struct Agreement {
  Masked dead;          // index = rank
  uint64_t epoch = 0;   // the most dispatches any survivor had started: every survivor resumes after it
  uint64_t round = 0;   // the deciding round; the next agreement starts after it
};

// `node`: every rank's workspace as mapped here (index = rank; all on this
// node). `dead`: what this rank already holds gone. `gone(r)`: whether rank
// r's process no longer exists. Every survivor returns the same Agreement, or
// throws TimeoutError after `timeout_s` (a survivor that never joins).
template <typename Gone>
Agreement agree_on_live(const A2AConfig& c, const Layout& l, const std::vector<uint8_t*>& node, Masked dead,
                        uint64_t epoch, uint64_t first_round, double timeout_s, Gone&& gone) {
  const int n = c.world;
  const size_t words = (static_cast<size_t>(n) + 63) / 64;
  dead.resize(n, 0);
  auto bits = [&](const Masked& m) {
    std::vector<uint64_t> w(words, 0);
    for (int r = 0; r < n; ++r)
      if (m[r]) w[r / 64] |= 1ull << (r % 64);
    return w;
  };
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::nanoseconds(static_cast<int64_t>(timeout_s * 1e9));
  VoteSlot* own = vote_slot(node[c.rank], l);
  for (uint64_t round = first_round;; ++round) {
    const std::vector<uint64_t> mine = bits(dead);
    own->seq.store(2 * round + 1, std::memory_order_relaxed);
    std::atomic_thread_fence(std::memory_order_release);
    own->epoch = epoch;
    for (size_t w = 0; w < words; ++w) own->dead()[w] = mine[w];
    own->seq.store(2 * round, std::memory_order_release);
    Masked merged = dead;
    bool same = true;
    uint64_t most = epoch;
    for (int j = 0; j < n; ++j) {
      if (j == c.rank || dead[j]) continue;
      const VoteSlot* slot = vote_slot(node[j], l);
      std::vector<uint64_t> theirs(words);
      uint64_t their_epoch = 0, seq = 0;
      bool died = false;
      for (int spins = 0;; ++spins) {
        seq = slot->seq.load(std::memory_order_acquire);
        if (seq % 2 == 0 && seq / 2 >= round) {
          their_epoch = slot->epoch;
          for (size_t w = 0; w < words; ++w) theirs[w] = slot->dead()[w];
          std::atomic_thread_fence(std::memory_order_acquire);
          if (slot->seq.load(std::memory_order_relaxed) == seq) break;  // not torn
          continue;
        }
        if (died) break;  // gone, and its slot final: no proposal of this round
        if (gone(j)) {
          died = true;  // look once more: it may have written before it died
          continue;
        }
        if (std::chrono::steady_clock::now() >= deadline)
          throw fabric::TimeoutError("rank " + std::to_string(c.rank) + ": timed out after " +
                                     std::to_string(timeout_s) + " s agreeing on the live ranks: rank " +
                                     std::to_string(j) + " (alive) never proposed round " + std::to_string(round));
        if (spins > 64) std::this_thread::sleep_for(std::chrono::microseconds(200));
      }
      if (died && !(seq % 2 == 0 && seq / 2 >= round)) {
        merged[j] = 1;
        same = false;
        continue;
      }
      if (seq / 2 > round) same = false;  // it moved on: it read a proposal unlike its own
      for (int r = 0; r < n; ++r)
        if ((theirs[r / 64] >> (r % 64)) & 1) merged[r] = 1;
      if (theirs != mine) same = false;
      most = std::max(most, their_epoch);
    }
    if (same) return Agreement{dead, most, round};
    dead = merged;
  }
}

}  // namespace moe_a2a::a2a
