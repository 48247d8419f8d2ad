// Backend over libfabric's reliable datagram endpoints (FI_EP_RDM): efa, the
// tcp and verbs providers under ofi_rxm, and shm. One write is one
// fi_writemsg; immediates travel as remote CQ data.
#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_rma.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <mutex>
#include <random>
#include <set>
#include <sstream>

#include <unistd.h>

#include "backend.h"
#include "error.h"
#include "hmem.h"

namespace moe_a2a::fabric {
namespace {

constexpr uint32_t kFabricVersion = FI_VERSION(1, 17);
// dma-buf registration (FI_MR_DMABUF) is part of the 1.20 API; asked for only
// by engines that register CUDA memory, with headers that know it.
#ifdef FI_MR_DMABUF
constexpr uint32_t kHmemVersion = FI_VERSION(1, 20);
#else
constexpr uint32_t kHmemVersion = kFabricVersion;
#endif
constexpr size_t kImmBytes = sizeof(uint32_t);
constexpr size_t kCqDepth = 4096;
// Keys we choose ourselves where the provider does not (mr_mode without
// FI_MR_PROV_KEY): random, since a key is all a process that reaches the
// listener needs to write into the region (counting 1, 2, ... gave them away).
uint64_t random_key(size_t key_bytes) {
  static std::mutex mu;
  static std::random_device device;  // the kernel's entropy (getrandom)
  std::lock_guard<std::mutex> lock(mu);
  uint64_t key = (static_cast<uint64_t>(device()) << 32) | device();
  if (key_bytes > 0 && key_bytes < sizeof(key)) key &= (uint64_t{1} << (8 * key_bytes)) - 1;
  return key;
}

// shm names an endpoint's /dev/shm file `<pid>:<uid>:<n>` and refuses to enable
// it when that file exists. A rank killed by SIGKILL leaves its file behind, and
// a later process given the same pid (pid_max can be 32768) could then open no
// shm endpoint: ours get a random middle part instead. The pid stays first, so
// `moe-a2a cleanup` still knows whose file it is.
std::string shm_endpoint_name() {
  static std::mutex mu;
  static const uint32_t nonce = static_cast<uint32_t>(random_key(4) & 0x7fffffff);
  static uint32_t next = 0;
  std::lock_guard<std::mutex> lock(mu);
  return std::to_string(getpid()) + ":" + std::to_string(nonce) + ":" + std::to_string(next++);
}

std::string fi_message(int rc) { return std::string(fi_strerror(-rc)) + " (" + std::to_string(rc) + ")"; }

// Names users type, mapped to libfabric's provider strings.
std::string libfabric_name(const std::string& provider) {
  if (provider == "tcp") return "tcp;ofi_rxm";
  if (provider == "verbs") return "verbs;ofi_rxm";
  return provider;
}

struct InfoDeleter {
  void operator()(fi_info* p) const { fi_freeinfo(p); }
};
using InfoPtr = std::unique_ptr<fi_info, InfoDeleter>;

// Per-write context: providers in FI_CONTEXT/FI_CONTEXT2 mode own the first
// bytes while the write is in flight. Taken from a pool sized when the
// backend opens, so posting a write allocates nothing.
struct WriteContext {
  fi_context2 fi;
  uint64_t id;
};

std::string what_gpu_registration_needs(const std::string& why) {
  return "registering CUDA device memory is not possible here: " + why +
         "; it needs FI_HMEM (a libfabric built with CUDA support, from the EFA installer or Spack's "
         "libfabric +cuda, and a provider that offers it: shm, efa or verbs; tcp has none), or stage through "
         "pinned host memory instead (MOE_A2A_GPU_DIRECT=0)";
}

template <typename T>
void close_fid(T*& obj) {
  if (obj != nullptr) fi_close(&obj->fid);
  obj = nullptr;
}

class LibfabricBackend final : public Backend {
 public:
  explicit LibfabricBackend(const BackendOptions& opts)
      : provider_(opts.provider), index_(opts.index), domain_name_(opts.domain) {
    info_ = find_info(opts.gpu_memory);
    caps_.backend = "libfabric";
    caps_.provider = info_->fabric_attr->prov_name != nullptr ? info_->fabric_attr->prov_name : provider_;
    caps_.device = info_->domain_attr->name != nullptr ? info_->domain_attr->name : "";
    describe_hmem(opts.gpu_memory);
    caps_.ordered_writes = (info_->tx_attr->msg_order & FI_ORDER_WAW) != 0;
    caps_.max_message_size = info_->ep_attr->max_msg_size;
    caps_.inject_size = info_->tx_attr->inject_size;
    caps_.imm_bytes = info_->domain_attr->cq_data_size;
    // Never more in flight than the completion queue holds, nor than the provider queues.
    caps_.max_in_flight = std::min<size_t>(kCqDepth, info_->tx_attr->size > 0 ? info_->tx_attr->size : kCqDepth);
    pool_.resize(caps_.max_in_flight);
    free_.reserve(caps_.max_in_flight);
    for (size_t i = caps_.max_in_flight; i-- > 0;) free_.push_back(static_cast<uint32_t>(i));
    mr_mode_ = info_->domain_attr->mr_mode;
    mr_key_size_ = info_->domain_attr->mr_key_size;
    check(fi_fabric(info_->fabric_attr, &fabric_, nullptr), "fi_fabric");
    check(fi_domain(fabric_, info_.get(), &domain_, nullptr), "fi_domain");
    fi_cq_attr cq_attr{};
    cq_attr.format = FI_CQ_FORMAT_DATA;
    cq_attr.size = kCqDepth;
    // A file descriptor lets an idle worker sleep in the kernel until something
    // arrives. Only that: FI_WAIT_UNSPEC lets shm pick FI_WAIT_YIELD, whose
    // fi_cq_sread spins in sched_yield (a full core per idle rank). Providers
    // without FI_WAIT_FD are polled, the worker sleeping between polls.
    cq_attr.wait_obj = FI_WAIT_FD;
    if (!thread_safe_ || fi_cq_open(domain_, &cq_attr, &cq_, nullptr) != 0) {
      cq_attr.wait_obj = FI_WAIT_NONE;
      check(fi_cq_open(domain_, &cq_attr, &cq_, nullptr), "fi_cq_open");
    } else {
      can_wait_ = true;
    }
    caps_.blocking_wait = can_wait_;
    fi_av_attr av_attr{};
    av_attr.type = FI_AV_TABLE;
    check(fi_av_open(domain_, &av_attr, &av_, nullptr), "fi_av_open");
    check(fi_endpoint(domain_, info_.get(), &ep_, nullptr), "fi_endpoint");
    if (caps_.provider == "shm") {
      std::string name = shm_endpoint_name();
      check(fi_setname(&ep_->fid, name.data(), name.size() + 1), "fi_setname");
    }
    check(fi_ep_bind(ep_, &cq_->fid, FI_TRANSMIT | FI_RECV), "fi_ep_bind(cq)");
    check(fi_ep_bind(ep_, &av_->fid, 0), "fi_ep_bind(av)");
    check(fi_enable(ep_), "fi_enable");
  }

