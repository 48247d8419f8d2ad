// Launch tuning of the CUDA kernels: one table per kernel family, the only
// place these numbers live. Plain C++ (no CUDA), so the bindings can report
// the tuning a build uses (tuning_table(), `_core.cuda_tuning()`) and traces
// and bench headers can record it. Chosen on the H200 (sm_90: 228 KB of
// shared memory and 64K registers a multiprocessor), for the reasons given
// with each family; tools/gpu/ab.sh compares two builds' step times.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace moe_a2a::a2a::cuda {

// Dispatch send of small calls (decode): route_pack_kernel routes the whole
// call in every block and packs (dispatch_send.cu). Two blocks of 16 warps a
// multiprocessor: every block routes the whole call, and the multiprocessor's
// instruction issue bounds that repeated work, so fewer, larger blocks than
// pack's five (measured: 1 x 1024 threads no better, the step's next kernels
// then wait for whole multiprocessors). Eight of its warps walk the copies,
// 128 each (a decode call of 128 tokens, top-8); all of them pack.
struct RoutePackTuning {
  static constexpr int kThreads = 512;
  static constexpr int kBlocksPerSm = 2;
  static constexpr int kRouteWarps = 8;
  // Shared memory a block may take so that two fit a multiprocessor (1 KB of
  // it reserved per block): it grows with the number of experts.
  static constexpr size_t kSmemBytes = 100 * 1024;
};

// Dispatch send of large calls where the bulk copy engine does not fit:
// pack_kernel (dispatch_send.cu). Five blocks a multiprocessor: 40 warps of
// up to 48 registers; warps run independently (no block barriers), each on
// its own (token, slice) items.
struct PackTuning {
  static constexpr int kThreads = 256;
  static constexpr int kBlocksPerSm = 5;
};

// The routing step of large calls (dispatch_route.cu, route.cuh): blocks of
// kBlockCopies copies, a warp's kIdsInFlight ids a lane loaded together.
struct RouteTuning {
  static constexpr int kBlockCopies = 1024;
  static constexpr int kIdsInFlight = 4;      // id loads a lane issues before the first is used
  static constexpr int kBlockBaseChunk = 16;  // block_base loads a thread issues before its stores
};

// Packing of large calls through the bulk copy engine (dispatch_bulk.cu).
// Four blocks a multiprocessor (64 registers a thread). A thread's pieces
// come in rounds of kPiecesInFlight, and the next round's loads go out
// before the current one is encoded (across tokens too), so that loads are
// always in flight: 4 x 256 x 2 x 16 bytes a multiprocessor, more than HBM
// needs.
struct BulkTuning {
  static constexpr int kThreads = 256;
  static constexpr int kBlocksPerSm = 4;
  static constexpr int kStages = 3;          // rows a block may have in the copy engine
  static constexpr int kPiecesInFlight = 2;  // pieces of a thread's round
  // Shared memory of one block, so that four fit a multiprocessor.
  static constexpr size_t kSmemBytes = 54 * 1024;
};

// Dispatch receive, the plan (dispatch_plan.cu, recv_plan.cuh). It runs
// beside our pack kernel, so it must fit beside its blocks: at most 16K
// registers (256 threads of 64), which a multiprocessor holding four pack
// blocks still has free.
struct PlanTuning {
  static constexpr int kThreads = 256;
  static constexpr int kMaxRegisters = 64;
};

// Dispatch receive, rows per rank: entry_kernel (dispatch_plan.cu), one
// block a remote sender walking its rows' entries in order. A round is 1024
// entries (4 a lane, their loads from host memory in flight together); the
// walk waits on those loads, not on the block's few instructions a round.
struct EntryTuning {
  static constexpr int kThreads = 256;
  static constexpr int kEntriesInFlight = 4;
};

// Dispatch receive, the copies (dispatch_recv.cu). Blocks a multiprocessor:
// the persistent grid is sized for this many, so all must be resident at
// once (a second wave would leave its rows to the end). Three: the row copy
// holds 8 x 16 bytes a lane in flight (24 warps, 96 KB a multiprocessor) in
// about 80 registers.
struct CopyTuning {
  static constexpr int kThreads = 256;
  static constexpr int kBlocksPerSm = 3;
  // plan_copy_kernel: the longest a block sleeps between looks at the
  // planner's word (the plan takes microseconds; a longer sleep would start
  // the copy late).
  static constexpr unsigned kPlanPollNs = 128;
};

// Row copies of every kernel family (rows.cuh, segments.cuh): 16-byte pieces
// a lane loads before its first store; a warp's round of them is the chunk
// rows are cut into, so that a row is spread over several warps (a
// decode-sized call waits on one round of loads per warp instead of four).
struct RowCopyTuning {
  static constexpr int kUnroll = 8;
  static constexpr int64_t kChunkAlign = 32;  // chunks: whole 8-element pieces of fp32; 16-byte accesses
};

