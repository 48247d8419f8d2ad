"""`moe-a2a run`: a full MoE layer per rank over the all-to-all, timed, traced, verified.

Run under `mpirun -n N` or `srun`. Every rank makes only its own experts (random,
one expert at a time from `--seed`, so all ranks agree on the whole layer), draws
new tokens and routing every iteration, and runs the layer with the shared expert
between the two halves of dispatch. Rank 0 prints a progress bar for long runs and
a summary table at the end; `--trace` writes the HDF5 trace; `--verify` checks every
measured iteration against the whole layer computed in one process on rank 0.

`--mode train` trains the layer instead (forward, backward, optimizer step over
`moe_a2a.autograd.ExpertParallel`); `--verify` then checks the loss and every
gradient against plain autograd over the whole layer on rank 0.

torch and mpi4py are imported inside `main`, so that `moe-a2a --help` stays instant
and argument errors are reported before MPI starts.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from moe_a2a import report
from moe_a2a.layers.presets import PRESETS, SCORE_FUNCS, MoEShape, get_preset

if TYPE_CHECKING:
    import torch

    from moe_a2a.layers.moe import MoELayer
    from moe_a2a.trace import RunTrace

MODES = ("decode", "prefill", "train")
OPTIMIZERS = ("adamw", "sgd")
GRAD_DTYPES = ("bf16", "fp32")
ROUTINGS = ("random", "skewed", "router")
DISPATCH_DTYPES = ("fp8", "bf16", "fp32")
COMBINE_DTYPES = ("bf16", "fp32")
WEIGHT_DTYPES = ("bf16", "fp32")
PROG = "moe-a2a run"


class UsageError(ValueError):
    """A bad combination of flags: one line on stderr, exit status 2."""


# --------------------------------------------------------------------------- parser


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the `run` subcommand to the `moe-a2a` sub-parsers; its `func` is `main`."""
    p = subparsers.add_parser(
        "run",
        help="run an MoE layer over the all-to-all (under mpirun/srun)",
        description="Run a full MoE layer per rank (router, dispatch, shared expert, grouped "
        "experts, combine) under mpirun or srun, and print a summary of phase times. "
        "Shape flags override the preset's values.",
        epilog="example: mpirun -n 4 moe-a2a run --model tiny --verify --trace run.h5",
    )
    run = p.add_argument_group("run")
    run.add_argument(
        "--mode",
        choices=MODES,
        default="decode",
        help="token counts of decode or prefill, or train: forward, backward and an optimizer "
        "step per iteration, with prefill's token count (default: %(default)s)",
    )
    # Not `choices`: an unknown preset gets one line naming it and the valid ones.
    run.add_argument(
        "--model",
        default="tiny",
        metavar="PRESET",
        help=f"model preset: {', '.join(PRESETS)} (default: %(default)s, as jobs/run-local.sh)",
    )
    run.add_argument(
        "--iters", type=int, default=20, metavar="N", help="measured iterations (default: %(default)s)"
    )
    run.add_argument(
        "--warmup",
        type=int,
        default=3,
        metavar="N",
        help="warm-up iterations, not measured (default: %(default)s)",
    )
    run.add_argument(
        "--seed",
        type=int,
        default=0,
        metavar="N",
        help="seed of weights, tokens and routing (default: %(default)s)",
    )
    run.add_argument(
        "--routing",
        choices=ROUTINGS,
        help="new routing every iteration: uniform random experts, skewed towards a few hot "
        "experts (--skew), or the layer's router on random tokens (default: router with "
        "--mode train, so the gate trains; random otherwise)",
    )
    run.add_argument(
        "--skew",
        type=float,
        default=1.0,
        metavar="S",
        help="with --routing skewed: the i-th hottest expert is picked in proportion to 1/i^S "
        "(default: %(default)s; 0 is uniform)",
    )
    run.add_argument(
        "--verify",
        action="store_true",
        help="check every measured output against a single-process reference of the whole layer on rank 0",
    )
    run.add_argument(
        "--verify-max-gib",
        type=float,
        default=8.0,
        metavar="GIB",
        help="--verify refuses when the whole layer's weights exceed this on rank 0 (default: %(default)s)",
    )
    run.add_argument("--trace", metavar="PATH", help="write an HDF5 trace of the run (from rank 0)")
    report.add_progress_argument(run)

    train = p.add_argument_group("training (--mode train)")
    train.add_argument("--optimizer", choices=OPTIMIZERS, help="torch.optim.AdamW or SGD (default: adamw)")
    train.add_argument("--lr", type=float, metavar="X", help="learning rate (default: 1e-3)")
    train.add_argument(
        "--grad-dtype",
        choices=GRAD_DTYPES,
        help="what gradients travel in through the all-to-all (default: bf16)",
    )
    train.add_argument(
        "--load-balance-coeff",
        type=float,
        metavar="X",
        help="auxiliary-loss-free load balancing: after each step, expert_bias += X * "
        "sign(mean load - load), load counted over all ranks (default: off)",
    )

    dims = p.add_argument_group("model shape (default: the preset's)")
    dims.add_argument("--hidden", type=int, metavar="D", help="model hidden size")
    dims.add_argument("--num-experts", type=int, metavar="E", help="routed experts")
    dims.add_argument("--topk", type=int, metavar="K", help="experts per token")
    dims.add_argument("--expert-hidden", type=int, metavar="F", help="hidden size of each routed expert")
    dims.add_argument("--num-shared-experts", type=int, metavar="N", help="shared experts (0: none)")
    dims.add_argument("--score-func", choices=SCORE_FUNCS, help="router scores")
    dims.add_argument("--num-groups", type=int, metavar="G", help="expert groups of group-limited routing")
    dims.add_argument("--topk-groups", type=int, metavar="G", help="groups each token may use")
    dims.add_argument(
        "--max-nodes",
        type=int,
        metavar="M",
        help="node-limited routing (with --routing "
        "router): each token uses experts of at most M nodes; replaces the groups",
    )
    dims.add_argument("--route-scale", type=float, metavar="X", help="factor on the chosen routing weights")
    dims.add_argument(
        "--tokens",
        type=int,
        metavar="T",
        help="tokens per rank (default: the preset's for "
        "--mode; 128 decode and 4096 prefill on the real models)",
    )

    a2a = p.add_argument_group("all-to-all")
    a2a.add_argument(
        "--dispatch-dtype",
        choices=DISPATCH_DTYPES,
        default="fp8",
        help="dispatch payload (default: %(default)s)",
    )
    a2a.add_argument(
        "--combine-dtype",
        choices=COMBINE_DTYPES,
        default="bf16",
        help="combine payload (default: %(default)s)",
    )
    a2a.add_argument(
        "--weight-dtype",
        choices=WEIGHT_DTYPES,
        default="bf16",
        help="expert weights and activations (default: %(default)s)",
    )
    a2a.add_argument(
        "--expert-padding",
        type=int,
        default=1,
        metavar="N",
        help="pad each expert's rows to a multiple of N (default: %(default)s)",
    )
    a2a.add_argument(
        "--max-private-tokens",
        type=int,
        metavar="N",
        help="private slots per sender (default: the library's)",
    )
    a2a.add_argument(
        "--max-recv-tokens",
        type=int,
        metavar="N",
        help="most token copies a rank may receive (default: the worst case)",
    )
    a2a.add_argument(
        "--provider",
        default="auto",
        help="libfabric provider: auto, tcp, shm, efa, verbs (default: %(default)s)",
    )
    a2a.add_argument(
        "--ranks-per-node",
        type=int,
        metavar="N",
        help="group consecutive ranks into virtual nodes of N (default: by host)",
    )
    # cpu by default: AllToAll runs dispatch/combine on the CPU only so far.
    a2a.add_argument(
        "--device", choices=("cpu", "cuda"), default="cpu", help="where the layer runs (default: %(default)s)"
    )
    p.set_defaults(func=main)
    return p


