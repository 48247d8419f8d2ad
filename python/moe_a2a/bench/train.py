"""`moe-a2a bench a2a --train`: dispatch + combine forward and backward against TorchTitan's dispatchers.

Run under mpirun, for example
    mpirun -n 4 --oversubscribe moe-a2a bench a2a --train --ranks-per-node 1 --provider tcp

The step every contender runs, on the same data (x and the top-k scores
require gradients; the routing is drawn afresh for every iteration, the same
for every contender):
    dispatch(x, topk_scores, topk_ids) -> expert rows
    y = rows * 1.0                      (the identity-like expert, the same for all)
    out = combine(y) = sum_k score[t, k] * y[row of (t, k)]
    out.backward(grad_out)              (a fixed random grad_out)

Contenders:
- moe-a2a: `moe_a2a.autograd.ExpertParallel` (forward in `--dispatch-dtype`,
  gradients in `--grad-dtype`), weighted combine;
- TorchTitan 0.3.0's `AllToAllTokenDispatcher`: `all_to_all_single` with
  autograd over a torch.distributed group (gloo on the CPU, NCCL where every
  rank has a GPU of its own), with a 1-D DeviceMesh "ep". TorchTitan's default
  SPMD backend ("spmd_types") exchanges uneven splits with `dist.all_to_all` on
  tensor lists, which gloo refuses, so the benchmark selects its
  "partial_dtensor" backend: the functional `all_to_all_single` path;
- TorchTitan's `LocalTokenDispatcher` at one rank (it does no exchange).

Forward and backward are timed separately, each after an MPI barrier, as the
slowest rank's time (`moe_a2a.bench.a2a.timed`), reported as fwd and bwd;
fwd+bwd is their sum for the iteration. Medians are over `--iters` after
`--warmup`. On the first iteration `out`, `x.grad` and the scores' gradient of
every baseline are compared with moe-a2a's.

`--gpu-busy-us US` (CUDA) queues a kernel that keeps the GPU busy about US
microseconds before each timed phase of every contender, as a model's layers
before the MoE block do, and times the phase from that kernel's end: the host's
time before the phase's first kernel runs meanwhile and leaves the span, so the
figures are what the block adds to a step whose host runs ahead of its GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import resource
import sys
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from moe_a2a import report
from moe_a2a.bench.common import local_rank, max_op, share_cores, timed
from moe_a2a.usage import UsageError

# DeepSeek-V3 training: 4096 tokens per rank, hidden 7168, 256 experts, top-8.
TRAIN_SHAPE = dict(tokens=4096, hidden=7168, num_experts=256, topk=8)
OURS = report.OURS
ALL_TO_ALL = "AllToAllTokenDispatcher"
LOCAL = "LocalTokenDispatcher"
PHASES = ("fwd", "bwd", "fwd+bwd")


class TrainArgumentError(UsageError):
    """A flag that `--train` cannot use; raised alike on every rank. The message starts with the flag."""


def check_args(args: argparse.Namespace, world: int) -> dict[str, int]:
    """Validate the flags of `bench a2a --train` for `world` ranks; return the shape."""
    if args.mode is not None:
        raise TrainArgumentError(
            f"--mode: got {args.mode!r}; --train runs the DeepSeek-V3 training shape "
            "(shrink it with --tokens, --hidden, --num-experts, --topk)"
        )
    if args.baseline is not None:
        raise TrainArgumentError(
            f"--baseline: got {args.baseline!r}; --train compares with TorchTitan's dispatchers, "
            "leave --baseline out"
        )
    shape = dict(TRAIN_SHAPE)
    for key in shape:
        if getattr(args, key) is not None:
            shape[key] = getattr(args, key)
    if shape["num_experts"] % world != 0:
        raise TrainArgumentError(
            f"--num-experts: got {shape['num_experts']}, which is not divisible by the {world} ranks; "
            "every rank hosts the same number of experts"
        )
    if shape["topk"] > shape["num_experts"]:
        raise TrainArgumentError(
            f"--topk: got {shape['topk']}; expected at most --num-experts={shape['num_experts']} "
            "(a token picks distinct experts)"
        )
    if args.warmup < 0:
        raise TrainArgumentError(f"--warmup: got {args.warmup}; expected an integer >= 0")
    if args.compiled_rows is not None and not args.compile:
        raise TrainArgumentError(f"--compiled-rows: got {args.compiled_rows!r}; only used with --compile")
    args.compiled_rows = args.compiled_rows or "exact"
    if args.gpu_busy_us is not None and args.device != "cuda":
        raise TrainArgumentError(
            f"--gpu-busy-us: got {args.gpu_busy_us}; it needs --device cuda (a kernel that keeps "
            f"the GPU busy before each phase), not --device {args.device}"
        )
    if args.compile and args.warmup < 1:
        raise TrainArgumentError(
            f"--warmup: got {args.warmup}; --compile needs 1 or more (the first call compiles, untimed)"
        )
    return shape


# ---------------------------------------------------------------- data


@dataclass
class Batch:
    """One rank's inputs of one iteration (routing drawn per iteration; x and grad_out fixed)."""

    x: Any  # [T, H] bf16
    ids: Any  # [T, K] int64, distinct experts per token
    scores: Any  # [T, K] fp32
    counts: Any  # [E] int64: this rank's tokens per expert (TorchTitan's router output)


