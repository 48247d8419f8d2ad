"""`moe-a2a bench a2a --device cuda`: per-phase time and bandwidth of the CUDA path.

Run under mpirun (ranks may share one GPU, each its own process), e.g.
    mpirun -n 4 python -m moe_a2a.bench.a2a_cuda --shapes decode prefill

In one run, for each shape (DeepSeek-V3: hidden 7168, 256 experts, top-8, fp8
dispatch, bf16 combine; decode 128 tokens per rank, prefill 4096):
- each phase of moe-a2a (dispatch send, dispatch recv, combine send, combine
  recv), eager (as `AllToAll` runs it), after a barrier, the slowest rank's
  time between CUDA events (bench/common.py), median over iterations; its
  bandwidth is the bytes all ranks read and wrote in it over that time;
- the whole step (dispatch, then combine) timed the same way in one span, as
  the torch-native version is: their ratio compares like with like;
- at one rank, the whole decode step captured in a CUDA graph and replayed,
  timed from the replay call (graph launch included) and as a GPU span (the
  replay queued behind a sleeping kernel, so the span starts when the GPU
  does);
- the device-to-device copy bandwidth (bytes read plus written), the ceiling;
- a torch-native version of the same data movement on each rank (quantise,
  sort copies by expert, index_select; then index_add_ of the weighted rows);
- with every peer remote (`--ranks-per-node 1`), each whole phase (dispatch,
  combine: both halves in one span) against the transfer engine alone moving
  that iteration's per-peer bytes, timed alike (`moe_a2a.bench.engine_ref`);
- with `--rows-path staged,gpu-direct`, all of the above once per path (one
  AllToAll each, MOE_A2A_GPU_DIRECT forced), then each phase's staged time
  over its GPU-direct time.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import statistics
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from moe_a2a import report, switches
from moe_a2a._core import FP8_BLOCK
from moe_a2a.bench import common, engine_ref
from moe_a2a.bench.args import ROWS_PATHS, int_at_least, rows_paths

PHASES = ("dispatch_send", "dispatch_recv", "combine_send", "combine_recv")
ENGINE_PHASES = ("dispatch", "combine", "total")  # whole phases, against the engine alone
MODEL = dict(hidden=7168, num_experts=256, topk=8)
SHAPES = {"decode": 128, "prefill": 4096}
COPY_BYTES = 1 << 30
# A sleeping kernel ahead of a timed launch (about 100 us on an H200), longer
# than the host takes to submit it: the start event then fires when the GPU
# reaches the work, so the span leaves out the launch latency.
QUEUE_SLEEP_CYCLES = 200_000


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
    """`bench.common.timed` in ms, on the GPU's clock where there is one.

    Without CUDA (the tests' CPU AllToAll) it is the host's clock.
    """
    result, ns = common.timed(comm, fn, torch.device("cuda") if torch.cuda.is_available() else None)
    return result, ns / 1e6


@contextlib.contextmanager
def forced_path(path: str | None) -> Iterator[None]:
    """MOE_A2A_GPU_DIRECT set for one AllToAll's construction (`path` None: left as it is)."""
    if path is None:
        yield
        return
    before = os.environ.get("MOE_A2A_GPU_DIRECT")
    os.environ["MOE_A2A_GPU_DIRECT"] = ROWS_PATHS[path]
    try:
        yield
    finally:
        if before is None:
            del os.environ["MOE_A2A_GPU_DIRECT"]
        else:
            os.environ["MOE_A2A_GPU_DIRECT"] = before


def run_shape(
    name: str, args: argparse.Namespace, comm: Any, copy_gbs: float, path: str | None = None
) -> dict[str, Any]:
    """One shape's passes on one AllToAll; `path` (--rows-path) forces its rows' path."""
    from moe_a2a.all_to_all import AllToAll, Config, Dispatched

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
        hidden=MODEL["hidden"],
        num_experts=MODEL["num_experts"],
        topk=MODEL["topk"],
    )
    rounds = [make_round(1000 * rank + i, tokens, device) for i in range(args.rounds)]
    result: dict[str, Any] = dict(shape=name, world=world, tokens=tokens, copy_gbs=copy_gbs)
    if path is not None:
        result["path"] = path
    rpn = args.ranks_per_node
    with forced_path(path):
        a2a = AllToAll(cfg, comm=comm, device="cuda", provider=args.provider, ranks_per_node=rpn)
    with a2a:
        result["ranks_per_node"] = len(a2a._node)
        result["rows_path"] = a2a.rows_path
        result["fabric_rows"] = a2a.cfg.fabric_rows  # "auto" resolved: what this instance runs
        y_full = torch.randn(a2a.max_output_rows, MODEL["hidden"], device=device).to(torch.bfloat16)
        times: dict[str, list[float]] = {p: [] for p in PHASES}
        received = []
        # Two passes (three with every peer remote): the phases apart, [each whole phase against
        # the engine alone,] then the whole step against torch-native.
        passes = 3 if engine_ref.applies(a2a) else 2
        bar = report.progress(passes * (args.warmup + args.iters), name, rank=rank, mode=args.progress)
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
            bar.update()
        row_bytes = (a2a._core_cfg.dispatch_row_bytes, a2a._core_cfg.combine_row_bytes)
        mine = phase_bytes(tokens, int(statistics.median(received)), *row_bytes)
        for phase in PHASES:
            ms = statistics.median(times[phase])
            result[phase] = dict(ms=ms, gbs=comm.allreduce(mine[phase]) / (ms * 1e-3) / 1e9)
        result["phases_ms"] = sum(result[p]["ms"] for p in PHASES)
        result["step_bytes"] = comm.allreduce(sum(mine.values()))
        # Its own engine only for its own pass: the other passes run as they did without it.
        alone = engine_ref.start_for(a2a, comm, args.provider)
        if alone is not None:
            result["whole_ns"] = whole_phases(a2a, alone, rounds, y_full, comm, args, bar)
            result["engine_ns"] = alone.samples
            alone.close()

        def step(r: Round) -> None:
            d = a2a.dispatch(r.x, r.ids, r.weights)
            assert isinstance(d, Dispatched)  # a whole call
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
                bar.update()
        bar.close()
        result["step_ms"] = statistics.median(spans[args.warmup :])
        result["torch_native_ms"] = statistics.median(native[args.warmup :])
        if args.profile:
            result["kernel_us"] = profile_kernels(a2a, rounds[0], y_full, name, rank == 0)
            result["rank_bytes"] = mine

    if world == 1 and name == "decode" and path in (None, "staged"):
        result["graph_step_ms"], result["graph_span_ms"] = graph_step_ms(cfg, args, comm, rounds[0], device)

    return result


