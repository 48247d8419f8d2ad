// What ends a wait on peers before its timeout: a peer that announced a
// failure (its abort record in our workspace, layout.h), a peer process on
// this host that no longer exists, or a peer on another host whose control
// connection the engine saw close (ProxyEngine::peer_gone). The proxy and the compute side each hold
// one and call check() from their waits; it looks at most every kInterval.
//
// A peer on another host whose script ends right after its last call closes its control connection
// at once, while what it wrote may still be on its way in its data connections, which are others.
// It says goodbye first (ProxyEngine::peer_left); such a peer is missing only once its part of our
// phase has not landed and nothing of it has landed for kGoneGrace. A peer on another node of this
// host (virtual nodes) is watched by its pid, which cannot tell an end from a kill: in a combine,
// either gets the same grace. Any other end is a loss at once.
#pragma once

#include <signal.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <chrono>
#include <cstring>
#include <string>
#include <vector>

#include "config.h"
#include "errors.h"
#include "fabric/proxy_engine.h"
#include "fabric/error.h"
#include "layout.h"
#include "live_ranks.h"
#include "signals.h"

namespace moe_a2a::a2a {

// Where a rank is in its call sequence: 2 * epoch for the dispatch of an
// epoch, 2 * epoch + 1 for its combine. A failed peer that completed our
// current phase sent us all of its part, so that phase still completes; its
// failure stops our next one (ranks agree on which calls succeeded).
inline uint64_t dispatch_phase(uint64_t epoch) { return 2 * epoch; }
inline uint64_t combine_phase(uint64_t epoch) { return 2 * epoch + 1; }

struct PeerWatch {
  static constexpr std::chrono::milliseconds kInterval{20};
  static constexpr std::chrono::milliseconds kPidInterval{100};
  // How long a remote peer that left may go without landing a slice of its part before it is missing:
  // what it wrote before it exited still drains from its socket (4 MB at most by default on Linux:
  // 32 ms at 1 Gbit/s), and one segment lost on the way costs TCP's minimum retransmission timeout,
  // 200 ms.
  static constexpr std::chrono::milliseconds kGoneGrace{250};

  A2AConfig cfg;
  Layout layout;
  uint8_t* workspace = nullptr;
  fabric::ProxyEngine* engine = nullptr;  // null when no peer is remote
  std::vector<int> remote_peers;
  std::vector<int> pids;  // index = rank: its pid where it runs on this host, else 0
  Masked masked;          // ranks nobody waits for any more (live_ranks.h)
  // Abort arrivals already counted when we started (a failed instance that
  // used our tag slot before us); only later ones are news.
  std::vector<uint64_t> seen_aborts;
  std::chrono::steady_clock::time_point next{};
  std::chrono::steady_clock::time_point next_pids{};
  uint64_t phase = 0;  // the phase our waits are in (its owner sets it as each phase starts)
  // The last phase in which every remote peer's part has landed (its owner sets it once its proxy
  // says so): a remote peer gone since is not missing from that phase.
  uint64_t landed = 0;
  // The proxy's words for each remote sender (signals.h): its whole part of a phase landed, and the
  // slices of it so far. Null pointers where there is no proxy.
  PeerSignals peers{};
  struct Gone {  // a remote peer gone (draining) while its part of `phase` had not landed
    uint64_t phase = 0;
    uint64_t progress = 0;  // its slice words then
    std::chrono::steady_clock::time_point since{};  // first seen gone in `phase`, or its last slice since
  };
  std::vector<Gone> gone_remote;  // index: as remote_peers

  PeerWatch() = default;
  PeerWatch(const A2AConfig& c, const Layout& l, uint8_t* ws, fabric::ProxyEngine* e, std::vector<int> remotes,
            std::vector<int> peer_pids, Masked m = {}, PeerSignals p = {})
      : cfg(c),
        layout(l),
        workspace(ws),
        engine(e),
        remote_peers(std::move(remotes)),
        pids(std::move(peer_pids)),
        masked(std::move(m)),
        peers(p),
        gone_remote(remote_peers.size()) {
    for (int s : remote_peers) seen_aborts.push_back(engine->imm_count(abort_tag(), s));
  }

