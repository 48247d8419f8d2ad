"""Where one rank's training step of dispatch + combine spends its GPU time (one process, no mpirun).

    python3 tools/gpu/profile_train.py [--dispatch-dtype bf16|fp8] [--compile] [--steps 3]
                                       [--compiled-rows exact|capacity] [--trace FILE.json] [--stacks]
                                       [--timeline]

The step of `moe-a2a bench a2a --train` at the DeepSeek-V3 training shape
(4096 tokens, hidden 7168, 256 experts, top-8, bf16 gradients, the identity
expert): prints the median forward and backward time of 10 steps, then the
torch profiler's table of kernels over `--steps` steps (divide by the steps
for a step's share). `--trace` also writes the profiled steps as a Chrome
trace (host calls and kernels on one clock), where the host waits show as
gaps between kernels; `--stacks` records the Python functions too (slower
steps, but it names the host's work in each gap). `--compile` profiles the
forward under torch.compile (fullgraph), as `bench a2a --train --compile` runs it.
`--timeline` prints, for the forward and the backward, each kernel's start after the
phase's call, its duration and how long the GPU idled before it (medians over the
profiled steps): the idle time before the first kernel is the host's, exposed; then the
phase's kernel time, summed, and the GPU's idle time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from dataclasses import dataclass

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from moe_a2a import Config
from moe_a2a.autograd import ExpertParallel

T, H, E, K = 4096, 7168, 256, 8
CPU_SHAPE = (64, 128, 16, 4)  # device "cpu": the same calls at a size the host's Python dominates


def training_case(
    dispatch_dtype: str, compiled_rows: str = "exact", device: str = "cuda"
) -> tuple[ExpertParallel, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The step's ExpertParallel (one rank, GPU 0, or the CPU at CPU_SHAPE) and its inputs: x, ids,
    weights, the output's gradient."""
    from mpi4py import MPI  # here: importing the timeline (tests/unit) starts no MPI

    tokens, hidden, experts, topk = CPU_SHAPE if device == "cpu" else (T, H, E, K)
    if device == "cuda":
        torch.cuda.set_device(0)
    cfg = Config(
        max_tokens=tokens,
        hidden=hidden,
        num_experts=experts,
        topk=topk,
        dispatch_dtype=dispatch_dtype,
        combine_dtype="bf16",
        max_recv_tokens=tokens * topk,
    )
    ep = ExpertParallel(cfg, MPI.COMM_WORLD, device=device, grad_dtype="bf16", compiled_rows=compiled_rows)
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(tokens, hidden, generator=g).bfloat16().to(device)
    ids = torch.stack([torch.randperm(experts, generator=g)[:topk] for _ in range(tokens)]).to(device)
    w0 = torch.rand(tokens, topk, generator=g).to(device)
    grad_out = torch.randn(tokens, hidden, generator=g).bfloat16().to(device)
    return ep, x0, ids, w0, grad_out


def step_forward(ep: ExpertParallel, ids: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The step's forward: dispatch, the identity expert, combine."""
    r = ep.dispatch(x, ids, w)
    return ep.combine(r.expert_x * 1.0, r)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dispatch-dtype", choices=("bf16", "fp8"), default="bf16")
    p.add_argument("--steps", type=int, default=3, help="profiled steps")
    p.add_argument("--trace", help="write the profiled steps as a Chrome trace to this file")
    p.add_argument("--stacks", action="store_true", help="record Python functions in the trace")
    p.add_argument("--compile", action="store_true", help="the forward under torch.compile (fullgraph)")
    p.add_argument(
        "--compiled-rows",
        choices=("exact", "capacity"),
        default="exact",
        help="with --compile: ExpertParallel's compiled_rows",
    )
    p.add_argument(
        "--timeline", action="store_true", help="each phase's kernels, and the GPU's idle time before each"
    )
    args = p.parse_args()
    ep, x0, ids, w0, grad_out = training_case(args.dispatch_dtype, args.compiled_rows)

    def forward(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return step_forward(ep, ids, x, w)

    if args.compile:
        torch._dynamo.config.capture_scalar_outputs = True
        forward = torch.compile(forward, fullgraph=True)

    def step() -> tuple[float, float]:
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with record_function(PHASES[0]):  # the marks --timeline splits the trace by
            out = forward(x, w)
            torch.cuda.synchronize()
        t1 = time.perf_counter()
        with record_function(PHASES[1]):
            out.backward(grad_out)
            torch.cuda.synchronize()
        return (t1 - t0) * 1e6, (time.perf_counter() - t1) * 1e6

    for _ in range(5):
        step()
    times = [step() for _ in range(10)]
    fwd, bwd = (statistics.median(t[i] for t in times) for i in (0, 1))
    what = args.dispatch_dtype + (" compiled" if args.compile else "")
    print(f"{what}: forward {fwd:.0f} us, backward {bwd:.0f} us (medians of 10)")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=args.stacks) as prof:
        for _ in range(args.steps):
            step()
    print(f"kernels over {args.steps} steps:")
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=20, max_name_column_width=70))
    print("host calls over the same steps:")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=70))
    if args.trace:
        prof.export_chrome_trace(args.trace)
    if args.timeline:
        print_timeline(prof, args.trace)
    ep.close()


