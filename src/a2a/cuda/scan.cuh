// Block-wide exclusive prefix sums over short arrays (experts, ranks), for the
// one-block planning kernels.
#pragma once

#include <cub/block/block_scan.cuh>

namespace moe_a2a::a2a::cuda {

// out(i, sum_{i' < i} in(i')) for i in [0, n); returns the total in every
// thread. Every thread of the block must call it (it synchronises).
template <int kThreads, typename T, typename In, typename Out>
__device__ T block_exclusive_scan(int n, In in, Out out) {
  using Scan = cub::BlockScan<T, kThreads>;
  __shared__ typename Scan::TempStorage storage;
  T carry = 0;
  for (int base = 0; base < n; base += kThreads) {
    const int i = base + static_cast<int>(threadIdx.x);
    T value = i < n ? in(i) : T(0);
    T prefix, total;
    Scan(storage).ExclusiveSum(value, prefix, total);
    if (i < n) out(i, carry + prefix);
    carry += total;
    __syncthreads();  // storage is reused by the next tile
  }
  return carry;
}

}  // namespace moe_a2a::a2a::cuda