  ~LibfabricBackend() override {
    close_fid(ep_);
    close_fid(av_);
    close_fid(cq_);
    close_fid(domain_);
    close_fid(fabric_);
  }

  const Capabilities& capabilities() const override { return caps_; }

  Bytes address() const override {
    Bytes addr(256);
    size_t len = addr.size();
    int rc = fi_getname(&ep_->fid, addr.data(), &len);
    if (rc == -FI_ETOOSMALL) {
      addr.resize(len);
      rc = fi_getname(&ep_->fid, addr.data(), &len);
    }
    check(rc, "fi_getname");
    addr.resize(len);
    return addr;
  }

  void insert_peers(const std::vector<Bytes>& addresses) override {
    std::lock_guard<std::mutex> lock(mu_);
    peers_.assign(addresses.size(), FI_ADDR_UNSPEC);
    for (size_t r = 0; r < addresses.size(); ++r) {
      int n = fi_av_insert(av_, addresses[r].data(), 1, &peers_[r], 0, nullptr);
      if (n != 1) fail("fi_av_insert of peer " + std::to_string(r), n < 0 ? n : -FI_EINVAL);
    }
  }

  void replace_peer(int peer, const Bytes& address) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (peer < 0 || static_cast<size_t>(peer) >= peers_.size())
      throw FabricError(where() + ": replace_peer: rank " + std::to_string(peer) + " is not connected (" +
                        std::to_string(peers_.size()) + " peers)");
    fi_addr_t fresh = FI_ADDR_UNSPEC;
    int n = fi_av_insert(av_, address.data(), 1, &fresh, 0, nullptr);
    if (n != 1) fail("fi_av_insert of peer " + std::to_string(peer) + "'s replacement", n < 0 ? n : -FI_EINVAL);
    peers_[peer] = fresh;
  }

