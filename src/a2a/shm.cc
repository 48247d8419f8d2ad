#include "shm.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <stdexcept>

namespace moe_a2a::a2a {
namespace {

std::string sys_error(const std::string& what, const std::string& name) {
  return what + " of shared-memory segment '" + name + "' failed: " + std::strerror(errno);
}

constexpr size_t kHugePage = size_t{2} << 20;

// `size` bytes at a 2 MB-aligned address: private anonymous memory (huge
// pages where the kernel gives them for `keep`), with the segment's file
// mapped over everything outside `keep`. The shared memory filesystem
// backs its files with 4 KB pages, and libfabric's shm provider moved rows
// out of such memory at about half the speed of huge-page memory
// (docs/benchmarks.md).
void* map_with_private_range(int fd, size_t size, PrivateRange keep) {
  void* raw = mmap(nullptr, size + kHugePage, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (raw == MAP_FAILED) return MAP_FAILED;
  auto* base = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(raw) + kHugePage - 1) / kHugePage * kHugePage);
  const size_t before = static_cast<size_t>(base - static_cast<uint8_t*>(raw));
  if (before > 0) munmap(raw, before);
  munmap(base + size, kHugePage - before);  // before < kHugePage: some slack is always left after
  madvise(base + keep.begin, keep.end - keep.begin, MADV_HUGEPAGE);  // a hint: EINVAL without THP is fine
  auto shared = [&](size_t at, size_t bytes) {
    return bytes == 0 || mmap(base + at, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd,
                              static_cast<off_t>(at)) != MAP_FAILED;
  };
  if (!shared(0, keep.begin) || !shared(keep.end, size - keep.end)) {
    const int err = errno;
    munmap(base, size);
    errno = err;
    return MAP_FAILED;
  }
  return base;
}

}  // namespace

ShmSegment::ShmSegment(const std::string& name, size_t size, bool create, PrivateRange keep)
    : name_(name), size_(size), owner_(create) {
  if (!keep.empty() && (!create || keep.end > size || keep.begin % 4096 || keep.end % 4096))
    throw std::invalid_argument("ShmSegment: a private range must be page-aligned, inside a segment we create");
  int flags = create ? (O_CREAT | O_EXCL | O_RDWR) : O_RDWR;
  const bool by_path = !create && name.rfind("/proc/", 0) == 0;
  int fd = by_path ? ::open(name.c_str(), O_RDWR | O_CLOEXEC) : shm_open(name.c_str(), flags, 0600);
  if (fd < 0) throw std::runtime_error(sys_error("shm_open", name));
  linked_ = create;
  if (create && ftruncate(fd, static_cast<off_t>(size)) != 0) {
    std::string msg = sys_error("ftruncate to " + std::to_string(size) + " bytes", name);
    close(fd);
    shm_unlink(name.c_str());
    throw std::runtime_error(msg);
  }
  void* p = keep.empty() ? mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)
                         : map_with_private_range(fd, size, keep);
  if (p == MAP_FAILED) {
    std::string msg = sys_error("mmap of " + std::to_string(size) + " bytes", name);
    close(fd);
    if (create) shm_unlink(name.c_str());
    throw std::runtime_error(msg);
  }
  if (create) fd_ = fd;
  else close(fd);
  data_ = static_cast<uint8_t*>(p);
}

ShmSegment::~ShmSegment() {
  if (data_ != nullptr) munmap(data_, size_);
  if (fd_ >= 0) close(fd_);
  unlink();
}

std::string ShmSegment::reopen_path() const {
  if (fd_ < 0) throw std::logic_error("reopen_path: only the segment's creator has one");
  return "/proc/" + std::to_string(getpid()) + "/fd/" + std::to_string(fd_);
}

void ShmSegment::unlink() {
  if (owner_ && linked_) shm_unlink(name_.c_str());
  linked_ = false;
}

}  // namespace moe_a2a::a2a
