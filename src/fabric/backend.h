// The interface every NIC backend implements: one endpoint, one completion
// queue, one address vector. The engine owns the backends and calls them from
// its worker thread only (except registration, which is serialised by the
// backend itself). Backends are opened by name through open_backend(); the
// one built is "libfabric". A direct libibverbs RC backend would plug in here
// (docs/transport.md) and is not built: it cannot run on these machines.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace moe_a2a::fabric {

using Bytes = std::vector<uint8_t>;

// Where registered memory lives. kCuda needs a backend that reports
// Capabilities::gpu_memory (libfabric: a provider offering FI_HMEM for CUDA).
enum class MemoryKind : uint8_t { kHost, kCuda };
const char* memory_kind_name(MemoryKind kind);

struct MemorySpec {
  void* ptr = nullptr;
  size_t length = 0;
  MemoryKind kind = MemoryKind::kHost;
  int device = -1;  // the CUDA device of kCuda memory
  const char* name = "region";  // what the region holds, for error messages
};

// What a backend can do, as it reports it once open; the engine and
// `moe-a2a info` read it instead of assuming one transport.
struct Capabilities {
  std::string backend;           // "libfabric"
  std::string provider;          // e.g. "tcp;ofi_rxm"
  std::string device;            // the domain (NIC) opened
  bool gpu_memory = false;       // registers MemoryKind::kCuda
  std::string gpu_memory_why;    // how it registers CUDA memory, or why it cannot
  bool gpu_dmabuf = false;       // CUDA memory is registered through dma-buf (FI_MR_DMABUF)
  bool ordered_writes = false;   // writes to one peer are placed in order (write after write)
  uint64_t max_message_size = 0; // longest single write
  size_t inject_size = 0;        // writes up to this size need no source buffer after posting
  size_t imm_bytes = 0;          // bytes of immediate data a write carries (4 are needed)
  size_t max_in_flight = 0;      // writes posted and not completed, at most (the context pool)
  bool blocking_wait = false;    // wait_poll blocks in the kernel
};

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
  // Completion only once the data is placed at the target (untagged writes,
  // which a later barrier must order).
  bool delivery_complete = false;
  uint64_t context = 0;  // returned with the write's completion
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
  virtual const Capabilities& capabilities() const = 0;
  virtual Bytes address() const = 0;
  // One address per rank, index = rank; our own is included. A connection-
  // oriented backend may connect lazily behind this (docs/transport.md).
  virtual void insert_peers(const std::vector<Bytes>& addresses) = 0;
  // Rank `peer` is a new process now (moe_a2a.rejoin): writes to it go to
  // `address` from here on. The old entry is left unused. Callable while the
  // worker runs (under the same lock as its posts).
  virtual void replace_peer(int peer, const Bytes& address) = 0;
  // Throws, naming what would be needed, for a memory kind it cannot register.
  virtual LocalMemory register_memory(const MemorySpec& mem) = 0;
  virtual void deregister_memory(const LocalMemory& mem) = 0;
  // False when the queue (or the context pool) is full: poll, then post again.
  virtual bool post_write(const WriteDesc& w) = 0;
  // Up to `max` completions; a kFailed entry leaves its text in last_error().
  virtual int poll(Completion* out, int max) = 0;
  // Like poll, but blocks until a completion arrives, wake() is called or
  // `timeout_ms` passes. Only where capabilities().blocking_wait; the worker
  // sleeps otherwise.
  virtual int wait_poll(Completion* out, int max, int timeout_ms) = 0;
  // Ends a wait_poll in progress; callable from any thread.
  virtual void wake() = 0;
  virtual std::string last_error() const = 0;
};

struct BackendOptions {
  std::string backend = "libfabric";  // which implementation (open_backend)
  std::string provider;  // "tcp", "shm", "efa", "verbs", or a libfabric name
  int index = 0;         // which NIC of this rank (for error messages)
  // The device to open: for libfabric a domain, e.g. "eth0" for tcp or
  // "rdmap79s0-rdm" for efa; empty: the first one the provider lists.
  std::string domain;
  // Ask the provider for FI_HMEM (CUDA memory registration). Only engines of
  // CUDA ranks ask: a provider with FI_HMEM checks every buffer's memory type.
  bool gpu_memory = false;
};

// Opens the named backend; an unknown or unbuilt name is an error that lists
// the ones built.
std::unique_ptr<Backend> open_backend(const BackendOptions& opts);
// Names open_backend accepts.
std::vector<std::string> backend_names();

std::unique_ptr<Backend> open_libfabric(const BackendOptions& opts);

// Provider names that fi_getinfo offers on this machine (for error messages
// and `moe-a2a info`).
std::vector<std::string> libfabric_providers();

// Domain names (devices) that `provider` offers for this backend's endpoints,
// in the order fi_getinfo lists them, each once.
std::vector<std::string> libfabric_domains(const std::string& provider);

}  // namespace moe_a2a::fabric
