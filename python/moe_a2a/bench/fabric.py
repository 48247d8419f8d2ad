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
import csv
import json
import os
import platform
import re
import sys
import time
import traceback
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from moe_a2a.bench.args import int_at_least, positive_seconds

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


class BenchArgumentError(ValueError):
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
        help="libfabric provider: tcp, shm, efa, verbs (default: $MOE_A2A_PROVIDER, else efa where "
        "offered, else tcp)",
    )
    parser.add_argument("--num-nics", type=int_at_least(1), default=1, help="NICs per rank (default 1)")
    parser.add_argument(
        "--nics",
        default=None,
        help="domain names per rank, as MOE_A2A_NICS ('a,b' or 'a,b;c,d' per local rank); default: nearest",
    )
    parser.add_argument(
        "--split-threshold",
        type=parse_size,
        default=MIB,
        help="writes of at least this many bytes are split across the NICs (default 1M)",
    )
    parser.add_argument(
        "--sizes",
        type=parse_sizes,
        default=DEFAULT_SIZES,
        help="bytes per peer, comma-separated; K and M mean KiB and MiB (default 1K,4K,16K,64K,256K,1M,4M)",
    )
    parser.add_argument(
        "--iters", type=int_at_least(1), default=100, help="timed exchanges per size (default 100)"
    )
    parser.add_argument(
        "--warmup", type=int_at_least(0), default=10, help="untimed exchanges per size first (default 10)"
    )
    parser.add_argument(
        "--timeout", type=positive_seconds, default=60.0, help="seconds any one wait may take (default 60)"
    )
    parser.add_argument(
        "--seed", type=int_at_least(0), default=0, help="seed of the checked data (default 0)"
    )
    parser.add_argument(
        "--output",
        type=Path,
        default=None,
        help="write the figures to PATH: CSV if it ends in .csv, else JSON with the run's settings",
    )
    parser.set_defaults(func=main)
    return parser


# ---------------------------------------------------------------- results


@dataclass(frozen=True)
class Row:
    """Figures for one message size; times are per exchange, the slowest rank's."""

    size: int  # bytes per peer
    fabric_median_us: float
    fabric_p90_us: float
    mpi_median_us: float
    mpi_p90_us: float
    ratio: float  # MPI median / moe-a2a median: above 1, moe-a2a is faster
    fabric_gbps: float  # bytes each rank sends per exchange / median time, in GB/s (1e9 B/s)
    mpi_gbps: float


def format_size(size: int) -> str:
    for unit, scale in (("MiB", MIB), ("KiB", KIB)):
        if size >= scale and size % scale == 0:
            return f"{size // scale} {unit}"
    return f"{size} B"


def format_table(rows: Sequence[Row]) -> str:
    """A Markdown table (as pasted into docs/benchmarks.md)."""
    head = (
        "| size per peer | moe-a2a median us | moe-a2a p90 us | MPI median us | MPI p90 us "
        "| ratio MPI/moe-a2a | moe-a2a GB/s | MPI GB/s |"
    )
    lines = [head, "|" + "---:|" * head.count(" | ") + "---:|"]
    for r in rows:
        lines.append(
            f"| {format_size(r.size)} | {r.fabric_median_us:.1f} | {r.fabric_p90_us:.1f} "
            f"| {r.mpi_median_us:.1f} | {r.mpi_p90_us:.1f} | {r.ratio:.2f} "
            f"| {r.fabric_gbps:.3f} | {r.mpi_gbps:.3f} |"
        )
    return "\n".join(lines)


