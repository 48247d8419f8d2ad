// POSIX shared-memory segments: each rank creates its workspace in one, the
// other ranks of its node map it. Names are unlinked as soon as every peer has
// mapped them, so a killed job leaves nothing in /dev/shm.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace moe_a2a::a2a {

// Bytes [begin, end) of a created segment that stay private to its creator
// (page-aligned): anonymous memory the kernel may back with huge pages,
// instead of the segment's 4 KB shared-memory pages. Peers that map the
// segment never touch them.
struct PrivateRange {
  size_t begin = 0, end = 0;
  bool empty() const { return end <= begin; }
};

class ShmSegment {
 public:
  // create=true: a new segment of `size` bytes (fails if the name exists),
  // with `keep` private to us. create=false: `name` is a segment's name, or
  // a path under /proc (reopen_path()) for one whose name is gone.
  ShmSegment(const std::string& name, size_t size, bool create, PrivateRange keep = {});
  ~ShmSegment();
  ShmSegment(const ShmSegment&) = delete;
  ShmSegment& operator=(const ShmSegment&) = delete;

  uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  const std::string& name() const { return name_; }
  void unlink();
  // A path a process of this host opens our segment by after its name was
  // unlinked: a replacement rank maps the survivors' (moe_a2a.rejoin). We
  // keep the descriptor open for it.
  std::string reopen_path() const;

 private:
  std::string name_;
  size_t size_ = 0;
  uint8_t* data_ = nullptr;
  bool owner_ = false;
  bool linked_ = false;
  int fd_ = -1;  // ours (create=true), kept open for reopen_path()
};

}  // namespace moe_a2a::a2a