  LocalMemory register_memory(const MemorySpec& spec) override {
    if (spec.kind == MemoryKind::kCuda) return register_cuda(spec);
    void* ptr = spec.ptr;
    const size_t len = spec.length;
    auto lock = serialise();
    fid_mr* mr = nullptr;
    // Ignored where the provider picks keys; a random one may already be taken.
    int rc = -FI_ENOKEY;
    for (int attempt = 0; attempt < 8 && rc == -FI_ENOKEY; ++attempt)
      rc = fi_mr_reg(domain_, ptr, len, FI_REMOTE_WRITE | FI_WRITE, 0, random_key(mr_key_size_), 0, &mr, nullptr);
    if (rc != 0) fail("fi_mr_reg of " + std::to_string(len) + " bytes", rc);
    return local_memory(mr, ptr);
  }

  void deregister_memory(const LocalMemory& mem) override {
    auto lock = serialise();
    auto* mr = static_cast<fid_mr*>(mem.handle);
    if (mr != nullptr) fi_close(&mr->fid);
  }

  bool post_write(const WriteDesc& w) override {
    on_cuda_device();
    std::lock_guard<std::mutex> lock(mu_);
    if (w.peer < 0 || static_cast<size_t>(w.peer) >= peers_.size())
      throw FabricError(where() + ": write to peer " + std::to_string(w.peer) + ", which is not connected (" +
                        std::to_string(peers_.size()) + " peers)");
    iovec iov{const_cast<void*>(w.src), w.len};
    void* desc = w.desc;
    fi_rma_iov rma{w.remote_addr, w.len, w.remote_key};
    fi_msg_rma msg{};
    msg.msg_iov = &iov;
    msg.desc = &desc;
    msg.iov_count = 1;
    msg.addr = peers_[w.peer];
    msg.rma_iov = &rma;
    msg.rma_iov_count = 1;
    if (free_.empty()) return false;  // as many in flight as the pool holds: completions first
    WriteContext* ctx = &pool_[free_.back()];
    ctx->id = w.context;
    msg.context = ctx;
    msg.data = w.imm;
    uint64_t flags = FI_COMPLETION;
    if (w.with_imm) flags |= FI_REMOTE_CQ_DATA;
    if (w.delivery_complete) flags |= FI_DELIVERY_COMPLETE;
    ssize_t rc = fi_writemsg(ep_, &msg, flags);
    if (rc == -FI_EAGAIN) return false;
    if (rc != 0) fail("fi_writemsg of " + std::to_string(w.len) + " bytes to peer " + std::to_string(w.peer), rc);
    free_.pop_back();
    return true;
  }

  int poll(Completion* out, int max) override { return read(out, max, -1); }

  int wait_poll(Completion* out, int max, int timeout_ms) override { return read(out, max, timeout_ms); }

  void wake() override {
    if (can_wait_) fi_cq_signal(cq_);
  }

  std::string last_error() const override { return last_error_; }

 private:
  LocalMemory local_memory(fid_mr* mr, void* ptr) const {
    LocalMemory mem;
    mem.handle = mr;
    mem.desc = fi_mr_desc(mr);
    mem.remote.key = fi_mr_key(mr);
    // FI_MR_VIRT_ADDR: peers address the region by our virtual address;
    // otherwise by the offset from its start.
    mem.remote.base = (mr_mode_ & FI_MR_VIRT_ADDR) ? reinterpret_cast<uint64_t>(ptr) : 0;
    return mem;
  }