def whole_phases(
    a2a: Any,
    alone: engine_ref.EngineReference,
    rounds: list[Round],
    y_full: torch.Tensor,
    comm: Any,
    args: argparse.Namespace,
    bar: Any,
) -> dict[str, list[float]]:
    """Dispatch and combine, each whole in one span, then the engine alone moving that iteration's
    per-peer bytes on the same clock (`timed`); ns of the timed iterations (the engine's: `alone.samples`).

    Not the halves: a phase's writes are posted in its send half and awaited in its recv half.
    """

    def clock(fn: Any) -> float:
        return timed(comm, fn)[1] * 1e6

    whole: dict[str, list[float]] = {"dispatch": [], "combine": []}
    for it in range(args.warmup + args.iters):
        r = rounds[it % len(rounds)]
        d, t_d = timed(comm, lambda r=r: a2a.dispatch(r.x, r.ids, r.weights))
        _, t_c = timed(comm, lambda d=d: a2a.combine(y_full[: d.expert_x.shape[0]], d))
        keep = it >= args.warmup
        alone.sample(r.ids.cpu().numpy(), a2a.cfg.num_experts, keep, timer=clock)
        if keep:
            whole["dispatch"].append(t_d * 1e6)
            whole["combine"].append(t_c * 1e6)
        bar.update()
    return whole


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


