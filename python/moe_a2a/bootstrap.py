"""Ranks, nodes and start-up exchanges, from mpi4py or a torch process group.

Everything the core needs from the outside world at start-up passes through a
`Bootstrap`: this rank's place (rank, world size, node, local rank) and an
all-gather of byte blobs (fabric addresses, region descriptors, shared-memory
names).
"""

from __future__ import annotations

import os
import pickle
import socket
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from moe_a2a import switches


@dataclass(frozen=True)
class Topology:
    """Where this rank sits: `node` groups ranks that share memory."""

    rank: int
    world_size: int
    node: int
    local_rank: int
    local_size: int
    node_ranks: tuple[int, ...]  # the ranks of this rank's node, ascending

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.local_size if self.world_size % self.local_size == 0 else -1

    def node_of(self, rank: int) -> int:
        """Node of any rank (nodes are contiguous, equal-sized blocks)."""
        return rank // self.local_size


class Bootstrap:
    """Rank layout plus blob all-gather over an mpi4py communicator or a torch process group."""

    def __init__(self, comm: Any = None, ranks_per_node: int | None = None) -> None:
        self._torch_group = None
        self._comm = None
        if comm is None or _is_mpi_comm(comm):
            if comm is None:
                from mpi4py import MPI

                comm = MPI.COMM_WORLD
            self._comm = comm
            rank, world = comm.Get_rank(), comm.Get_size()
            placed = comm.allgather((_host_id(), ranks_per_node))
        else:
            import torch.distributed as dist

            self._torch_group = comm
            rank, world = dist.get_rank(comm), dist.get_world_size(comm)
            placed = [None] * world
            dist.all_gather_object(placed, (_host_id(), ranks_per_node), group=comm)
        hosts = [host for host, _ in placed]
        # Checked on every rank alike: one rank failing its own layout check would
        # leave the others waiting for it in their next collective.
        differs = difference("ranks_per_node", [given for _, given in placed])
        if differs is not None:
            raise ValueError(
                f"the ranks passed different node layouts (every rank must pass the same): {differs}"
            )
        self.topology = _layout(rank, world, hosts, ranks_per_node)
        self.single_host = len(set(hosts)) == 1

    @property
    def rank(self) -> int:
        return self.topology.rank

    @property
    def world_size(self) -> int:
        return self.topology.world_size

    def allgather(self, blob: bytes) -> list[bytes]:
        """Every rank's blob, index = rank."""
        if self._comm is not None:
            return self._comm.allgather(bytes(blob))
        import torch.distributed as dist

        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, bytes(blob), group=self._torch_group)
        return out

    def barrier(self) -> None:
        if self._comm is not None:
            self._comm.Barrier()
        else:
            import torch.distributed as dist

            dist.barrier(group=self._torch_group)

    @contextmanager
    def together(self, what: str) -> Iterator[None]:
        """Collective: a local step of start-up that fails on every rank if it fails on any.

        The failing rank raises its own error; the others raise `PeerFailedError`
        naming it. The block must hold no collective: a rank that failed before
        one would leave the others waiting in it.
        """
        error: Exception | None = None
        try:
            yield
            failing = switches.get("MOE_A2A_TEST_FAIL_STEP")
            if failing and what.startswith(failing):
                raise RuntimeError(f"MOE_A2A_TEST_FAIL_STEP: {what} fails on rank {self.rank}")
        except Exception as exc:
            error = exc
        mine = b"" if error is None else f"{type(error).__name__}: {error}".encode()
        failed = [(r, m.decode()) for r, m in enumerate(self.allgather(mine)) if m]
        if error is not None:
            others = [r for r, _ in failed if r != self.rank]
            if others and sys.version_info >= (3, 11):  # notes are 3.11's
                error.add_note(f"{what} failed on {ranks_text(others)} as well")
            raise error
        if failed:
            from moe_a2a._core import PeerFailedError

            by_error: dict[str, list[int]] = {}
            for r, message in failed:
                by_error.setdefault(message, []).append(r)
            raise PeerFailedError(
                f"{what} failed on "
                + "; ".join(f"{ranks_text(r)} ({message})" for message, r in by_error.items())
                + f"; rank {self.rank} stops with it (start-up fails on every rank together)"
            )

    @property
    def launched_by_mpi(self) -> bool:
        """An mpi4py communicator under an MPI launcher (mpirun, srun), which MPI_Abort ends whole."""
        launcher = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "SLURM_PROCID")
        return self._comm is not None and any(v in os.environ for v in launcher)

    def local_pids(self) -> list[int]:
        """Collective: each rank's pid where it runs on this host and in our pid namespace, else 0."""
        me = (_host_id(), _boot_id(), _pid_namespace())
        everyone = [pickle.loads(b) for b in self.allgather(pickle.dumps((*me, os.getpid())))]
        if not all(me):  # unknown boot or namespace: no pid is known to be ours to check
            return [0] * len(everyone)
        return [pid if tuple(where) == me else 0 for *where, pid in everyone]

    def close(self) -> None:
        """Nothing to release: the communicator is the caller's (moe_a2a.rejoin's has files)."""

    def abort(self, code: int = 1) -> None:
        """End every rank of the job (used when one rank fails)."""
        if self._comm is not None:
            self._comm.Abort(code)
        os._exit(code)