  // What the endpoint can do with CUDA memory, decided once it is open.
  void describe_hmem(bool asked) {
    caps_.gpu_memory = hmem_;
    if (!asked) {
      caps_.gpu_memory_why = "not asked for (a CPU rank, or MOE_A2A_GPU_DIRECT=0)";
    } else if (!hmem_) {
      caps_.gpu_memory_why = "provider '" + caps_.provider + "' of libfabric " +
                             std::to_string(FI_MAJOR(fi_version())) + "." + std::to_string(FI_MINOR(fi_version())) +
                             " offers no FI_HMEM (a libfabric without CUDA support, or a provider without it)";
    } else if (caps_.provider == "shm") {
      // shm moves CUDA memory through CUDA IPC only for regions registered
      // FI_HMEM_DEVICE_ONLY; otherwise it bounces through host copies.
      caps_.gpu_memory_why = "FI_HMEM, iface CUDA, FI_HMEM_DEVICE_ONLY (CUDA IPC)";
    } else {
      std::string why;
#ifdef FI_MR_DMABUF
      caps_.gpu_dmabuf = kernel_has_dmabuf(&why);
#else
      why = "libfabric headers older than 1.20 (no FI_MR_DMABUF)";
#endif
      caps_.gpu_memory_why = caps_.gpu_dmabuf ? "FI_HMEM, iface CUDA, dma-buf"
                                              : "FI_HMEM, iface CUDA, peer memory (no dma-buf: " + why + ")";
    }
  }

  // CUDA device memory: fi_mr_regattr with iface FI_HMEM_CUDA and the device,
  // through dma-buf where the provider and kernel take it. A failure names
  // the provider, the region, its size and the reason.
  LocalMemory register_cuda(const MemorySpec& spec) {
    const std::string what = std::string(spec.name) + " (" + std::to_string(spec.length) +
                             " bytes of CUDA memory on device " + std::to_string(spec.device) + ")";
    if (!caps_.gpu_memory)
      throw FabricError(where() + ": registering " + what + ": " + what_gpu_registration_needs(caps_.gpu_memory_why));
    auto lock = serialise();
    iovec iov{spec.ptr, spec.length};
    fi_mr_attr attr{};
    attr.mr_iov = &iov;
    attr.iov_count = 1;
    attr.access = FI_REMOTE_WRITE | FI_WRITE;
    attr.iface = FI_HMEM_CUDA;
    attr.device.cuda = spec.device;
    uint64_t flags = caps_.provider == "shm" ? FI_HMEM_DEVICE_ONLY : 0;
    int fd = -1;
#ifdef FI_MR_DMABUF
    fi_mr_dmabuf dmabuf{};
    std::string no_fd;
    if (caps_.gpu_dmabuf && (fd = cuda_dmabuf_fd(spec.ptr, spec.length, &no_fd)) < 0)
      throw FabricError(where() + ": registering " + what + " through dma-buf failed: " + no_fd);
    if (fd >= 0) {
      dmabuf = {fd, 0, spec.length, spec.ptr};
      attr.dmabuf = &dmabuf;
      flags |= FI_MR_DMABUF;
    }
#endif
    fid_mr* mr = nullptr;
    int rc = -FI_ENOKEY;
    for (int attempt = 0; attempt < 8 && rc == -FI_ENOKEY; ++attempt) {
      attr.requested_key = random_key(mr_key_size_);
      rc = fi_mr_regattr(domain_, &attr, flags, &mr);
    }
    if (fd >= 0) close(fd);  // the registration holds its own reference
    if (rc != 0)
      throw FabricError(where() + ": registering " + what + " with " + caps_.gpu_memory_why + " failed: " +
                        fi_message(rc));
    cuda_device_.store(spec.device, std::memory_order_release);
    return local_memory(mr, spec.ptr);
  }

  // The thread that posts and progresses writes of CUDA memory (the worker)
  // calls into the provider's CUDA code: our device's context, not device 0's.
  void on_cuda_device() {
    const int device = cuda_device_.load(std::memory_order_acquire);
    thread_local int current = -1;
    if (device < 0 || device == current) return;
    std::string why;
    if (!cuda_make_current(device, &why)) throw FabricError(where() + ": " + why);
    current = device;
  }

