#include "hmem.h"

#include <dlfcn.h>
#include <sys/utsname.h>

#include <cstdint>
#include <cstdio>

namespace moe_a2a::fabric {

bool kernel_has_dmabuf(std::string* why) {
  utsname u{};
  int major = 0, minor = 0;
  if (uname(&u) != 0 || std::sscanf(u.release, "%d.%d", &major, &minor) != 2) {
    *why = "the kernel's version is unknown (uname)";
    return false;
  }
  if (major > 5 || (major == 5 && minor >= 12)) return true;
  *why = std::string("Linux ") + u.release + " has no dma-buf export of GPU memory (needs >= 5.12)";
  return false;
}

int cuda_dmabuf_fd(void* ptr, size_t len, std::string* why) {
  // CUresult cuMemGetHandleForAddressRange(void*, CUdeviceptr, size_t, CUmemRangeHandleType, unsigned long long)
  using GetHandle = int (*)(void*, uint64_t, size_t, int, unsigned long long);
  constexpr int kDmaBufFd = 1;  // CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD
  static GetHandle get = [] {
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    if (lib == nullptr) lib = dlopen("libcuda.so.1", RTLD_NOW);
    return lib == nullptr ? nullptr : reinterpret_cast<GetHandle>(dlsym(lib, "cuMemGetHandleForAddressRange"));
  }();
  if (get == nullptr) {
    *why = "the CUDA driver has no cuMemGetHandleForAddressRange (needs CUDA >= 11.7)";
    return -1;
  }
  int fd = -1;
  const int rc = get(&fd, reinterpret_cast<uint64_t>(ptr), len, kDmaBufFd, 0);
  if (rc != 0) {
    *why = "cuMemGetHandleForAddressRange failed (CUresult " + std::to_string(rc) + ")";
    return -1;
  }
  return fd;
}

}  // namespace moe_a2a::fabric
