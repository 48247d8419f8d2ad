// Host helpers shared by the launchers.
#include <cuda_runtime.h>

#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <utility>

#include "../env.h"
#include "launch.h"

namespace moe_a2a::a2a::cuda {

cudaError_t allow_dynamic_smem(const void* kernel, size_t bytes) {
  static std::mutex mu;
  static std::map<std::pair<const void*, int>, size_t> allowed;
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  std::lock_guard<std::mutex> lock(mu);
  size_t& have = allowed[{kernel, device}];
  if (bytes <= have) return cudaSuccess;
  err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
  if (err == cudaSuccess) have = bytes;
  return err;
}

namespace {

// A Hopper feature, on unless the switch `name` is off (env.h); the answer
// is kept per device in `cached` (0 unknown, 1 no, 2 yes).
constexpr int kMaxDevices = 64;
bool sm90_feature(const char* name, int (&cached)[kMaxDevices]) {
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= kMaxDevices) return false;
  if (cached[device] == 0) {
    int major = 0;
    const bool capable =
        cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) == cudaSuccess && major >= 9;
    cached[device] = capable && env_switch(name) != 0 ? 2 : 1;
  }
  return cached[device] == 2;
}

}  // namespace

bool use_pdl() {
  static int cached[kMaxDevices] = {};
  return sm90_feature("MOE_A2A_CUDA_PDL", cached);
}

bool use_bulk_pack() {
  static int cached[kMaxDevices] = {};
  return sm90_feature("MOE_A2A_CUDA_BULK", cached);
}

// The default: GridTuning::kDefaultBlocksPerSm (tuning.h).
int persistent_blocks(int64_t items, int per_block, int per_sm) {
  static int sm_count[kMaxDevices] = {};
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= kMaxDevices) device = 0;
  if (sm_count[device] == 0) {
    int n = 0;
    if (cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device) != cudaSuccess || n <= 0) n = 1;
    sm_count[device] = n;
  }
  const int64_t needed = (items + per_block - 1) / per_block;
  const int64_t cap = static_cast<int64_t>(sm_count[device]) * per_sm;
  const int64_t blocks = needed < cap ? needed : cap;
  return blocks < 1 ? 1 : static_cast<int>(blocks);
}

}  // namespace moe_a2a::a2a::cuda
