// Host helpers shared by the launchers.
#include <cuda_runtime.h>

#include "launch.h"

namespace moe_a2a::a2a::cuda {

int persistent_blocks(int64_t items, int per_block) {
  // 256-thread blocks per multiprocessor: at about 64 registers a thread, 3 to
  // 4 fit, and each warp keeps 4 x 16 bytes a lane in flight, more than
  // Little's law asks of HBM3e (about 33 KB per multiprocessor).
  constexpr int kBlocksPerSm = 4;
  constexpr int kMaxDevices = 64;
  static int sm_count[kMaxDevices] = {};
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= kMaxDevices) device = 0;
  if (sm_count[device] == 0) {
    int n = 0;
    if (cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device) != cudaSuccess || n <= 0) n = 1;
    sm_count[device] = n;
  }
  const int64_t needed = (items + per_block - 1) / per_block;
  const int64_t cap = static_cast<int64_t>(sm_count[device]) * kBlocksPerSm;
  const int64_t blocks = needed < cap ? needed : cap;
  return blocks < 1 ? 1 : static_cast<int>(blocks);
}

}  // namespace moe_a2a::a2a::cuda
