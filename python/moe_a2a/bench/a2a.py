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
(`--ranks-per-node 1`) the engine alone also moves each phase's bytes, and two
more columns give its time and the phase/engine ratio (`moe_a2a.bench.engine_ref`).

`--device cuda` without `--baseline` runs the per-phase CUDA benchmark
(`moe_a2a.bench.a2a_cuda`: bandwidth against the copy ceiling, torch-native).

Rank 0 draws a progress bar on stderr while it runs, then prints what ran (the
configuration block) and one table (`COLUMNS`, in moe_a2a.report's style and
words); `--output` writes the same rows as CSV or JSON.
"""

from __future__ import annotations

import argparse
import functools
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from moe_a2a import report
from moe_a2a.bench import a2a_bytes, engine_ref
from moe_a2a.bench.args import int_at_least, rows_paths
from moe_a2a.bench.common import INTERRUPTS, local_rank, mpi_transport, share_cores, timed, transport_warning
from moe_a2a.bench.routing import Routing
from moe_a2a.usage import UsageError

if TYPE_CHECKING:
    import torch

POSITIVE = int_at_least(1)

SHAPES = {
    # DeepSeek-V3 decode: 128 tokens per rank.
    "decode": dict(tokens=128, hidden=7168, num_experts=256, topk=8),
    # Prefill, scaled to what two CPU cores and 24 GiB hold for 4 ranks (flags change it).
    "prefill": dict(tokens=1024, hidden=7168, num_experts=256, topk=8),
}
PHASES = ("dispatch", "combine", "total")


@dataclass
class Round:
    """One rank's inputs for one iteration."""

    x: torch.Tensor
    ids: torch.Tensor
    weights: torch.Tensor


def make_round(seed: int, rank: int, tokens: int, hidden: int, routing: Routing) -> Round:
    """Random tokens; uniform top-k experts, or the group-limited rule where `routing` has one."""
    import torch

    g = torch.Generator().manual_seed(seed * 65537 + rank)
    x = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16)
    experts, topk = routing.num_experts, routing.topk
    ids = torch.argsort(torch.rand(tokens, experts, generator=g), dim=1)[:, :topk].contiguous()
    weights = torch.rand(tokens, topk, generator=g)
    if routing.limited:
        ids, weights = routing.ids_weights(seed, rank, tokens)
    return Round(x, ids, weights)


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
        raise UsageError(f"--baseline {args.baseline}: needs --device {wanted}; got --device {device.type}")
    return TorchExchange(comm, device)


def shape_of(name: str, args: argparse.Namespace) -> dict[str, int]:
    """The sizes a shape runs: the preset's, with --tokens, --hidden, --num-experts, --topk applied."""
    shape = dict(SHAPES[name])
    for key in shape:
        if getattr(args, key) is not None:
            shape[key] = getattr(args, key)
    return shape


def check_shapes(args: argparse.Namespace, world: int) -> None:
    """Refuse, alike on every rank and before any exchange, shapes that `world` ranks cannot run."""
    for name in _shapes(args):
        shape = shape_of(name, args)
        if shape["num_experts"] % world:
            raise UsageError(
                f"--num-experts: got {shape['num_experts']} ({name}), which is not divisible by the "
                f"{world} ranks; every rank hosts the same number of experts"
            )
        if shape["topk"] > shape["num_experts"]:
            raise UsageError(
                f"--topk: got {shape['topk']}; expected at most --num-experts={shape['num_experts']} "
                "(a token picks distinct experts)"
            )


def check_graph(args: argparse.Namespace) -> None:
    """--graph needs CUDA and a baseline (the per-phase CUDA benchmark times its own graph)."""
    if args.graph and (args.device != "cuda" or args.baseline is None):
        raise UsageError(
            f"--graph: got it with --device {args.device} and --baseline {args.baseline}; expected "
            "--device cuda and a --baseline (the per-phase CUDA benchmark times its own graph)"
        )


