"""Where one rank's training step of dispatch + combine spends its GPU time (one process, no mpirun).

    python3 tools/gpu/profile_train.py [--dispatch-dtype bf16|fp8] [--compile] [--steps 3]
                                       [--compiled-rows exact|capacity] [--trace FILE.json] [--stacks]

The step of `moe-a2a bench a2a --train` at the DeepSeek-V3 training shape
(4096 tokens, hidden 7168, 256 experts, top-8, bf16 gradients, the identity
expert): prints the median forward and backward time of 10 steps, then the
torch profiler's table of kernels over `--steps` steps (divide by the steps
for a step's share). `--trace` also writes the profiled steps as a Chrome
trace (host calls and kernels on one clock), where the host waits show as
gaps between kernels; `--stacks` records the Python functions too (slower
steps, but it names the host's work in each gap). `--compile` profiles the
forward under torch.compile (fullgraph), as `bench a2a --train --compile` runs it.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from mpi4py import MPI
from torch.profiler import ProfilerActivity, profile

from moe_a2a import Config
from moe_a2a.autograd import ExpertParallel

T, H, E, K = 4096, 7168, 256, 8


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
    args = p.parse_args()
    torch.cuda.set_device(0)
    cfg = Config(
        max_tokens=T,
        hidden=H,
        num_experts=E,
        topk=K,
        dispatch_dtype=args.dispatch_dtype,
        combine_dtype="bf16",
        max_recv_tokens=T * K,
    )
    rows = args.compiled_rows
    ep = ExpertParallel(cfg, MPI.COMM_WORLD, device="cuda", grad_dtype="bf16", compiled_rows=rows)
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(T, H, generator=g).bfloat16().cuda()
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).cuda()
    w0 = torch.rand(T, K, generator=g).cuda()
    grad_out = torch.randn(T, H, generator=g).bfloat16().cuda()

    def forward(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        r = ep.dispatch(x, ids, w)
        return ep.combine(r.expert_x * 1.0, r)

    if args.compile:
        torch._dynamo.config.capture_scalar_outputs = True
        forward = torch.compile(forward, fullgraph=True)

    def step() -> tuple[float, float]:
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = forward(x, w)
        torch.cuda.synchronize()
        t1 = time.perf_counter()
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
    ep.close()


if __name__ == "__main__":
    main()