  uint32_t abort_tag() const { return wire_tag(cfg.instance, kTagAbort); }

  // Throws PeerFailedError for an announced failure, FabricError for a dead peer.
  // `force`: look now, not at the next interval (to explain an error at hand).
  void check(bool force = false) {
    auto now = std::chrono::steady_clock::now();
    if (workspace == nullptr || (now < next && !force)) return;
    next = now + kInterval;
    for (int s = 0; s < cfg.world; ++s) {
      if (s == cfg.rank || !cfg.same_node(s) || is_masked(masked, s)) continue;
      const AbortRecord* rec = abort_at(workspace, layout, s);
      if (rec->state.load(std::memory_order_acquire) != 0 && rec->done < phase) announced(s, rec);
    }
    for (size_t i = 0; i < remote_peers.size(); ++i) {
      int s = remote_peers[i];
      // The immediate follows the record's bytes, so the text is whole once it counts.
      const uint64_t count = engine->imm_count(abort_tag(), s);
      if (count <= seen_aborts[i]) continue;
      const AbortRecord* rec = abort_at(workspace, layout, s);
      if (rec->state.load(std::memory_order_acquire) == 0) {
        seen_aborts[i] = count;  // a stale one: its bytes went to an old region
        continue;
      }
      if (rec->done < phase) announced(s, rec);  // else news for our next phase: look again then
    }
    if (now < next_pids && !force) return;
    next_pids = now + kPidInterval;
    for (int s = 0; s < static_cast<int>(pids.size()); ++s) {
      if (s == cfg.rank || pids[s] <= 0 || is_masked(masked, s) || !gone(pids[s]) || delivered(s)) continue;
      // One on another node of this host (virtual nodes) that ended its job after its last call:
      // its part of our combine may still drain from its data connections. Its pid cannot tell
      // that from a kill, so a combine gives either the grace of a peer that left.
      if (!cfg.same_node(s) && !force && phase != dispatch_phase(phase / 2) && draining(s, now)) continue;
      throw fabric::FabricError("rank " + std::to_string(cfg.rank) + ": peer " + std::to_string(s) + " (pid " +
                                std::to_string(pids[s]) + " on this host) is gone: it exited or was killed");
    }
    // Peers on other hosts: the engine's control connection to each (engine.h, watch_peers; none
    // for a peer on this host, which its pid covers).
    for (size_t i = 0; i < remote_peers.size(); ++i) {
      const int s = remote_peers[i];
      if (is_masked(masked, s) || !engine->peer_gone(s) || delivered(s)) continue;
      // A peer that left (its script ended, its writes on their way) is given them to land.
      const bool left = engine->peer_left(s);
      if (left && !force && draining(s, now)) continue;
      throw fabric::FabricError("rank " + std::to_string(cfg.rank) + ": peer " + std::to_string(s) +
                                " (on another host) is gone: its control connection closed, so its process " +
                                (left ? "ended, without all of its part of this call" : "exited or was killed"));
    }
  }

  // Whether peer s gave us its whole part of our phase before it went. Ranks finish a job at
  // different times: one that ended its last call and exited has not failed the combine a slower
  // peer is still in; only that peer's next call misses it. A node peer's combine flag for us
  // follows its staged outputs, the last thing we read from it in a combine. In a dispatch, gone
  // is gone, wherever the peer ran: no peer ends its job inside a dispatch (its combine needs
  // ours), and a live peer whose own part depends on the gone one's (rows it forwards, or its
  // call failing on the loss) never sends us the rest, so a wait that excused the gone peer for
  // its own part having landed would wait out its timeout on the live one.
  bool delivered(int s) const {
    if (phase == 0 || phase == dispatch_phase(phase / 2)) return false;
    if (!cfg.same_node(s)) return landed >= phase || part_landed(s);
    return flag_at(workspace, layout, s, kFlagCombine)->load(std::memory_order_acquire) >= phase / 2;
  }

