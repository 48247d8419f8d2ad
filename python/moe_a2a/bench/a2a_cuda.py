"""`moe-a2a bench a2a --device cuda`: per-phase time and bandwidth of the CUDA path.

Run under mpirun (ranks may share one GPU, each its own process), e.g.
    mpirun -n 4 python -m moe_a2a.bench.a2a_cuda --shapes decode prefill

In one run, for each shape (DeepSeek-V3: hidden 7168, 256 experts, top-8, fp8
dispatch, bf16 combine; decode 128 tokens per rank, prefill 4096):
- each phase of moe-a2a (dispatch send, dispatch recv, combine send, combine
  recv), eager (as `AllToAll` runs it), from a barrier until the last rank's
  stream is idle, median over iterations; its bandwidth is the bytes all ranks
  read and wrote in it over that time;
- at one rank, the whole decode step captured in a CUDA graph and replayed;
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

PHASES = ("dispatch_send", "dispatch_recv", "combine_send", "combine_recv")
MODEL = dict(hidden=7168, num_experts=256, topk=8)
SHAPES = {"decode": 128, "prefill": 4096}
COPY_BYTES = 1 << 30
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


def median_ms(fn: Any, iters: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
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
        result["step_ms"] = sum(result[p]["ms"] for p in PHASES)
        result["step_bytes"] = comm.allreduce(sum(mine.values()))
        if args.profile:
            profile_kernels(a2a, rounds[0], y_full, name, rank == 0)

    if world == 1 and name == "decode":
        result["graph_step_ms"] = graph_step_ms(cfg, args, comm, rounds[0], device)

    dispatch, combine = torch_native(rounds[0], y_full)
    native = []
    for it in range(args.warmup + args.iters):
        _, t_d = timed(comm, dispatch)
        _, t_c = timed(comm, combine)
        if it >= args.warmup:
            native.append(t_d + t_c)
    result["torch_native_ms"] = statistics.median(native)
    return result


def profile_kernels(a2a: Any, r: Round, y_full: torch.Tensor, name: str, report: bool) -> None:
    """Average GPU time of each kernel over a few eager steps; every rank steps, `report` prints."""
    from torch.profiler import ProfilerActivity, profile

    steps = 5
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            d = a2a.dispatch(r.x, r.ids, r.weights)
            a2a.combine(y_full[: d.expert_x.shape[0]], d)
        torch.cuda.synchronize()
    if not report:
        return
    print(f"-- kernels of one {name} step (rank 0, average of {steps}):")
    for e in sorted(prof.key_averages(), key=lambda e: -e.device_time_total):
        found = re.search(r"(\w+_kernel)", e.key)
        if e.device_time_total > 0 and "moe_a2a" in e.key and found:
            print(f"   {found.group(1):16} {e.device_time_total / steps:9.1f} us  x{e.count // steps}")


def graph_step_ms(cfg: Any, args: argparse.Namespace, comm: Any, r: Round, device: torch.device) -> float:
    """One decode step (all four phases) captured in a CUDA graph, timed over replays."""
    from moe_a2a.all_to_all import AllToAll

    with AllToAll(cfg, comm=comm, device="cuda", provider=args.provider, graph_safe=True) as a2a:
        y_full = torch.randn(a2a.max_output_rows, MODEL["hidden"], device=device).to(torch.bfloat16)

        def step() -> None:
            d = a2a.dispatch(r.x, r.ids, r.weights)
            a2a.combine(y_full, d)

        step()
        torch.cuda.synchronize()
        a2a.check()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        ms = median_ms(graph.replay, args.iters * 10)
        torch.cuda.synchronize()
        a2a.check()
        return ms


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
            f"{head} {'step':14} {step_us:9.1f}   torch-native {native_us:.1f} us "
            f"({native_us / step_us:.1f}x), bytes/copy-bandwidth floor {floor_us:.1f} us"
        )
        if "graph_step_ms" in res:
            g = res["graph_step_ms"] * 1e3
            line += f", graph replay {g:.1f} us ({g / floor_us:.1f}x floor)"
        print(line)
    if results:
        print(f"device-to-device copy: {results[0]['copy_gbs']:.0f} GB/s (read + write)")


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
    copy_gbs = 0.0
    comm.Barrier()
    if comm.Get_rank() == 0:  # alone on the GPU while the others wait
        copy_gbs = copy_bandwidth_gbs(torch.device("cuda", torch.cuda.current_device()))
    copy_gbs = comm.bcast(copy_gbs)
    results = [run_shape(name, args, comm, copy_gbs) for name in args.shapes]
    if comm.Get_rank() == 0:
        print_table(results)
        if args.json:
            with open(args.json, "a") as f:
                for res in results:
                    f.write(json.dumps(res) + "\n")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args())


if __name__ == "__main__":
    raise SystemExit(main())
