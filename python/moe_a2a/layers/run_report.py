"""What `moe-a2a run` records and prints: phase timers, the trace, the summary table.

Each phase's time in an iteration is its longest over ranks; the table and the
trace's configuration are made on rank 0 after the last iteration.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from moe_a2a import report
from moe_a2a.layers.presets import MoEShape
from moe_a2a.layers.run_args import PROG

if TYPE_CHECKING:
    from moe_a2a.layers.moe import MoELayer
    from moe_a2a.trace import RunTrace


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


def phase_timer(recorder: Any, it: int, device: str) -> Any:
    """`timer(name)` for iteration `it`: a context that records the phase's start and end."""
    if device == "cuda":
        return lambda name: _SyncedPhase(recorder.phase(it, name))
    return lambda name: recorder.phase(it, name)


def record_counts(recorder: Any, it: int, layer: MoELayer, a2a: Any) -> None:
    """Tokens per expert and bytes per peer and path of iteration `it`."""
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


def no_phase(name: str) -> Any:
    """The phase timer of a warm-up iteration: records nothing."""
    return contextlib.nullcontext()


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


def finish(
    comm: Any,
    recorder: Any,
    args: argparse.Namespace,
    shape: MoEShape,
    tokens: int,
    topology: Any,
    provider: str,
    footer: list[str],
    failed: bool,
    rows_path: dict[str, str] | None = None,
) -> int:
    """Gather the trace, write it and print the summary on rank 0; the exit status on every rank.

    `failed` (what rank 0's verification found) makes the status 1. `rows_path`: the
    AllToAll's (GPU-direct or staged, and why), recorded in the trace's config.
    """
    from moe_a2a.trace import gather_trace

    world = comm.Get_size()
    config = _run_config(args, shape, tokens, world, topology, provider)
    if rows_path is not None:
        config["rows_path"] = rows_path
    trace = gather_trace(comm, recorder, config)
    status = 0
    if comm.Get_rank() == 0:
        assert trace is not None
        header = [_header(args, shape, tokens, world, topology, provider)]
        status = 1 if args.verify and failed else 0
        status = max(status, publish(trace, tokens * world, header, footer, args.trace))
    return int(comm.bcast(status, root=0))


def publish(
    trace: RunTrace, tokens_per_iter: int, header: list[str], footer: list[str], path: str | None
) -> int:
    """Write the trace to `path` (if given), then print the summary; 1 if the trace could not be written.

    The results come first either way: a trace that fails to write (a full disk, a
    folder gone since the run started) costs the file, not the run's figures.
    """
    from moe_a2a.trace import write_trace

    problem = None
    if path:
        try:
            write_trace(path, trace)
            footer = [*footer, f"trace: {path} (details: moe-a2a trace summary {path})"]
        except OSError as err:
            problem = (
                f"{PROG}: error: --trace {path}: could not write the trace ({err}); nothing was written there"
            )
    print(format_summary(trace, tokens_per_iter, header, footer), flush=True)
    if problem is None:
        return 0
    print(problem, file=sys.stderr, flush=True)
    return 1


def provider_name(args: argparse.Namespace) -> str:
    """The provider the run uses: --provider, or the default one for auto."""
    from moe_a2a.fabric import default_provider

    return default_provider(args.provider)


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


def _ranks_text(args: argparse.Namespace, world: int, topology: Any) -> str:
    """`4 on 2 node(s) of 2`; with --ranks-per-node, says the nodes are virtual (hosts may be fewer)."""
    if args.ranks_per_node is None:
        return f"{world} on {topology.num_nodes} node(s) of {topology.local_size}"
    return (
        f"{world} in {topology.num_nodes} virtual node(s) of {topology.local_size} "
        f"(--ranks-per-node {args.ranks_per_node})"
    )


def _header(
    args: argparse.Namespace, shape: MoEShape, tokens: int, world: int, topology: Any, provider: str
) -> str:
    """The configuration block above the summary table (the same style as `bench`'s)."""
    settings = {
        "model": f"{args.model} {args.mode}",
        "ranks": _ranks_text(args, world, topology),
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
