"""`moe-a2a bench fabric`: the transfer engine's all-to-all against MPI `Alltoallv`.

Run under mpirun with 2 or more ranks, for example
    mpirun -n 4 --oversubscribe moe-a2a bench fabric --provider tcp

One exchange moves `size` bytes from every rank to every other rank:
- moe-a2a: one `scatter` with an immediate to every peer, then a wait for every
  peer's immediate and for our own writes to complete (so the send buffer is
  reusable, as it is when `Alltoallv` returns);
- MPI: `Alltoallv` on numpy buffers with the same counts (nothing to ourselves).

Each timed exchange starts after an MPI barrier; its time is the slowest rank's.
The two are interleaved iteration by iteration, so both see the same machine
load. Before timing, one exchange of each kind is checked byte for byte.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import traceback
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from moe_a2a import report
from moe_a2a.bench.args import int_at_least, positive_seconds
from moe_a2a.bench.common import elapsed_ns, mpi_transport, transport_warning
from moe_a2a.usage import Parser, UsageError, usage_error

KIB = 1024
MIB = 1024 * KIB
DEFAULT_SIZES = [KIB << (2 * i) for i in range(7)]  # 1 KiB, 4 KiB, ..., 4 MiB
EXCHANGE_TAG = 0xFAB1  # the benchmark's own engine, so any fixed tag will do
_UNITS = {
    "": 1,
    "B": 1,
    "K": KIB,
    "KB": KIB,
    "KIB": KIB,
    "M": MIB,
    "MB": MIB,
    "MIB": MIB,
    "G": 1 << 30,
    "GIB": 1 << 30,
}


class BenchArgumentError(UsageError):
    """A flag with a value the benchmark cannot use (the same on every rank)."""


# ---------------------------------------------------------------- arguments


# argparse puts "argument --flag: " before these messages, so they need not name the flag.


def parse_size(text: str) -> int:
    """Bytes from `4096`, `4K`, `4KiB`, `1M`, ... (K and M are powers of 1024)."""
    match = re.fullmatch(r"\s*(\d+)\s*([A-Za-z]*)\s*", text)
    unit = match.group(2).upper() if match else ""
    if match is None or unit not in _UNITS:
        raise argparse.ArgumentTypeError(
            f"got {text!r}; expected a byte count such as 4096, 64K, 64KiB or 4M"
        )
    value = int(match.group(1)) * _UNITS[unit]
    if value <= 0:
        raise argparse.ArgumentTypeError(f"got {text!r}; expected a positive byte count")
    return value


def parse_sizes(text: str) -> list[int]:
    """Comma-separated sizes, e.g. `1K,4K,64K,1M`; sorted, duplicates dropped."""
    parts = [p for p in text.split(",") if p.strip()]
    if not parts:
        raise argparse.ArgumentTypeError(f"got {text!r}; expected sizes such as 1K,4K,64K,1M")
    return sorted({parse_size(p) for p in parts})


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the `fabric` subcommand to `moe-a2a bench`."""
    parser = subparsers.add_parser(
        "fabric",
        help="transfer engine all-to-all vs MPI Alltoallv (run under mpirun)",
        description="Time the transfer engine's all-to-all (scatter, then waits) against MPI Alltoallv "
        "for each message size, check the received bytes once per size, and print a table on rank 0. "
        "Run under mpirun with 2 or more ranks.",
    )
    parser.add_argument(
        "--provider",
        default=None,
        metavar="PROVIDER",
        help="libfabric provider: tcp, shm, efa, verbs (default: $MOE_A2A_PROVIDER, else efa where "
        "offered, else tcp)",
    )
    parser.add_argument(
        "--num-nics", type=int_at_least(1), default=1, metavar="N", help="NICs per rank (default: 1)"
    )
    parser.add_argument(
        "--nics",
        default=None,
        metavar="LIST",
        help="domain names per rank, as MOE_A2A_NICS ('a,b' or 'a,b;c,d' per local rank) "
        "(default: the nearest)",
    )
    parser.add_argument(
        "--split-threshold",
        type=parse_size,
        default=MIB,
        metavar="BYTES",
        help="writes of at least this many bytes are split across the NICs (default: 1M)",
    )
    parser.add_argument(
        "--sizes",
        type=parse_sizes,
        default=DEFAULT_SIZES,
        metavar="LIST",
        help="bytes per peer, comma-separated; K and M mean KiB and MiB (default: 1K,4K,16K,64K,256K,1M,4M)",
    )
    parser.add_argument(
        "--iters",
        type=int_at_least(1),
        default=100,
        metavar="N",
        help="timed exchanges per size (default: 100)",
    )
    parser.add_argument(
        "--warmup",
        type=int_at_least(0),
        default=10,
        metavar="N",
        help="untimed exchanges per size first (default: 10)",
    )
    parser.add_argument(
        "--timeout",
        type=positive_seconds,
        default=60.0,
        metavar="S",
        help="seconds any one wait may take (default: 60)",
    )
    parser.add_argument(
        "--seed", type=int_at_least(0), default=0, metavar="N", help="seed of the checked data (default: 0)"
    )
    report.add_output_argument(parser, "one row per size")
    report.add_progress_argument(parser)
    parser.set_defaults(func=main)
    return parser


