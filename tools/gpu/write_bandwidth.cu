// How fast this GPU writes, and how fast it moves a pack-like mix (one byte
// read for every four written: dispatch send reads bf16 tokens and writes
// eight fp8 copies), with plain 16-byte stores, streaming stores and the
// bulk copy engine (shared -> global); next to torch's copy (cudaMemcpyAsync),
// which beats a plain copy kernel by about 9% here. Backs the ceiling that
// docs/benchmarks.md gives for dispatch send.
//
//   nvcc -std=c++17 -O3 -arch=sm_90 -o /tmp/write_bandwidth tools/gpu/write_bandwidth.cu && /tmp/write_bandwidth
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

namespace {

constexpr size_t kBytes = size_t{1} << 30;  // written per launch
constexpr int kReps = 20;
constexpr int kThreads = 512;
constexpr int kBlocksPerSm = 2;
constexpr int kWritesPerRead = 4;             // the pack-like mix
constexpr int kBulkBytes = 16 * 1024;         // one bulk store from shared memory
constexpr int kBulkInFlight = 4;              // bulk stores a block keeps in flight
constexpr int kUnroll = 4;                    // 16-byte loads a thread issues before its stores

#define CHECK(x)                                                                        \
  do {                                                                                  \
    cudaError_t e = (x);                                                                \
    if (e != cudaSuccess) {                                                             \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e)); \
      std::exit(1);                                                                     \
    }                                                                                   \
  } while (0)

__device__ __forceinline__ void st_cs(uint4* p, uint4 v) {
  asm volatile("st.global.cs.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
}

// Plain copy: 16 bytes read and written per step.
__global__ void copy_kernel(uint4* dst, const uint4* src, size_t n) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n; i += size_t{gridDim.x} * blockDim.x)
    dst[i] = src[i];
}

// kUnroll 16-byte reads in flight per thread, then kWrites writes of each,
// to kWrites parts of dst: a copy (1) or the mix (kWritesPerRead).
template <int kWrites>
__global__ void unrolled_kernel(uint4* __restrict__ dst, const uint4* __restrict__ src, size_t n) {
  const size_t part = n / kWrites, stride = size_t{gridDim.x} * blockDim.x;
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < part; i += kUnroll * stride) {
    uint4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) v[u] = i + u * stride < part ? src[i + u * stride] : make_uint4(0, 0, 0, 0);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
#pragma unroll
      for (int k = 0; k < kWrites; ++k)
        if (i + u * stride < part) dst[k * part + i + u * stride] = v[u];
  }
}

// Write-only, or the mix when src != nullptr (one 16-byte read for every
// kWritesPerRead 16-byte writes, each write to a different quarter of dst,
// as pack stores one piece to several rows).
template <bool kStreaming>
__global__ void store_kernel(uint4* dst, const uint4* src, size_t n) {
  const size_t quarter = n / kWritesPerRead;
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < quarter; i += size_t{gridDim.x} * blockDim.x) {
    const uint4 v = src != nullptr ? src[i] : make_uint4(1, 2, 3, 4);
#pragma unroll
    for (int k = 0; k < kWritesPerRead; ++k) {
      if (kStreaming) st_cs(dst + k * quarter + i, v);
      else dst[k * quarter + i] = v;
    }
  }
}

// Write-only or the mix through the bulk copy engine: each block fills a
// shared-memory tile (from src when given, one read a kWritesPerRead writes)
// and stores it kWritesPerRead times with cp.async.bulk.
__global__ void bulk_kernel(uint8_t* dst, const uint8_t* src, size_t bytes) {
  extern __shared__ __align__(128) uint8_t tile[];
  const size_t quarter = bytes / kWritesPerRead;
  const size_t tiles = quarter / kBulkBytes;
  int stage = 0;
  for (size_t t = blockIdx.x; t < tiles; t += gridDim.x, stage = (stage + 1) % kBulkInFlight) {
    uint8_t* buf = tile + stage * kBulkBytes;
    // The stage's previous bulk stores must have read it before we refill it.
    if (threadIdx.x == 0) asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(kBulkInFlight - 1) : "memory");
    __syncthreads();
    for (int i = threadIdx.x; i < kBulkBytes / 16; i += blockDim.x) {
      const uint4 v = src != nullptr ? reinterpret_cast<const uint4*>(src + t * kBulkBytes)[i] : make_uint4(1, 2, 3, 4);
      reinterpret_cast<uint4*>(buf)[i] = v;
    }
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    __syncthreads();
    if (threadIdx.x == 0) {
      for (int k = 0; k < kWritesPerRead; ++k) {
        uint8_t* to = dst + k * quarter + t * kBulkBytes;
        asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(to),
                     "r"(static_cast<uint32_t>(__cvta_generic_to_shared(buf))), "n"(kBulkBytes)
                     : "memory");
      }
      asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    }
  }
  if (threadIdx.x == 0) asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