# --------------------------------------------------------------------------- arguments


def _positive(args: argparse.Namespace, name: str, minimum: int = 1) -> None:
    value = getattr(args, name.replace("-", "_"))
    if value is not None and value < minimum:
        raise UsageError(f"--{name}: got {value}; expected an integer >= {minimum}")


def resolve_shape(args: argparse.Namespace) -> MoEShape:
    """The preset with every dimension flag applied; UsageError names the bad flag."""
    try:
        shape = get_preset(args.model)
    except ValueError as err:
        raise UsageError(str(err)) from None
    for name in (
        "hidden",
        "num-experts",
        "topk",
        "expert-hidden",
        "num-groups",
        "topk-groups",
        "tokens",
        "max-nodes",
    ):
        _positive(args, name)
    _positive(args, "num-shared-experts", 0)
    if args.route_scale is not None and not args.route_scale > 0:
        raise UsageError(f"--route-scale: got {args.route_scale}; expected a positive number")
    changes: dict[str, Any] = {
        "hidden": args.hidden,
        "num_experts": args.num_experts,
        "topk": args.topk,
        "expert_hidden": args.expert_hidden,
        "num_shared_experts": args.num_shared_experts,
        "score_func": args.score_func,
        "num_groups": args.num_groups,
        "topk_groups": args.topk_groups,
        "route_scale": args.route_scale,
    }
    if args.num_experts is not None and args.num_groups is None and args.num_experts % shape.num_groups:
        # The preset's groups no longer divide the new expert count: drop the group limit.
        changes.update(num_groups=1, topk_groups=1)
    if changes["num_groups"] is not None and args.topk_groups is None:
        changes["topk_groups"] = min(shape.topk_groups, changes["num_groups"])
    if args.tokens is not None:
        changes[f"{token_mode(args.mode)}_tokens"] = args.tokens
    try:
        return shape.replace(**changes)
    except ValueError as err:
        raise UsageError(f"--model {args.model} with the given flags: {err}") from None


def token_mode(mode: str) -> str:
    """Whose token count a mode uses: training steps are prefill-sized."""
    return "prefill" if mode == "train" else mode


TRAIN_FLAGS = ("optimizer", "lr", "grad-dtype", "load-balance-coeff")


