"""`moe-a2a bench a2a`: dispatch and combine latency against an MPI baseline.

Run under mpirun, for example
    mpirun -n 4 --oversubscribe moe-a2a bench a2a --mode decode --ranks-per-node 1

Both sides move the same tokens in the same run, iteration by iteration:
- moe-a2a: `AllToAll.dispatch` (fp8 quantisation included) and `AllToAll.combine`;
- a baseline written the way a user of a collective library would
  (`moe_a2a.bench.baseline`): over MPI `Alltoallv` (`--baseline mpi`, the
  default on the CPU), or torch.distributed `all_to_all_single` on NCCL
  (`--device cuda --baseline nccl`) or gloo (`--baseline gloo`).

Each timed phase starts after an MPI barrier and ends when the rank's work
is done (its CUDA stream drained); its time is the slowest rank's. On the
first iteration both combine outputs are compared. With every peer remote
(`--ranks-per-node 1`) the engine alone also moves each phase's bytes, and a
second table gives the phase/engine ratio (`moe_a2a.bench.engine_ref`).

`--device cuda` without `--baseline` runs the per-phase CUDA benchmark
(`moe_a2a.bench.a2a_cuda`: bandwidth against the copy ceiling, torch-native).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from moe_a2a.bench.args import int_at_least

if TYPE_CHECKING:
    import torch

POSITIVE = int_at_least(1)

SHAPES = {
    # DeepSeek-V3 decode: 128 tokens per rank.
    "decode": dict(tokens=128, hidden=7168, num_experts=256, topk=8),
    # Prefill, scaled to what two CPU cores and 24 GiB hold for 4 ranks (flags change it).
    "prefill": dict(tokens=1024, hidden=7168, num_experts=256, topk=8),
}
PERCENTILES = (50, 90, 99)


@dataclass
class Round:
    """One rank's inputs for one iteration."""

    x: torch.Tensor
    ids: torch.Tensor
    weights: torch.Tensor


def make_round(seed: int, rank: int, tokens: int, hidden: int, experts: int, topk: int) -> Round:
    import torch

    g = torch.Generator().manual_seed(seed * 65537 + rank)
    x = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16)
    ids = torch.argsort(torch.rand(tokens, experts, generator=g), dim=1)[:, :topk].contiguous()
    weights = torch.rand(tokens, topk, generator=g)
    return Round(x, ids, weights)


def percentiles_us(samples_ns: np.ndarray) -> list[float]:
    return [float(np.percentile(samples_ns, p)) / 1e3 for p in PERCENTILES]


def timed(comm: Any, fn: Any, device: Any = None) -> tuple[Any, float]:
    """Run fn after a barrier (and until the GPU is done); the slowest rank's time in ns."""
    import torch

    comm.Barrier()
    start = time.perf_counter_ns()
    result = fn()
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)
    elapsed = time.perf_counter_ns() - start
    return result, comm.allreduce(elapsed, op=_max_op())


def _max_op() -> Any:
    from mpi4py import MPI

    return MPI.MAX


