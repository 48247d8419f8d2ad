// The interface every NIC backend implements: one endpoint, one completion
// queue, one address vector. The engine owns the backends and calls them from
// its worker thread only (except registration, which is serialised by the
// backend itself).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace moe_a2a::fabric {

using Bytes = std::vector<uint8_t>;

// What a peer needs to write into one registered region through one backend.
struct RemoteKey {
  uint64_t base = 0;  // address of offset 0 (0 where the provider takes offsets)
  uint64_t key = 0;
};

struct LocalMemory {
  void* handle = nullptr;  // the provider's registration object
  void* desc = nullptr;    // local descriptor passed with every write
  RemoteKey remote;
};

// One RMA write, as plain data.
struct WriteDesc {
  int peer = 0;
  const void* src = nullptr;
  size_t len = 0;
  void* desc = nullptr;
  uint64_t remote_addr = 0;
  uint64_t remote_key = 0;
  uint32_t imm = 0;
  bool with_imm = false;
  // Completion only once the data is placed at the target (used for the
  // leading pieces of a write split across NICs).
  bool delivery_complete = false;
  uint64_t context = 0;
};

enum class CompletionKind : uint8_t { kSent, kArrived, kFailed };

struct Completion {
  CompletionKind kind = CompletionKind::kSent;
  uint64_t context = 0;  // kSent, kFailed: the WriteDesc's context
  uint32_t imm = 0;      // kArrived: the immediate data
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual const std::string& provider() const = 0;
  virtual Bytes address() const = 0;
  // One address per rank, index = rank; our own is included.
  virtual void insert_peers(const std::vector<Bytes>& addresses) = 0;
  virtual LocalMemory register_memory(void* ptr, size_t len) = 0;
  virtual void deregister_memory(const LocalMemory& mem) = 0;
  // False when the provider's queue is full: poll, then post again.
  virtual bool post_write(const WriteDesc& w) = 0;
  // Up to `max` completions; a kFailed entry leaves its text in last_error().
  virtual int poll(Completion* out, int max) = 0;
  // Like poll, but blocks until a completion arrives, wake() is called or
  // `timeout_ms` passes. Only where can_wait(); the worker sleeps otherwise.
  virtual bool can_wait() const = 0;
  virtual int wait_poll(Completion* out, int max, int timeout_ms) = 0;
  // Ends a wait_poll in progress; callable from any thread.
  virtual void wake() = 0;
  virtual std::string last_error() const = 0;
};

struct BackendOptions {
  std::string provider;  // "tcp", "shm", "efa", "verbs", or a libfabric name
  int index = 0;         // which NIC of this rank (for error messages)
  // The libfabric domain (device) to open, e.g. "eth0" for tcp or
  // "rdmap79s0-rdm" for efa; empty: the first one the provider lists.
  std::string domain;
};

std::unique_ptr<Backend> open_libfabric(const BackendOptions& opts);

// Provider names that fi_getinfo offers on this machine (for error messages
// and `moe-a2a info`).
std::vector<std::string> libfabric_providers();

// Domain names (devices) that `provider` offers for this backend's endpoints,
// in the order fi_getinfo lists them, each once.
std::vector<std::string> libfabric_domains(const std::string& provider);

}  // namespace moe_a2a::fabric