  // No such process, or a zombie that its parent has not reaped yet (a
  // launcher that polls its children every few seconds).
  static bool gone(int pid) {
    if (kill(pid, 0) != 0) return errno == ESRCH;
    char path[64], buf[256];
    snprintf(path, sizeof(path), "/proc/%d/stat", pid);
    FILE* f = fopen(path, "r");
    if (f == nullptr) return false;
    size_t n = fread(buf, 1, sizeof(buf) - 1, f);
    fclose(f);
    buf[n] = '\0';
    const char* state = strrchr(buf, ')');  // the name may hold spaces and parentheses
    return state != nullptr && state[1] == ' ' && (state[2] == 'Z' || state[2] == 'X');
  }

 private:
  // Whether remote sender s's whole part of our phase has landed, by the proxy's word for it.
  bool part_landed(int s) const {
    if (peers.landed == nullptr || phase == 0) return false;
    const Seq* words = phase == dispatch_phase(phase / 2) ? peers.landed : peers.combine_landed;
    return words[s].get() >= phase / 2;
  }

  // Whether remote sender s, gone with its part of our phase not landed, may still be landing it:
  // within kGoneGrace of first being seen gone in this phase, or of the last slice of it landing.
  bool draining(int s, std::chrono::steady_clock::time_point now) {
    const auto at = std::find(remote_peers.begin(), remote_peers.end(), s);
    if (at == remote_peers.end()) return false;
    Gone& g = gone_remote[static_cast<size_t>(at - remote_peers.begin())];
    const uint64_t progress = slices_landed(s);
    if (g.phase != phase || g.progress != progress || g.since == std::chrono::steady_clock::time_point{}) {
      g = {phase, progress, now};
      return true;
    }
    return now - g.since < kGoneGrace;
  }

  uint64_t slices_landed(int s) const {
    if (peers.slices_landed == nullptr) return 0;
    return peers.slices_landed[s].get() + peers.combine_slices_landed[s].get();
  }

  [[noreturn]] void announced(int s, const AbortRecord* rec) const {
    std::string text(rec->text, strnlen(rec->text, sizeof(rec->text)));
    throw PeerFailedError("rank " + std::to_string(cfg.rank) + ": peer " + std::to_string(s) +
                          " failed and stopped this AllToAll: " + text);
  }
};

// Writes `text` as rank cfg.rank's abort record into `dst` (a workspace).
// `done`: the last phase this rank completed (its stamp; 0 for none).
inline void write_abort_record(uint8_t* dst, const Layout& l, int rank, const std::string& text, uint64_t done) {
  AbortRecord* rec = abort_at(dst, l, rank);
  size_t n = std::min(text.size(), sizeof(rec->text) - 1);
  std::memcpy(rec->text, text.data(), n);
  rec->text[n] = '\0';
  rec->done = done;
  rec->state.store(1, std::memory_order_release);
}

// Our record in our own workspace (the source of the fabric writes that carry
// it to remote peers) and in every same-node peer's.
inline void announce_on_node(const A2AConfig& c, const Layout& l, uint8_t* self,
                             const std::vector<uint8_t*>& node_workspaces, const std::string& text, uint64_t done) {
  write_abort_record(self, l, c.rank, text, done);
  for (int r = 0; r < c.world && r < static_cast<int>(node_workspaces.size()); ++r)
    if (r != c.rank && c.same_node(r) && node_workspaces[r] != nullptr)
      write_abort_record(node_workspaces[r], l, c.rank, text, done);
}

}  // namespace moe_a2a::a2a
