"""Where the host's time goes in one rank's training step, layer by layer (one process, no mpirun).

    python3 tools/gpu/host_marks.py [--dispatch-dtype bf16|fp8] [--steps 30] [--device cuda|cpu]
                                    [--compile [--compiled-rows exact|capacity]]

The step of `tools/gpu/profile_train.py` (DeepSeek-V3 training shape, the identity
expert), unprofiled: each layer of moe-a2a's call path is wrapped to note when it is
entered and left, and the medians over `--steps` steps are printed as microseconds
after the phase's call (`ep.dispatch` for the forward, `out.backward` for the backward),
then when the call returned and when the GPU was done. Where the profiler's timeline
(`profile_train.py --timeline`) shows the GPU idle before a phase's first kernel, this
names the host's work in that time without the profiler's own cost: the first line of
the backward is the time torch's autograd engine takes before our backward starts.
`--device cpu` runs the same calls on the CPU backend at a small shape (`CPU_SHAPE`),
where no GPU is: the backend's calls then do the copies themselves, and the front end
checks the ids on the host, which CUDA leaves to its kernels; compare runs, not devices.
`--compile` runs the forward under torch.compile (fullgraph), as `profile_train.py
--compile` does: the layers are then those the operators' kernels call (the ones Dynamo
traces cannot be wrapped), with Inductor's compiled graph as the first and last mark.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from typing import Any

import torch
from profile_train import step_forward, training_case  # this folder's: the same step

from moe_a2a import autograd as ag
from moe_a2a.all_to_all import AllToAll
from moe_a2a.backends.cpu import CpuBackend
from moe_a2a.backends.cuda import CudaBackend
from moe_a2a.ep_channel import Channel

try:  # the compiled graphs' entry (torch's private module: absent, no such mark)
    from torch._inductor.output_code import CompiledFxGraph
except ImportError:
    CompiledFxGraph = None

LAYERS: list[tuple[type, str]] = [
    (ag.ExpertParallel, "dispatch"),
    (ag.ExpertParallel, "combine"),
    (ag._CombineFn, "forward"),
    (ag._CombineFn, "backward"),
    (ag._DispatchFn, "backward"),
    (Channel, "dispatch_whole"),
    (AllToAll, "_dispatch"),
    (AllToAll, "_dispatch_send"),
    (CudaBackend, "dispatch_send"),
    (CudaBackend, "_recv_buffers"),
    (CudaBackend, "_recv_args"),
    (CudaBackend, "_launch_recv"),
    (CudaBackend, "dispatch_recv"),
    (CudaBackend, "combine_send"),
    (CudaBackend, "combine_recv"),
]
CPU_LAYERS: list[tuple[type, str]] = [
    *(layer for layer in LAYERS if layer[0] is not CudaBackend),
    *((CpuBackend, name) for name in ("dispatch_send", "dispatch_recv", "combine_send", "combine_recv")),
]
# Under compile: where the operators' kernels enter our code (ExpertParallel.dispatch and
# combine, and the autograd Functions, are traced or unused there).
COMPILED_ENTRIES: list[tuple[type, str]] = [
    *([(CompiledFxGraph, "__call__")] if CompiledFxGraph is not None else []),
    *(
        (ag.ExpertParallel, n)
        for n in (
            "_forward_dispatch",
            "_forward_combine_send",
            "_forward_combine_recv",
            "_backward_combine",
            "_backward_dispatch",
        )
    ),
]
TRACED = {(ag.ExpertParallel, "dispatch"), (ag.ExpertParallel, "combine")}
marks: list[tuple[str, float]] = []


def wrap(cls: type, name: str) -> None:
    fn = getattr(cls, name)
    label = f"{cls.__name__}.{name}"

    @functools.wraps(fn)
    def marked(*args: Any, **kwargs: Any) -> Any:
        marks.append((label, time.perf_counter()))
        try:
            return fn(*args, **kwargs)
        finally:
            marks.append((label + " returns", time.perf_counter()))

    static = isinstance(cls.__dict__[name], staticmethod)  # autograd.Function's forward and backward
    setattr(cls, name, staticmethod(marked) if static else marked)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dispatch-dtype", choices=("bf16", "fp8"), default="bf16")
    p.add_argument("--steps", type=int, default=30, help="timed steps (after 10 untimed)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: at CPU_SHAPE, no GPU")
    p.add_argument("--compile", action="store_true", help="the forward under torch.compile (fullgraph)")
    p.add_argument("--compiled-rows", choices=("exact", "capacity"), default="exact", help="with --compile")
    args = p.parse_args()
    cuda = args.device == "cuda"
    layers = LAYERS if cuda else CPU_LAYERS
    if args.compile:
        layers = [*COMPILED_ENTRIES, *(layer for layer in layers if layer not in TRACED)]
    for cls, name in layers:
        wrap(cls, name)
    ep, x0, ids, w0, grad_out = training_case(args.dispatch_dtype, args.compiled_rows, device=args.device)

    def forward(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return step_forward(ep, ids, x, w)

    if args.compile:
        torch._dynamo.config.capture_scalar_outputs = True
        forward = torch.compile(forward, fullgraph=True)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    end = "(GPU done)" if cuda else "(done)"
    times: dict[tuple[str, int, str], list[float]] = {}

    def note(phase: str, start: float, returned: float) -> None:
        sync()
        done = time.perf_counter()
        seen = [*marks, ("(call returned)", returned), (end, done)]
        for i, (label, t) in enumerate(seen):
            times.setdefault((phase, i, label), []).append((t - start) * 1e6)
        marks.clear()

    for step in range(10 + args.steps):
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        sync()
        marks.clear()
        t0 = time.perf_counter()
        out = forward(x, w)
        note("forward", t0, time.perf_counter())
        t1 = time.perf_counter()
        out.backward(grad_out)
        note("backward", t1, time.perf_counter())
        if step < 10:
            times.clear()
    for phase in ("forward", "backward"):
        print(f"{phase}: us after the call (medians of {args.steps} steps)")
        for (ph, _, label), us in sorted(times.items()):
            if ph == phase:
                print(f"  {statistics.median(us):8.1f}  {label}")
    ep.close()


if __name__ == "__main__":
    main()