# ---------------------------------------------------------------- results


@dataclass(frozen=True)
class Row:
    """Figures for one message size; times are per exchange, the slowest rank's (baseline: MPI Alltoallv)."""

    size: int  # bytes per peer
    moe_a2a_p50_us: float
    moe_a2a_p90_us: float
    baseline_p50_us: float
    baseline_p90_us: float
    ratio: float  # baseline p50 / moe-a2a p50: above 1, moe-a2a is faster
    moe_a2a_gbps: float  # bytes each rank sends per exchange / p50 time, in GB/s (1e9 B/s)
    baseline_gbps: float


def format_size(size: int) -> str:
    for unit, scale in (("MiB", MIB), ("KiB", KIB)):
        if size >= scale and size % scale == 0:
            return f"{size // scale} {unit}"
    return f"{size} B"


# (Row field, column header) of the printed table.
COLUMNS = (
    ("size", "size per peer"),
    ("moe_a2a_p50_us", "moe-a2a p50 (us)"),
    ("moe_a2a_p90_us", "moe-a2a p90 (us)"),
    ("baseline_p50_us", "baseline p50 (us)"),
    ("baseline_p90_us", "baseline p90 (us)"),
    ("ratio", report.RATIO),
    ("moe_a2a_gbps", "moe-a2a GB/s"),
    ("baseline_gbps", "baseline GB/s"),
)
NOTE = (
    f"{report.RATIO_NOTE}; time per exchange = the slowest rank's, after a barrier; "
    "GB/s = (ranks - 1) x size / p50"
)


def format_table(rows: Sequence[Row]) -> str:
    """The table, in the one style of moe-a2a (Markdown, as pasted into docs/benchmarks.md)."""
    cells = [{**asdict(r), "size": format_size(r.size)} for r in rows]
    return report.columns_table(COLUMNS, cells, {"moe_a2a_gbps": ".3f", "baseline_gbps": ".3f"})


def summarize(size: int, world: int, fabric_s: np.ndarray, mpi_s: np.ndarray) -> Row:
    """`*_s[rank, iteration]` in seconds -> one Row (slowest rank per iteration)."""
    ours = report.percentiles_us(fabric_s.max(axis=0) * 1e9, (50, 90))
    base = report.percentiles_us(mpi_s.max(axis=0) * 1e9, (50, 90))
    got = [ours["p50"], ours["p90"], base["p50"], base["p90"]]
    if any(v is None for v in got):
        raise ValueError(f"summarize: size {size} has no finite timing; expected at least one iteration")
    o50, o90, b50, b90 = (float(v) for v in got if v is not None)
    sent = (world - 1) * size
    return Row(
        size=size,
        moe_a2a_p50_us=o50,
        moe_a2a_p90_us=o90,
        baseline_p50_us=b50,
        baseline_p90_us=b90,
        ratio=b50 / o50,
        moe_a2a_gbps=sent / (o50 * 1e-6) / 1e9,
        baseline_gbps=sent / (b50 * 1e-6) / 1e9,
    )


# ---------------------------------------------------------------- the run


