"""`moe-a2a bench a2a --device cuda`: per-phase time and bandwidth of the CUDA path.

Run under mpirun (ranks may share one GPU, each its own process), e.g.
    mpirun -n 4 python -m moe_a2a.bench.a2a_cuda --shapes decode prefill

In one run, for each shape (DeepSeek-V3: hidden 7168, 256 experts, top-8, fp8
dispatch, bf16 combine; decode 128 tokens per rank, prefill 4096):
- each phase of moe-a2a (dispatch send, dispatch recv, combine send, combine
  recv), eager (as `AllToAll` runs it), from a barrier until the last rank's
  stream is idle, median over iterations; its bandwidth is the bytes all ranks
  read and wrote in it over that time;
- the whole step (dispatch, then combine) timed the same way in one span, as
  the torch-native version is: their ratio compares like with like;
- at one rank, the whole decode step captured in a CUDA graph and replayed,
  timed from the replay call (graph launch included) and as a GPU span (the
  replay queued behind a sleeping kernel, so the span starts when the GPU
  does);
- the device-to-device copy bandwidth (bytes read plus written), the ceiling;
- a torch-native version of the same data movement on each rank (quantise,
  sort copies by expert, index_select; then index_add_ of the weighted rows).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch

from moe_a2a import switches

PHASES = ("dispatch_send", "dispatch_recv", "combine_send", "combine_recv")
MODEL = dict(hidden=7168, num_experts=256, topk=8)
SHAPES = {"decode": 128, "prefill": 4096}
COPY_BYTES = 1 << 30
# A sleeping kernel ahead of a timed launch (about 100 us on an H200), longer
# than the host takes to submit it: the start event then fires when the GPU
# reaches the work, so the span leaves out the launch latency.
QUEUE_SLEEP_CYCLES = 200_000
FP8_BLOCK = 128


@dataclass
class Round:
    x: torch.Tensor
    ids: torch.Tensor
    weights: torch.Tensor


def make_round(seed: int, tokens: int, device: torch.device) -> Round:
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(tokens, MODEL["hidden"], generator=g, device=device).to(torch.bfloat16)
    ids = torch.rand(tokens, MODEL["num_experts"], generator=g, device=device).argsort(dim=1)[
        :, : MODEL["topk"]
    ]
    weights = torch.rand(tokens, MODEL["topk"], generator=g, device=device)
    return Round(x, ids.contiguous(), weights)


def median_ms(fn: Any, iters: int, warmup: int = 3, queued: bool = False) -> float:
    """Median milliseconds of fn between CUDA events; `queued`: behind a sleeping kernel (GPU span)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if queued:
            torch.cuda._sleep(QUEUE_SLEEP_CYCLES)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def copy_bandwidth_gbs(device: torch.device) -> float:
    """Device-to-device copy, bytes read plus bytes written per second."""
    src = torch.empty(COPY_BYTES, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), iters=20)
    return 2 * COPY_BYTES / (ms * 1e-3) / 1e9


def fill_bandwidth_gbs(device: torch.device) -> float:
    """Bytes written per second by torch's 1 GiB fill_ (write-only traffic).

    Not the GPU's ceiling: on an H200 this measures about 3.3 TB/s (zero_ too),
    where cudaMemsetAsync and plain 16-byte stores write 4.3-4.5 TB/s
    (tools/gpu/write_bandwidth.cu).
    """
    dst = torch.empty(COPY_BYTES, dtype=torch.uint8, device=device)
    ms = median_ms(lambda: dst.fill_(1), iters=20)
    return COPY_BYTES / (ms * 1e-3) / 1e9


