// The receiver's plan, row by row: output row -> (sender, j). Shared by
// dispatch recv (which fills output rows) and combine send (which returns
// them), so both walk the same rows in the same way.
#pragma once

#include "params.h"
#include "rows.cuh"
#include "tuning.h"

namespace moe_a2a::a2a::cuda {

// Copies the segment table (num_experts entries) into shared memory; the
// caller synchronises afterwards.
__device__ __forceinline__ void load_segments(Segment* dst, const Segment* src, int count) {
  for (int i = threadIdx.x; i < count; i += blockDim.x) dst[i] = src[i];
}

// Finds the segment holding output `row`: the last one starting at or before
// it (later empty segments start after its end). Returns false for padding.
__device__ __forceinline__ bool locate(const Segment* segs, int count, int row, int* sender, int* j) {
  int lo = 0, hi = count;  // segs[0].out_row == 0 <= row
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (segs[mid].out_row <= row) lo = mid;
    else hi = mid;
  }
  const Segment s = segs[lo];
  if (row >= s.out_row + s.count) return false;
  *sender = s.sender;
  *j = s.first_j + (row - s.out_row);
  return true;
}

// Warps of a persistent grid take work items round-robin: output rows, each
// cut into `chunks` pieces (consecutive warps take consecutive chunks of a
// row). Items are stepped by a fixed stride instead of divided out of a
// counter each time.
struct ChunkWalk {
  int row, chunk, lane;
  int chunks, stride_rows, stride_chunks;
  __device__ explicit ChunkWalk(int row_chunks) : chunks(row_chunks) {
    const int warps = blockDim.x / kWarp;
    const int first = blockIdx.x * warps + threadIdx.x / kWarp;
    const int stride = gridDim.x * warps;
    row = first / chunks, chunk = first % chunks;
    stride_rows = stride / chunks, stride_chunks = stride % chunks;
    lane = threadIdx.x % kWarp;
  }
  __device__ void next() {
    row += stride_rows;
    chunk += stride_chunks;
    if (chunk >= chunks) chunk -= chunks, ++row;
  }
};

// Chunks of at most kCopyChunkBytes in a row of `bytes`.
__host__ __device__ constexpr int row_chunks(int64_t bytes) {
  return bytes > kCopyChunkBytes ? static_cast<int>((bytes + kCopyChunkBytes - 1) / kCopyChunkBytes) : 1;
}

// Bytes of each chunk: equal shares (the last may be shorter), rounded up to
// kChunkAlign bytes (whole 8-element pieces of fp32; 16-byte accesses).
constexpr int64_t kChunkAlign = RowCopyTuning::kChunkAlign;
__host__ __device__ constexpr int64_t chunk_bytes(int64_t bytes) {
  const int64_t share = (bytes + row_chunks(bytes) - 1) / row_chunks(bytes);
  return (share + kChunkAlign - 1) / kChunkAlign * kChunkAlign;
}

}  // namespace moe_a2a::a2a::cuda