def make_routing(seed: int, rank: int, tokens: int, experts: int, topk: int) -> tuple[Any, Any]:
    import torch

    g = torch.Generator().manual_seed(seed * 65537 + rank)
    ids = torch.argsort(torch.rand(tokens, experts, generator=g), dim=1)[:, :topk].contiguous()
    return ids, torch.rand(tokens, topk, generator=g)


def recv_capacity(comm: Any, routings: list[tuple[Any, Any]], experts: int) -> int:
    """The most token copies any rank receives in any iteration: `max_recv_tokens`, exactly."""
    import torch

    world = comm.Get_size()
    local = experts // world
    sent = np.stack(
        [torch.bincount(ids.reshape(-1) // local, minlength=world).numpy() for ids, _ in routings]
    ).astype(np.int64)
    received = np.empty_like(sent)
    from mpi4py import MPI

    comm.Allreduce(sent, received, op=MPI.SUM)
    return max(1, int(received.max()))


def expert(rows: Any) -> Any:
    """The identity-like expert every contender runs."""
    return rows * 1.0


# ---------------------------------------------------------------- contenders


@dataclass
class Contender:
    name: str
    forward: Callable[[Any, Any, Any, Any], Any]  # (x leaf, scores leaf, ids, counts) -> out
    fwd_ns: list[float] = field(default_factory=list)  # timed iterations only
    bwd_ns: list[float] = field(default_factory=list)


def ours(ep: Any) -> Contender:
    def forward(x: Any, scores: Any, ids: Any, counts: Any) -> Any:
        routed = ep.dispatch(x, ids, scores)
        return ep.combine(expert(routed.expert_x), routed, weighted=True)

    return Contender(OURS, forward)


def torchtitan_dispatcher(cls: Any, mesh: Any, experts: int, topk: int) -> Contender:
    d = cls(cls.Config(num_experts=experts, top_k=topk))
    d.wire_meshes(ep_mesh=mesh)

    def forward(x: Any, scores: Any, ids: Any, counts: Any) -> Any:
        rows, _, meta = d.dispatch(x, scores, ids, counts)
        return d.combine(expert(rows), meta, x)

    return Contender(cls.__name__, forward)


@contextlib.contextmanager
def torchtitan_group(comm: Any, device: Any) -> Iterator[Any]:
    """The "ep" DeviceMesh over all MPI ranks, TorchTitan's all_to_all_single path selected."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torchtitan.distributed import utils as titan_dist

    from moe_a2a.bench.baseline import init_process_group

    owned = not dist.is_initialized()
    if owned:
        init_process_group(comm, "nccl" if device.type == "cuda" else "gloo")
    previous = titan_dist.get_spmd_backend()
    titan_dist.set_spmd_backend("partial_dtensor")
    try:
        yield init_device_mesh(device.type, (comm.Get_size(),), mesh_dim_names=("ep",))
    finally:
        titan_dist.set_spmd_backend(previous)
        if owned:
            dist.destroy_process_group()


def torchtitan_skip_reason(comm: Any, device: Any) -> str | None:
    """Why TorchTitan's AllToAllTokenDispatcher cannot run here, or None."""
    try:
        import torchtitan.models.common.token_dispatcher  # noqa: F401
    except Exception as e:  # ImportError, or triton's own failures at import time
        return f"torchtitan 0.3.0 does not import here ({type(e).__name__}: {e})"
    if device.type == "cuda":
        import torch
        from mpi4py import MPI

        on_host = comm.Split_type(MPI.COMM_TYPE_SHARED).Get_size()
        gpus = torch.cuda.device_count()
        if comm.allreduce(int(on_host > gpus), op=MPI.MAX):
            return f"NCCL needs a GPU per rank; {on_host} ranks share {gpus} GPU(s) on a host"
    return None


# ---------------------------------------------------------------- agreement


def agreement(name: str, mine: dict[str, Any], theirs: dict[str, Any], fp8: bool) -> dict[str, Any]:
    """Compare `out`, `x.grad` and `scores.grad` of moe-a2a and one baseline (this rank's tensors).

    Both sum bf16 rows, but in different orders and precisions (TorchTitan
    scales each row in fp32, rounds it to bf16 and adds in bf16), so they agree
    to a few bf16 roundings: |diff| <= 3e-2 * (|theirs| + max|theirs| / 8).
    With an fp8 forward `out` and the scores' gradient (which sees y) carry
    the e4m3 rounding of x: their norm-relative difference must stay under 6%;
    x.grad (straight-through) is held to the bf16 bound still.
    """
    result: dict[str, Any] = {"baseline": name}
    ok = True
    for key in ("out", "x.grad", "scores.grad"):
        a, b = mine[key].float(), theirs[key].float()
        diff = (a - b).abs()
        rel = float(diff.norm() / b.norm().clamp_min(1e-30))
        if fp8 and key != "x.grad":
            good = rel <= 0.06
        else:
            bound = 3e-2 * (b.abs() + b.abs().max() / 8)
            good = bool((diff <= bound).all())
        result[key] = {"max_abs_diff": float(diff.max()) if diff.numel() else 0.0, "rel_norm_diff": rel}
        ok = ok and good
    result["ok"] = ok
    return result


def gather_agreement(comm: Any, checks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every rank's checks merged: worst differences, ok only where every rank agreed."""
    merged = []
    for per_rank in zip(*comm.allgather(checks), strict=True):
        m: dict[str, Any] = {"baseline": per_rank[0]["baseline"], "ok": all(c["ok"] for c in per_rank)}
        for key in ("out", "x.grad", "scores.grad"):
            m[key] = {s: max(c[key][s] for c in per_rank) for s in ("max_abs_diff", "rel_norm_diff")}
        merged.append(m)
    return merged


# ---------------------------------------------------------------- the run


def step(
    comm: Any,
    device: Any,
    c: Contender,
    b: Batch,
    grad_out: Any,
    keep: bool,
    lead: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """One measured step of one contender; its out and gradients, the times kept if `keep`.
    `lead`: GPU work queued before each phase, out of its time (`--gpu-busy-us`)."""
    x = b.x.detach().requires_grad_()
    scores = b.scores.detach().requires_grad_()
    out, t_fwd = timed(comm, lambda: c.forward(x, scores, b.ids, b.counts), device, lead)
    _, t_bwd = timed(comm, lambda: out.backward(grad_out), device, lead)
    if keep:
        c.fwd_ns.append(t_fwd)
        c.bwd_ns.append(t_bwd)
    return {"out": out.detach(), "x.grad": x.grad, "scores.grad": scores.grad}


def gpu_busy(us: int) -> Callable[[], None]:
    """A launch that keeps the current GPU busy about `us` microseconds: torch's spin kernel,
    its cycles a microsecond measured here (the clock the GPU runs at now)."""
    import torch

    probe = 1_000_000
    torch.cuda._sleep(probe)  # the first launch loads the kernel
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(probe)
    end.record()
    end.synchronize()
    cycles = max(1, round(us * probe / (start.elapsed_time(end) * 1e3)))
    return lambda: torch.cuda._sleep(cycles)


def compile_contenders(contenders: list[Contender]) -> None:
    """--compile: each contender's forward compiled as TorchTitan's `apply_compile` compiles a
    block (fullgraph, scalar outputs captured for the data-dependent sizes of token routing)."""
    import torch

    torch._dynamo.config.capture_scalar_outputs = True
    for c in contenders:
        c.forward = torch.compile(c.forward, fullgraph=True)


def skipped_dispatchers(reason: str | None, world: int) -> dict[str, str]:
    """TorchTitan's dispatchers this run leaves out, and why (`reason`: TorchTitan is unusable)."""
    import torch

    skipped: dict[str, str] = {}
    if reason is not None:
        skipped[ALL_TO_ALL] = skipped[LOCAL] = reason
    elif world > 1:
        skipped[LOCAL] = f"runs at one rank only (it does no exchange); this run has {world}"
    if reason is None and not hasattr(torch.compiler, "_is_non_strict_tracing"):
        # TorchTitan 0.3.0's all-to-all path calls it; torch 2.11 (the GPU image's) lacks it.
        skipped[ALL_TO_ALL] = (
            f"TorchTitan 0.3.0 calls torch.compiler._is_non_strict_tracing; torch {torch.__version__} lacks"
        )
    return skipped


def run(args: argparse.Namespace, comm: Any, device: Any, shape: dict[str, int]) -> dict[str, Any]:
    import torch

    from moe_a2a.all_to_all import Config
    from moe_a2a.autograd import ExpertParallel

    rank, world = comm.Get_rank(), comm.Get_size()
    T, H, E, K = shape["tokens"], shape["hidden"], shape["num_experts"], shape["topk"]
    iters = args.warmup + args.iters
    routings = [make_routing(it, rank, T, E, K) for it in range(iters)]
    g = torch.Generator().manual_seed(1_000_003 + rank)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16).to(device)
    grad_out = torch.randn(T, H, generator=g).to(torch.bfloat16).to(device)
    batches = [
        Batch(x, ids.to(device), s.to(device), torch.bincount(ids.reshape(-1), minlength=E).to(device))
        for ids, s in routings
    ]
    cfg = Config(
        max_tokens=T,
        hidden=H,
        num_experts=E,
        topk=K,
        dispatch_dtype=args.dispatch_dtype,
        combine_dtype="bf16",
        max_recv_tokens=recv_capacity(comm, routings, E),
        timeout_s=300.0,
    )
    reason = torchtitan_skip_reason(comm, device)
    skipped = skipped_dispatchers(reason, world)
    with contextlib.ExitStack() as stack:
        ep = stack.enter_context(
            ExpertParallel(
                cfg,
                comm=comm,
                device=device.type,
                provider=args.provider,
                ranks_per_node=args.ranks_per_node,
                grad_dtype=args.grad_dtype,
                compiled_rows=args.compiled_rows,
            )
        )
        contenders = [ours(ep)]
        if reason is None:
            from torchtitan.models.common import token_dispatcher as titan

            mesh = stack.enter_context(torchtitan_group(comm, device))
            if ALL_TO_ALL not in skipped:
                contenders.append(torchtitan_dispatcher(titan.AllToAllTokenDispatcher, mesh, E, K))
            if world == 1:
                contenders.append(torchtitan_dispatcher(titan.LocalTokenDispatcher, None, E, K))
        if args.compile:
            compile_contenders(contenders)
        lead = gpu_busy(args.gpu_busy_us) if args.gpu_busy_us is not None else None
        checks = []
        bar = report.progress(len(batches), "train", rank=rank, mode=args.progress)
        for it, b in enumerate(batches):
            results = [step(comm, device, c, b, grad_out, it >= args.warmup, lead) for c in contenders]
            bar.update()
            if it == 0:
                fp8 = args.dispatch_dtype == "fp8"
                checks = [
                    agreement(c.name, results[0], r, fp8)
                    for c, r in zip(contenders[1:], results[1:], strict=True)
                ]
            del results
        bar.close()
        ranks_per_node = ep.forward_a2a._boot.topology.local_size
    rss_mib = comm.allreduce(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024, op=max_op())
    return dict(
        settings=settings_of(args, world, ranks_per_node, device, shape),
        rows=summarize(contenders),
        agreement=gather_agreement(comm, checks),
        skipped=skipped,
        max_recv_tokens=cfg.max_recv_tokens,
        peak_rss_mib_per_rank=rss_mib,
    )


def settings_of(
    args: argparse.Namespace, world: int, ranks_per_node: int, device: Any, shape: dict[str, int]
) -> dict[str, Any]:
    """The run's configuration, for the block above the table and the JSON."""
    return dict(
        world=world,
        ranks_per_node=ranks_per_node,
        provider=args.provider,
        device=device.type,
        dispatch_dtype=args.dispatch_dtype,
        grad_dtype=args.grad_dtype,
        iters=args.iters,
        warmup=args.warmup,
        compile=bool(args.compile),
        compiled_rows=args.compiled_rows,
        gpu_busy_us=args.gpu_busy_us,
        **shape,
    )


def summarize(contenders: list[Contender]) -> list[dict[str, Any]]:
    """One row per phase and baseline: moe-a2a's and the baseline's percentiles (us), their ratio.

    fwd+bwd is each iteration's fwd + bwd. Without a baseline that ran, moe-a2a's row stands alone.
    """
    samples = {}
    for c in contenders:
        fwd, bwd = np.array(c.fwd_ns), np.array(c.bwd_ns)
        by_phase = {"fwd": fwd, "bwd": bwd, "fwd+bwd": fwd + bwd}
        samples[c.name] = {ph: report.percentiles_us(v) for ph, v in by_phase.items()}
    rows = []
    for phase in PHASES:
        ours = samples[OURS][phase]
        bases: list[str | None] = [c.name for c in contenders[1:]] or [None]
        for base in bases:
            theirs = samples[base][phase] if base else {}
            row: dict[str, Any] = {"phase": phase, "baseline": base}
            row.update({f"moe_a2a_p{q}_us": ours[f"p{q}"] for q in report.PERCENTILES})
            row.update({f"baseline_p{q}_us": theirs.get(f"p{q}") for q in report.PERCENTILES})
            row["ratio"] = report.ratio(theirs.get("p50"), ours["p50"])
            rows.append(row)
    return rows


# (row key, column header) of the printed table; the CSV and JSON have every key of the rows.
COLUMNS = (
    ("phase", "phase"),
    ("baseline", "baseline"),
    ("moe_a2a_p50_us", "moe-a2a p50 (us)"),
    ("moe_a2a_p99_us", "moe-a2a p99 (us)"),
    ("baseline_p50_us", "baseline p50 (us)"),
    ("baseline_p99_us", "baseline p99 (us)"),
    ("ratio", report.RATIO),
)
NOTE = (
    f"{report.RATIO_NOTE}; each phase is the slowest rank's after a barrier; "
    "fwd+bwd = fwd + bwd of each iteration"
)


def format_config(result: dict[str, Any]) -> str:
    s = result["settings"]
    return report.config_block(
        "moe-a2a bench a2a --train",
        {
            "ranks": f"{s['world']} ({s['ranks_per_node']} per node)",
            "provider": s["provider"],
            "device": s["device"],
            "baseline": f"TorchTitan 0.3.0 token dispatchers ({'gloo' if s['device'] == 'cpu' else 'NCCL'})",
            "payloads": f"forward {s['dispatch_dtype']}, gradients {s['grad_dtype']}",
            "sizes": f"{report.sizes_text(s['tokens'], s['hidden'], s['num_experts'], s['topk'])}; "
            f"max_recv_tokens {result['max_recv_tokens']}",
            "iterations": f"{s['iters']} timed after {s['warmup']} warm-up",
            "compile": f"each forward torch.compile'd, fullgraph; moe-a2a's rows {s['compiled_rows']}"
            if s["compile"]
            else "off (eager)",
            "GPU busy": f"{s['gpu_busy_us']} us before each phase, timed from its end (host lead-in hidden)"
            if s["gpu_busy_us"] is not None
            else "off (each phase timed from its call)",
            "peak RSS": f"{result['peak_rss_mib_per_rank']} MiB/rank",
            **({"tuning": report.tuning_set()} if s["device"] == "cuda" else {}),
            "switches": report.switches_set(),
        },
    )


def print_report(result: dict[str, Any]) -> None:
    table = report.columns_table(COLUMNS, result["rows"], default=".0f")
    print(format_config(result), "", table, f"({NOTE})", sep="\n")
    for name, why in result["skipped"].items():
        print(f"{name}: skipped: {why}")
    for a in result["agreement"]:
        diffs = ", ".join(
            f"{k} max|diff| {a[k]['max_abs_diff']:.3g} (norm-rel {a[k]['rel_norm_diff']:.2g})"
            for k in ("out", "x.grad", "scores.grad")
        )
        print(f"agreement with {a['baseline']}: {'ok' if a['ok'] else 'FAILED'}: {diffs}")


def meta(result: dict[str, Any]) -> dict[str, Any]:
    return {
        **report.run_meta("a2a --train", result["settings"]),
        "note": NOTE,
        **{k: result[k] for k in ("agreement", "skipped", "max_recv_tokens", "peak_rss_mib_per_rank")},
    }


def main(args: argparse.Namespace) -> int:
    import torch
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    args.dispatch_dtype = args.dispatch_dtype or "bf16"
    args.grad_dtype = args.grad_dtype or "bf16"
    # A TrainArgumentError is found alike on every rank: moe_a2a.cli ends them together.
    shape = check_args(args, comm.Get_size())
    if args.device == "cuda":
        from moe_a2a.backends.cuda import cuda_available

        why = cuda_available()
        if why is not None:
            raise TrainArgumentError(f"--device: got 'cuda'; {why}")
    if args.device == "cuda":
        torch.cuda.set_device(local_rank(comm) % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        share_cores(comm)
        device = torch.device("cpu")
    try:
        result = run(args, comm, device, shape)
    except Exception:
        # The others may wait for us in a collective: end the job.
        sys.stderr.write(f"moe-a2a bench a2a --train: rank {rank} failed:\n{traceback.format_exc()}")
        sys.stderr.flush()
        if comm.Get_size() > 1:
            comm.Abort(1)
        raise
    if rank == 0:
        print_report(result)
        if args.output:
            report.write_output(args.output, result["rows"], meta(result))
            print(f"figures written to {args.output}")
    bad = [a["baseline"] for a in result["agreement"] if not a["ok"]]
    if bad:
        if rank == 0:
            print(f"bench a2a --train: error: results disagree with {', '.join(bad)}", file=sys.stderr)
        return 1
    return 0
