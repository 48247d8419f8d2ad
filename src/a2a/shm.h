// POSIX shared-memory segments: each rank creates its workspace in one, the
// other ranks of its node map it. Names are unlinked as soon as every peer has
// mapped them, so a killed job leaves nothing in /dev/shm.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace moe_a2a::a2a {

class ShmSegment {
 public:
  // create=true: a new segment of `size` bytes (fails if the name exists).
  ShmSegment(const std::string& name, size_t size, bool create);
  ~ShmSegment();
  ShmSegment(const ShmSegment&) = delete;
  ShmSegment& operator=(const ShmSegment&) = delete;

  uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  const std::string& name() const { return name_; }
  void unlink();

 private:
  std::string name_;
  size_t size_ = 0;
  uint8_t* data_ = nullptr;
  bool owner_ = false;
  bool linked_ = false;
};

}  // namespace moe_a2a::a2a