def _payload(seed: int, rank: int, size: int, world: int) -> np.ndarray:
    """What `rank` sends in the checked exchange of `size` (slot p to peer p); any rank can rebuild it."""
    return np.random.default_rng([seed, rank, size]).integers(0, 256, world * size, dtype=np.uint8)


def _check(what: str, size: int, rank: int, world: int, seed: int, recv: np.ndarray) -> None:
    for peer in range(world):
        if peer == rank:
            continue
        want = _payload(seed, peer, size, world)[rank * size : (rank + 1) * size]
        got = recv[peer * size : (peer + 1) * size]
        if not np.array_equal(got, want):
            bad = np.flatnonzero(got != want)
            raise RuntimeError(
                f"{what}, {size} bytes per peer: rank {rank} received wrong data from peer {peer} "
                f"({bad.size} bytes differ, first at byte {bad[0]})"
            )


def _check_job(world: int, provider: str) -> None:
    """Refuse, alike on every rank, a job of one rank or a provider libfabric does not offer."""
    from moe_a2a import _core

    if world < 2:
        raise BenchArgumentError(
            f"world size: got {world}; expected at least 2 ranks (run under mpirun -n 2 or more)"
        )
    offered = _core.libfabric_providers()
    if provider.split(";")[0] not in {name.split(";")[0] for name in offered}:
        raise BenchArgumentError(
            f"--provider: got {provider!r}; expected one that libfabric offers here: {', '.join(offered)}"
        )


def run(args: argparse.Namespace, bootstrap: Any) -> list[Row]:
    """Measure every size; rank 0 gets the rows (other ranks an empty list)."""
    from mpi4py import MPI

    from moe_a2a.fabric import Engine, ScatterItem, default_provider

    comm = MPI.COMM_WORLD
    rank, world = bootstrap.rank, bootstrap.world_size
    provider = args.provider or default_provider()
    _check_job(world, provider)
    engine = Engine(
        bootstrap, provider, num_nics=args.num_nics, split_threshold=args.split_threshold, nics=args.nics
    )
    core = engine.core
    largest = max(args.sizes)
    # Slot p of `src` goes to peer p; slot s of `recv` comes from peer s. MPI gets its own buffers.
    src = np.zeros(world * largest, np.uint8)
    recv = np.zeros(world * largest, np.uint8)
    mpi_src = np.zeros(world * largest, np.uint8)
    mpi_recv = np.zeros(world * largest, np.uint8)
    src_region = engine.register(src)
    recv_region = engine.register(recv)
    remotes = engine.exchange_region(recv_region)
    peers = [p for p in range(world) if p != rank]
    group = engine.group(peers, remotes)
    timeout = args.timeout

    rows: list[Row] = []
    bar = report.progress(
        len(args.sizes) * (args.warmup + args.iters), "fabric", rank=rank, mode=args.progress
    )
    for size in args.sizes:
        bar.set_description(format_size(size))
        items = [ScatterItem(i, p * size, size, rank * size) for i, p in enumerate(peers)]
        counts = [0 if p == rank else size for p in range(world)]
        displs = [p * size for p in range(world)]

        def fabric_exchange(items: list[Any] = items) -> None:
            core.scatter(group, src_region, items, EXCHANGE_TAG)
            for p in peers:
                core.wait_imm(EXCHANGE_TAG, p, 1, timeout)
            core.wait_tx(timeout)

        def mpi_exchange(counts: list[int] = counts, displs: list[int] = displs) -> None:
            comm.Alltoallv([mpi_src, counts, displs, MPI.BYTE], [mpi_recv, counts, displs, MPI.BYTE])

        # Correctness, once per size: fresh random bytes in, every peer's slot checked.
        payload = _payload(args.seed, rank, size, world)
        src[: world * size] = payload
        mpi_src[: world * size] = payload
        recv[: world * size] = ~payload  # not what any peer sends
        mpi_recv[: world * size] = ~payload
        comm.Barrier()
        fabric_exchange()
        mpi_exchange()
        _check("moe-a2a", size, rank, world, args.seed, recv)
        _check("MPI Alltoallv", size, rank, world, args.seed, mpi_recv)

        fabric_s = np.empty(args.iters)
        mpi_s = np.empty(args.iters)
        for it in range(args.warmup + args.iters):
            comm.Barrier()
            _, fabric_ns = elapsed_ns(fabric_exchange)
            comm.Barrier()
            _, mpi_ns = elapsed_ns(mpi_exchange)
            if it >= args.warmup:
                fabric_s[it - args.warmup] = fabric_ns * 1e-9
                mpi_s[it - args.warmup] = mpi_ns * 1e-9
            bar.update()
        all_fabric = comm.gather(fabric_s, root=0)
        all_mpi = comm.gather(mpi_s, root=0)
        if rank == 0:
            assert all_fabric is not None and all_mpi is not None  # gathered to rank 0
            rows.append(summarize(size, world, np.stack(all_fabric), np.stack(all_mpi)))
        report.case_done(f"moe-a2a bench fabric: {size} B done", rank=rank, mode=args.progress)
    bar.close()
    if core.error:
        raise RuntimeError(f"rank {rank}: transfer engine error after the run: {core.error}")
    comm.Barrier()  # nobody drops the engine while a peer may still write into it
    return rows