def expert_stand_in(expert_x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """bf16 expert outputs from the dispatched rows (outside the timed region)."""
    import torch

    if scale is None:
        return expert_x.to(torch.bfloat16)
    x = expert_x.float() * scale.repeat_interleave(128, dim=1)[:, : expert_x.shape[1]]
    return x.to(torch.bfloat16)


def check_agree(ours: torch.Tensor, theirs: torch.Tensor, fp8_on_gpu: bool) -> None:
    """Both implementations computed the same combine.

    On the CPU the baseline quantises exactly as moe-a2a does (true fp32
    division), so they agree to bf16 rounding. On GPUs torch's division is not
    the correctly rounded one moe-a2a's kernels use, so a few fp8 values land
    one e4m3 step (12.5%) apart: most outputs must still agree to bf16
    rounding, and none by more than a quarter of its row's largest value.
    """
    import torch

    ours, theirs = ours.float(), theirs.float()
    if not fp8_on_gpu:
        torch.testing.assert_close(ours, theirs, rtol=2e-2, atol=2e-2)
        return
    bound = 0.25 * theirs.abs().amax(dim=1, keepdim=True) + 2e-2
    worst = ((ours - theirs).abs() - bound).max().item()
    assert worst <= 0, (
        f"combine outputs differ by more than a quarter of their row's scale (excess {worst:.3g})"
    )
    close = torch.isclose(ours, theirs, rtol=2e-2, atol=2e-2).float().mean().item()
    assert close >= 0.99, f"only {close:.2%} of combine outputs agree within bf16 tolerance"


def make_exchange(args: argparse.Namespace, comm: Any, device: Any) -> Any:
    from moe_a2a.bench.baseline import MpiExchange, TorchExchange

    if args.baseline == "mpi":
        return MpiExchange(comm)
    wanted = "cuda" if args.baseline == "nccl" else "cpu"
    if device.type != wanted:
        raise SystemExit(
            f"bench a2a: --baseline {args.baseline} needs --device {wanted}; got --device {device.type}"
        )
    return TorchExchange(comm, device)


def run_shape(name: str, args: argparse.Namespace, comm: Any, exchange: Any, device: Any) -> dict[str, Any]:

    from moe_a2a.all_to_all import AllToAll, Config
    from moe_a2a.bench import engine_ref
    from moe_a2a.bench.baseline import Baseline

    shape = dict(SHAPES[name])
    for key in ("tokens", "hidden", "num_experts", "topk"):
        if getattr(args, key) is not None:
            shape[key] = getattr(args, key)
    rank, world = comm.Get_rank(), comm.Get_size()
    tokens, topk = shape["tokens"], shape["topk"]
    cfg = Config(
        max_tokens=tokens,
        hidden=shape["hidden"],
        num_experts=shape["num_experts"],
        topk=topk,
        dispatch_dtype=args.dispatch_dtype,
        combine_dtype="bf16",
        # Room for twice the balanced load: enough for random routing, a fraction of the worst case.
        max_recv_tokens=2 * tokens * topk,
        timeout_s=120.0,
    )
    baseline = Baseline(exchange, world, cfg.num_experts, cfg.dispatch_dtype)
    times: dict[str, list[float]] = {
        k: [] for k in ("ours_dispatch", "ours_combine", "mpi_dispatch", "mpi_combine")
    }
    with AllToAll(
        cfg, comm=comm, device=device.type, provider=args.provider, ranks_per_node=args.ranks_per_node
    ) as a2a:
        alone = engine_ref.start_for(a2a, comm, args.provider)  # every peer remote: the engine alone too
        if alone is not None:
            times.update(engine_dispatch=[], engine_combine=[])
        for it in range(args.warmup + args.iters):
            r = make_round(it, rank, tokens, cfg.hidden, cfg.num_experts, topk)
            r = Round(r.x.to(device), r.ids.to(device), r.weights.to(device))
            d, t_d = timed(comm, lambda r=r: a2a.dispatch(r.x, r.ids, r.weights), device)
            y = expert_stand_in(d.expert_x, d.expert_x_scale)
            out, t_c = timed(comm, lambda y=y, d=d: a2a.combine(y, d), device)
            state, b_d = timed(comm, lambda r=r: baseline.dispatch(r.x, r.ids), device)
            yb = expert_stand_in(*baseline.expert_input(state, cfg.hidden))
            ref, b_c = timed(
                comm, lambda yb=yb, state=state, r=r: baseline.combine(yb, state, r.weights), device
            )
            if it == 0:
                check_agree(out, ref, cfg.dispatch_dtype == "fp8" and device.type == "cuda")
            if it >= args.warmup:
                times["ours_dispatch"].append(t_d)
                times["ours_combine"].append(t_c)
                times["mpi_dispatch"].append(b_d)
                times["mpi_combine"].append(b_c)
            if alone is not None:
                e_d, e_c = alone.measure(r.ids.cpu().numpy(), cfg.num_experts)
                if it >= args.warmup:
                    times["engine_dispatch"].append(e_d)
                    times["engine_combine"].append(e_c)
        if alone is not None:
            alone.close()
        topo = a2a._boot.topology
    result = dict(
        shape=name,
        world=world,
        ranks_per_node=topo.local_size,
        provider=args.provider,
        device=device.type,
        baseline=exchange.name,
        **shape,
    )
    for key, samples in times.items():
        result[key] = percentiles_us(np.array(samples))
    return result


def print_table(results: list[dict[str, Any]]) -> None:
    head = (
        f"{'shape':8} {'ranks':>5} {'rpn':>3} {'phase':8} "
        f"{'moe-a2a p50/p90/p99 (us)':>28} {'baseline p50/p90/p99 (us)':>28} {'base/ours':>11}"
    )
    print(head)
    print("-" * len(head))
    for r in results:
        for phase in ("dispatch", "combine", "total"):
            if phase == "total":
                ours = [a + b for a, b in zip(r["ours_dispatch"], r["ours_combine"], strict=True)]
                mpi = [a + b for a, b in zip(r["mpi_dispatch"], r["mpi_combine"], strict=True)]
            else:
                ours, mpi = r[f"ours_{phase}"], r[f"mpi_{phase}"]
            fmt = "/".join(f"{v:.0f}" for v in ours)
            fmt_m = "/".join(f"{v:.0f}" for v in mpi)
            print(
                f"{r['shape']:8} {r['world']:>5} {r['ranks_per_node']:>3} {phase:8} "
                f"{fmt:>28} {fmt_m:>28} {mpi[0] / ours[0]:>10.2f}x"
            )
    print(
        f"(baseline: {results[0]['baseline']}; total sums the percentiles of the two phases; "
        "rpn = ranks per node)"
    )


def main(args: argparse.Namespace) -> int:
    import torch
    from mpi4py import MPI

    if args.train:
        from moe_a2a.bench import train

        return train.main(args)
    if args.grad_dtype is not None:
        raise SystemExit("bench a2a: --grad-dtype: only used with --train")
    args.mode = args.mode or "both"
    args.dispatch_dtype = args.dispatch_dtype or "fp8"
    if args.device == "cuda" and args.baseline is None:
        return _run_cuda(args)
    comm = MPI.COMM_WORLD
    if args.device == "cuda":
        torch.cuda.set_device(_local_rank(comm) % torch.cuda.device_count())  # one rank per GPU
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        _share_cores(comm)
        device = torch.device("cpu")
    args.baseline = args.baseline or "mpi"
    exchange = make_exchange(args, comm, device)
    shapes = list(SHAPES) if args.mode == "both" else [args.mode]
    results = [run_shape(name, args, comm, exchange, device) for name in shapes]
    if hasattr(exchange, "close"):
        exchange.close()
    if comm.Get_rank() == 0:
        from moe_a2a.bench import engine_ref

        print_table(results)
        engine_ref.print_table(results)
        if args.output:
            from moe_a2a import __version__, switches

            meta = {"benchmark": "a2a", "moe_a2a_version": __version__, "command": " ".join(sys.argv)}
            with open(args.output, "w") as f:
                json.dump({**meta, "switches": switches.recorded(), "results": results}, f, indent=2)
            print(f"figures written to {args.output}")
    return 0


def _local_rank(comm: Any) -> int:
    from mpi4py import MPI

    return comm.Split_type(MPI.COMM_TYPE_SHARED).Get_rank()


def _share_cores(comm: Any) -> None:
    """Give torch's intra-op threads an equal share of the host's cores (both sides use torch)."""
    import os

    import torch
    from mpi4py import MPI

    on_host = comm.Split_type(MPI.COMM_TYPE_SHARED).Get_size()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // on_host))


def _run_cuda(args: argparse.Namespace) -> int:
    """The CUDA benchmark (per-phase bandwidth against the copy ceiling and torch-native)."""
    from moe_a2a.backends.cuda import cuda_available

    reason = cuda_available()
    if reason is not None:
        raise SystemExit(f"bench a2a --device cuda: {reason}")
    from moe_a2a.bench import a2a_cuda

    cuda_args = argparse.Namespace(
        shapes=list(SHAPES) if args.mode == "both" else [args.mode],
        iters=args.iters,
        warmup=args.warmup,
        rounds=4,
        provider=args.provider,
        ranks_per_node=args.ranks_per_node,
        json=args.output,
        profile=False,
    )
    return a2a_cuda.run(cuda_args)


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("a2a", help="dispatch/combine latency against an MPI Alltoallv baseline")
    p.add_argument(
        "--mode",
        choices=[*SHAPES, "both"],
        default=None,
        help="decode, prefill or both (default: both); the name `run --mode` uses",
    )
    p.add_argument("--tokens", type=POSITIVE, help="tokens per rank (overrides the shape)")
    p.add_argument("--hidden", type=POSITIVE)
    p.add_argument("--num-experts", type=POSITIVE)
    p.add_argument("--topk", type=POSITIVE)
    p.add_argument(
        "--dispatch-dtype", choices=["fp8", "bf16"], default=None, help="default: fp8; bf16 with --train"
    )
    p.add_argument("--iters", type=POSITIVE, default=20)
    p.add_argument("--warmup", type=int_at_least(0), default=3)
    p.add_argument("--provider", default="auto", help="libfabric provider: tcp, shm, efa, verbs or auto")
    p.add_argument("--ranks-per-node", type=POSITIVE, default=None, help="virtual nodes of this many ranks")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument(
        "--baseline",
        choices=["mpi", "nccl", "gloo"],
        default=None,
        help="what moe-a2a is compared with (default: mpi; with --device cuda the per-phase CUDA benchmark)",
    )
    p.add_argument("--output", help="write the figures as JSON (with --train: CSV if the name ends in .csv)")
    p.add_argument(
        "--train",
        action="store_true",
        help="forward + backward of dispatch and combine (DeepSeek-V3 training shape) against "
        "TorchTitan's token dispatchers (moe_a2a.bench.train)",
    )
    p.add_argument(
        "--grad-dtype",
        choices=["bf16", "fp32"],
        default=None,
        help="with --train: what gradients travel in (default: bf16)",
    )
    p.set_defaults(func=main)