template <typename F>
float median_ms(F launch) {
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  launch();  // warm-up
  std::vector<float> ms;
  for (int r = 0; r < kReps; ++r) {
    CHECK(cudaEventRecord(a));
    launch();
    CHECK(cudaEventRecord(b));
    CHECK(cudaEventSynchronize(b));
    float t = 0;
    CHECK(cudaEventElapsedTime(&t, a, b));
    ms.push_back(t);
  }
  CHECK(cudaGetLastError());
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

void report(const char* name, size_t bytes_moved, float ms, double copy_gbs) {
  const double gbs = bytes_moved / (ms * 1e-3) / 1e9;
  std::printf("%-34s %8.0f GB/s %6.0f%% of copy\n", name, gbs, copy_gbs > 0 ? 100 * gbs / copy_gbs : 100.0);
}

}  // namespace

int main() {
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const int grid = sms * kBlocksPerSm;
  uint8_t *dst = nullptr, *src = nullptr;
  CHECK(cudaMalloc(&dst, kBytes));
  CHECK(cudaMalloc(&src, kBytes));
  CHECK(cudaMemset(src, 1, kBytes));
  const size_t n = kBytes / 16;
  const size_t mix_bytes = kBytes + kBytes / kWritesPerRead;  // written plus read
  auto* d4 = reinterpret_cast<uint4*>(dst);
  const auto* s4 = reinterpret_cast<const uint4*>(src);
  const size_t bulk_smem = size_t{kBulkBytes} * kBulkInFlight;
  CHECK(cudaFuncSetAttribute(bulk_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bulk_smem)));

  const double copy_gbs = 2.0 * kBytes / (median_ms([&] { copy_kernel<<<grid, kThreads>>>(d4, s4, n); }) * 1e-3) / 1e9;
  report("copy (read + write)", 2 * kBytes, 2.0 * kBytes / (copy_gbs * 1e9) * 1e3, copy_gbs);
  report("copy: cudaMemcpyAsync (torch's copy_)", 2 * kBytes,
         median_ms([&] { CHECK(cudaMemcpyAsync(dst, src, kBytes, cudaMemcpyDeviceToDevice)); }), copy_gbs);
  report("copy: 4 loads in flight", 2 * kBytes, median_ms([&] { unrolled_kernel<1><<<grid, kThreads>>>(d4, s4, n); }),
         copy_gbs);
  report("cudaMemsetAsync", kBytes, median_ms([&] { CHECK(cudaMemsetAsync(dst, 0, kBytes)); }), copy_gbs);
  report("write: 16-byte stores", kBytes, median_ms([&] { store_kernel<false><<<grid, kThreads>>>(d4, nullptr, n); }),
         copy_gbs);
  report("write: streaming stores", kBytes,
         median_ms([&] { store_kernel<true><<<grid, kThreads>>>(d4, nullptr, n); }), copy_gbs);
  report("write: bulk copy engine", kBytes,
         median_ms([&] { bulk_kernel<<<grid, kThreads, bulk_smem>>>(dst, nullptr, kBytes); }), copy_gbs);
  report("mix 1:4: 16-byte stores", mix_bytes,
         median_ms([&] { store_kernel<false><<<grid, kThreads>>>(d4, s4, n); }), copy_gbs);
  report("mix 1:4: 4 reads in flight", mix_bytes,
         median_ms([&] { unrolled_kernel<kWritesPerRead><<<grid, kThreads>>>(d4, s4, n); }), copy_gbs);
  report("mix 1:4: streaming stores", mix_bytes, median_ms([&] { store_kernel<true><<<grid, kThreads>>>(d4, s4, n); }),
         copy_gbs);
  report("mix 1:4: bulk copy engine", mix_bytes,
         median_ms([&] { bulk_kernel<<<grid, kThreads, bulk_smem>>>(dst, src, kBytes); }), copy_gbs);
  CHECK(cudaFree(dst));
  CHECK(cudaFree(src));
  return 0;
}
