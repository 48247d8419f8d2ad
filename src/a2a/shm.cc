#include "shm.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <stdexcept>

namespace moe_a2a::a2a {
namespace {

std::string sys_error(const std::string& what, const std::string& name) {
  return what + " of shared-memory segment '" + name + "' failed: " + std::strerror(errno);
}

}  // namespace

ShmSegment::ShmSegment(const std::string& name, size_t size, bool create) : name_(name), size_(size), owner_(create) {
  int flags = create ? (O_CREAT | O_EXCL | O_RDWR) : O_RDWR;
  int fd = shm_open(name.c_str(), flags, 0600);
  if (fd < 0) throw std::runtime_error(sys_error("shm_open", name));
  linked_ = create;
  if (create && ftruncate(fd, static_cast<off_t>(size)) != 0) {
    std::string msg = sys_error("ftruncate to " + std::to_string(size) + " bytes", name);
    close(fd);
    shm_unlink(name.c_str());
    throw std::runtime_error(msg);
  }
  void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (p == MAP_FAILED) {
    std::string msg = sys_error("mmap of " + std::to_string(size) + " bytes", name);
    if (create) shm_unlink(name.c_str());
    throw std::runtime_error(msg);
  }
  data_ = static_cast<uint8_t*>(p);
}

ShmSegment::~ShmSegment() {
  if (data_ != nullptr) munmap(data_, size_);
  unlink();
}

void ShmSegment::unlink() {
  if (owner_ && linked_) shm_unlink(name_.c_str());
  linked_ = false;
}

}  // namespace moe_a2a::a2a