def validate_args(args: argparse.Namespace) -> MoEShape:
    """Check every flag that needs no MPI; returns the model shape.

    Fills in the defaults that depend on the mode (routing, and the training flags).
    """
    if args.routing is None:
        args.routing = "router" if args.mode == "train" else "random"
    if args.mode != "train":
        for name in TRAIN_FLAGS:
            if getattr(args, name.replace("-", "_")) is not None:
                raise UsageError(f"--{name}: applies to --mode train, got --mode {args.mode}")
    else:
        args.optimizer = args.optimizer or "adamw"
        args.grad_dtype = args.grad_dtype or "bf16"
        args.lr = 1e-3 if args.lr is None else args.lr
        if not args.lr > 0:
            raise UsageError(f"--lr: got {args.lr}; expected a positive number")
        if args.load_balance_coeff is not None and not args.load_balance_coeff > 0:
            raise UsageError(
                f"--load-balance-coeff: got {args.load_balance_coeff}; expected a positive number"
            )
    shape = resolve_shape(args)
    _positive(args, "iters")
    _positive(args, "warmup", 0)
    _positive(args, "expert-padding")
    _positive(args, "max-private-tokens", 0)
    _positive(args, "max-recv-tokens")
    _positive(args, "ranks-per-node")
    if not args.skew >= 0:
        raise UsageError(f"--skew: got {args.skew}; expected a number >= 0")
    if not args.verify_max_gib > 0:
        raise UsageError(f"--verify-max-gib: got {args.verify_max_gib}; expected a positive number")
    if args.routing != "router" and args.max_nodes is not None:
        raise UsageError("--max-nodes: limits the router's choice; use it with --routing router")
    if args.routing != "skewed" and args.skew != 1.0:
        raise UsageError(f"--skew: applies to --routing skewed, got --routing {args.routing}")
    if args.trace is not None:
        folder = os.path.dirname(os.path.abspath(args.trace))
        if not os.path.isdir(folder):
            raise UsageError(f"--trace: folder {folder} does not exist")
    return shape


def verify_bytes(shape: MoEShape, weight_dtype: str) -> int:
    """Bytes rank 0 holds for --verify: the whole layer's weights."""
    import torch

    from moe_a2a.layers.weights import full_layer_nbytes

    return full_layer_nbytes(shape, torch.bfloat16 if weight_dtype == "bf16" else torch.float32)


def _env_rank() -> int:
    """This process's rank from the launcher's environment, before MPI starts (0 if unknown)."""
    for name in ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "SLURM_PROCID"):
        value = os.environ.get(name)
        if value is not None and value.isdigit():
            return int(value)
    return 0


# --------------------------------------------------------------------------- inputs


