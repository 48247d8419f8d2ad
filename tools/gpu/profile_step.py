"""Where one rank's eager CUDA step spends its time, for tuning (one process, no mpirun).

    python3 tools/gpu/profile_step.py --shape decode host     # host-side costs, one table
    python3 tools/gpu/profile_step.py --shape prefill span    # GPU span of dispatch send, PDL on
    python3 tools/gpu/profile_step.py --shape decode timeline # kernels of a replayed graph step
    ncu --profile-from-start off ... python3 tools/gpu/profile_step.py --shape prefill ncu

`host` times, on the host clock with the stream idle before each: the bare
costs this machine charges (a stream sync, a tiny kernel and its sync, the id
range check), then each half of dispatch and combine as the benchmark times
it, and the whole step in one span next to the torch-native version.
`span` times dispatch send's kernels on the GPU as a step runs them (with
programmatic dependent launch, so overlap between them counts): its launches
are queued behind a sleeping kernel, so host launch gaps do not count, and
CUDA events before and after give the span (median of 35 after 5 warm-up).
Only dispatch send is timed so: the receive half waits on the host, and the
kernels after it could then wait for launches.
`timeline` captures one step (graph_safe) in a CUDA graph, replays it
back to back under the torch profiler and prints each kernel's start and end
relative to the step's first kernel (medians over the replays), and the
replay times from the call, queued behind a sleeping kernel, and back to back.
`ncu` runs warm-up steps, then one step between cudaProfilerStart/Stop, so
Nsight Compute sees exactly one step's kernels.
"""

from __future__ import annotations

import argparse
import re
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from moe_a2a.all_to_all import AllToAll, Config
from moe_a2a.bench.a2a_cuda import MODEL, QUEUE_SLEEP_CYCLES, SHAPES, make_round, torch_native


def host_us(fn: Callable[[], object], iters: int) -> float:
    """Median microseconds from call to idle stream."""
    times = []
    for _ in range(iters + 3):
        torch.cuda.synchronize()
        start = time.perf_counter_ns()
        fn()
        torch.cuda.current_stream().synchronize()
        times.append((time.perf_counter_ns() - start) / 1e3)
    return statistics.median(times[3:])


def send_span_us(a2a: AllToAll, r: Any, y: torch.Tensor, iters: int = 40, warmup: int = 5) -> str:
    """Dispatch send's GPU span (first kernel's start to last kernel's end), launches queued ahead."""
    spans = []
    for i in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        torch.cuda._sleep(QUEUE_SLEEP_CYCLES)  # longer than the host takes to launch dispatch send
        start.record()
        pending = a2a.dispatch(r.x, r.ids, r.weights, recv=False)
        end.record()
        d = a2a.dispatch(handle=pending, send=False)
        a2a.combine(y[: d.expert_x.shape[0]], d)
        torch.cuda.synchronize()
        if i >= warmup:
            spans.append(start.elapsed_time(end) * 1e3)
    spans.sort()
    p90 = spans[int(0.9 * len(spans))]
    return f"median {statistics.median(spans):.1f} us, min {spans[0]:.1f}, p90 {p90:.1f}"


def replay_timeline(cfg: Config, r: Any, device: torch.device, shape: str, replays: int = 60) -> None:
    """Median start and end of each kernel of a replayed step, from the step's first kernel."""
    from mpi4py import MPI
    from torch.profiler import ProfilerActivity, profile

    from moe_a2a.bench.a2a_cuda import capture_step, median_ms

    with AllToAll(cfg, comm=MPI.COMM_WORLD, device="cuda", provider="shm", graph_safe=True) as a2a:
        graph, _y = capture_step(a2a, r, device)
        called = median_ms(graph.replay, 200) * 1e3
        queued = median_ms(graph.replay, 200, queued=True) * 1e3
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(200):
            graph.replay()
        end.record()
        end.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(replays):
                graph.replay()
            torch.cuda.synchronize()
        a2a.check()
    print(
        f"-- {shape} step replayed: {called:.1f} us from the call, {queued:.1f} us queued (GPU span), "
        f"{start.elapsed_time(end) * 1e3 / 200:.1f} us each back to back"
    )
    kernels = sorted(
        (e.time_range.start, e.time_range.end, _kernel_name(e.name))
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA
    )
    rows, replayed = step_timeline(kernels)
    print(f"   kernel             start us   end us   (median of {replayed} replays)")
    for name, begin, finish in rows:
        print(f"   {name:18} {begin:8.2f} {finish:8.2f}")


def step_timeline(kernels: list[tuple[float, float, str]]) -> tuple[list[tuple[str, float, float]], int]:
    """(name, median start, median end) of each kernel of a step, from the step's first kernel.

    `kernels` are (start, end, name) of back-to-back replays, sorted by start; a
    step begins at each launch of the first kernel seen. Steps of another length
    than the usual one (cut by the profiler's window) and the first step are left out.
    """
    first = kernels[0][2]
    steps: list[list[tuple[float, float, str]]] = []
    for k in kernels:
        if k[2] == first or not steps:
            steps.append([])
        steps[-1].append(k)
    size = statistics.mode(len(s) for s in steps)
    steps = [s for s in steps if len(s) == size][1:]
    rows = [
        (
            steps[0][i][2],
            statistics.median(s[i][0] - s[0][0] for s in steps),
            statistics.median(s[i][1] - s[0][0] for s in steps),
        )
        for i in range(size)
    ]
    return rows, len(steps)