def in_turn(modes: list[str], it: int) -> list[str]:
    """The order iteration `it` calls the modes in: rotated by one each iteration, so that each
    runs first (right after the baseline) as often as the others. Called in one fixed order on an
    H100 shared by 4 ranks, the second of two instances running the same path measured up to 13%
    slower than the first."""
    k = it % len(modes) if modes else 0
    return modes[k:] + modes[:k]


def run_shape(name: str, args: argparse.Namespace, comm: Any, exchange: Any, device: Any) -> dict[str, Any]:
    """Time one shape in every --fabric-rows mode (one AllToAll each, the same tokens); every rank
    gets the slowest rank's samples (ns) per side and phase, and each mode's byte tallies."""
    import contextlib
    from dataclasses import replace

    import torch

    from moe_a2a.all_to_all import AllToAll, Config, Dispatched
    from moe_a2a.bench.baseline import Baseline

    shape = shape_of(name, args)
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
    times: dict[str, list[float]] = {key: [] for key in SIDES if key.startswith("base")}
    modes: dict[str, dict[str, Any]] = {}
    graphs = len(args.fabric_rows) if args.graph else 0
    bar = report.progress(args.warmup + args.iters + graphs, name, rank=rank, mode=args.progress)
    first: tuple[Round, Any] | None = None  # round 0 and the baseline's result of it
    with bar, contextlib.ExitStack() as stack:
        a2as = {
            mode: stack.enter_context(
                AllToAll(
                    replace(cfg, fabric_rows=mode),
                    comm=comm,
                    device=device.type,
                    provider=args.provider,
                    ranks_per_node=args.ranks_per_node,
                )
            )
            for mode in args.fabric_rows
        }
        topology = next(iter(a2as.values()))._boot.topology
        ranks_per_node = topology.local_size
        routing = Routing.of_args(shape, args, topology.num_nodes)
        for mode, a2a in a2as.items():
            modes[mode] = {
                "samples_ns": {"ours_dispatch": [], "ours_combine": []},
                "tally": a2a_bytes.Tally(),
            }
            alone = engine_ref.start_for(a2a, comm, args.provider)  # every peer remote: the engine alone
            modes[mode]["alone"] = alone
            if alone is not None:
                modes[mode]["samples_ns"].update(
                    engine_dispatch=alone.samples["dispatch"], engine_combine=alone.samples["combine"]
                )
        for it in range(args.warmup + args.iters):
            INTERRUPTS.check()
            r = make_round(it, rank, tokens, cfg.hidden, routing)
            r = Round(r.x.to(device), r.ids.to(device), r.weights.to(device))
            state, b_d = timed(comm, functools.partial(baseline.dispatch, r.x, r.ids), device)
            yb = expert_stand_in(*baseline.expert_input(state, cfg.hidden))
            ref, b_c = timed(comm, functools.partial(baseline.combine, yb, state, r.weights), device)
            keep = it >= args.warmup
            if keep:
                times["base_dispatch"].append(b_d)
                times["base_combine"].append(b_c)
            for mode in in_turn(list(a2as), it):
                a2a, m = a2as[mode], modes[mode]
                d, t_d = timed(comm, functools.partial(a2a.dispatch, r.x, r.ids, r.weights), device)
                assert isinstance(d, Dispatched)  # a whole call, not a half
                y = expert_stand_in(d.expert_x, d.expert_x_scale)
                out, t_c = timed(comm, functools.partial(a2a.combine, y, d), device)
                assert isinstance(out, torch.Tensor)
                if it == 0:
                    check_agree(out, ref, cfg.dispatch_dtype == "fp8" and device.type == "cuda")
                    first = (r, ref)
                if keep:
                    m["samples_ns"]["ours_dispatch"].append(t_d)
                    m["samples_ns"]["ours_combine"].append(t_c)
                    m["tally"].add(a2a, r.ids.cpu().numpy(), ranks_per_node)
                if m["alone"] is not None:
                    m["alone"].sample(r.ids.cpu().numpy(), cfg.num_experts, keep=keep)
            bar.update()
        for m in modes.values():
            alone = m.pop("alone")
            if alone is not None:
                alone.close()
            m["bytes"] = m.pop("tally").gathered(comm)
        rows_path = next(iter(a2as.values())).rows_path
        if graphs:  # after the eager instances' samples, each mode's graph-safe one alone
            assert first is not None
            for mode, m in modes.items():
                m["samples_ns"]["ours_graph"] = graph_samples(
                    replace(cfg, fabric_rows=mode), args, comm, *first
                )
                bar.update()
    bound = routing.bound(world, ranks_per_node)
    return dict(
        shape=name,
        ranks_per_node=ranks_per_node,
        rows_path=rows_path,
        **shape,
        routing=routing.text(),
        bound=bound,
        samples_ns=times,
        modes=modes,
    )