def settings_of(args: argparse.Namespace, world: int, one_host: bool) -> dict[str, Any]:
    return dict(
        provider=args.provider,
        mpi_transport=mpi_transport(os.environ, one_host),
        world_size=world,
        num_nics=args.num_nics,
        nics=args.nics,
        split_threshold=args.split_threshold,
        sizes=args.sizes,
        iters=args.iters,
        warmup=args.warmup,
        baseline="MPI Alltoallv",
    )


def format_config(s: dict[str, Any]) -> str:
    return report.config_block(
        "moe-a2a bench fabric",
        {
            "ranks": s["world_size"],
            "provider": f"{s['provider']} (moe-a2a's transport)",
            "NICs per rank": s["num_nics"] if not s["nics"] else f"{s['num_nics']} ({s['nics']})",
            "split threshold": format_size(s["split_threshold"]),
            "baseline": f"{s['baseline']} on numpy buffers, the same counts, over {s['mpi_transport']}",
            "sizes": ", ".join(format_size(x) for x in s["sizes"]) + " per peer",
            "iterations": f"{s['iters']} timed after {s['warmup']} warm-up, per size",
            "switches": report.switches_set(),
        },
    )


def main(args: argparse.Namespace) -> int:
    """Entry point of `moe-a2a bench fabric`; returns the exit status."""
    from moe_a2a.bootstrap import Bootstrap
    from moe_a2a.fabric import default_provider

    bootstrap = Bootstrap()
    rank, world = bootstrap.rank, bootstrap.world_size
    args.provider = args.provider or default_provider()
    try:
        rows = run(args, bootstrap)
    except BenchArgumentError:  # raised alike on every rank: moe_a2a.cli ends them together
        raise
    except Exception:
        # The others may wait for us in a collective or an engine wait: end the job.
        sys.stderr.write(f"moe-a2a bench fabric: rank {rank} failed:\n{traceback.format_exc()}")
        sys.stderr.flush()
        if world > 1:
            bootstrap.abort(1)
        raise
    if rank == 0:
        settings = settings_of(args, world, bootstrap.topology.num_nodes == 1)
        print(format_config(settings), "", format_table(rows), f"({NOTE})", sep="\n")
        warning = transport_warning(settings["provider"], settings["mpi_transport"])
        if warning:
            print(warning)
        if args.output is not None:
            meta = {**report.run_meta("fabric", settings), "note": NOTE}
            report.write_output(args.output, [asdict(r) for r in rows], meta)
            print(f"figures written to {args.output}")
    return 0


def _standalone(argv: list[str] | None = None) -> int:
    """`python -m moe_a2a.bench.fabric [flags]`, for use without the `moe-a2a` command."""
    parser = Parser(prog="python -m moe_a2a.bench.fabric")
    add_parser(parser.add_subparsers(dest="bench", required=True))
    args = parser.parse_args(["fabric", *(sys.argv[1:] if argv is None else argv)])
    try:
        return main(args)
    except UsageError as err:
        usage_error(parser.prog, str(err))


if __name__ == "__main__":
    sys.exit(_standalone())