def _kernel_name(name: str) -> str:
    found = re.search(r"(\w+_kernel)", name)
    return found.group(1) if found else name[:18]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="decode")
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("mode", choices=["host", "span", "ncu", "timeline"])
    args = parser.parse_args()
    from mpi4py import MPI

    device = torch.device("cuda", 0)
    tokens = SHAPES[args.shape]
    cfg = Config(
        max_tokens=tokens,
        dispatch_dtype="fp8",
        combine_dtype="bf16",
        max_recv_tokens=2 * tokens * MODEL["topk"],
        timeout_s=60.0,
        **MODEL,
    )
    r = make_round(1, tokens, device)
    if args.mode == "timeline":
        replay_timeline(cfg, r, device, args.shape)
        return 0
    with AllToAll(cfg, comm=MPI.COMM_WORLD, device="cuda", provider="shm") as a2a:
        y = torch.randn(a2a.max_output_rows, MODEL["hidden"], device=device).to(torch.bfloat16)

        def step() -> None:
            d = a2a.dispatch(r.x, r.ids, r.weights)
            a2a.combine(y[: d.expert_x.shape[0]], d)

        for _ in range(5):
            step()
        torch.cuda.synchronize()
        if args.mode == "span":
            print(f"-- {args.shape}, one rank: dispatch send on the GPU, {send_span_us(a2a, r, y)}")
            return 0
        if args.mode == "ncu":
            torch.cuda.cudart().cudaProfilerStart()
            step()
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaProfilerStop()
            return 0

        one = torch.zeros(1, device=device)
        rows: list[tuple[str, float]] = [
            ("stream sync, idle", host_us(lambda: None, args.iters)),
            ("tiny kernel + sync", host_us(lambda: one.add_(1), args.iters)),
            ("aminmax(ids) + int()", host_us(lambda: [int(v) for v in torch.aminmax(r.ids)], args.iters)),
            (
                "validate dispatch args",
                host_us(lambda: a2a._validate_dispatch(r.x, r.ids, r.weights, None), args.iters),
            ),
        ]
        halves = {"dispatch send": 0.0, "dispatch recv": 0.0, "combine send": 0.0, "combine recv": 0.0}
        samples: dict[str, list[float]] = {k: [] for k in halves}
        for _ in range(args.iters):
            torch.cuda.synchronize()
            t = [time.perf_counter_ns()]
            p = a2a.dispatch(r.x, r.ids, r.weights, recv=False)
            torch.cuda.current_stream().synchronize()
            t.append(time.perf_counter_ns())
            d = a2a.dispatch(handle=p, send=False)
            torch.cuda.current_stream().synchronize()
            t.append(time.perf_counter_ns())
            pc = a2a.combine(y[: d.expert_x.shape[0]], d, recv=False)
            torch.cuda.current_stream().synchronize()
            t.append(time.perf_counter_ns())
            a2a.combine(handle=pc, send=False)
            torch.cuda.current_stream().synchronize()
            t.append(time.perf_counter_ns())
            for i, k in enumerate(halves):
                samples[k].append((t[i + 1] - t[i]) / 1e3)
        rows += [(k, statistics.median(v)) for k, v in samples.items()]
        # The host's own cost of each call: from the call to its return, the GPU idle before.
        calls: dict[str, list[float]] = {f"{k}, call only": [] for k in halves}
        for _ in range(args.iters):
            stamps = []
            torch.cuda.synchronize()
            stamps.append(time.perf_counter_ns())
            p = a2a.dispatch(r.x, r.ids, r.weights, recv=False)
            stamps.append(time.perf_counter_ns())
            torch.cuda.synchronize()
            stamps.append(time.perf_counter_ns())
            d = a2a.dispatch(handle=p, send=False)
            stamps.append(time.perf_counter_ns())
            torch.cuda.synchronize()
            stamps.append(time.perf_counter_ns())
            pc = a2a.combine(y[: d.expert_x.shape[0]], d, recv=False)
            stamps.append(time.perf_counter_ns())
            torch.cuda.synchronize()
            stamps.append(time.perf_counter_ns())
            a2a.combine(handle=pc, send=False)
            stamps.append(time.perf_counter_ns())
            for i, k in enumerate(calls):
                calls[k].append((stamps[2 * i + 1] - stamps[2 * i]) / 1e3)
        rows += [(k, statistics.median(v)) for k, v in calls.items()]
        rows.append(("step, one span", host_us(step, args.iters)))
        native_dispatch, native_combine = torch_native(r, y)
        rows.append(
            ("torch-native, one span", host_us(lambda: (native_dispatch(), native_combine()), args.iters))
        )
    print(f"-- {args.shape}, one rank, host clock (median of {args.iters}):")
    for name, us in rows:
        print(f"   {name:30} {us:9.1f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