MISSING = object()  # a value a rank did not send (for settings: another library version)


def difference(name: str, values: list[Any]) -> str | None:
    """'name: 8 on ranks 0, 2, 12 on rank 1' for values that differ (index = rank), else None."""
    ranks_of: dict[str, list[int]] = {}
    for rank, value in enumerate(values):
        ranks_of.setdefault("(none)" if value is MISSING else repr(value), []).append(rank)
    if len(ranks_of) == 1:
        return None
    return f"{name}: " + ", ".join(f"{v} on {ranks_text(r)}" for v, r in ranks_of.items())


def ranks_text(ranks: list[int]) -> str:
    """'rank 3' or 'ranks 0, 2-5' (ascending input)."""
    spans: list[list[int]] = []
    for r in ranks:
        if spans and spans[-1][1] == r - 1:
            spans[-1][1] = r
        else:
            spans.append([r, r])
    text = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)
    return ("rank " if len(ranks) == 1 else "ranks ") + text


def _is_mpi_comm(comm: Any) -> bool:
    return hasattr(comm, "Get_rank") and hasattr(comm, "allgather")


def _host_id() -> str:
    return socket.gethostname()


def _boot_id() -> str:
    """This kernel's boot, so that two hosts (or containers) of one name are never taken for one."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def _pid_namespace() -> int:
    """A pid means the same process only within one pid namespace."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def _layout(rank: int, world: int, hosts: list[str], ranks_per_node: int | None) -> Topology:
    """Node layout from host names, or virtual nodes of `ranks_per_node` consecutive ranks."""
    if ranks_per_node is not None:
        if not isinstance(ranks_per_node, int) or ranks_per_node < 1 or world % ranks_per_node != 0:
            raise ValueError(
                f"ranks_per_node: got {ranks_per_node!r}; expected a positive integer that divides "
                f"the world size {world}"
            )
        if any(hosts[r] != hosts[(r // ranks_per_node) * ranks_per_node] for r in range(world)):
            raise ValueError(
                f"ranks_per_node={ranks_per_node} puts ranks of different hosts into one node; "
                "virtual nodes must lie within one host"
            )
        size = ranks_per_node
    else:
        size = sum(1 for h in hosts if h == hosts[rank])
        # Nodes must be contiguous, equal blocks of ranks (as mpirun/srun place them by default).
        for r in range(world):
            if hosts[r] != hosts[(r // size) * size]:
                raise ValueError(
                    "ranks are not placed in contiguous, equal blocks per host "
                    f"(host of each rank: {hosts}); use block placement or pass ranks_per_node"
                )
    node = rank // size
    return Topology(
        rank=rank,
        world_size=world,
        node=node,
        local_rank=rank % size,
        local_size=size,
        node_ranks=tuple(range(node * size, (node + 1) * size)),
    )
