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

namespace {

void* cuda_driver(const char* symbol) {
  static void* lib = [] {
    void* l = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    return l != nullptr ? l : dlopen("libcuda.so.1", RTLD_NOW);
  }();
  return lib == nullptr ? nullptr : dlsym(lib, symbol);
}

}  // namespace

bool cuda_make_current(int device, std::string* why) {
  using Retain = int (*)(void**, int);  // cuDevicePrimaryCtxRetain(CUcontext*, CUdevice)
  using SetCurrent = int (*)(void*);    // cuCtxSetCurrent(CUcontext)
  static auto retain = reinterpret_cast<Retain>(cuda_driver("cuDevicePrimaryCtxRetain"));
  static auto set_current = reinterpret_cast<SetCurrent>(cuda_driver("cuCtxSetCurrent"));
  if (retain == nullptr || set_current == nullptr) {
    *why = "the CUDA driver (libcuda.so.1) was not found";
    return false;
  }
  void* ctx = nullptr;
  int rc = retain(&ctx, device);  // the runtime's own context of the device, retained once per thread
  if (rc == 0) rc = set_current(ctx);
  if (rc != 0) *why = "CUresult " + std::to_string(rc) + " making device " + std::to_string(device) + " current";
  return rc == 0;
}

int cuda_dmabuf_fd(void* ptr, size_t len, std::string* why) {
  // CUresult cuMemGetHandleForAddressRange(void*, CUdeviceptr, size_t, CUmemRangeHandleType, unsigned long long)
  using GetHandle = int (*)(void*, uint64_t, size_t, int, unsigned long long);
  constexpr int kDmaBufFd = 1;  // CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD
  static auto get = reinterpret_cast<GetHandle>(cuda_driver("cuMemGetHandleForAddressRange"));
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