  // timeout_ms < 0: non-blocking read; otherwise a blocking read (sread).
  int read(Completion* out, int max, int timeout_ms) {
    on_cuda_device();
    auto lock = serialise();
    fi_cq_data_entry entries[64];
    int want = max < 64 ? max : 64;
    ssize_t n = timeout_ms < 0 ? fi_cq_read(cq_, entries, want)
                               : fi_cq_sread(cq_, entries, want, nullptr, timeout_ms);
    if (n == -FI_EAGAIN || n == -FI_ECANCELED || n == -FI_ETIMEDOUT) return 0;
    if (n == -FI_EAVAIL) {
      fi_cq_err_entry err{};
      fi_cq_readerr(cq_, &err, 0);
      std::ostringstream msg;
      msg << where() << ": completion error: " << fi_strerror(err.err);
      const char* detail = fi_cq_strerror(cq_, err.prov_errno, err.err_data, nullptr, 0);
      if (detail != nullptr && *detail != '\0') msg << " (" << detail << ")";
      last_error_ = msg.str();
      out[0].kind = CompletionKind::kFailed;
      out[0].context = take_context(err.op_context);
      return 1;
    }
    if (n < 0) fail("fi_cq_read", static_cast<int>(n));
    int m = 0;
    for (ssize_t i = 0; i < n; ++i) {
      const fi_cq_data_entry& e = entries[i];
      // Some providers mark the sender's own completion with
      // FI_REMOTE_CQ_DATA too: FI_REMOTE_WRITE means "arrived here", and
      // only one carrying data is an immediate (others are not reported).
      if (e.flags & FI_REMOTE_WRITE) {
        if (e.flags & FI_REMOTE_CQ_DATA) out[m++] = {CompletionKind::kArrived, 0, static_cast<uint32_t>(e.data)};
        continue;
      }
      out[m++] = {CompletionKind::kSent, take_context(e.op_context), 0};
    }
    return m;
  }

  // Held around calls into the provider: always the peer table's lock; the
  // provider's calls need it too only where the domain is not thread-safe.
  std::unique_lock<std::mutex> serialise() const {
    return thread_safe_ ? std::unique_lock<std::mutex>() : std::unique_lock<std::mutex>(mu_);
  }

  // Only the worker thread posts and polls, so the pool needs no lock.
  uint64_t take_context(void* p) {
    auto* ctx = static_cast<WriteContext*>(p);
    if (ctx == nullptr) return 0;
    free_.push_back(static_cast<uint32_t>(ctx - pool_.data()));
    return ctx->id;
  }

  std::string where() const { return "libfabric provider '" + provider_ + "' (NIC " + std::to_string(index_) + ")"; }

  [[noreturn]] void fail(const std::string& what, int rc) const {
    throw FabricError(where() + ": " + what + " failed: " + fi_message(rc));
  }
  void check(int rc, const char* what) const {
    if (rc != 0) fail(what, rc);
  }

  // With `hmem`, FI_HMEM is asked for first; a provider without it opens as
  // before (host memory only) and capabilities() says why.
  InfoPtr find_info(bool hmem) {
    if (hmem) {
      version_ = kHmemVersion;
      hmem_ = true;
      try {
        return find_info_with(FI_HMEM);
      } catch (const FabricError&) {
        hmem_ = false;
        version_ = kFabricVersion;
      }
    }
    return find_info_with(0);
  }