def graph_samples(cfg: Any, args: argparse.Namespace, comm: Any, r: Round, ref: Any) -> list[float]:
    """--graph: one step (dispatch, the expert stand-in, combine) of a graph-safe AllToAll, run
    once, captured in a CUDA graph and replayed warmup + iters times; the timed replays' samples
    (ns, each from a barrier to the slowest rank's end). The replay's result must agree with `ref`."""
    import torch

    from moe_a2a.all_to_all import AllToAll, Dispatched

    with AllToAll(
        cfg,
        comm=comm,
        device="cuda",
        provider=args.provider,
        ranks_per_node=args.ranks_per_node,
        graph_safe=True,
    ) as a2a:

        def step() -> torch.Tensor:
            d = a2a.dispatch(r.x, r.ids, r.weights)
            assert isinstance(d, Dispatched)  # whole calls, not halves
            out = a2a.combine(expert_stand_in(d.expert_x, d.expert_x_scale), d)
            assert isinstance(out, torch.Tensor)
            return out

        step()
        torch.cuda.synchronize()
        a2a.check()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = step()
        samples = [timed(comm, graph.replay, r.x.device)[1] for _ in range(args.warmup + args.iters)]
        a2a.check()
        check_agree(out, ref, cfg.dispatch_dtype == "fp8")
    return samples[args.warmup :]


# Samples of each side and phase; with every peer remote also engine_dispatch and engine_combine.
SIDES = tuple(f"{side}_{p}" for side in ("ours", "base") for p in ("dispatch", "combine"))