def phase_bytes(tokens: int, rows: int, dispatch_row: int, combine_row: int) -> dict[str, int]:
    """Bytes one rank reads plus writes in each phase (rows: copies it received)."""
    h, k = MODEL["hidden"], MODEL["topk"]
    scales = -(-h // FP8_BLOCK) * 4
    return {
        "dispatch_send": tokens * h * 2 + tokens * k * dispatch_row,
        "dispatch_recv": rows * dispatch_row + rows * (h + scales),
        "combine_send": rows * h * 2 + rows * combine_row,
        "combine_recv": tokens * k * combine_row + tokens * h * 2,
    }


def torch_native(r: Round, y: torch.Tensor) -> tuple[Any, Any]:
    """The same data movement with torch operations, one rank's share, as two callables."""
    from moe_a2a.reference import quantize_fp8

    k = MODEL["topk"]
    flat = r.ids.reshape(-1)
    state: dict[str, torch.Tensor] = {}

    def dispatch() -> None:
        q, s = quantize_fp8(r.x)
        order = torch.argsort(flat, stable=True)
        token = order // k
        state["x"] = q.index_select(0, token)
        state["s"] = s.index_select(0, token)
        state["counts"] = torch.bincount(flat, minlength=MODEL["num_experts"])
        state["order"], state["token"] = order, token

    def combine() -> None:
        rows = y[: flat.numel()].float() * r.weights.reshape(-1)[state["order"]].unsqueeze(1)
        out = torch.zeros(r.x.shape[0], MODEL["hidden"], dtype=torch.float32, device=y.device)
        out.index_add_(0, state["token"], rows)
        state["out"] = out.to(torch.bfloat16)

    return dispatch, combine


def timed(comm: Any, fn: Any) -> tuple[Any, float]:
    """Run fn on every rank from a barrier until its stream is idle: ms from the first start to the last end.

    Ranks that share a GPU run by time slices, so per-rank GPU timers would overlap and
    overcount; host clocks (one machine, CLOCK_MONOTONIC) give the span of the whole phase.
    """
    comm.Barrier()
    start = time.perf_counter_ns()
    out = fn()
    torch.cuda.current_stream().synchronize()
    end = time.perf_counter_ns()
    first, last = comm.allreduce(start, op=_op("MIN")), comm.allreduce(end, op=_op("MAX"))
    return out, (last - first) / 1e6


def run_shape(name: str, args: argparse.Namespace, comm: Any, copy_gbs: float) -> dict[str, Any]:
    from moe_a2a.all_to_all import AllToAll, Config

    rank, world = comm.Get_rank(), comm.Get_size()
    device = torch.device("cuda", torch.cuda.current_device())
    tokens = SHAPES[name]
    worst = world * tokens * MODEL["topk"]
    cfg = Config(
        max_tokens=tokens,
        dispatch_dtype="fp8",
        combine_dtype="bf16",
        # Room for twice the balanced load: random routing fits, buffers stay a fraction of the worst case.
        max_recv_tokens=min(worst, 2 * tokens * MODEL["topk"]),
        timeout_s=120.0,
        **MODEL,
    )
    rounds = [make_round(1000 * rank + i, tokens, device) for i in range(args.rounds)]
    result: dict[str, Any] = dict(shape=name, world=world, tokens=tokens, copy_gbs=copy_gbs)
    rpn = args.ranks_per_node
    with AllToAll(cfg, comm=comm, device="cuda", provider=args.provider, ranks_per_node=rpn) as a2a:
        result["ranks_per_node"] = len(a2a._node)
        y_full = torch.randn(a2a.max_output_rows, MODEL["hidden"], device=device).to(torch.bfloat16)
        times: dict[str, list[float]] = {p: [] for p in PHASES}
        received = []
        for it in range(args.warmup + args.iters):
            r = rounds[it % len(rounds)]
            pending, t0 = timed(comm, lambda r=r: a2a.dispatch(r.x, r.ids, r.weights, recv=False))
            d, t1 = timed(comm, lambda p=pending: a2a.dispatch(handle=p, send=False))
            pending_c, t2 = timed(comm, lambda d=d: a2a.combine(y_full[: d.expert_x.shape[0]], d, recv=False))
            _, t3 = timed(comm, lambda p=pending_c: a2a.combine(handle=p, send=False))
            if it >= args.warmup:
                for phase, t in zip(PHASES, (t0, t1, t2, t3), strict=True):
                    times[phase].append(t)
                received.append(d.expert_x.shape[0])
        row_bytes = (a2a._core_cfg.dispatch_row_bytes, a2a._core_cfg.combine_row_bytes)
        mine = phase_bytes(tokens, int(statistics.median(received)), *row_bytes)
        for phase in PHASES:
            ms = statistics.median(times[phase])
            result[phase] = dict(ms=ms, gbs=comm.allreduce(mine[phase]) / (ms * 1e-3) / 1e9)
        result["phases_ms"] = sum(result[p]["ms"] for p in PHASES)
        result["step_bytes"] = comm.allreduce(sum(mine.values()))

        def step(r: Round) -> None:
            d = a2a.dispatch(r.x, r.ids, r.weights)
            a2a.combine(y_full[: d.expert_x.shape[0]], d)

        # The whole step and the torch-native version in alternating blocks, so that
        # both see the same machine (host timings on a VM drift within a run) and
        # each runs back to back, as it would in a model.
        native_dispatch, native_combine = torch_native(rounds[0], y_full)
        spans, native = [], []
        block = max(1, args.iters // 4)
        for start in range(0, args.warmup + args.iters, block):
            for it in range(start, min(start + block, args.warmup + args.iters)):
                spans.append(timed(comm, lambda it=it: step(rounds[it % len(rounds)]))[1])
            for _ in range(start, min(start + block, args.warmup + args.iters)):
                native.append(timed(comm, lambda: (native_dispatch(), native_combine()))[1])
        result["step_ms"] = statistics.median(spans[args.warmup :])
        result["torch_native_ms"] = statistics.median(native[args.warmup :])
        if args.profile:
            result["kernel_us"] = profile_kernels(a2a, rounds[0], y_full, name, rank == 0)
            result["rank_bytes"] = mine

    if world == 1 and name == "decode":
        result["graph_step_ms"], result["graph_span_ms"] = graph_step_ms(cfg, args, comm, rounds[0], device)

    return result


# Which phase each kernel belongs to (src/a2a/cuda/*.cu).
KERNEL_PHASE = {
    "route_pack_kernel": "dispatch_send",
    "count_kernel": "dispatch_send",
    "slot_kernel": "dispatch_send",
    "pack_kernel": "dispatch_send",
    "bulk_pack_kernel": "dispatch_send",
    "plan_kernel": "dispatch_recv",
    "copy_kernel": "dispatch_recv",
    "plan_copy_kernel": "dispatch_recv",
    "return_kernel": "combine_send",
    "wait_kernel": "combine_recv",
    "reduce_kernel": "combine_recv",
}


def profile_kernels(a2a: Any, r: Round, y_full: torch.Tensor, name: str, report: bool) -> dict[str, float]:
    """Average GPU time (us) of each kernel over a few eager steps; every rank steps, `report` prints."""
    from torch.profiler import ProfilerActivity, profile

    steps = 5
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            d = a2a.dispatch(r.x, r.ids, r.weights)
            a2a.combine(y_full[: d.expert_x.shape[0]], d)
        torch.cuda.synchronize()
    kernels: dict[str, float] = {}
    for e in prof.key_averages():
        found = re.search(r"(\w+_kernel)", e.key)
        if e.device_time_total > 0 and "moe_a2a" in e.key and found:
            kernels[found.group(1)] = kernels.get(found.group(1), 0.0) + e.device_time_total / steps
    if report:
        print(f"-- kernels of one {name} step (rank 0, average of {steps}):")
        for kernel, us in sorted(kernels.items(), key=lambda kv: -kv[1]):
            print(f"   {kernel:18} {us:9.1f} us")
    return kernels


def capture_step(a2a: Any, r: Round, device: torch.device) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """One step (dispatch, then combine) of a graph-safe AllToAll, run once, then captured.

    Returns the graph and the expert outputs it reads: keep both while replaying.
    """
    y_full = torch.randn(a2a.max_output_rows, MODEL["hidden"], device=device).to(torch.bfloat16)

    def step() -> None:
        a2a.combine(y_full, a2a.dispatch(r.x, r.ids, r.weights))

    step()
    torch.cuda.synchronize()
    a2a.check()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph, y_full


def graph_step_ms(
    cfg: Any, args: argparse.Namespace, comm: Any, r: Round, device: torch.device
) -> tuple[float, float]:
    """One decode step (all four phases) captured in a CUDA graph: (from the replay call, GPU span) ms."""
    from moe_a2a.all_to_all import AllToAll

    with AllToAll(cfg, comm=comm, device="cuda", provider=args.provider, graph_safe=True) as a2a:
        graph, _y = capture_step(a2a, r, device)
        launched = median_ms(graph.replay, args.iters * 10)
        span = median_ms(graph.replay, args.iters * 10, queued=True)
        torch.cuda.synchronize()
        a2a.check()
        return launched, span


def _op(name: str) -> Any:
    from mpi4py import MPI

    return getattr(MPI, name)


def print_table(results: list[dict[str, Any]]) -> None:
    print(f"{'shape':8} {'ranks':>5} {'phase':14} {'time us':>9} {'GB/s':>7} {'% copy':>7}")
    for res in results:
        head = f"{res['shape']:8} {res['world']:>5}"
        for phase in PHASES:
            p = res[phase]
            pct = 100 * p["gbs"] / res["copy_gbs"]
            print(f"{head} {phase:14} {p['ms'] * 1e3:9.1f} {p['gbs']:7.0f} {pct:6.0f}%")
        floor_us = res["step_bytes"] / (res["copy_gbs"] * 1e9) * 1e6
        native_us, step_us = res["torch_native_ms"] * 1e3, res["step_ms"] * 1e3
        line = (
            f"{head} {'step':14} {step_us:9.1f}   (phases apart {res['phases_ms'] * 1e3:.1f}) "
            f"torch-native {native_us:.1f} us ({native_us / step_us:.1f}x), "
            f"bytes/copy-bandwidth floor {floor_us:.1f} us"
        )
        if "graph_step_ms" in res:
            g, span = res["graph_step_ms"] * 1e3, res["graph_span_ms"] * 1e3
            line += (
                f", graph replay {g:.1f} us from the call ({g / floor_us:.2f}x floor), "
                f"GPU span {span:.1f} us ({span / floor_us:.2f}x floor)"
            )
        print(line)
    # Alone on the GPU only: with ranks sharing it, one rank's kernels run beside the
    # others', and its bytes over its kernels' time would say little.
    for res in (r for r in results if "kernel_us" in r and r["world"] == 1):
        print(f"{res['shape']:8} {res['world']:>5} rank 0's kernels per phase (GPU time):")
        for phase in PHASES:
            us = sum(t for k, t in res["kernel_us"].items() if KERNEL_PHASE.get(k) == phase)
            gbs = res["rank_bytes"][phase] / (us * 1e-6) / 1e9 if us > 0 else 0.0
            line = f"{'':14} {phase:14} {us:9.1f} {gbs:7.0f} {100 * gbs / res['copy_gbs']:6.0f}%"
            print(line)
        unassigned = sorted(k for k in res["kernel_us"] if k not in KERNEL_PHASE)
        if unassigned:  # a new kernel: add it to KERNEL_PHASE
            print(f"{'':14} kernels of no phase (not counted above): {', '.join(unassigned)}")
    if results:
        print(
            f"device-to-device copy: {results[0]['copy_gbs']:.0f} GB/s (read + write); "
            f"fill: {results[0]['fill_gbs']:.0f} GB/s (write only)"
        )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=["decode", "prefill"])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=4, help="distinct input sets, cycled")
    parser.add_argument("--provider", default="auto")
    parser.add_argument("--ranks-per-node", type=int, default=None, help="virtual nodes (fabric path)")
    parser.add_argument("--json", default=None, help="append the results to this file (rank 0)")
    parser.add_argument("--profile", action="store_true", help="print each kernel's GPU time (rank 0)")


def run(args: argparse.Namespace) -> int:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    torch.cuda.set_device(comm.Get_rank() % torch.cuda.device_count())
    ceilings = (0.0, 0.0)
    comm.Barrier()
    if comm.Get_rank() == 0:  # alone on the GPU while the others wait
        device = torch.device("cuda", torch.cuda.current_device())
        ceilings = (copy_bandwidth_gbs(device), fill_bandwidth_gbs(device))
    copy_gbs, fill_gbs = comm.bcast(ceilings)
    results = [run_shape(name, args, comm, copy_gbs) for name in args.shapes]
    for res in results:
        res["fill_gbs"] = fill_gbs
    if comm.Get_rank() == 0:
        print_table(results)
        if args.json:
            with open(args.json, "a") as f:
                for res in results:
                    f.write(json.dumps({**res, "switches": switches.recorded()}) + "\n")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    add_arguments(parser)
    return run(parser.parse_args())


if __name__ == "__main__":
    raise SystemExit(main())
