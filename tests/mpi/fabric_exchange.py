"""What the fabric tests share: registered exchanges between all ranks, seeded data, peers.

Test data are random, drawn from the job's seed (fixture `seed`) so every rank
can compute what every other rank sent; they differ per sender, receiver and round.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest

from moe_a2a.fabric import Engine, Group, Region, RemoteRegion

# Ends only a test that is already broken; long, because a rank of the 2-core
# CI machine can stall for a minute (tests/conftest.py, the watchdog).
WAIT_S = 120.0
SPLIT_THRESHOLD = 64 * 1024  # small, so the multi-NIC tests split writes of modest size

# Registered memory must outlive its registration, and the engine offers no
# deregistration: keep every registered array for the life of the process.
_registered: list[np.ndarray] = []


@dataclass
class Exchange:
    """Registered send and receive arrays, the peers' receive regions and a group of all peers."""

    engine: Engine
    src: np.ndarray
    recv: np.ndarray
    src_region: Region
    recv_region: Region
    remotes: list[RemoteRegion | None]  # peer rank -> its receive region (None for ourselves)
    peers: list[int]  # group index -> peer rank
    group: Group

    @staticmethod
    def position(sender: int, receiver: int) -> int:
        """Index of `sender` among `receiver`'s peers (the ranks other than the receiver)."""
        return sender if sender < receiver else sender - 1


def make_exchange(engine: Engine, src_bytes: int, recv_bytes: int) -> Exchange:
    """Collective: register a send and a receive array on every rank and build a group of all peers."""
    src = np.zeros(src_bytes, np.uint8)
    recv = np.zeros(recv_bytes, np.uint8)
    _registered.extend([src, recv])
    src_region = engine.register(src)
    recv_region = engine.register(recv)
    remotes = engine.exchange_region(recv_region)
    peers = [p for p in range(engine.world_size) if p != engine.rank]
    return Exchange(engine, src, recv, src_region, recv_region, remotes, peers, engine.group(peers, remotes))


def random_bytes(seed: int, *key: int, size: int) -> np.ndarray:
    """Bytes that any rank can regenerate from (seed, key)."""
    return np.random.default_rng([seed, *key]).integers(0, 256, size, dtype=np.uint8)


def wait_until(what: str, condition: Callable[[], bool], timeout_s: float = WAIT_S) -> None:
    """Poll `condition` without touching the engine's waits; fail naming `what` on timeout."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s} s waiting until {what}")
        time.sleep(0.001)


def first_peer(rank: int, world: int = 0) -> int:
    """The lowest other rank."""
    return 1 if rank == 0 else 0


def last_peer(rank: int, world: int) -> int:
    """The highest other rank."""
    return world - 1 if rank != world - 1 else world - 2


def senders_to(rank: int, world: int, target: Callable[[int, int], int]) -> list[int]:
    """The ranks s whose `target(s, world)` is `rank`."""
    return [s for s in range(world) if s != rank and target(s, world) == rank]