// Rows for remote peers to the fabric's host memory (stage.cu). A work item
// (a chunk, copied by one block) ends with a system-scope fence and a count,
// so large enough to amortise them, small enough that a decode-sized peer (a
// few MB) spreads over many blocks.
struct StageTuning {
  static constexpr int kThreads = 256;
  static constexpr int kBlocksPerSm = 4;
  static constexpr int kUnroll = 4;  // 16-byte loads a thread issues before its stores
  static constexpr int64_t kChunkBytes = 64 * 1024;
};

// Combine send (combine_send.cu). Blocks a multiprocessor; the persistent
// grid is sized for this many, and __launch_bounds__ makes them all resident.
// Four: 64 registers, 8 x 16 bytes a lane in flight, and a decode-sized
// call's row chunks all in one round.
struct ReturnTuning {
  static constexpr int kThreads = 256;
  static constexpr int kBlocksPerSm = 4;
};

// Combine receive, the weighted sum (combine_recv.cu).
struct ReduceTuning {
  static constexpr int kThreads = 256;        // many tokens: several blocks share a multiprocessor
  static constexpr int kWideThreads = 1024;   // few tokens (decode): a whole bf16 row in one round
  static constexpr int kWideBlocksPerSm = 2;  // "few": at most this many wide blocks per multiprocessor
  static constexpr int kRowsInFlight = 8;     // rows whose pieces a thread loads before using the first (top-8: all)
};

// A kernel's wait for a flag of the proxy (signal.cuh, wait_proxy).
struct WaitTuning {
  static constexpr unsigned kProxySleepNs = 256;  // between looks at the flag
};

// Persistent grids of the copy kernels that take the default (launch.h,
// persistent_blocks). Four blocks a multiprocessor suit the 256-thread copy
// kernels: at about 64 registers a thread, 3 to 4 fit, and each warp keeps 4
// x 16 bytes a lane in flight, more than Little's law asks of HBM3e (about
// 33 KB per multiprocessor).
struct GridTuning {
  static constexpr int kDefaultBlocksPerSm = 4;
};

// One tuning value, for reports: family (the struct's name less "Tuning",
// in snake case), name and value.
struct TuningEntry {
  std::string family;
  std::string name;
  int64_t value;
};

// Every value above, in the order of this file.
inline std::vector<TuningEntry> tuning_table() {
  return {
      {"route_pack", "threads", RoutePackTuning::kThreads},
      {"route_pack", "blocks_per_sm", RoutePackTuning::kBlocksPerSm},
      {"route_pack", "route_warps", RoutePackTuning::kRouteWarps},
      {"route_pack", "smem_bytes", static_cast<int64_t>(RoutePackTuning::kSmemBytes)},
      {"pack", "threads", PackTuning::kThreads},
      {"pack", "blocks_per_sm", PackTuning::kBlocksPerSm},
      {"route", "block_copies", RouteTuning::kBlockCopies},
      {"route", "ids_in_flight", RouteTuning::kIdsInFlight},
      {"route", "block_base_chunk", RouteTuning::kBlockBaseChunk},
      {"bulk", "threads", BulkTuning::kThreads},
      {"bulk", "blocks_per_sm", BulkTuning::kBlocksPerSm},
      {"bulk", "stages", BulkTuning::kStages},
      {"bulk", "pieces_in_flight", BulkTuning::kPiecesInFlight},
      {"bulk", "smem_bytes", static_cast<int64_t>(BulkTuning::kSmemBytes)},
      {"plan", "threads", PlanTuning::kThreads},
      {"plan", "max_registers", PlanTuning::kMaxRegisters},
      {"entry", "threads", EntryTuning::kThreads},
      {"entry", "entries_in_flight", EntryTuning::kEntriesInFlight},
      {"copy", "threads", CopyTuning::kThreads},
      {"copy", "blocks_per_sm", CopyTuning::kBlocksPerSm},
      {"copy", "plan_poll_ns", CopyTuning::kPlanPollNs},
      {"row_copy", "unroll", RowCopyTuning::kUnroll},
      {"row_copy", "chunk_align", RowCopyTuning::kChunkAlign},
      {"stage", "threads", StageTuning::kThreads},
      {"stage", "blocks_per_sm", StageTuning::kBlocksPerSm},
      {"stage", "unroll", StageTuning::kUnroll},
      {"stage", "chunk_bytes", StageTuning::kChunkBytes},
      {"return", "threads", ReturnTuning::kThreads},
      {"return", "blocks_per_sm", ReturnTuning::kBlocksPerSm},
      {"reduce", "threads", ReduceTuning::kThreads},
      {"reduce", "wide_threads", ReduceTuning::kWideThreads},
      {"reduce", "wide_blocks_per_sm", ReduceTuning::kWideBlocksPerSm},
      {"reduce", "rows_in_flight", ReduceTuning::kRowsInFlight},
      {"wait", "proxy_sleep_ns", WaitTuning::kProxySleepNs},
      {"grid", "default_blocks_per_sm", GridTuning::kDefaultBlocksPerSm},
  };
}

}  // namespace moe_a2a::a2a::cuda