PHASES = ("train_step_forward", "train_step_backward")


def print_timeline(prof: profile, trace: str | None) -> None:
    """Per phase, every kernel's start (after the phase's call), duration and the GPU's idle
    time before it, as medians over the profiled steps (host and GPU share the trace's clock).
    `trace`: the file --trace already wrote, read instead of exporting the trace again."""
    with tempfile.TemporaryDirectory() as tmp:
        path = trace or os.path.join(tmp, "trace.json")
        if trace is None:
            prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    for phase, t in phase_timelines(events).items():
        if isinstance(t, str):
            print(f"{phase}: {t}")
            continue
        print(f"{phase}: {t.span_us:.0f} us (median of {t.steps} profiled steps)")
        print(f"  {'start us':>9} {'kernel us':>9} {'idle before':>11}  kernel")
        for name, start, dur, idle in t.kernels:
            print(f"  {start:9.1f} {dur:9.1f} {idle:11.1f}  {name[:90]}")
        print(f"  idle after the last kernel (the host's synchronise): {t.idle_after_us:.1f} us")
        share = 100 * t.idle_us / t.span_us
        # Kernels that overlap (programmatic dependent launch) count each in full.
        print(f"  kernels {t.busy_us:.0f} us summed, GPU idle {t.idle_us:.0f} us ({share:.0f}% of the phase)")


@dataclass(frozen=True)
class PhaseTimeline:
    """One phase's kernels over the profiled steps, medians: (name, start after the phase's
    call, duration, GPU idle before it), all in us."""

    steps: int
    span_us: float
    kernels: list[tuple[str, float, float, float]]
    idle_after_us: float

    @property
    def busy_us(self) -> float:
        """The kernels' durations, summed: what the phase would take with no host time."""
        return sum(k[2] for k in self.kernels)

    @property
    def idle_us(self) -> float:
        """The GPU's idle time in the phase: before each kernel, and after the last."""
        return sum(k[3] for k in self.kernels) + self.idle_after_us


def phase_timelines(events: list[dict]) -> dict[str, PhaseTimeline | str]:
    """Each phase's timeline from a Chrome trace's events, or why there is none."""
    gpu = sorted(
        (e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
        key=lambda e: e["ts"],
    )
    out: dict[str, PhaseTimeline | str] = {}
    med = statistics.median
    for phase in PHASES:
        spans = [
            e
            for e in events
            if e.get("ph") == "X" and e.get("name") == phase and e.get("cat") == "user_annotation"
        ]
        steps = []  # per step: its span, its kernels (name, start, duration, idle before), idle after
        for span in spans:
            start, end = span["ts"], span["ts"] + span["dur"]
            rows, free = [], start
            for k in (k for k in gpu if start <= k["ts"] < end):
                rows.append((k["name"], k["ts"] - start, k["dur"], max(0.0, k["ts"] - free)))
                free = max(free, k["ts"] + k["dur"])
            steps.append((span["dur"], rows, end - free))
        names = {tuple(r[0] for r in rows) for _, rows, _ in steps}
        if not steps or len(names) != 1 or not next(iter(names)):
            out[phase] = "no kernels, or not the same kernels in every profiled step; see --trace"
            continue
        kernels = []
        for i, first in enumerate(steps[0][1]):
            start, dur, idle = (med(r[i][j] for _, r, _ in steps) for j in (1, 2, 3))
            kernels.append((first[0], start, dur, idle))
        out[phase] = PhaseTimeline(
            steps=len(steps),
            span_us=med(d for d, _, _ in steps),
            kernels=kernels,
            idle_after_us=med(t for _, _, t in steps),
        )
    return out


if __name__ == "__main__":
    main()
