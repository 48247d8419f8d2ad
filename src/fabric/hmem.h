// What registering CUDA memory with a provider needs besides libfabric: the
// kernel's dma-buf support and the dma-buf file of a device range. CUDA's
// driver is loaded at run time, so the fabric library builds and runs without
// CUDA (a CPU rank never touches it).
#pragma once

#include <cstddef>
#include <string>

namespace moe_a2a::fabric {

// Linux >= 5.12 exports GPU memory to a NIC through dma-buf; libfabric does
// not check the kernel itself. False with `why` set otherwise.
bool kernel_has_dmabuf(std::string* why);

// A dma-buf file descriptor for [ptr, ptr + len) of CUDA device memory
// (cuMemGetHandleForAddressRange), or -1 with `why` set. The caller closes it
// once the registration holds its own reference.
int cuda_dmabuf_fd(void* ptr, size_t len, std::string* why);

// Makes `device`'s primary context current on the calling thread (the
// engine's worker, which posts and progresses writes of CUDA memory: the
// provider's CUDA calls there would otherwise open a context on device 0).
// False with `why` set where the driver cannot.
bool cuda_make_current(int device, std::string* why);

}  // namespace moe_a2a::fabric