def _generator(seed: int, *parts: object) -> torch.Generator:
    import torch

    digest = hashlib.blake2b("/".join(map(str, (seed, *parts))).encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") & ((1 << 63) - 1))


def random_routing(
    tokens: int, num_experts: int, topk: int, gen: torch.Generator, popularity: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k distinct experts per token, drawn without replacement; weights sum to one.

    `popularity` (positive, [E]) makes expert e that much likelier; None is uniform.
    Gumbel top-k draws k experts without replacement in proportion to it in one pass.
    """
    import torch

    u = torch.rand(tokens, num_experts, generator=gen).clamp_(1e-12, 1 - 1e-7)
    keys = -torch.log(-torch.log(u))
    if popularity is not None:
        keys = keys + torch.log(popularity)
    ids = keys.topk(topk, dim=-1).indices
    weights = torch.softmax(torch.randn(tokens, topk, generator=gen), dim=-1)
    return ids, weights


def skewed_popularity(num_experts: int, skew: float, seed: int) -> torch.Tensor:
    """Zipf-like popularity: the i-th hottest expert weighs 1/i^skew; which experts are
    hot is a fixed random permutation of `seed`, the same on every rank and iteration."""
    import torch

    order = torch.randperm(num_experts, generator=_generator(seed, "hot-experts"))
    weight = torch.arange(1, num_experts + 1, dtype=torch.float64).pow(-skew)
    popularity = torch.empty(num_experts, dtype=torch.float64)
    popularity[order] = weight
    return popularity.float()


# --------------------------------------------------------------------------- summary


def summary_rows(trace: RunTrace, tokens_per_iter: int) -> tuple[list[list[Any]], float | None]:
    """Rows of the summary table and tokens/s.

    Each phase's time in an iteration is its longest over ranks (the layer waits for
    the slowest rank); p50 and p99 are over iterations. `layer` is a rank's first
    phase start to last phase end, again the longest over ranks. tokens/s is every
    rank's tokens of one iteration over the p50 layer time.
    """
    import numpy as np

    from moe_a2a.report import percentiles_us

    durations = trace.durations_ns()  # [ranks, iters, phases]
    rows: list[list[Any]] = []

    def row(name: str, per_iter: np.ndarray) -> dict[str, Any]:
        stats = percentiles_us(per_iter, (50, 99))
        rows.append([name, *(stats[k] for k in ("p50", "p99", "mean"))])
        return stats

    for i, name in enumerate(trace.phases):
        per_rank = durations[:, :, i]
        if np.isnan(per_rank).all():
            continue
        row(name, np.nanmax(per_rank, axis=0))
    layer = row("layer", np.nanmax(trace.total_ns(), axis=0))
    tokens_per_s = None if not layer["p50"] else tokens_per_iter / (layer["p50"] * 1e-6)
    return rows, tokens_per_s


def format_summary(trace: RunTrace, tokens_per_iter: int, header: list[str], footer: list[str]) -> str:
    """The table printed at the end of a run."""
    from moe_a2a.report import table

    rows, tokens_per_s = summary_rows(trace, tokens_per_iter)
    lines = [
        *header,
        "",
        f"{trace.num_iters} measured iterations; per phase: max over ranks, then over iterations (us)",
        table(["phase", "moe-a2a p50 (us)", "moe-a2a p99 (us)", "moe-a2a mean (us)"], rows),
    ]
    if tokens_per_s is not None:
        lines.append(
            f"throughput: {tokens_per_s:,.0f} tokens/s over {trace.num_ranks} ranks "
            f"({tokens_per_s / trace.num_ranks:,.0f} per rank) at the p50 layer time"
        )
    return "\n".join([*lines, *footer])


# --------------------------------------------------------------------------- run


def main(args: argparse.Namespace) -> int:
    """Entry point of `moe-a2a run`; returns the exit status (0 ok, 1 verify failed, 2 usage)."""
    try:
        shape = validate_args(args)
    except UsageError as err:
        # Every rank finds the same error; one line from rank 0 is enough.
        if _env_rank() == 0:
            print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2

    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    try:
        return _run(args, shape, comm)
    except UsageError as err:
        # Raised by every rank alike before any collective step of the run.
        if comm.Get_rank() == 0:
            print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2
    except Exception as err:
        # One failing rank would leave the others waiting in a collective: end the job.
        import traceback

        traceback.print_exc()
        print(f"{PROG}: rank {comm.Get_rank()}: error: {err}; aborting the job", file=sys.stderr, flush=True)
        comm.Abort(1)
        return 1


def _run(args: argparse.Namespace, shape: MoEShape, comm: Any) -> int:
    import torch

    from moe_a2a.bootstrap import Bootstrap
    from moe_a2a.layers.moe import MoELayer
    from moe_a2a.layers.reference import max_relative_error, reference_forward, tolerance
    from moe_a2a.layers.router import node_limited
    from moe_a2a.layers.weights import local_experts, random_weights
    from moe_a2a.trace import TraceRecorder

    rank, world = comm.Get_rank(), comm.Get_size()
    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: this torch build or machine has no CUDA device")
    if shape.num_experts % world:
        raise UsageError(
            f"--num-experts: got {shape.num_experts}, not divisible by the {world} ranks; "
            "every rank must host the same number of experts"
        )
    weight_dtype = torch.bfloat16 if args.weight_dtype == "bf16" else torch.float32
    if args.verify:
        need = verify_bytes(shape, args.weight_dtype)
        if need > args.verify_max_gib * 2**30:
            raise UsageError(
                f"--verify: the whole layer's weights need {need / 2**30:.1f} GiB on rank 0 "
                f"({shape.num_experts} experts x 3 x {shape.expert_hidden} x {shape.hidden} "
                f"{args.weight_dtype}), "
                f"above --verify-max-gib {args.verify_max_gib:g}; raise the limit or shrink the layer "
                "(--num-experts, --expert-hidden, --hidden)"
            )
    if device == "cuda":
        # The launcher's node-local rank (torchrun, Open MPI, Slurm), else block placement.
        local = next(
            (
                os.environ[v]
                for v in ("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID")
                if v in os.environ
            ),
            None,
        )
        torch.cuda.set_device((int(local) if local is not None else rank) % torch.cuda.device_count())

    try:
        topology = Bootstrap(comm, args.ranks_per_node).topology
    except ValueError as err:  # same host list on every rank, so every rank refuses alike
        raise UsageError(f"--ranks-per-node: {err}") from None
    if device == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        # Ranks of one host share its cores: torch's default (every core per rank)
        # oversubscribes them and makes each rank's compute phases slower.
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        torch.set_num_threads(max(1, cores // topology.local_size))
    if args.max_nodes is not None:
        if shape.num_experts % topology.num_nodes:
            raise UsageError(
                f"--max-nodes: {shape.num_experts} experts do not split evenly over "
                f"{topology.num_nodes} nodes"
            )
        try:
            shape = node_limited(shape, topology.num_nodes, args.max_nodes)
        except ValueError as err:
            raise UsageError(f"--max-nodes {args.max_nodes}: {err}") from None
    tokens = shape.tokens(token_mode(args.mode))

    weights = random_weights(
        shape, args.seed, local_experts(shape.num_experts, rank, world), dtype=weight_dtype, device=device
    )
    if args.mode == "train":
        return _train(args, shape, comm, topology, tokens, weights)
    # Inference: no autograd graph, not even the router's.
    layer = MoELayer(shape, weights, expert_padding=args.expert_padding).eval().requires_grad_(False)
    full = random_weights(shape, args.seed, dtype=weight_dtype) if args.verify and rank == 0 else None
    popularity = None
    if args.routing == "skewed":
        popularity = skewed_popularity(shape.num_experts, args.skew, args.seed)

    try:
        a2a = _make_all_to_all(args, shape, tokens, comm, device)
    except ValueError as err:  # configuration checks, made alike on every rank before any exchange
        raise UsageError(str(err)) from None
    provider = _provider(args)
    recorder = TraceRecorder(args.iters, world, shape.num_experts)
    total_iters = args.warmup + args.iters
    progress = report.progress(total_iters, f"{PROG} {args.mode}", rank=rank, mode=args.progress)
    worst = 0.0
    limit = tolerance(args.dispatch_dtype, args.combine_dtype, weight_dtype)
    failures: list[str] = []
    try:
        for step in range(total_iters):
            it = step - args.warmup  # measured iteration index, negative during warm-up
            gen = _generator(args.seed, "tokens", rank, step)
            x = torch.randn(tokens, shape.hidden, generator=gen).to(device=device, dtype=weight_dtype)
            if args.routing == "router":
                topk_ids, topk_weights = layer.route(x)
            else:
                topk_ids, topk_weights = random_routing(
                    tokens, shape.num_experts, shape.topk, gen, popularity
                )
                topk_ids, topk_weights = topk_ids.to(device), topk_weights.to(device)
            # Start together, so each phase measures the layer and not the ranks' skew.
            comm.Barrier()
            timer = _phase_timer(recorder, it, device) if it >= 0 else None
            out = layer.forward(x, a2a, topk_ids, topk_weights, timer=timer)
            if it >= 0:
                _record_counts(recorder, it, layer, a2a)
                if args.verify:
                    rel_err = _verify(
                        comm,
                        full,
                        x,
                        topk_ids,
                        topk_weights,
                        out,
                        args.dispatch_dtype,
                        reference_forward,
                        max_relative_error,
                    )
                    if rank == 0:
                        worst = max(worst, rel_err)
                        if rel_err > limit:
                            failures.append(f"iteration {it}: max relative error {rel_err:.3g}")
            progress.update()
    except BaseException:
        # No collective close here: the peers may sit in another collective. main()
        # aborts the job, which releases everything.
        progress.close()
        raise
    progress.close()
    a2a.close()

    footer = []
    if args.verify:
        footer.append(
            f"verify: {'FAILED' if failures else 'OK'}: max relative error {worst:.3g} (limit {limit:g}) "
            f"over {args.iters} iterations x {world} ranks"
        )
        footer += [f"  {f}" for f in failures[:5]]
    return _finish(comm, recorder, args, shape, tokens, topology, provider, footer, bool(failures))


def _finish(
    comm: Any,
    recorder: Any,
    args: argparse.Namespace,
    shape: MoEShape,
    tokens: int,
    topology: Any,
    provider: str,
    footer: list[str],
    failed: bool,
) -> int:
    """Gather the trace, write it and print the summary on rank 0; the exit status on every rank.

    `failed` (what rank 0's verification found) makes the status 1.
    """
    from moe_a2a.trace import gather_trace, write_trace

    world = comm.Get_size()
    config = _run_config(args, shape, tokens, world, topology, provider)
    trace = gather_trace(comm, recorder, config)
    status = 0
    if comm.Get_rank() == 0:
        assert trace is not None
        if args.trace:
            write_trace(args.trace, trace)
        header = [_header(args, shape, tokens, world, topology, provider)]
        if args.trace:
            footer = [*footer, f"trace: {args.trace} (details: moe-a2a trace summary {args.trace})"]
        print(format_summary(trace, tokens * world, header, footer), flush=True)
        status = 1 if args.verify and failed else 0
    return int(comm.bcast(status, root=0))


def _provider(args: argparse.Namespace) -> str:
    if args.provider != "auto":
        return args.provider
    from moe_a2a.fabric import default_provider

    return default_provider()


def _run_config(
    args: argparse.Namespace, shape: MoEShape, tokens: int, world: int, topology: Any, provider: str
) -> dict[str, Any]:
    """The run's configuration, as the trace stores it."""
    config = {
        "command": "run",
        "mode": args.mode,
        "model": args.model,
        **{k: v for k, v in asdict(shape).items() if k not in ("decode_tokens", "prefill_tokens")},
        "tokens": tokens,
        "world_size": world,
        "num_nodes": topology.num_nodes,
        "ranks_per_node": topology.local_size,
        "dispatch_dtype": args.dispatch_dtype,
        "combine_dtype": args.combine_dtype,
        "weight_dtype": args.weight_dtype,
        "expert_padding": args.expert_padding,
        "iters": args.iters,
        "warmup": args.warmup,
        "routing": args.routing,
        "skew": args.skew if args.routing == "skewed" else None,
        "seed": args.seed,
        "provider": provider,
        "device": args.device,
        "verify": bool(args.verify),
    }
    if args.mode == "train":
        config.update(
            optimizer=args.optimizer,
            lr=args.lr,
            grad_dtype=args.grad_dtype,
            load_balance_coeff=args.load_balance_coeff,
        )
    return config


def _header(
    args: argparse.Namespace, shape: MoEShape, tokens: int, world: int, topology: Any, provider: str
) -> str:
    """The configuration block above the summary table (the same style as `bench`'s)."""
    settings = {
        "model": f"{args.model} {args.mode}",
        "ranks": f"{world} on {topology.num_nodes} node(s) of {topology.local_size}",
        "provider": provider,
        "device": args.device,
        "sizes": report.sizes_text(tokens, shape.hidden, shape.num_experts, shape.topk),
        "payloads": f"dispatch {args.dispatch_dtype}, combine {args.combine_dtype}",
        "routing": args.routing,
        "iterations": f"{args.iters} measured after {args.warmup} warm-up",
    }
    if args.mode == "train":
        settings["training"] = f"{args.optimizer} lr {args.lr:g}, gradients {args.grad_dtype}"
        if args.load_balance_coeff is not None:
            settings["training"] += f", load balancing {args.load_balance_coeff:g}"
    settings["switches"] = report.switches_set()
    return report.config_block(PROG, settings)


def _a2a_config(args: argparse.Namespace, shape: MoEShape, tokens: int) -> Any:
    from moe_a2a.all_to_all import Config

    return Config(
        max_tokens=tokens,
        hidden=shape.hidden,
        num_experts=shape.num_experts,
        topk=shape.topk,
        dispatch_dtype=args.dispatch_dtype,
        combine_dtype=args.combine_dtype,
        expert_padding=args.expert_padding,
        max_private_tokens=args.max_private_tokens,
        max_recv_tokens=args.max_recv_tokens,
    )


def _make_all_to_all(args: argparse.Namespace, shape: MoEShape, tokens: int, comm: Any, device: str) -> Any:
    from moe_a2a.all_to_all import AllToAll

    cfg = _a2a_config(args, shape, tokens)
    return AllToAll(cfg, comm=comm, device=device, provider=args.provider, ranks_per_node=args.ranks_per_node)


# --------------------------------------------------------------------------- train

ROUTED = "routed_experts."  # parameter names of this rank's experts; the rest is replicated


def _train(
    args: argparse.Namespace, shape: MoEShape, comm: Any, topology: Any, tokens: int, weights: Any
) -> int:
    """`--mode train`: forward, backward and an optimizer step of the layer per iteration.

    The loss is the mean squared error against a fixed random linear teacher of the
    tokens (new tokens every iteration, the same teacher on every rank), so it falls
    as the layer learns. Each rank holds its experts; the router and shared expert
    are replicated, so their gradients are summed over ranks before the step, as data
    parallelism over the expert-parallel group would.
    """
    import torch

    from moe_a2a.autograd import ExpertParallel
    from moe_a2a.layers.moe import MoELayer
    from moe_a2a.layers.reference import grad_tolerance
    from moe_a2a.trace import TRAIN_PHASES, TraceRecorder

    rank, world = comm.Get_rank(), comm.Get_size()
    device = args.device
    weight_dtype = torch.bfloat16 if args.weight_dtype == "bf16" else torch.float32
    layer = MoELayer(
        shape, weights, expert_padding=args.expert_padding, load_balance_coeff=args.load_balance_coeff
    ).train()
    try:
        ep = ExpertParallel(
            _a2a_config(args, shape, tokens),
            comm=comm,
            device=device,
            provider=args.provider,
            ranks_per_node=args.ranks_per_node,
            grad_dtype=args.grad_dtype,
        )
    except ValueError as err:  # configuration checks, made alike on every rank before any exchange
        raise UsageError(str(err)) from None
    replicated = [p for n, p in layer.named_parameters() if not n.startswith(ROUTED)]
    optimizer_cls = torch.optim.AdamW if args.optimizer == "adamw" else torch.optim.SGD
    optimizer = optimizer_cls(layer.parameters(), lr=args.lr)
    popularity = None
    if args.routing == "skewed":
        popularity = skewed_popularity(shape.num_experts, args.skew, args.seed)
    D = shape.hidden
    teacher = (torch.randn(D, D, generator=_generator(args.seed, "teacher")) * D**-0.5).to(device)
    provider = _provider(args)
    recorder = TraceRecorder(args.iters, world, shape.num_experts, phases=TRAIN_PHASES)
    total_iters = args.warmup + args.iters
    progress = report.progress(total_iters, f"{PROG} {args.mode}", rank=rank, mode=args.progress)
    limit = grad_tolerance(args.dispatch_dtype, args.combine_dtype, weight_dtype, args.grad_dtype)
    failures: list[str] = []
    worst: dict[str, float] = {}
    losses: list[float] = []
    try:
        for step in range(total_iters):
            it = step - args.warmup
            gen = _generator(args.seed, "tokens", rank, step)
            x = (
                torch.randn(tokens, D, generator=gen)
                .to(device=device, dtype=weight_dtype)
                .requires_grad_(True)
            )
            target = x.detach().float() @ teacher
            topk_weights: torch.Tensor | None = None
            if args.routing != "router":
                topk_ids, topk_weights = random_routing(
                    tokens, shape.num_experts, shape.topk, gen, popularity
                )
                topk_ids, topk_weights = topk_ids.to(device), topk_weights.to(device)
            before = (
                {n: p.detach().clone() for n, p in layer.named_parameters()}
                if args.verify and it >= 0
                else None
            )
            comm.Barrier()
            timer = _phase_timer(recorder, it, device) if it >= 0 else None
            phase = timer or _no_phase
            if args.routing == "router":
                # Recomputed every step from the current gate; differentiable w.r.t. it.
                topk_ids, topk_weights = layer.route(x)
            out = layer(x, ep, topk_ids, topk_weights, timer=timer)
            if it >= 0:
                _record_counts(recorder, it, layer, ep.forward_a2a)
            loss = (out.float() - target).square().sum() / (world * tokens * D)
            loss.backward()
            with phase("grad_allreduce"):
                _allreduce_grads(comm, replicated)
            grads = (
                {n: None if p.grad is None else p.grad.clone() for n, p in layer.named_parameters()}
                if before is not None
                else None
            )
            with phase("optimizer"):
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            if args.load_balance_coeff is not None:
                layer.update_expert_bias(all_reduce=lambda t: _allreduce_sum(comm, t))
            global_loss = float(comm.allreduce(float(loss.detach())))
            losses.append(global_loss)
            if rank == 0:
                tag = " (warm-up)" if it < 0 else ""
                # tqdm.write: the line goes above the bar instead of through it.
                progress.write(
                    f"{PROG}: step {step + 1}/{total_iters}{tag}: loss {global_loss:.6g}", sys.stdout
                )
            if before is not None:
                assert grads is not None
                found = _verify_train(
                    comm,
                    args,
                    shape,
                    before,
                    grads,
                    x,
                    topk_ids,
                    None if args.routing == "router" else topk_weights,
                    target,
                    global_loss,
                    limit,
                    worst,
                )
                failures += [f"iteration {it}: {f}" for f in found]
            progress.update()
    except BaseException:
        progress.close()  # no collective close: main() aborts the job (see _run)
        raise
    progress.close()
    ep.close()

    footer = [f"loss: {losses[0]:.6g} at step 1, {losses[-1]:.6g} at step {len(losses)}"]
    if args.verify:
        worst_s = ", ".join(f"{k} {v:.3g}" for k, v in worst.items())
        footer.append(
            f"verify: {'FAILED' if failures else 'OK'}: loss and gradients over {args.iters} iterations "
            f"x {world} ranks (limit {limit:g}); max relative errors: {worst_s}"
        )
        footer += [f"  {f}" for f in failures[:10]]
    return _finish(comm, recorder, args, shape, tokens, topology, provider, footer, bool(failures))


def _no_phase(name: str) -> Any:
    import contextlib

    return contextlib.nullcontext()


def _allreduce_sum(comm: Any, t: torch.Tensor) -> torch.Tensor:
    """The sum of `t` over ranks (in fp32), in t's dtype and device."""
    import torch
    from mpi4py import MPI

    buf = t.detach().to("cpu", torch.float32).contiguous().numpy().copy()
    comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
    return torch.from_numpy(buf).to(device=t.device, dtype=t.dtype)


def _allreduce_grads(comm: Any, params: list[Any]) -> None:
    """Sum the replicated parameters' gradients over ranks, in one collective.

    A missing gradient counts as zeros, so every rank takes part alike.
    """
    import torch

    if not params:
        return
    flat = torch.cat(
        [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).float() for p in params]
    )
    total = _allreduce_sum(comm, flat)
    offset = 0
    for p in params:
        n = p.numel()
        p.grad = total[offset : offset + n].view_as(p).to(p.dtype)
        offset += n


def _verify_train(
    comm: Any,
    args: argparse.Namespace,
    shape: MoEShape,
    before: dict[str, Any],
    grads: dict[str, Any],
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor | None,
    target: torch.Tensor,
    loss: float,
    limit: float,
    worst: dict[str, float],
) -> list[str]:
    """Check the loss and every gradient against `reference_train_step` on rank 0.

    Gathers the tokens, routing, targets, the weights the forward used and the
    gradients of every rank. Returns what failed (rank 0; empty elsewhere); `worst`
    collects the largest error per name.
    """
    import torch

    from moe_a2a.layers.reference import max_relative_error, reference_train_step
    from moe_a2a.layers.weights import MoEWeights

    def cpu(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.detach().cpu()

    routed = [n for n in before if n.startswith(ROUTED)]
    local = {
        "x": cpu(x),
        "x_grad": cpu(x.grad),
        "ids": cpu(topk_ids),
        "weights": cpu(topk_weights),
        "target": cpu(target),
        "experts": {n: cpu(before[n]) for n in routed},
        "grads": {n: cpu(grads[n]) for n in routed},
    }
    parts = comm.gather(local, root=0)
    if parts is None:
        return []

    def cat(key: str) -> torch.Tensor:
        return torch.cat([p[key] for p in parts])

    def cat_named(key: str, name: str) -> torch.Tensor | None:
        got = [p[key][name] for p in parts]
        if all(g is None for g in got):
            return None
        ref = next(g for g in got if g is not None)
        return torch.cat([torch.zeros_like(ref) if g is None else g for g in got])

    def whole(name: str) -> torch.Tensor | None:
        return cpu(before.get(name))

    def needed(t: torch.Tensor | None) -> torch.Tensor:
        assert t is not None  # the router and the routed experts are always there
        return t

    inner = "routed_experts.inner_experts."
    full = MoEWeights(
        gate=needed(whole("router.gate.weight")),
        w1=needed(cat_named("experts", inner + "w1_EFD")),
        w2=needed(cat_named("experts", inner + "w2_EDF")),
        w3=needed(cat_named("experts", inner + "w3_EFD")),
        shared_w1=whole("shared_experts.w1.weight"),
        shared_w2=whole("shared_experts.w2.weight"),
        shared_w3=whole("shared_experts.w3.weight"),
    )
    ref_loss, ref_grads = reference_train_step(
        cat("x"),
        full,
        cat("ids"),
        cat("target"),
        topk_weights=None if topk_weights is None else cat("weights"),
        score_func=shape.score_func,
        norm_topk=shape.norm_topk,
        route_scale=shape.route_scale,
        dispatch_dtype=args.dispatch_dtype,
    )
    run_grads: dict[str, torch.Tensor | None] = {n: cpu(g) for n, g in grads.items() if n not in routed}
    run_grads.update({n: cat_named("grads", n) for n in routed})
    x_grads = [p["x_grad"] for p in parts]
    run_grads["x"] = None if any(g is None for g in x_grads) else torch.cat(x_grads)
    found = []
    loss_err = abs(loss - ref_loss) / max(abs(ref_loss), 1e-30)
    worst["loss"] = max(worst.get("loss", 0.0), loss_err)
    if loss_err > limit:
        found.append(
            f"loss {loss:.6g}, reference {ref_loss:.6g}: relative error {loss_err:.3g} (limit {limit:g})"
        )
    for name in [*run_grads, *(n for n in ref_grads if n not in run_grads)]:
        label = "the input x" if name == "x" else name
        ref, got = ref_grads.get(name), run_grads.get(name)
        ref_max = 0.0 if ref is None else float(ref.abs().max())
        got_max = 0.0 if got is None else float(got.float().abs().max())
        if ref_max == 0.0:
            if got_max > 0.0:
                found.append(f"gradient of {label}: max |grad| {got_max:.3g} where the reference has none")
            continue
        if got_max == 0.0:
            what = "None" if got is None else "all zero"
            found.append(f"gradient of {label}: {what} here, the reference's has max |grad| {ref_max:.3g}")
            worst[name] = float("inf")
            continue
        assert got is not None and ref is not None  # both have a nonzero maximum
        err = max_relative_error(got, ref)
        worst[name] = max(worst.get(name, 0.0), err)
        if err > limit:
            found.append(f"gradient of {label}: max relative error {err:.3g} (limit {limit:g})")
    return found


class _SyncedPhase:
    """A recorder phase that waits for the GPU before it stamps the end."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __enter__(self) -> Any:
        import torch

        torch.cuda.synchronize()
        return self._inner.__enter__()

    def __exit__(self, *exc: object) -> None:
        import torch

        torch.cuda.synchronize()
        self._inner.__exit__(*exc)


def _phase_timer(recorder: Any, it: int, device: str) -> Any:
    if device == "cuda":
        return lambda name: _SyncedPhase(recorder.phase(it, name))
    return lambda name: recorder.phase(it, name)


def _record_counts(recorder: Any, it: int, layer: MoELayer, a2a: Any) -> None:
    import numpy as np
    import torch

    counts = layer.last_tokens_per_expert
    if counts is not None:
        recorder.add_tokens(it, layer.expert_offset, counts.to("cpu", torch.int64).numpy())
    traffic = getattr(a2a, "traffic", None)
    if callable(traffic):
        from moe_a2a.trace import PATHS

        sent = traffic()  # [peer, path]: bytes this rank sent in the last dispatch + combine
        for peer, path in zip(*np.nonzero(sent), strict=True):
            recorder.add_bytes(it, int(peer), PATHS[int(path)], int(sent[peer, path]))


def _verify(
    comm: Any,
    full: Any,
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    out: torch.Tensor,
    dispatch_dtype: str,
    reference_forward: Any,
    max_relative_error: Any,
) -> float:
    """Gather every rank's tokens, routing and output on rank 0; its max relative error there."""
    import torch

    parts = comm.gather(tuple(t.cpu() for t in (x, topk_ids, topk_weights, out)), root=0)
    if parts is None:
        return 0.0
    xs, ids, ws, outs = (torch.cat([p[i] for p in parts]) for i in range(4))
    ref = reference_forward(xs, full, ids, ws, dispatch_dtype)
    return max_relative_error(outs, ref)