def rows_of(result: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per mode and phase of a shape: moe-a2a's and the baseline's percentiles (us), their ratio.

    `total` is each iteration's dispatch + combine, so its percentiles are of those sums.
    """
    base = {k: np.asarray(v) for k, v in result["samples_ns"].items()}
    rows = []
    for mode, m in result["modes"].items():
        t = {**base, **{k: np.asarray(v) for k, v in m["samples_ns"].items()}}
        for phase in (*PHASES, "graph") if "ours_graph" in t else PHASES:
            if phase == "graph":  # the whole step replayed, against the baseline's dispatch + combine
                ours, theirs = t["ours_graph"], t["base_dispatch"] + t["base_combine"]
            elif phase == "total":
                ours, theirs = t["ours_dispatch"] + t["ours_combine"], t["base_dispatch"] + t["base_combine"]
            else:
                ours, theirs = t[f"ours_{phase}"], t[f"base_{phase}"]
            o, b = report.percentiles_us(ours), report.percentiles_us(theirs)
            row: dict[str, Any] = {
                "shape": result["shape"],
                "tokens": result["tokens"],
                "fabric_rows": mode,
                "phase": phase,
            }
            row.update({f"moe_a2a_p{q}_us": o[f"p{q}"] for q in report.PERCENTILES})
            row.update({f"baseline_p{q}_us": b[f"p{q}"] for q in report.PERCENTILES})
            row["ratio"] = report.ratio(b["p50"], o["p50"])
            if "engine_dispatch" in t:  # every peer remote: the engine alone moving the phase's bytes
                e = t["engine_dispatch"] + t["engine_combine"] if phase == "total" else t[f"engine_{phase}"]
                row.update(engine_ref.fields(o["p50"], e))
            rows.append(row)
    return rows


# (row key, column header) of the printed table; the CSV and JSON have every key of the rows.
COLUMNS = (
    ("shape", "shape"),
    ("tokens", "tokens/rank"),
    ("fabric_rows", "fabric_rows"),
    ("phase", "phase"),
    ("moe_a2a_p50_us", "moe-a2a p50 (us)"),
    ("moe_a2a_p99_us", "moe-a2a p99 (us)"),
    ("baseline_p50_us", "baseline p50 (us)"),
    ("baseline_p99_us", "baseline p99 (us)"),
    ("ratio", report.RATIO),
)


# With every peer remote: the engine alone moving each phase's per-peer bytes (moe_a2a.bench.engine_ref).
ENGINE_COLUMNS = engine_ref.COLUMNS


def format_table(rows: list[dict[str, Any]]) -> str:
    columns = COLUMNS + (ENGINE_COLUMNS if any("engine_p50_us" in r for r in rows) else ())
    return report.columns_table(columns, rows, formats={"phase_engine": ".2f"}, default=".0f")


# What each baseline is (moe_a2a/bench/baseline.py), for the configuration block.
BASELINE_WHAT = {
    "MPI": "Alltoallv of the counts, then of rows that carry their expert ids",
    "GLOO": "torch.distributed all_to_all_single on gloo, the same exchange",
    "NCCL": "torch.distributed all_to_all_single on NCCL, the same exchange",
}
NOTE = (
    f"{report.RATIO_NOTE}; each phase is the slowest rank's, after a barrier; "
    "total = dispatch + combine of each iteration"
)


def note_of(rows: list[dict[str, Any]]) -> str:
    """The footnote: the engine's column explained only where the table has it."""
    return f"{NOTE}; {engine_ref.NOTE}" if any("engine_p50_us" in r for r in rows) else NOTE


def settings_of(
    args: argparse.Namespace,
    world: int,
    ranks_per_node: int,
    exchange: Any,
    one_host: bool = True,
    routing_text: str | None = None,
) -> dict[str, Any]:
    """The run's configuration, for the block above the table and the JSON."""
    mpi = exchange.name == "MPI"
    return dict(
        mpi_transport=mpi_transport(os.environ, one_host) if mpi else None,
        world=world,
        ranks_per_node=ranks_per_node,
        provider=_provider_name(args.provider),
        device=args.device,
        baseline=exchange.name,
        dispatch_dtype=args.dispatch_dtype,
        combine_dtype="bf16",
        iters=args.iters,
        warmup=args.warmup,
        shapes={name: shape_of(name, args) for name in _shapes(args)},
        fabric_rows=list(getattr(args, "fabric_rows", None) or ["rank"]),
        routing=routing_text,
    )


def format_config(s: dict[str, Any]) -> str:
    shapes = "; ".join(f"{name} {report.sizes_text(**v)}" for name, v in s["shapes"].items())
    return report.config_block(
        "moe-a2a bench a2a",
        {
            "ranks": f"{s['world']} ({s['ranks_per_node']} per node)",
            "provider": s["provider"],
            "device": s["device"],
            "baseline": f"{s['baseline']}: {BASELINE_WHAT[s['baseline']]}"
            + (f", over {s['mpi_transport']}" if s.get("mpi_transport") else ""),
            "payloads": f"dispatch {s['dispatch_dtype']}, combine {s['combine_dtype']}",
            "sizes": shapes,
            **({"routing": s["routing"]} if s.get("routing") else {}),
            **({"fabric_rows": ", ".join(s["fabric_rows"])} if s.get("fabric_rows") else {}),
            "iterations": f"{s['iters']} timed after {s['warmup']} warm-up",
            **({"tuning": report.tuning_set()} if s["device"] == "cuda" else {}),
            # GPU-direct or staged (moe_a2a.gpu_direct), per shape.
            **({"rows' path": report.rows_path_text(s["rows_path"])} if s.get("rows_path") else {}),
            "switches": report.switches_set(),
        },
    )


def _provider_name(provider: str) -> str:
    from moe_a2a.fabric import default_provider

    chosen = default_provider(provider)
    return chosen if chosen == provider else f"{chosen} (auto)"


def _shapes(args: argparse.Namespace) -> list[str]:
    return list(SHAPES) if args.mode == "both" else [args.mode]


def main(args: argparse.Namespace) -> int:
    import torch
    from mpi4py import MPI

    if args.train:
        from moe_a2a.bench import train

        return train.main(args)
    if args.grad_dtype is not None:
        raise UsageError("--grad-dtype: only used with --train")
    if args.compile:
        raise UsageError("--compile: only used with --train")
    if args.compiled_rows is not None:
        raise UsageError("--compiled-rows: only used with --train --compile")
    if args.gpu_busy_us is not None:
        raise UsageError("--gpu-busy-us: only used with --train")
    check_graph(args)
    args.mode = args.mode or "both"
    args.dispatch_dtype = args.dispatch_dtype or "fp8"
    if args.device == "cuda" and args.baseline is None:
        return _run_cuda(args)
    if args.rows_path is not None:
        raise UsageError(
            f"--rows-path: got {','.join(args.rows_path)}; only the per-phase CUDA benchmark "
            "(--device cuda without --baseline) compares rows' paths"
        )
    comm = MPI.COMM_WORLD
    # Collective, so every rank asks (rank 0 alone prints): the ranks on our host.
    host = comm.Split_type(MPI.COMM_TYPE_SHARED)
    host_size = host.Get_size()
    host.Free()
    one_host = host_size == comm.Get_size()
    if not args.fabric_rows:  # one row per expert, per rank, and what the default runs here
        from moe_a2a.a2a_types import default_fabric_rows

        default = default_fabric_rows(comm.Get_size(), args.ranks_per_node or host_size)
        args.fabric_rows = list(dict.fromkeys(["expert", "rank", default]))
    check_shapes(args, comm.Get_size())
    if args.device == "cuda":
        torch.cuda.set_device(local_rank(comm) % torch.cuda.device_count())  # one rank per GPU
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        share_cores(comm)
        device = torch.device("cpu")
    args.baseline = args.baseline or "mpi"
    exchange = make_exchange(args, comm, device)
    results: list[dict[str, Any]] = []
    INTERRUPTS.install()
    try:
        for name in _shapes(args):
            results.append(run_shape(name, args, comm, exchange, device))
            report.case_done(f"moe-a2a bench a2a: {name} done", rank=comm.Get_rank(), mode=args.progress)
    except KeyboardInterrupt:
        # Ctrl-C: what finished is every rank's already (run_shape gathers its samples).
        if comm.Get_rank() == 0:
            _print_results(args, comm, exchange, results, one_host)
        return report.interrupted("moe-a2a bench a2a", [r["shape"] for r in results], rank=comm.Get_rank())
    if hasattr(exchange, "close"):
        exchange.close()
    if comm.Get_rank() == 0:
        _print_results(args, comm, exchange, results, one_host)
    return 0


def _print_results(
    args: argparse.Namespace, comm: Any, exchange: Any, results: list[dict[str, Any]], one_host: bool
) -> None:
    """Rank 0: the configuration block, the table of the shapes in `results`, and --output."""
    if not results:
        return
    settings = settings_of(
        args, comm.Get_size(), results[0]["ranks_per_node"], exchange, one_host, results[0]["routing"]
    )
    if args.device == "cuda":
        settings["rows_path"] = {r["shape"]: r["rows_path"] for r in results}
    rows = [row for result in results for row in rows_of(result)]
    byte_rows = [row for result in results for row in a2a_bytes.rows_of(result)]
    note = note_of(rows)
    print(
        format_config(settings),
        "",
        format_table(rows),
        f"({note})",
        "",
        a2a_bytes.format_table(byte_rows),
        f"({a2a_bytes.NOTE})",
        sep="\n",
        flush=True,
    )
    warning = settings["mpi_transport"] and transport_warning(settings["provider"], settings["mpi_transport"])
    if warning:
        print(warning)
    if args.output:
        meta = {**report.run_meta("a2a", settings), "note": note, "bytes": byte_rows}
        report.write_output(args.output, rows, meta)
        print(f"figures written to {args.output}")


def _run_cuda(args: argparse.Namespace) -> int:
    """The CUDA benchmark (per-phase bandwidth against the copy ceiling and torch-native)."""
    from moe_a2a.backends.cuda import cuda_available

    # The per-phase benchmark runs its own fixed shapes and one AllToAll: an option it would
    # ignore is refused rather than silently dropped.
    ignored = {
        "--tokens": args.tokens,
        "--hidden": args.hidden,
        "--num-experts": args.num_experts,
        "--topk": args.topk,
        "--dispatch-dtype": None if args.dispatch_dtype == "fp8" else args.dispatch_dtype,
        "--fabric-rows": args.fabric_rows and ",".join(args.fabric_rows),
        "--num-groups": args.num_groups,
        "--topk-groups": args.topk_groups,
        "--max-nodes": args.max_nodes,
    }
    given = {flag: value for flag, value in ignored.items() if value is not None}
    if given:
        flag, value = next(iter(given.items()))
        raise UsageError(
            f"{flag}: got {value}; the per-phase CUDA benchmark (--device cuda without --baseline) "
            "runs DeepSeek-V3's shapes in one mode; pass --baseline mpi (or nccl) to set " + ", ".join(given)
        )
    reason = cuda_available()
    if reason is not None:
        raise UsageError(f"--device cuda: {reason}")
    from moe_a2a.bench import a2a_cuda

    cuda_args = argparse.Namespace(
        shapes=list(SHAPES) if args.mode == "both" else [args.mode],
        iters=args.iters,
        warmup=args.warmup,
        rounds=4,
        provider=args.provider,
        ranks_per_node=args.ranks_per_node,
        json=None,
        output=args.output,
        profile=False,
        progress=args.progress,
        rows_path=args.rows_path,
    )
    return a2a_cuda.run(cuda_args)


def _modes(text: str) -> list[str]:
    """--fabric-rows: distinct built modes, in the order given."""
    from moe_a2a.a2a_types import FABRIC_ROWS

    modes = [m for m in text.split(",") if m]
    built = [m for m in FABRIC_ROWS if m != "auto"]  # side by side: the modes themselves
    if not modes or any(m not in built for m in modes) or len(set(modes)) != len(modes):
        raise argparse.ArgumentTypeError(f"got {text!r}; expected distinct modes of {built}, comma-separated")
    return modes


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "a2a",
        help="dispatch/combine latency against an MPI Alltoallv baseline (run under mpirun)",
        description="Time moe-a2a's dispatch and combine against a baseline that moves the same tokens "
        "(MPI Alltoallv by default), iteration by iteration, and print the configuration and a table "
        "of percentiles on rank 0. Run under mpirun.",
        epilog="example: mpirun -n 4 moe-a2a bench a2a --mode decode --ranks-per-node 1 --provider tcp",
    )
    p.add_argument(
        "--mode",
        choices=[*SHAPES, "both"],
        default=None,
        help="decode (128 tokens/rank) or prefill (1024), DeepSeek-V3's hidden 7168, 256 experts, top-8; "
        "the name `run --mode` uses (default: both; --train runs its training shape instead)",
    )
    p.add_argument("--tokens", type=POSITIVE, metavar="T", help="tokens per rank (default: the shape's)")
    p.add_argument("--hidden", type=POSITIVE, metavar="D", help="hidden size (default: the shape's, 7168)")
    p.add_argument(
        "--num-experts", type=POSITIVE, metavar="E", help="routed experts (default: the shape's, 256)"
    )
    p.add_argument("--topk", type=POSITIVE, metavar="K", help="experts per token (default: the shape's, 8)")
    p.add_argument(
        "--dispatch-dtype",
        choices=["fp8", "bf16"],
        default=None,
        help="dispatch payload (default: fp8; bf16 with --train)",
    )
    p.add_argument(
        "--iters", type=POSITIVE, default=20, metavar="N", help="timed iterations (default: %(default)s)"
    )
    p.add_argument(
        "--warmup",
        type=int_at_least(0),
        default=3,
        metavar="N",
        help="untimed iterations first (default: %(default)s)",
    )
    p.add_argument(
        "--provider",
        default="auto",
        metavar="PROVIDER",
        help="libfabric provider: tcp, shm, efa, verbs or auto (default: %(default)s: "
        "$MOE_A2A_PROVIDER, else efa where offered, else tcp)",
    )
    p.add_argument(
        "--ranks-per-node",
        type=POSITIVE,
        default=None,
        metavar="N",
        help="virtual nodes of this many ranks, so one host runs the cross-node path "
        "(default: the real hosts)",
    )
    p.add_argument(
        "--device", default="cpu", choices=["cpu", "cuda"], help="where tensors live (default: %(default)s)"
    )
    p.add_argument(
        "--baseline",
        choices=["mpi", "nccl", "gloo"],
        default=None,
        help="what moe-a2a is compared with (default: mpi; with --device cuda the per-phase CUDA benchmark)",
    )
    p.add_argument(
        "--fabric-rows",
        type=_modes,
        default=None,
        metavar="MODES",
        help="Config.fabric_rows modes to run side by side, one AllToAll each, comma-separated "
        "(default: expert,rank, and node where nodes have several ranks, as the default runs there)",
    )
    p.add_argument(
        "--rows-path",
        type=rows_paths,
        default=None,
        metavar="PATHS",
        help="with --device cuda: each shape once per rows' path, forced, side by side: staged, "
        "gpu-direct or staged,gpu-direct (default: the path AllToAll chooses)",
    )
    p.add_argument(
        "--num-groups", type=POSITIVE, metavar="G", help="expert groups of group-limited routing (default: 1)"
    )
    p.add_argument(
        "--topk-groups",
        type=POSITIVE,
        metavar="G",
        help="groups each token picks its experts in (DeepSeek-V3's topk_group; default: 1)",
    )
    p.add_argument(
        "--max-nodes",
        type=POSITIVE,
        metavar="M",
        help="node-limited routing: one group per node, at most M nodes per token "
        "(instead of --num-groups/--topk-groups; default: off)",
    )
    report.add_output_argument(p)
    report.add_progress_argument(p)
    p.add_argument(
        "--train",
        action="store_true",
        help="forward + backward of dispatch and combine (DeepSeek-V3 training shape) against "
        "TorchTitan's token dispatchers (moe_a2a.bench.train) (default: off)",
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="with --train: every contender's forward under torch.compile (fullgraph), as TorchTitan's "
        "--compile.enable compiles a block (default: off)",
    )
    p.add_argument(
        "--compiled-rows",
        choices=["exact", "capacity"],
        default=None,
        help="with --compile: what moe-a2a's compiled dispatch gives the expert, the rows received "
        "(a data-dependent size) or max_output_rows rows, zero past them (a static size) "
        "(ExpertParallel's compiled_rows; default: exact)",
    )
    p.add_argument(
        "--gpu-busy-us",
        type=POSITIVE,
        default=None,
        metavar="US",
        help="with --train --device cuda: a kernel keeps the GPU busy about US microseconds before "
        "each timed phase, which is timed from its end, so the host's time before the phase's first "
        "kernel is hidden as a model's earlier layers hide it (default: off)",
    )
    p.add_argument(
        "--graph",
        action="store_true",
        help="with --device cuda and a --baseline: also each mode's step (dispatch, combine) in a "
        "graph-safe AllToAll, captured in a CUDA graph and replayed, its own row (phase graph) "
        "(default: off)",
    )
    p.add_argument(
        "--grad-dtype",
        choices=["bf16", "fp32"],
        default=None,
        help="with --train: what gradients travel in (default: bf16)",
    )
    p.set_defaults(func=main)