def profile_kernels(a2a: Any, r: Round, y_full: torch.Tensor, name: str, report_: bool) -> dict[str, float]:
    """Average GPU time (us) of each kernel over a few eager steps; every rank steps, `report_` prints."""
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
    if report_:
        print(f"kernels of one {name} step (rank 0, average of {steps}):")
        print(report.table(["kernel", "GPU time (us)"], sorted(kernels.items(), key=lambda kv: -kv[1])))
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


def _us(ms: float | None) -> float | None:
    return None if ms is None else ms * 1e3


def rows_of(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per shape and phase, [the whole phases against the engine alone,] then the whole
    step against torch-native (the baseline); us."""
    rows = []
    for res in results:
        lead = {"shape": res["shape"], "tokens": res["tokens"]}
        if "path" in res:
            lead["rows_path"] = res["path"]
        for phase in PHASES:
            p = res[phase]
            rows.append(
                {
                    **lead,
                    "phase": phase,
                    "moe_a2a_us": p["ms"] * 1e3,
                    "moe_a2a_gbs": p["gbs"],
                    "pct_of_copy": 100 * p["gbs"] / res["copy_gbs"],
                }
            )
        if "engine_ns" in res:  # every peer remote
            rows.extend({**lead, **row} for row in engine_rows(res["whole_ns"], res["engine_ns"]))
        step_us, native_us = res["step_ms"] * 1e3, res["torch_native_ms"] * 1e3
        rows.append(
            {
                **lead,
                "phase": "step",
                "moe_a2a_us": step_us,
                "phases_apart_us": res["phases_ms"] * 1e3,
                "baseline_us": native_us,
                "ratio": report.ratio(native_us, step_us),
                "copy_floor_us": res["step_bytes"] / (res["copy_gbs"] * 1e9) * 1e6,
                "graph_replay_us": _us(res.get("graph_step_ms")),  # one rank, decode only
                "graph_span_us": _us(res.get("graph_span_ms")),
            }
        )
    return rows


def path_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """--rows-path staged,gpu-direct: per shape and phase (the table's rows of each path), the
    staged time, the GPU-direct time and staged/gpu-direct (above 1: GPU-direct is faster)."""
    by_key: dict[tuple[str, str], dict[str, float]] = {}
    for r in rows:
        if r.get("rows_path") in ROWS_PATHS:
            by_key.setdefault((r["shape"], r["phase"]), {})[r["rows_path"]] = r["moe_a2a_us"]
    out = []
    for (shape, phase), t in by_key.items():
        if set(t) == set(ROWS_PATHS):
            staged, direct = t["staged"], t["gpu-direct"]
            out.append(
                {
                    "shape": shape,
                    "phase": phase,
                    "staged_us": staged,
                    "gpu_direct_us": direct,
                    "staged_over_direct": report.ratio(staged, direct),
                }
            )
    return out


PATH_COLUMNS = (
    ("shape", "shape"),
    ("phase", "phase"),
    ("staged_us", "staged (us)"),
    ("gpu_direct_us", "gpu-direct (us)"),
    ("staged_over_direct", "staged/gpu-direct"),
)
PATH_NOTE = (
    "staged/gpu-direct: the staged p50 over the GPU-direct p50, same run; above 1, GPU-direct is faster"
)


def engine_rows(whole_ns: dict[str, list[float]], engine_ns: dict[str, list[float]]) -> list[dict[str, Any]]:
    """dispatch, combine and total (each iteration's sum): the whole phase's p50 and the engine's."""
    rows = []
    for phase in ENGINE_PHASES:
        if phase == "total":
            ours = np.add(whole_ns["dispatch"], whole_ns["combine"])
            engine = np.add(engine_ns["dispatch"], engine_ns["combine"])
        else:
            ours, engine = np.asarray(whole_ns[phase]), np.asarray(engine_ns[phase])
        p50 = report.percentiles_us(ours)["p50"]
        rows.append({"phase": phase, "moe_a2a_us": p50, **engine_ref.fields(p50, engine)})
    return rows


# (row key, column header) of the printed table; the CSV and JSON have every key of the rows.
COLUMNS = (
    ("shape", "shape"),
    ("tokens", "tokens/rank"),
    ("phase", "phase"),
    ("moe_a2a_us", "moe-a2a (us)"),
    ("moe_a2a_gbs", "moe-a2a GB/s"),
    ("pct_of_copy", "% of copy"),
    ("baseline_us", "baseline (us)"),
    ("ratio", report.RATIO),
    ("copy_floor_us", "copy floor (us)"),
    ("graph_replay_us", "graph replay (us)"),
)


def format_table(rows: list[dict[str, Any]]) -> str:
    columns: tuple[tuple[str, str], ...] = COLUMNS
    if any("rows_path" in r for r in rows):  # --rows-path: which path each row measured
        columns = (*COLUMNS[:2], ("rows_path", "rows' path"), *COLUMNS[2:])
    columns += engine_ref.COLUMNS if any("engine_p50_us" in r for r in rows) else ()
    formats = {"moe_a2a_gbs": ".0f", "pct_of_copy": ".0f", "phase_engine": ".2f"}
    return report.columns_table(columns, rows, formats)


NOTE = (
    "phases: after a barrier, the slowest rank's time between CUDA events, median; GB/s: bytes all "
    "ranks read and wrote over that time; step: dispatch then combine in one span; baseline: the same data "
    f"movement in torch operations; {report.RATIO_NOTE}; copy floor: the step's bytes at the "
    "device-to-device copy bandwidth; graph replay: one rank, the step in a CUDA graph, from the call"
)
# With every peer remote: what the engine columns compare (the halves are not compared: a phase's
# writes are posted in its send half and awaited in its recv half).
ENGINE_NOTE = (
    "dispatch, combine: each whole phase (send and recv halves) in one span, in a pass of its own, "
    "each iteration followed by the engine alone moving its bytes (dispatch: the routing row and the "
    "rows to each peer; combine: the rows back to each peer), timed alike; total = dispatch + combine "
    f"of each iteration; {engine_ref.NOTE}"
)


def note_of(rows: list[dict[str, Any]]) -> str:
    """The footnote of the table: the engine's part where its columns are there."""
    engine = any("engine_p50_us" in r for r in rows)
    return f"{NOTE}; {ENGINE_NOTE}" if engine else NOTE


def format_kernels(results: list[dict[str, Any]]) -> str:
    """Rank 0's kernels per phase, alone on the GPU only (sharing it, its kernels run beside others')."""
    rows = []
    for res in (r for r in results if "kernel_us" in r and r["world"] == 1):
        for phase in PHASES:
            us = sum(t for k, t in res["kernel_us"].items() if KERNEL_PHASE.get(k) == phase)
            gbs = res["rank_bytes"][phase] / (us * 1e-6) / 1e9 if us > 0 else 0.0
            rows.append([res["shape"], phase, us, gbs, 100 * gbs / res["copy_gbs"]])
        unassigned = sorted(k for k in res["kernel_us"] if k not in KERNEL_PHASE)
        if unassigned:  # a new kernel: add it to KERNEL_PHASE
            rows.append([res["shape"], "no phase: " + ", ".join(unassigned), None, None, None])
    if not rows:
        return ""
    head = ["shape", "phase", "kernels GPU time (us)", "GB/s", "% of copy"]
    return "rank 0's kernels per phase:\n" + report.table(head, rows, [".1f", ".1f", ".1f", ".0f", ".0f"])


def settings_of(args: argparse.Namespace, world: int, results: list[dict[str, Any]]) -> dict[str, Any]:
    return dict(
        world=world,
        ranks_per_node=results[0]["ranks_per_node"] if results else None,
        fabric_rows=results[0].get("fabric_rows") if results else None,
        rows_path={
            r["shape"] + (f" {r['path']}" if "path" in r else ""): r["rows_path"]
            for r in results
            if r.get("rows_path")
        },
        provider=args.provider,
        device="cuda",
        baseline="torch-native",
        dispatch_dtype="fp8",
        combine_dtype="bf16",
        iters=args.iters,
        warmup=args.warmup,
        rounds=args.rounds,
        shapes={name: {"tokens": SHAPES[name], **MODEL} for name in args.shapes},
        copy_gbs=results[0]["copy_gbs"] if results else None,
        fill_gbs=results[0]["fill_gbs"] if results else None,
    )


def format_config(s: dict[str, Any]) -> str:
    sizes = "; ".join(f"{n} {report.sizes_text(**v)}" for n, v in s["shapes"].items())
    return report.config_block(
        "moe-a2a bench a2a --device cuda",
        {
            "ranks": f"{s['world']} ({s['ranks_per_node']} per node)",
            "provider": s["provider"],
            "rows' path": report.rows_path_text(s["rows_path"]) if s.get("rows_path") else "unknown",
            "fabric_rows": s.get("fabric_rows") or "unknown",
            "device": f"cuda ({torch.cuda.get_device_name()})" if torch.cuda.is_available() else "cuda",
            "baseline": "torch-native (quantise, sort by expert, index_select; index_add_)",
            "payloads": f"dispatch {s['dispatch_dtype']}, combine {s['combine_dtype']}",
            "sizes": sizes,
            "iterations": f"{s['iters']} timed after {s['warmup']} warm-up, {s['rounds']} input sets",
            "ceilings": f"device-to-device copy {s['copy_gbs']:.0f} GB/s (read + write), "
            f"fill {s['fill_gbs']:.0f} GB/s (write only)",
            "tuning": report.tuning_set(),
            "switches": report.switches_set(),
        },
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--shapes",
        nargs="+",
        choices=sorted(SHAPES),
        default=["decode", "prefill"],
        help="decode (128 tokens/rank), prefill (4096) (default: decode prefill)",
    )
    parser.add_argument("--iters", type=int_at_least(1), default=20, help="timed iterations (default: 20)")
    parser.add_argument("--warmup", type=int_at_least(0), default=3, help="untimed iterations (default: 3)")
    parser.add_argument(
        "--rounds", type=int_at_least(1), default=4, help="distinct input sets, cycled (default: 4)"
    )
    parser.add_argument("--provider", default="auto", help="libfabric provider (default: auto)")
    parser.add_argument(
        "--ranks-per-node",
        type=int_at_least(1),
        default=None,
        help="virtual nodes of this many ranks (fabric path) (default: the real hosts)",
    )
    parser.add_argument(
        "--rows-path",
        type=rows_paths,
        default=None,
        help="run each shape once per rows' path, forced, and compare them: staged, gpu-direct or "
        "staged,gpu-direct (default: the path AllToAll chooses)",
    )
    parser.add_argument(
        "--json", default=None, help="append one JSON line per shape to this file (rank 0) (default: none)"
    )
    report.add_output_argument(parser)
    parser.add_argument(
        "--profile", action="store_true", help="print each kernel's GPU time (rank 0) (default: off)"
    )
    report.add_progress_argument(parser)


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
    results = []
    for name in args.shapes:
        for path in getattr(args, "rows_path", None) or [None]:
            results.append(run_shape(name, args, comm, copy_gbs, path))
        report.case_done(f"moe-a2a bench a2a: {name} done", rank=comm.Get_rank(), mode=args.progress)
    for res in results:
        res["fill_gbs"] = fill_gbs
    if comm.Get_rank() == 0:
        settings = settings_of(args, comm.Get_size(), results)
        rows = rows_of(results)
        note = note_of(rows)
        print(format_config(settings), "", format_table(rows), f"({note})", sep="\n")
        compared = path_rows(rows)
        if compared:
            print(
                "",
                report.columns_table(PATH_COLUMNS, compared, {"staged_over_direct": ".2f"}),
                f"({PATH_NOTE})",
                sep="\n",
            )
        kernels = format_kernels(results)
        if kernels:
            print(kernels)
        if args.json:
            run = {"switches": switches.recorded(), "cuda_tuning": report.cuda_tuning()}
            with open(args.json, "a") as f:
                for res in results:
                    f.write(json.dumps({**res, **run}) + "\n")
        if args.output:
            meta = {**report.run_meta("a2a --device cuda", settings), "note": note}
            report.write_output(args.output, rows, meta)
            print(f"figures written to {args.output}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    add_arguments(parser)
    return run(parser.parse_args())


if __name__ == "__main__":
    raise SystemExit(main())
