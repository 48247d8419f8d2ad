// Dispatch send, packing of large calls through the bulk copy engine: a block
// builds one token's whole dispatch row in shared memory (each piece loaded,
// converted or quantised once, scales included), then one thread hands the
// row to cp.async.bulk once for each of the token's destinations. A row goes
// out as topk bulk writes instead of 16-byte stores from every lane to every
// destination, and the block loads the next token while they run. Rows leave
// from a ring of kBulkStages buffers.
//
// Used for calls that route in separate kernels (dispatch_route.cu), which
// leave each copy's destination in scratch.copy_dst, when the row fits the
// ring and hidden is whole fp8 blocks; otherwise pack_kernel
// (dispatch_send.cu) packs.
#include <cuda_runtime.h>

#include "launch.h"
#include "pack.cuh"
#include "route.cuh"
#include "signal.cuh"
#include "tuning.h"

namespace moe_a2a::a2a::cuda {
namespace {

// Launch tuning: BulkTuning (tuning.h).
constexpr int kBulkThreads = BulkTuning::kThreads;
constexpr int kBulkBlocksPerSm = BulkTuning::kBlocksPerSm;
constexpr int kBulkStages = BulkTuning::kStages;
constexpr int kBulkPiecesInFlight = BulkTuning::kPiecesInFlight;
constexpr size_t kBulkSmemBytes = BulkTuning::kSmemBytes;

// The lane's pieces of one round: loaded together, then encoded into the row.
struct BulkRound {
  RawPiece raw[kBulkPiecesInFlight];
  float in_scale[kBulkPiecesInFlight];  // kPackFp8: the scale stored with x
};

template <int kMode>
__device__ __forceinline__ void load_pieces(const DispatchSendParams& p, int t, int first_piece, int pieces,
                                            BulkRound& r) {
  const int H = p.inst.hidden;
  const uint8_t* x = static_cast<const uint8_t*>(p.x);
#pragma unroll
  for (int j = 0; j < kBulkPiecesInFlight; ++j) {
    const int piece = first_piece + j * kBulkThreads;
    if (piece >= pieces) continue;
    const int64_t first = static_cast<int64_t>(piece) * kVec;
    if constexpr (kMode == kPackFp8) {
      const uint2 v = *reinterpret_cast<const uint2*>(x + static_cast<int64_t>(t) * H + first);
      r.raw[j].lo = make_uint4(v.x, v.y, 0, 0);
      if (first % kFp8Block == 0)
        r.in_scale[j] = p.x_scale[static_cast<int64_t>(t) * p.inst.num_scales + first / kFp8Block];
    } else {
      r.raw[j] = load_raw_piece(x + (static_cast<int64_t>(t) * H + first) * dtype_size(p.x_dtype), p.x_dtype);
    }
  }
}

// Encodes the round's pieces into `row` (shared memory). Pieces are whole
// (hidden is whole fp8 blocks); a warp's lanes past the row still join the
// amax shuffles, with zeros.
template <int kMode>
__device__ __forceinline__ void encode_pieces(const DispatchSendParams& p, int first_piece, int pieces,
                                              const BulkRound& r, uint8_t* row, int out_bytes) {
  const int warp_first = first_piece - static_cast<int>(threadIdx.x % kWarp);
#pragma unroll
  for (int j = 0; j < kBulkPiecesInFlight; ++j) {
    const int piece = first_piece + j * kBulkThreads;
    if (warp_first + j * kBulkThreads >= pieces) break;  // warp-uniform
    const bool live = piece < pieces;
    const int64_t first = static_cast<int64_t>(piece) * kVec;
    Encoded enc;
    float scale;
    if constexpr (kMode == kPackFp8) {
      enc = {r.raw[j].lo, make_uint4(0, 0, 0, 0)};
      scale = r.in_scale[j];
    } else {
      float v[kVec];
      unpack_piece(r.raw[j], p.x_dtype, v);
      if (!live) {
#pragma unroll
        for (int i = 0; i < kVec; ++i) v[i] = 0.0f;
      }
      enc = encode_values<kMode>(v, out_bytes, scale);
    }
    if (!live) continue;
    uint8_t* at = row + first * out_bytes;
    if (out_bytes == 1) {
      *reinterpret_cast<uint2*>(at) = make_uint2(enc.lo.x, enc.lo.y);
    } else {
      *reinterpret_cast<uint4*>(at) = enc.lo;
      if (out_bytes == 4) *reinterpret_cast<uint4*>(at + 16) = enc.hi;
    }
    if (kMode != kPackConvert && first % kFp8Block == 0)
      *reinterpret_cast<float*>(row + p.inst.payload_bytes + (first / kFp8Block) * sizeof(float)) = scale;
  }
}

// Builds token t's row into `row`, round by round, each round's loads issued
// before the previous round is encoded. On entry `next` holds t's first
// round; on return, the first round of token `after` (when it is a token).
template <int kMode>
__device__ __forceinline__ void build_row(const DispatchSendParams& p, int t, int after, int tokens, int pieces,
                                          uint8_t* row, int out_bytes, BulkRound& next) {
  constexpr int kPerRound = kBulkThreads * kBulkPiecesInFlight;
  const int rounds = (pieces + kPerRound - 1) / kPerRound;
  for (int round = 0; round < rounds; ++round) {
    const BulkRound current = next;
    const int first_piece = round * kPerRound + static_cast<int>(threadIdx.x);
    if (round + 1 < rounds) load_pieces<kMode>(p, t, first_piece + kPerRound, pieces, next);
    else if (after < tokens) load_pieces<kMode>(p, after, threadIdx.x, pieces, next);
    encode_pieces<kMode>(p, first_piece, pieces, current, row, out_bytes);
  }
}

// A block's first row is built before the grid wait: x, its scales and the
// token count are the call's input, complete before count_kernel's wait
// returned, and the kernels between (slot_kernel, then us) are scheduled
// only after it. So the first rows overlap slot_kernel; only the
// destinations (slot_kernel's copy_dst) wait for it.
template <int kMode>
__global__ void __launch_bounds__(kBulkThreads, kBulkBlocksPerSm) bulk_pack_kernel(DispatchSendParams p) {
  if (stale_replay(p.inst)) return;  // a graph captured before a mask
  extern __shared__ __align__(128) uint8_t ring[];
  const Instance& in = p.inst;
  const int K = in.topk;
  const int tokens = resolve_tokens(p);
  const int pieces = in.hidden / kVec;
  const int out_bytes = pack_out_bytes(in, kMode);
  const uint32_t row_bytes = static_cast<uint32_t>(in.layout.dispatch_row);
  const uint32_t body_bytes = static_cast<uint32_t>(in.layout.dispatch_tail);  // the tail is stored apart
  const int lane = threadIdx.x % kWarp;
  const bool issuer = threadIdx.x == 0;
  const int first_t = blockIdx.x, stride = gridDim.x;
  BulkRound next;
  if (first_t < tokens) {
    load_pieces<kMode>(p, first_t, threadIdx.x, pieces, next);
    build_row<kMode>(p, first_t, first_t + stride, tokens, pieces, ring, out_bytes, next);
  }
  kernel_prologue();
  int stage = 0;
  for (int t = first_t; t < tokens; t += stride) {
    // Warp 0 fetches the copies' destinations now, to use once the row is built.
    uint8_t* mine =
        threadIdx.x < static_cast<unsigned>(K) ? p.scratch.copy_dst[static_cast<int64_t>(t) * K + lane] : nullptr;
    uint8_t* row = ring + static_cast<size_t>(stage) * row_bytes;
    stage = stage + 1 == kBulkStages ? 0 : stage + 1;
    if (t != first_t) {
      if (issuer) bulk_wait_read<kBulkStages - 1>();  // this buffer's last copies have read it
      __syncthreads();
      build_row<kMode>(p, t, t + stride, tokens, pieces, row, out_bytes, next);
    }
    fence_proxy_async_shared();
    __syncthreads();
    if (threadIdx.x < kWarp) {
      for (int k = 0; k < K; ++k) {
        uint8_t* dst = reinterpret_cast<uint8_t*>(__shfl_sync(kFullMask, reinterpret_cast<uintptr_t>(mine), k));
        if (issuer && dst != nullptr) bulk_store(dst, row, body_bytes);  // null: a dropped copy
      }
      if (issuer) bulk_commit();
      // Each copy's weight into its row's tail: bytes no bulk write touches.
      const int64_t copy = static_cast<int64_t>(t) * K + lane;
      const float w = lane < K && p.weights != nullptr ? p.weights[copy] : 0.0f;
      if (!wide(in)) {
        if (mine != nullptr) store_f32(mine + body_bytes, w);
      } else if (lane < K) {
        // Rows per rank or node: every copy of a token's row writes its entry, also those
        // that do not pack it (copy_dst null).
        const int32_t word = p.scratch.copy_entry[copy];
        uint8_t* tail_row = word >= 0 ? (in.staged ? in.device_ws : in.fabric_ws) + in.layout.send +
                                       static_cast<size_t>(p.scratch.slots[copy]) * in.layout.dispatch_row
                                 : mine;
        if (tail_row != nullptr) store_tail(in, tail_row, word, w, lane);
      }
    }
  }
  if (issuer) bulk_wait_written();
  signal_when_grid_done(in, p.scratch.done_blocks, kFlagDispatch, packed_flag(in, in.proxy.packed));
}

template <int kMode>
cudaError_t launch_bulk(const DispatchSendParams& p, cudaStream_t stream) {
  const Instance& in = p.inst;
  const size_t smem = static_cast<size_t>(kBulkStages) * in.layout.dispatch_row;
  cudaError_t err = allow_dynamic_smem(reinterpret_cast<const void*>(bulk_pack_kernel<kMode>), smem);
  if (err != cudaSuccess) return err;
  const int blocks = persistent_blocks(in.max_tokens, 1, kBulkBlocksPerSm);
  return launch_kernel(bulk_pack_kernel<kMode>, blocks, kBulkThreads, smem, stream, p);
}

}  // namespace

bool bulk_pack_fits(const DispatchSendParams& p) {
  const Instance& in = p.inst;
  const size_t x_elem = dtype_bytes(static_cast<DType>(p.x_dtype));
  return use_bulk_pack() && in.topk <= kWarp && in.hidden % kFp8Block == 0 &&
         reinterpret_cast<uintptr_t>(p.x) % 16 == 0 && (in.hidden * x_elem) % 16 == 0 &&
         static_cast<size_t>(kBulkStages) * in.layout.dispatch_row <= kBulkSmemBytes;
}

cudaError_t launch_bulk_pack(const DispatchSendParams& p, cudaStream_t stream) {
  if (p.inst.dispatch_dtype != static_cast<int>(DType::kFp8)) return launch_bulk<kPackConvert>(p, stream);
  if (p.x_dtype == static_cast<int>(DType::kFp8)) return launch_bulk<kPackFp8>(p, stream);
  return launch_bulk<kPackQuantize>(p, stream);
}

}  // namespace moe_a2a::a2a::cuda
