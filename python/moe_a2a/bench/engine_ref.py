"""The transfer engine alone, moving the bytes of each a2a phase: the reference of `bench a2a`.

With `--ranks-per-node 1` every peer is remote and each phase's bytes go
through the engine. For each iteration this module moves the same per-peer
sizes as the phase did, on an engine of its own with the same provider, and
times it with the benchmark's own clock (`bench a2a`: after an MPI barrier,
the slowest rank; the CUDA benchmark: from a barrier, the first rank's start
to the last rank's end):

- dispatch: the routing row to every peer (`num_experts + world` x 4 bytes), then one
  write per peer of the rows sent to it (wire rows x dispatch row bytes; none
  where there are none), then waits for every peer's;
- combine: one write per peer of the rows it sent us (wire rows x combine row
  bytes, empty where none), as the proxy sends it, then waits.

Each ends when every expected write has arrived and our own writes are
complete. The phase/engine ratio says how far an a2a phase is from the
fabric time of its own bytes (issue 16: the goal is 1.3x or less). Where the
AllToAll moves its rows GPU-direct (`rows_path`), the engine alone moves its
bytes from and into GPU memory too (the routing rows as well, which the
AllToAll keeps in host memory), so the ratio compares like with like.

Both benchmarks, `bench a2a` (`moe_a2a.bench.a2a`) and `bench a2a --device
cuda` (`moe_a2a.bench.a2a_cuda`), print it with `COLUMNS` and `NOTE` and put
`fields()` in their rows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from moe_a2a import report

ROUTE_TAG, DISPATCH_TAG, COMBINE_TAG = 1, 2, 3  # this module's own engine: any fixed tags do
TIMEOUT_S = 120.0

# (row key, column header) the benchmarks append to their tables where the reference ran.
COLUMNS = (("engine_p50_us", "engine alone p50 (us)"), ("phase_engine", "moe-a2a/engine"))
NOTE = (
    "with every peer remote, moe-a2a/engine = the phase's p50 over the engine alone's, moving the same "
    "per-peer bytes on the same provider in the same iterations (above 1: time beyond the fabric's)"
)
# Runs one phase on every rank and returns its time in ns (the benchmark's own clock).
Timer = Callable[[Callable[[], None]], float]


@dataclass(frozen=True)
class RowBytes:
    """What one wire row weighs in each phase (A2AConfig.dispatch_row_bytes, combine_row_bytes)."""

    dispatch: int
    combine: int
    routing_row: int  # (num_experts + world) x 4
    per_rank: bool = False  # fabric_rows="rank": one row per token and remote rank


def rows_to(ids: np.ndarray, world: int, num_experts: int, per_rank: bool = False) -> np.ndarray:
    """Wire rows this rank sends to each (remote) rank: ids are [T, K] expert ids, experts split
    evenly; a row per copy, or per token with a k there (`per_rank`, docs/protocol.md)."""
    if num_experts % world:
        raise ValueError(f"num_experts: got {num_experts}; expected a multiple of the world size {world}")
    owners = np.asarray(ids, dtype=np.int64)
    owners = (owners if owners.ndim == 2 else owners.reshape(-1, 1)) // (num_experts // world)
    if per_rank:
        return np.array([(owners == r).any(axis=1).sum() for r in range(world)], dtype=np.int64)
    return np.bincount(owners.reshape(-1), minlength=world)[:world]


def applies(a2a: Any) -> bool:
    """Whether every peer of the AllToAll is remote (one rank per node), so the engine moves every byte."""
    return bool(a2a.world_size >= 2 and a2a._boot.topology.local_size == 1)


def start_for(a2a: Any, comm: Any, provider: str | None) -> EngineReference | None:
    """The reference for an AllToAll whose peers are all remote (`applies`); else None."""
    if not applies(a2a):
        return None
    core = a2a._core_cfg
    per_rank = a2a.cfg.fabric_rows == "rank"
    rows = RowBytes(core.dispatch_row_bytes, core.combine_row_bytes, core.routing_width * 4, per_rank)
    gpu = a2a.device.index if getattr(a2a, "rows_path", {}).get("path") == "gpu-direct" else None
    return EngineReference(comm, provider, rows, a2a.cfg.max_tokens * a2a.cfg.topk, a2a.max_recv_tokens, gpu)


class EngineReference:
    """An engine with send and receive buffers for the largest phase; collective to build and use."""

    def __init__(
        self,
        comm: Any,
        provider: str | None,
        rows: RowBytes,
        max_send_copies: int,
        max_recv_copies: int,
        gpu: int | None = None,
    ) -> None:
        """`gpu`: the CUDA device whose memory the buffers are (GPU-direct), else host memory."""
        from moe_a2a.bootstrap import Bootstrap
        from moe_a2a.fabric import Engine

        self.comm = comm
        self.rank, self.world = comm.Get_rank(), comm.Get_size()
        self.rows = rows
        self.peers = [p for p in range(self.world) if p != self.rank]
        self.routes = self.world * rows.routing_row  # routing rows first, at sender * row
        most = max(rows.dispatch, rows.combine)
        size = self.routes + max(max_send_copies, max_recv_copies) * most
        # "auto" and None resolve alike (default_provider)
        self.engine = Engine(Bootstrap(comm), provider, gpu_memory=gpu is not None)
        self.buffers: tuple[Any, ...]  # kept until the engine goes
        if gpu is None:
            self.buffers = (np.zeros(size, np.uint8), np.zeros(size, np.uint8))
            self.src_region = self.engine.register(self.buffers[0])
            recv_region = self.engine.register(self.buffers[1])
        else:
            import torch

            self.buffers = tuple(torch.zeros(size, dtype=torch.uint8, device=f"cuda:{gpu}") for _ in range(2))
            reg = self.engine.core.register_region
            src, recv = (b.data_ptr() for b in self.buffers)
            self.src_region = reg(src, size, "cuda", gpu, "the engine reference's send buffer")
            recv_region = reg(recv, size, "cuda", gpu, "the engine reference's receive buffer")
        remotes = self.engine.exchange_region(recv_region)
        self.group = self.engine.group(self.peers, remotes)
        self.samples: dict[str, list[float]] = {"dispatch": [], "combine": []}  # ns, kept iterations

    def sample(self, ids: np.ndarray, num_experts: int, keep: bool, timer: Timer | None = None) -> None:
        """Move one iteration's bytes; with `keep` (a timed iteration) add its times to `samples`."""
        times = self.measure(ids, num_experts, timer)
        if keep:
            for phase, t in zip(self.samples, times, strict=True):
                self.samples[phase].append(t)

    def measure(self, ids: np.ndarray, num_experts: int, timer: Timer | None = None) -> tuple[float, float]:
        """Time (ns) to move one iteration's dispatch and combine bytes (`timer`, else slowest rank)."""
        from moe_a2a.fabric import ScatterItem

        mine = rows_to(ids, self.world, num_experts, self.rows.per_rank)
        counts = np.array(self.comm.allgather(mine))  # counts[s, r]: wire rows s sends to r
        core, rows = self.engine.core, self.rows
        # Dispatch: the routing row, then the rows, packed by destination; at the
        # receiver each sender's rows follow the previous senders'.
        at = self.rank * rows.routing_row
        route = [ScatterItem(i, 0, rows.routing_row, at) for i in range(len(self.peers))]
        sent = np.concatenate([[0], np.cumsum(counts[self.rank])])
        before = np.cumsum(counts, axis=0) - counts  # before[s, r]: copies senders < s send to r
        data = [
            ScatterItem(
                i,
                self.routes + int(sent[p]) * rows.dispatch,
                int(counts[self.rank, p]) * rows.dispatch,
                self.routes + int(before[self.rank, p]) * rows.dispatch,
            )
            for i, p in enumerate(self.peers)
            if counts[self.rank, p] > 0
        ]
        senders = [s for s in self.peers if counts[s, self.rank] > 0]

        def dispatch() -> None:
            core.scatter(self.group, self.src_region, route, ROUTE_TAG)
            core.scatter(self.group, self.src_region, data, DISPATCH_TAG)
            for s in self.peers:
                core.wait_imm(ROUTE_TAG, s, 1, TIMEOUT_S)
            for s in senders:
                core.wait_imm(DISPATCH_TAG, s, 1, TIMEOUT_S)
            core.wait_tx(TIMEOUT_S)

        # Combine: back to each peer the rows it sent us, into its rows for our experts.
        got = np.concatenate([[0], np.cumsum(counts[:, self.rank])])
        back = [
            ScatterItem(
                i,
                int(got[p]) * rows.combine,
                int(counts[p, self.rank]) * rows.combine,
                int(sent_by(counts, p, self.rank)) * rows.combine,
            )
            for i, p in enumerate(self.peers)
        ]

        def combine() -> None:
            core.scatter(self.group, self.src_region, back, COMBINE_TAG)
            for s in self.peers:
                core.wait_imm(COMBINE_TAG, s, 1, TIMEOUT_S)
            core.wait_tx(TIMEOUT_S)

        timer = timer or self.slowest_rank
        return timer(dispatch), timer(combine)

    def slowest_rank(self, phase: Callable[[], None]) -> float:
        """The default clock: after a barrier, the slowest rank's time (ns)."""
        from moe_a2a.bench.common import timed

        return timed(self.comm, phase)[1]

    def close(self) -> None:
        """Collective: nobody drops the engine while a peer may still write into it."""
        self.comm.Barrier()
        self.engine = None  # type: ignore[assignment]


def sent_by(counts: np.ndarray, sender: int, receiver: int) -> int:
    """Where `receiver`'s rows start among `sender`'s sent rows (the copies sender sends to lower ranks)."""
    return int(counts[sender, :receiver].sum())


def fields(phase_p50_us: float | None, engine_ns: Any) -> dict[str, float | None]:
    """A row's engine columns: the engine's p50 (us) over `engine_ns` and the phase's p50 over it."""
    engine_us = report.percentiles_us(engine_ns)["p50"]
    return {"engine_p50_us": engine_us, "phase_engine": report.ratio(phase_p50_us, engine_us)}