def write_output(path: Path, rows: Sequence[Row], meta: dict[str, Any]) -> None:
    """CSV (one row per size) when `path` ends in .csv, else JSON with the run's settings."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix.lower() == ".csv":
        with path.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(asdict(rows[0]).keys()) if rows else ["size"])
            writer.writeheader()
            for r in rows:
                writer.writerow(asdict(r))
    else:
        path.write_text(json.dumps({**meta, "rows": [asdict(r) for r in rows]}, indent=2) + "\n")


def summarize(size: int, world: int, fabric_s: np.ndarray, mpi_s: np.ndarray) -> Row:
    """`*_s[rank, iteration]` in seconds -> one Row (slowest rank per iteration)."""
    fabric = fabric_s.max(axis=0) * 1e6
    mpi = mpi_s.max(axis=0) * 1e6
    f_med, m_med = float(np.median(fabric)), float(np.median(mpi))
    sent = (world - 1) * size
    return Row(
        size=size,
        fabric_median_us=f_med,
        fabric_p90_us=float(np.percentile(fabric, 90)),
        mpi_median_us=m_med,
        mpi_p90_us=float(np.percentile(mpi, 90)),
        ratio=m_med / f_med,
        fabric_gbps=sent / (f_med * 1e-6) / 1e9,
        mpi_gbps=sent / (m_med * 1e-6) / 1e9,
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


def run(args: argparse.Namespace, bootstrap: Any) -> list[Row]:
    """Measure every size; rank 0 gets the rows (other ranks an empty list)."""
    from mpi4py import MPI

    from moe_a2a import _core
    from moe_a2a.fabric import Engine, ScatterItem, default_provider

    comm = MPI.COMM_WORLD
    rank, world = bootstrap.rank, bootstrap.world_size
    if world < 2:
        raise BenchArgumentError(
            f"world size: got {world}; expected at least 2 ranks (run under mpirun -n 2 or more)"
        )
    provider = args.provider or default_provider()
    offered = _core.libfabric_providers()
    if provider.split(";")[0] not in {name.split(";")[0] for name in offered}:
        raise BenchArgumentError(
            f"--provider: got {provider!r}; expected one that libfabric offers here: {', '.join(offered)}"
        )
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
    for size in args.sizes:
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
            t0 = time.perf_counter()
            fabric_exchange()
            t1 = time.perf_counter()
            comm.Barrier()
            t2 = time.perf_counter()
            mpi_exchange()
            t3 = time.perf_counter()
            if it >= args.warmup:
                fabric_s[it - args.warmup] = t1 - t0
                mpi_s[it - args.warmup] = t3 - t2
        all_fabric = comm.gather(fabric_s, root=0)
        all_mpi = comm.gather(mpi_s, root=0)
        if rank == 0:
            row = summarize(size, world, np.stack(all_fabric), np.stack(all_mpi))
            rows.append(row)
            print(
                f"  {format_size(size):>8}: moe-a2a {row.fabric_median_us:9.1f} us, "
                f"MPI {row.mpi_median_us:9.1f} us",
                file=sys.stderr,
                flush=True,
            )
    if core.error:
        raise RuntimeError(f"rank {rank}: transfer engine error after the run: {core.error}")
    comm.Barrier()  # nobody drops the engine while a peer may still write into it
    return rows


def _meta(args: argparse.Namespace, world: int) -> dict[str, Any]:
    from moe_a2a import __version__, switches

    return {
        "benchmark": "fabric",
        "moe_a2a_version": __version__,
        "switches": switches.recorded(),
        "command": " ".join(sys.argv),
        "provider": args.provider,
        "num_nics": args.num_nics,
        "split_threshold": args.split_threshold,
        "world_size": world,
        "iters": args.iters,
        "warmup": args.warmup,
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "time_per_exchange": "slowest rank, after an MPI barrier",
        "gbps": "bytes each rank sends per exchange ((world-1)*size) / median time, 1e9 B/s",
    }


def main(args: argparse.Namespace) -> int:
    """Entry point of `moe-a2a bench fabric`; returns the exit status."""
    from moe_a2a.bootstrap import Bootstrap
    from moe_a2a.fabric import default_provider

    bootstrap = Bootstrap()
    rank, world = bootstrap.rank, bootstrap.world_size
    args.provider = args.provider or default_provider()
    try:
        if rank == 0:
            print(
                f"moe-a2a bench fabric: provider {args.provider}, {world} ranks, "
                f"{args.num_nics} NIC(s) per rank, {args.iters} iterations after {args.warmup} warm-up",
                file=sys.stderr,
                flush=True,
            )
        rows = run(args, bootstrap)
    except BenchArgumentError as e:  # raised alike on every rank: no abort needed
        if rank == 0:
            print(f"moe-a2a bench fabric: error: {e}", file=sys.stderr)
        return 2
    except Exception:
        # The others may wait for us in a collective or an engine wait: end the job.
        sys.stderr.write(f"moe-a2a bench fabric: rank {rank} failed:\n{traceback.format_exc()}")
        sys.stderr.flush()
        if world > 1:
            bootstrap.abort(1)
        raise
    if rank == 0:
        meta = _meta(args, world)
        print(
            f"\nprovider {meta['provider']}, {world} ranks, {args.num_nics} NIC(s) per rank, "
            f"{args.iters} iterations; time per exchange = slowest rank; GB/s = (ranks-1) x size / median"
        )
        print(format_table(rows))
        if args.output is not None:
            write_output(args.output, rows, meta)
            print(f"figures written to {args.output}")
    return 0


def _standalone(argv: list[str] | None = None) -> int:
    """`python -m moe_a2a.bench.fabric [flags]`, for use without the `moe-a2a` command."""
    parser = argparse.ArgumentParser(prog="python -m moe_a2a.bench.fabric", allow_abbrev=False)
    add_parser(parser.add_subparsers(dest="bench", required=True))
    args = parser.parse_args(["fabric", *(sys.argv[1:] if argv is None else argv)])
    return main(args)


if __name__ == "__main__":
    sys.exit(_standalone())
