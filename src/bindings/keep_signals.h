// Signal dispositions kept across a call that may start libfabric or one of
// its providers. libfabric loads providers at its first fi_getinfo, and a
// provider may install handlers when it starts: 1.17's shm provider takes
// SIGINT, SIGTERM, SIGBUS and SIGSEGV at its first endpoint, psm's library
// (linked by Debian's build) a backtrace handler that exits with 1. The
// process's handlers are its user's (docs/process.md, "Signals"): every
// disposition that such a call changed is put back as it was.
#pragma once

#include <signal.h>

namespace moe_a2a::bindings {

class KeepSignals {
 public:
  KeepSignals() {
    for (int s = 1; s < NSIG; ++s) saved_ok_[s] = sigaction(s, nullptr, &saved_[s]) == 0;
  }
  ~KeepSignals() {
    for (int s = 1; s < NSIG; ++s) {
      struct sigaction now {};
      if (!saved_ok_[s] || sigaction(s, nullptr, &now) != 0) continue;
      if (handler(now) != handler(saved_[s]) || now.sa_flags != saved_[s].sa_flags) sigaction(s, &saved_[s], nullptr);
    }
  }
  KeepSignals(const KeepSignals&) = delete;
  KeepSignals& operator=(const KeepSignals&) = delete;

 private:
  static void* handler(const struct sigaction& a) { return reinterpret_cast<void*>(a.sa_handler); }
  struct sigaction saved_[NSIG] {};
  bool saved_ok_[NSIG] {};
};

}  // namespace moe_a2a::bindings
