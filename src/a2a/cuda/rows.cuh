// Element conversions and row pieces shared by the kernels. A thread works on
// a piece of kVec consecutive elements of a row; pieces start at multiples of
// kVec, so 16 consecutive threads cover exactly one fp8 scale block.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <cstdint>

#include "../row_tail.h"
#include "memory.cuh"
#include "params.h"
#include "tuning.h"

namespace moe_a2a::a2a::cuda {

constexpr int kVec = 8;                                // elements per thread piece
constexpr int kLanesPerScaleBlock = kFp8Block / kVec;  // 16
constexpr int kWarp = 32;
constexpr unsigned kFullMask = 0xffffffffu;
constexpr int kMaxTopk = 64;

static_assert(kFp8Block % kVec == 0 && kWarp % kLanesPerScaleBlock == 0,
              "a scale block must be whole pieces within one warp");

__device__ __forceinline__ int dtype_size(int dtype) {
  return dtype == static_cast<int>(DType::kFp32) ? 4 : dtype == static_cast<int>(DType::kBf16) ? 2 : 1;
}

__device__ __forceinline__ bool aligned(const void* p, unsigned bytes) {
  return (reinterpret_cast<uintptr_t>(p) & (bytes - 1)) == 0;
}

__device__ __forceinline__ float bf16_bits_to_float(uint16_t b) {
  return __uint_as_float(static_cast<uint32_t>(b) << 16);
}

__device__ __forceinline__ uint16_t float_to_bf16_bits(float f) { return __bfloat16_as_ushort(__float2bfloat16_rn(f)); }

// A whole piece as loaded: kVec bf16 (lo) or fp32 (lo, hi) elements.
struct RawPiece {
  uint4 lo, hi;
};

// Issues the loads of the whole piece at p (16-byte aligned); nothing waits yet.
__device__ __forceinline__ RawPiece load_raw_piece(const void* p, int dtype) {
  if (dtype == static_cast<int>(DType::kBf16)) return {ld_16_stream(p), make_uint4(0, 0, 0, 0)};
  return {ld_16_stream(p), ld_16_stream(static_cast<const float*>(p) + 4)};
}

__device__ __forceinline__ void unpack_piece(const RawPiece& r, int dtype, float (&v)[kVec]) {
  if (dtype == static_cast<int>(DType::kBf16)) {
    const uint32_t w[4] = {r.lo.x, r.lo.y, r.lo.z, r.lo.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      v[2 * i] = __uint_as_float(w[i] << 16);
      v[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
    return;
  }
  const uint32_t w[8] = {r.lo.x, r.lo.y, r.lo.z, r.lo.w, r.hi.x, r.hi.y, r.hi.z, r.hi.w};
#pragma unroll
  for (int i = 0; i < kVec; ++i) v[i] = __uint_as_float(w[i]);
}

// Loads the whole piece at p (kVec bf16 or fp32 elements, 16-byte aligned) as floats.
__device__ __forceinline__ void load_full_piece(const void* p, int dtype, float (&v)[kVec]) {
  unpack_piece(load_raw_piece(p, dtype), dtype, v);
}

// Loads elements [first, first + n) of a bf16 or fp32 row as floats (n <= kVec;
// the rest are 0, which leaves an fp8 block's amax unchanged).
__device__ __forceinline__ void load_piece(const void* row, int dtype, int64_t first, int n, float (&v)[kVec]) {
  const size_t elem = dtype == static_cast<int>(DType::kBf16) ? 2 : 4;
  const void* p = static_cast<const uint8_t*>(row) + first * elem;
  if (n == kVec && aligned(p, 16)) return load_full_piece(p, dtype, v);
  if (elem == 2) {
#pragma unroll
    for (int i = 0; i < kVec; ++i) v[i] = i < n ? bf16_bits_to_float(static_cast<const uint16_t*>(p)[i]) : 0.0f;
    return;
  }
#pragma unroll
  for (int i = 0; i < kVec; ++i) v[i] = i < n ? static_cast<const float*>(p)[i] : 0.0f;
}

// A piece converted to its stored form: up to 32 bytes (8 fp32).
struct Encoded {
  uint4 lo, hi;
};

__device__ __forceinline__ Encoded encode_bf16(const float (&v)[kVec]) {
  uint32_t w[4];
#pragma unroll
  for (int i = 0; i < 4; ++i)
    w[i] = static_cast<uint32_t>(float_to_bf16_bits(v[2 * i])) |
           (static_cast<uint32_t>(float_to_bf16_bits(v[2 * i + 1])) << 16);
  return {make_uint4(w[0], w[1], w[2], w[3]), make_uint4(0, 0, 0, 0)};
}

__device__ __forceinline__ Encoded encode_fp32(const float (&v)[kVec]) {
  return {make_uint4(__float_as_uint(v[0]), __float_as_uint(v[1]), __float_as_uint(v[2]), __float_as_uint(v[3])),
          make_uint4(__float_as_uint(v[4]), __float_as_uint(v[5]), __float_as_uint(v[6]), __float_as_uint(v[7]))};
}

// e4m3(v / scale), round to nearest even, saturating at +-448: the same bits
// as reference.quantize_fp8 (true fp32 division, then clamp and convert).
__device__ __forceinline__ Encoded encode_fp8(const float (&v)[kVec], float scale) {
  uint32_t w[2] = {0, 0};
#pragma unroll
  for (int i = 0; i < kVec; ++i) {
    __nv_fp8_storage_t q = __nv_cvt_float_to_fp8(__fdiv_rn(v[i], scale), __NV_SATFINITE, __NV_E4M3);
    w[i / 4] |= static_cast<uint32_t>(q) << (8 * (i % 4));
  }
  return {make_uint4(w[0], w[1], 0, 0), make_uint4(0, 0, 0, 0)};
}

// Stores a whole piece at dst, aligned to its size (8, 16 or 32 bytes).
__device__ __forceinline__ void store_full_piece(uint8_t* dst, const Encoded& e, int elem_bytes) {
  if (elem_bytes == 1) return st_8(dst, make_uint2(e.lo.x, e.lo.y));
  st_16(dst, e.lo);
  if (elem_bytes == 4) st_16(dst + 16, e.hi);
}

// Stores the first n elements (of `elem_bytes` each) of a piece at dst.
__device__ __forceinline__ void store_piece(uint8_t* dst, const Encoded& e, int elem_bytes, int n) {
  const int bytes = n * elem_bytes;
  if (n == kVec && aligned(dst, elem_bytes == 1 ? 8 : 16)) return store_full_piece(dst, e, elem_bytes);
  // Tail of a row: bytewise, fully unrolled so the piece stays in registers.
  const uint32_t w[8] = {e.lo.x, e.lo.y, e.lo.z, e.lo.w, e.hi.x, e.hi.y, e.hi.z, e.hi.w};
#pragma unroll
  for (int i = 0; i < kVec * 4; ++i)
    if (i < bytes) dst[i] = static_cast<uint8_t>(w[i / 4] >> (8 * (i % 4)));
}

// Scales follow the fp8 payload at byte offset `hidden`, which is 4-aligned
// only when hidden is; store bytewise otherwise.
__device__ __forceinline__ void store_f32(uint8_t* dst, float v) {
  if (aligned(dst, 4)) {
    *reinterpret_cast<float*>(dst) = v;
    return;
  }
  uint32_t u = __float_as_uint(v);
#pragma unroll
  for (int i = 0; i < 4; ++i) dst[i] = static_cast<uint8_t>(u >> (8 * i));
}

__device__ __forceinline__ float load_f32(const uint8_t* src) {
  if (aligned(src, 4)) return *reinterpret_cast<const float*>(src);
  uint32_t u = 0;
#pragma unroll
  for (int i = 0; i < 4; ++i) u |= static_cast<uint32_t>(src[i]) << (8 * i);
  return __uint_as_float(u);
}

// 16-byte pieces a lane loads before its first store, in the row copies.
constexpr int kCopyUnroll = RowCopyTuning::kUnroll;
// Bytes one warp moves in one round of a row copy: rows are cut into chunks of
// this size, so that a row is spread over several warps (a decode-sized call
// waits on one round of loads per warp instead of four).
constexpr int kCopyChunkBytes = kCopyUnroll * kWarp * 16;

// One round of a warp's 16-byte row copy: up to kCopyUnroll pieces a lane,
// all loaded before the first is stored. `left` is the round's 16-byte
// pieces less the lane's index (piece u is the lane's when u * kWarp < left).
using CopyRound = uint4[kCopyUnroll];
__device__ __forceinline__ void load_round(CopyRound& v, const uint8_t* src, int64_t left, int lane) {
#pragma unroll
  for (int u = 0; u < kCopyUnroll; ++u)
    if (u * kWarp < left) v[u] = ld_16_stream(src + (lane + u * kWarp) * 16);
}
__device__ __forceinline__ void store_round(uint8_t* dst, const CopyRound& v, int64_t left, int lane) {
#pragma unroll
  for (int u = 0; u < kCopyUnroll; ++u)
    if (u * kWarp < left) st_16(dst + (lane + u * kWarp) * 16, v[u]);
}

// Copies `bytes` bytes from src to dst with one warp: 16-byte accesses when
// both ends allow it, up to kCopyUnroll of them a lane issued before their
// stores, the last partial step too (predicated).
__device__ __forceinline__ void warp_copy(uint8_t* dst, const uint8_t* src, int64_t bytes, int lane) {
  if (aligned(dst, 16) && aligned(src, 16)) {
    const int64_t vecs = bytes / 16;
    for (int64_t base = 0; base < vecs; base += kCopyUnroll * kWarp) {
      CopyRound v;
      load_round(v, src + base * 16, vecs - base - lane, lane);
      store_round(dst + base * 16, v, vecs - base - lane, lane);
    }
    for (int64_t b = vecs * 16 + lane; b < bytes; b += kWarp) dst[b] = src[b];
    return;
  }
  if (aligned(dst, 4) && aligned(src, 4)) {
    const int64_t words = bytes / 4;
    for (int64_t i = lane; i < words; i += kWarp)
      reinterpret_cast<uint32_t*>(dst)[i] = reinterpret_cast<const uint32_t*>(src)[i];
    for (int64_t b = words * 4 + lane; b < bytes; b += kWarp) dst[b] = src[b];
    return;
  }
  for (int64_t b = lane; b < bytes; b += kWarp) dst[b] = src[b];
}

// Whether warp_copy_split can copy a row of a_bytes + b_bytes: every pointer
// and both sizes multiples of 16.
__device__ __forceinline__ bool split_copyable(const uint8_t* dst_a, const uint8_t* dst_b, const uint8_t* src,
                                               int64_t a_bytes, int64_t b_bytes) {
  return aligned(dst_a, 16) && aligned(src, 16) && a_bytes % 16 == 0 && b_bytes % 16 == 0 &&
         (b_bytes == 0 || aligned(dst_b, 16));
}

// Copies bytes [begin, end) (multiples of 16, or end the row's) of
// src[0, a_bytes + b_bytes) with one warp, the first a_bytes to dst_a and the
// rest to dst_b (a dispatch row: payload, then fp8 scales), as one stream of
// 16-byte pieces across the boundary. Needs split_copyable.
__device__ __forceinline__ void warp_copy_split(uint8_t* dst_a, uint8_t* dst_b, const uint8_t* src, int64_t a_bytes,
                                                int64_t begin, int64_t end, int lane) {
  const int64_t va = a_bytes / 16, vt = end / 16;
  for (int64_t base = begin / 16; base < vt; base += kCopyUnroll * kWarp) {
    uint4 v[kCopyUnroll];
#pragma unroll
    for (int u = 0; u < kCopyUnroll; ++u) {
      const int64_t i = base + u * kWarp + lane;
      if (i < vt) v[u] = ld_16_stream(src + i * 16);
    }
#pragma unroll
    for (int u = 0; u < kCopyUnroll; ++u) {
      const int64_t i = base + u * kWarp + lane;
      if (i < vt) st_16(i < va ? dst_a + i * 16 : dst_b + (i - va) * 16, v[u]);
    }
  }
}

// Location helpers on the Layout (host-only methods there).
__device__ __forceinline__ uint64_t* flag_ptr(uint8_t* ws, const Layout& l, int sender, int kind) {
  return reinterpret_cast<uint64_t*>(ws + l.flags + (static_cast<size_t>(sender) * kNumFlagKinds + kind) * kFlagStride);
}

// Row stride E + N (config.h, routing_width); the kernels write and read its first E words.
__device__ __forceinline__ uint32_t* routing_row(uint8_t* ws, const Layout& l, int sender) {
  return reinterpret_cast<uint32_t*>(ws + l.routing) + static_cast<size_t>(sender) * l.routing_width;
}

__device__ __forceinline__ bool same_node(const Instance& in, int r) { return in.peers[r].device != nullptr; }

// Whether we exchange rows per rank with rank r (A2AConfig::per_rank): rows
// per rank in use and r on another node.
__device__ __forceinline__ bool per_rank(const Instance& in, int r) { return in.rank_rows && !same_node(in, r); }

// Whether rows carry route entries at all: rows per rank or per node.
__host__ __device__ __forceinline__ bool wide(const Instance& in) { return in.rank_rows || in.node_rows; }

// Send side: whether our copies for rank r are merged into a row per token,
// r's own (rows per rank) or its node forwarder's (rows per node).
__device__ __forceinline__ bool wide_remote(const Instance& in, int r) { return wide(in) && !same_node(in, r); }

// The rank our copies for rank r go to: r, or with rows per node the rank of
// our local index on r's node (A2AConfig::wire_dest).
__device__ __forceinline__ int wire_dest(const Instance& in, int r) {
  const int rpn = in.ranks_per_node;
  return in.node_rows && !same_node(in, r) ? r / rpn * rpn + in.rank % rpn : r;
}

// The expert an entry's expert index counts from at wire destination d: d's
// first expert, or with rows per node its node's (row_tail.h).
__device__ __forceinline__ int dest_first_expert(const Instance& in, int d) {
  return (in.node_rows ? d / in.ranks_per_node * in.ranks_per_node : d) * in.local_experts;
}

// Receive side: whether sender s sends our copies in rows per node, through
// its forwarder on our node (which may be us).
__device__ __forceinline__ bool node_sender(const Instance& in, int s) { return in.node_rows && !same_node(in, s); }

// The forwarder of sender s on our node.
__device__ __forceinline__ int forwarder_of(const Instance& in, int s) {
  const int rpn = in.ranks_per_node;
  return in.rank / rpn * rpn + s % rpn;
}

// A copy's place in its token's row per rank (Scratch::copy_entry): its entry
// (k order among the token's copies to that rank), the row's entries, its
// local expert on that rank. -1: a row of its own.
__device__ __forceinline__ int32_t entry_word(int entry, int count, int local_expert) {
  return entry | (count << 8) | (local_expert << 16);
}
__device__ __forceinline__ int word_entry(int32_t word) { return word & 0xff; }
__device__ __forceinline__ int word_count(int32_t word) { return (word >> 8) & 0xff; }
__device__ __forceinline__ int word_expert(int32_t word) { return static_cast<int>(static_cast<uint32_t>(word) >> 16); }

// Copy i's entry and the entries of its token's row for rank r, from the
// ranks of the token's copies (rank_of(c): -1 for a dropped one), k order.
template <typename RankOf>
__device__ __forceinline__ void token_entries(int64_t i, int topk, int r, RankOf rank_of, int* entry, int* count) {
  const int64_t t0 = i - i % topk;
  int before = 0, n = 0;
  for (int k = 0; k < topk; ++k) {
    const bool on_r = rank_of(t0 + k) == r;
    n += on_r;
    before += on_r && t0 + k < i;
  }
  *entry = before;
  *count = n;
}

// Stores a dispatch row's tail for copy (entry word `word`, weight w, index k
// in its token): a row of its own holds the weight at the tail's first byte;
// a row per rank entry word_entry(word), and its entry 0 also marks the
// entries past the token's as unused.
__device__ __forceinline__ void store_tail(const Instance& in, uint8_t* row, int32_t word, float w, int k) {
  uint8_t* tail = row + in.layout.dispatch_tail;
  if (word < 0) return store_f32(tail, w);
  const int entry = word_entry(word);
  const auto pack = [](float weight, uint32_t expert, uint32_t kk) {
    return make_uint2(__float_as_uint(weight), expert | (kk << 16));
  };
  *reinterpret_cast<uint2*>(tail + entry * sizeof(RouteEntry)) =
      pack(w, static_cast<uint32_t>(word_expert(word)), static_cast<uint32_t>(k));
  if (entry != 0) return;
  for (int n = word_count(word); n < in.max_entries; ++n)
    *reinterpret_cast<uint2*>(tail + n * sizeof(RouteEntry)) = pack(0.0f, kNoExpert, 0);
}

// Records an error for the host. Atomics on mapped host memory are not atomic
// across PCIe, and errors are rare: a plain store, so some error wins.
__device__ __forceinline__ void report(const Instance& in, int32_t status) {
  volatile int32_t* s = in.status;
  if (*s == kStatusOk) *s = status;
}

// Every kernel's first step: whether it belongs to a graph captured before
// the ranks were masked (Instance::generation). Its whole launch then returns
// at once, so a stale replay writes to no peer and waits for none, and the
// host's check() raises StaleGraphError. One load of a word beside the epoch,
// in instances that may be masked only (Instance::maskable). kCheck false:
// kernels of the latency-bound path (route_pack, plan) instantiated for
// instances never masked, where the check would return false anyway, leave
// out even that load and branch (a replayed decode step's first steps).
template <bool kCheck = true>
__device__ __forceinline__ bool stale_replay(const Instance& in) {
  if (!kCheck || !in.maskable) return false;
  if (*reinterpret_cast<volatile const uint64_t*>(in.epoch + 1) == in.generation) return false;
  if (threadIdx.x == 0 && blockIdx.x == 0) report(in, kStatusStaleGraph);
  return true;
}

}  // namespace moe_a2a::a2a::cuda