  InfoPtr find_info_with(uint64_t extra_caps) {
    InfoPtr hints(fi_allocinfo());
    hints->ep_attr->type = FI_EP_RDM;
    hints->caps = FI_RMA | FI_WRITE | FI_REMOTE_WRITE | extra_caps;
    hints->mode = FI_CONTEXT | FI_CONTEXT2;
    // The modes this backend handles; the provider keeps those it needs.
    hints->domain_attr->mr_mode = FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY;
    // Every write passes its registration's descriptor, host memory's too.
    if (extra_caps & FI_HMEM) hints->domain_attr->mr_mode |= FI_MR_HMEM;
    hints->fabric_attr->prov_name = strdup(libfabric_name(provider_).c_str());
    fi_info* found = nullptr;
    // Thread-safe domains let the worker block on its completion queue while
    // another thread registers memory; otherwise every call is serialised and
    // the worker never blocks.
    hints->domain_attr->threading = FI_THREAD_SAFE;
    int rc = fi_getinfo(version_, nullptr, nullptr, 0, hints.get(), &found);
    thread_safe_ = rc == 0 && found != nullptr;
    if (!thread_safe_) {
      hints->domain_attr->threading = FI_THREAD_DOMAIN;
      rc = fi_getinfo(version_, nullptr, nullptr, 0, hints.get(), &found);
    }
    if (rc != 0 || found == nullptr) {
      std::string offered;
      for (const auto& p : libfabric_providers()) offered += (offered.empty() ? "" : ", ") + p;
      throw FabricError("libfabric provider '" + provider_ + "' is not available on this machine (fi_getinfo: " +
                        fi_message(rc) + "); providers offered here: " + offered);
    }
    InfoPtr all(found);
    // Only the named domain's entries, so that each NIC of a rank opens its
    // own device; matched here rather than in the hints so that a name that
    // does not exist can be reported with the names that do.
    fi_info* first = nullptr;
    std::string offered;
    for (fi_info* i = found; i != nullptr; i = i->next) {
      std::string name = i->domain_attr->name != nullptr ? i->domain_attr->name : "";
      if (first == nullptr && (domain_name_.empty() || name == domain_name_)) first = i;
      if (offered.find("'" + name + "'") == std::string::npos) offered += (offered.empty() ? "'" : ", '") + name + "'";
    }
    if (first == nullptr)
      throw FabricError(where() + ": no domain named '" + domain_name_ + "'; domains offered: " + offered);
    // Prefer IPv4 for tcp so that every rank picks the same fabric.
    fi_info* pick = first;
    for (fi_info* i = first; i != nullptr; i = i->next) {
      if (i->addr_format == FI_SOCKADDR_IN && (domain_name_.empty() || domain_name_ == i->domain_attr->name)) {
        pick = i;
        break;
      }
    }
    if (pick->domain_attr->cq_data_size < kImmBytes)
      throw FabricError(where() + ": the provider carries " + std::to_string(pick->domain_attr->cq_data_size) +
                        " bytes of remote CQ data; 4 are needed for immediates");
    return InfoPtr(fi_dupinfo(pick));
  }

  std::string provider_;
  int index_;
  std::string domain_name_;  // empty: the provider's first
  InfoPtr info_;
  uint64_t mr_mode_ = 0;
  uint32_t version_ = kFabricVersion;  // the API version asked for
  bool hmem_ = false;                  // the endpoint was opened with FI_HMEM
  std::atomic<int> cuda_device_{-1};   // the device of the CUDA memory registered here, once any is
  size_t mr_key_size_ = 0;  // bytes of a key the provider accepts (0: unstated)
  fid_fabric* fabric_ = nullptr;
  fid_domain* domain_ = nullptr;
  fid_cq* cq_ = nullptr;
  fid_av* av_ = nullptr;
  fid_ep* ep_ = nullptr;
  std::vector<fi_addr_t> peers_;
  Capabilities caps_;
  std::vector<WriteContext> pool_;
  std::vector<uint32_t> free_;  // indices into pool_ of contexts not in flight
  bool can_wait_ = false;
  bool thread_safe_ = false;
  mutable std::mutex mu_;
  std::string last_error_;
};

}  // namespace

std::unique_ptr<Backend> open_libfabric(const BackendOptions& opts) { return std::make_unique<LibfabricBackend>(opts); }

std::vector<std::string> libfabric_providers() {
  fi_info* found = nullptr;
  std::set<std::string> names;
  if (fi_getinfo(kFabricVersion, nullptr, nullptr, 0, nullptr, &found) == 0) {
    for (fi_info* i = found; i != nullptr; i = i->next) names.insert(i->fabric_attr->prov_name);
    fi_freeinfo(found);
  }
  return {names.begin(), names.end()};
}

std::vector<std::string> libfabric_domains(const std::string& provider) {
  InfoPtr hints(fi_allocinfo());
  hints->ep_attr->type = FI_EP_RDM;
  hints->caps = FI_RMA | FI_WRITE | FI_REMOTE_WRITE;
  hints->mode = FI_CONTEXT | FI_CONTEXT2;
  hints->fabric_attr->prov_name = strdup(libfabric_name(provider).c_str());
  fi_info* found = nullptr;
  std::vector<std::string> names;
  if (fi_getinfo(kFabricVersion, nullptr, nullptr, 0, hints.get(), &found) == 0) {
    for (fi_info* i = found; i != nullptr; i = i->next) {
      std::string name = i->domain_attr->name != nullptr ? i->domain_attr->name : "";
      if (std::find(names.begin(), names.end(), name) == names.end()) names.push_back(name);
    }
    fi_freeinfo(found);
  }
  return names;
}

}  // namespace moe_a2a::fabric
