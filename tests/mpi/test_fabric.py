"""The transfer engine across ranks: scatter, barrier, immediate counters and errors.

Run under mpirun with pytest-mpi, for example
    mpirun -n 4 --oversubscribe python -m pytest --with-mpi -q tests/mpi/test_fabric.py
with MOE_A2A_TEST_PROVIDER=tcp (default) or shm.

Every rank runs the same tests in the same order, so collective steps (engine
creation, region exchange) line up. Test data are random, drawn from the job's
seed (fixture `seed`) so every rank can compute what every other rank sent;
they differ per sender, receiver and round.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import pytest

from moe_a2a import FabricError, FabricTimeoutError, _core
from moe_a2a.bench import fabric as bench
from moe_a2a.fabric import Engine, Group, Region, RemoteRegion, ScatterItem
from moe_a2a.report import write_output

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


# ---------------------------------------------------------------- basics


@pytest.mark.mpi(min_size=1)
@pytest.mark.timeout(240)
def test_engine_connects(engine: Engine, bootstrap: Any, provider: str, num_nics: int) -> None:
    assert (engine.rank, engine.world_size) == (bootstrap.rank, bootstrap.world_size)
    assert engine.core.provider == provider
    assert engine.core.num_nics == num_nics
    assert engine.core.error == ""


# ---------------------------------------------------------------- scatter


def plan_pieces(
    seed: int, round_: int, world: int, slot: int, src_bytes: int, min_piece: int = 0
) -> dict[tuple[int, int], list[tuple[int, int, int]]]:
    """(sender, receiver) -> pieces (src_offset, length, offset within the sender's slot).

    The pieces of one pair tile the sender's slot of `slot` bytes at the receiver,
    so the last piece of the last slot ends at the end of the receive region.
    Repeated cut points make zero-length pieces; the first piece is at least
    `min_piece` long; the longest piece of each pair is read from the very end
    of the source region. Every rank computes the same plan.
    """
    rng = np.random.default_rng([seed, round_, 1])
    plan = {}
    for s in range(world):
        for d in range(world):
            if s == d:
                continue
            inner = rng.integers(min_piece, slot + 1, size=int(rng.integers(1, 6)))
            fixed = [0, min_piece, slot] if min_piece else [0, slot]
            cuts = np.sort(np.concatenate([fixed, inner, inner[:1]]))  # inner[0] twice: an empty piece
            lengths = np.diff(cuts)
            longest = int(np.argmax(lengths))
            pieces = []
            for i, (start, length) in enumerate(zip(cuts[:-1].tolist(), lengths.tolist(), strict=True)):
                src_offset = (
                    src_bytes - length if i == longest else int(rng.integers(0, src_bytes - length + 1))
                )
                pieces.append((src_offset, length, start))
            plan[(s, d)] = pieces
    return plan


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("nics", "split_threshold", "slot", "rounds"),
    [(None, 1 << 20, 40_017, 12), (2, SPLIT_THRESHOLD, 300_007, 4)],
    ids=["default-nics", "2nics-split64k"],
)
def test_scatter_random_sizes_byte_for_byte(
    make_engine: Callable[..., Engine],
    num_nics: int,
    seed: int,
    next_tag: Callable[[], int],
    nics: int | None,
    split_threshold: int,
    slot: int,
    rounds: int,
) -> None:
    engine = make_engine(num_nics=nics or num_nics, split_threshold=split_threshold)
    rank, world = engine.rank, engine.world_size
    src_bytes = 2 * slot + 3
    ex = make_exchange(engine, src_bytes, (world - 1) * slot)
    data_tag, round_tag = next_tag(), next_tag()
    # With a small split threshold, make the first piece of every pair large enough to be split.
    min_piece = 2 * split_threshold + 4095 if split_threshold < slot // 2 else 0
    if min_piece:
        assert len(_core.split_write(1, min_piece, engine.core.num_nics, split_threshold)) > 1

    ex.recv[:] = random_bytes(seed, rank, 0, 3, size=ex.recv.size)  # never test on zeros
    engine.core.barrier(ex.group, round_tag, WAIT_S)
    zero_pieces = 0
    for r in range(rounds):
        plan = plan_pieces(seed, r, world, slot, src_bytes, min_piece)
        ex.src[:] = random_bytes(seed, rank, r, 2, size=src_bytes)
        items = [
            ScatterItem(i, src_offset, length, ex.position(rank, peer) * slot + start)
            for i, peer in enumerate(ex.peers)
            for src_offset, length, start in plan[(rank, peer)]
        ]
        np.random.default_rng([seed, rank, r, 4]).shuffle(items)  # the engine must not rely on order
        engine.core.scatter(ex.group, ex.src_region, items, data_tag)

        expected = np.empty_like(ex.recv)
        for peer in ex.peers:
            pieces = plan[(peer, rank)]
            sent = random_bytes(seed, peer, r, 2, size=src_bytes)
            base = ex.position(peer, rank) * slot
            for src_offset, length, start in pieces:
                expected[base + start : base + start + length] = sent[src_offset : src_offset + length]
            zero_pieces += sum(1 for _, length, _ in pieces if length == 0)
            # One immediate per piece, the empty ones included.
            engine.core.wait_imm(data_tag, peer, len(pieces), WAIT_S)
        bad = np.flatnonzero(ex.recv != expected)
        assert bad.size == 0, (
            f"round {r}: {bad.size} of {ex.recv.size} bytes differ, first at byte {bad[0]} "
            f"(from peer {ex.peers[bad[0] // slot]}, slot offset {bad[0] % slot})"
        )
        engine.core.wait_tx(WAIT_S)  # our source may be rewritten only when our writes are done
        ex.recv[:] = random_bytes(seed, rank, r + 1, 3, size=ex.recv.size)
        engine.core.barrier(ex.group, round_tag, WAIT_S)  # peers write round r+1 only after this
    assert zero_pieces >= rounds * (world - 1), "the plan was meant to have an empty piece per pair"
    assert engine.core.error == ""


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(300)
def test_large_writes_split_across_two_nics(
    make_engine: Callable[..., Engine], seed: int, next_tag: Callable[[], int]
) -> None:
    """Writes at, just above and far above the split threshold, on 2 endpoints per rank."""
    engine = make_engine(num_nics=2, split_threshold=SPLIT_THRESHOLD)
    rank, world = engine.rank, engine.world_size
    lengths = [SPLIT_THRESHOLD, SPLIT_THRESHOLD + 1, SPLIT_THRESHOLD - 1, (1 << 20) + 4095, 3 * (1 << 20) + 7]
    assert [len(_core.split_write(0, n, 2, SPLIT_THRESHOLD)) for n in lengths] == [2, 2, 1, 2, 2]
    slot = sum(lengths)
    ex = make_exchange(engine, (world - 1) * slot, (world - 1) * slot)
    tag = next_tag()
    ex.src[:] = random_bytes(seed, rank, 5, size=ex.src.size)
    ex.recv[:] = random_bytes(seed, rank, 6, size=ex.recv.size)
    engine.bootstrap.barrier()  # every receive array is filled before anyone writes
    for i, peer in enumerate(ex.peers):
        offset = 0
        for n in lengths:  # one write() per length, with the immediate on the last piece
            engine.core.write(
                ex.src_region,
                i * slot + offset,
                n,
                ex.remotes[peer],
                ex.position(rank, peer) * slot + offset,
                tag,
            )
            offset += n
    for peer in ex.peers:
        engine.core.wait_imm(tag, peer, len(lengths), WAIT_S)
        # The peer sent from its source slot for us (our index in its group).
        sent = random_bytes(seed, peer, 5, size=ex.src.size)
        want = sent[ex.position(rank, peer) * slot : (ex.position(rank, peer) + 1) * slot]
        base = ex.position(peer, rank) * slot
        bad = np.flatnonzero(ex.recv[base : base + slot] != want)
        assert bad.size == 0, f"from peer {peer}: {bad.size} bytes differ, first at {bad[0]}"
    engine.core.wait_tx(WAIT_S)
    assert engine.core.tx_completed == engine.core.tx_submitted
    engine.bootstrap.barrier()


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(300)
def test_split_write_pieces_carry_the_immediate_on_every_nic(
    make_engine: Callable[..., Engine], seed: int, next_tag: Callable[[], int]
) -> None:
    """A split write goes out as one piece per NIC at once; each piece brings the immediate, and
    the receiver's wait for one write returns only when all of them (all the bytes) are in."""
    engine = make_engine(num_nics=2, split_threshold=SPLIT_THRESHOLD)
    rank, world = engine.rank, engine.world_size
    size = 4 * SPLIT_THRESHOLD + 4095
    assert len(_core.split_write(0, size, 2, SPLIT_THRESHOLD)) == 2
    ex = make_exchange(engine, (world - 1) * size, (world - 1) * size)
    tag = next_tag()
    ex.src[:] = random_bytes(seed, rank, 10, size=ex.src.size)
    ex.recv[:] = random_bytes(seed, rank, 11, size=ex.recv.size)
    engine.core.wait_tx(WAIT_S)
    # Read before the barrier: earlier tests waited for all their arrivals, and
    # no peer writes this test's before we pass it.
    arrived = [engine.core.arrivals(nic) for nic in range(2)]
    engine.bootstrap.barrier()
    submitted = engine.core.tx_submitted
    items = [ScatterItem(i, i * size, size, ex.position(rank, p) * size) for i, p in enumerate(ex.peers)]
    engine.core.scatter(ex.group, ex.src_region, items, tag)
    # Handed over at once, two pieces per write: no piece waits for another to land.
    assert engine.core.tx_submitted - submitted == 2 * len(ex.peers)
    for peer in ex.peers:
        engine.core.wait_imm(tag, peer, 1, WAIT_S)
        sent = random_bytes(seed, peer, 10, size=ex.src.size)
        want = sent[ex.position(rank, peer) * size : (ex.position(rank, peer) + 1) * size]
        base = ex.position(peer, rank) * size
        bad = np.flatnonzero(ex.recv[base : base + size] != want)
        assert bad.size == 0, f"from peer {peer}: {bad.size} bytes differ, first at {bad[0]}"
        assert engine.core.imm_count(tag, peer) == 0
    got = [engine.core.arrivals(nic) - arrived[nic] for nic in range(2)]
    assert got == [world - 1, world - 1], f"immediates per NIC: {got}; expected one piece per sender on each"
    engine.core.wait_tx(WAIT_S)
    engine.bootstrap.barrier()


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(300)
def test_steps_of_a_registered_group_allocate_nothing(
    engine: Engine, seed: int, next_tag: Callable[[], int], bootstrap: Any
) -> None:
    """Scatter and barrier rounds on a registered group grow no queue of the write path."""
    rank, world = engine.rank, engine.world_size
    payload = 64
    ex = make_exchange(engine, world * payload, world * payload)
    tag, barrier_tag = next_tag(), next_tag()
    items = [
        ScatterItem(i, peer * payload, payload, rank * payload) for i, peer in enumerate(ex.peers)
    ]

    def round_(r: int) -> None:
        ex.src[:] = random_bytes(seed, rank, 12, r, size=ex.src.size)
        engine.core.scatter(ex.group, ex.src_region, items, tag)
        for peer in ex.peers:
            engine.core.wait_imm(tag, peer, 1, WAIT_S)
            want = random_bytes(seed, peer, 12, r, size=ex.src.size)[rank * payload : (rank + 1) * payload]
            assert np.array_equal(ex.recv[peer * payload : (peer + 1) * payload], want), (r, peer)
        engine.core.barrier(ex.group, barrier_tag, WAIT_S)  # nobody rewrites a source still being read

    for r in range(10):
        round_(r)
    before = engine.core.hot_path_allocations
    for r in range(10, 310):
        round_(r)
    assert engine.core.hot_path_allocations == before, "a queue of the write path grew in steady state"
    bootstrap.barrier()


# ---------------------------------------------------------------- barrier


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(300)
def test_barrier_rounds_make_prior_writes_visible(
    engine: Engine, seed: int, next_tag: Callable[[], int], bootstrap: Any
) -> None:
    """Untagged writes before each barrier are visible to their receivers once it returns."""
    rounds = int(os.environ.get("MOE_A2A_TEST_BARRIER_ROUNDS", "1000"))
    payload = 40
    rank, world = engine.rank, engine.world_size
    # data[r, s, d]: what rank s writes to rank d in round r; every rank knows all of it.
    data = random_bytes(seed, 7, size=rounds * world * world * payload).reshape(rounds, world, world, payload)
    # The source holds every round, so no write's source is ever rewritten; the
    # receive side reuses two slots, so a missing write leaves round r-2's bytes.
    ex = make_exchange(engine, rounds * world * payload, 2 * world * payload)
    ex.src[:] = data[:, rank].reshape(-1)
    recv = ex.recv.reshape(2, world, payload)
    tag = next_tag()
    want_from = data[:, ex.peers, rank]  # [round, peer index, byte]
    start = time.perf_counter()
    for r in range(rounds):
        items = [
            ScatterItem(i, (r * world + peer) * payload, payload, ((r % 2) * world + rank) * payload)
            for i, peer in enumerate(ex.peers)
        ]
        engine.core.scatter(ex.group, ex.src_region, items)  # no immediate: only the barrier announces it
        engine.core.barrier(ex.group, tag, WAIT_S)
        got = recv[r % 2, ex.peers]
        if not np.array_equal(got, want_from[r]):
            late = [p for i, p in enumerate(ex.peers) if not np.array_equal(got[i], want_from[r, i])]
            pytest.fail(
                f"round {r}: data written before the barrier by peer(s) {late} is not visible after it"
            )
    elapsed = time.perf_counter() - start
    engine.core.wait_tx(WAIT_S)
    assert engine.core.imm_count(tag, ex.peers[0]) == 0, "barrier arrivals left over"
    if rank == 0:
        print(
            f"\n{rounds} barrier rounds on {world} ranks: {elapsed:.2f} s "
            f"({elapsed / rounds * 1e6:.0f} us/round)"
        )
    bootstrap.barrier()


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(240)
def test_barrier_without_one_peer_times_out_naming_it(
    engine: Engine, next_tag: Callable[[], int], bootstrap: Any, provider: str
) -> None:
    ex = make_exchange(engine, 64, 64)
    tag = next_tag()
    if engine.rank == 0:
        start = time.monotonic()
        with pytest.raises(FabricTimeoutError) as info:
            engine.core.barrier(ex.group, tag, 0.5)
        elapsed = time.monotonic() - start
        message = str(info.value)
        assert f"rank 0 (provider '{provider}')" in message
        assert f"tag {tag} from peer 1" in message and "Is peer 1 alive" in message
        assert 0.5 <= elapsed < 10, elapsed
    else:
        # Rank 0's half of the barrier still arrives here, counted but unconsumed.
        wait_until("rank 0's barrier write arrived", lambda: engine.core.imm_count(tag, 0) == 1)
    bootstrap.barrier()
    assert engine.core.error == ""


# ---------------------------------------------------------------- immediate counters


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(240)
def test_immediates_that_arrive_before_the_wait_are_counted(
    engine: Engine, seed: int, next_tag: Callable[[], int], bootstrap: Any
) -> None:
    rank, world = engine.rank, engine.world_size
    writes = 5
    size = 1000
    ex = make_exchange(engine, writes * size, (world - 1) * writes * size)
    ex.src[:] = random_bytes(seed, rank, 8, size=ex.src.size)
    tag, unused_tag = next_tag(), next_tag()
    bootstrap.barrier()
    for peer in ex.peers:
        for k in range(writes):
            dst = (ex.position(rank, peer) * writes + k) * size
            engine.core.write(ex.src_region, k * size, size, ex.remotes[peer], dst, tag)
    # Nobody waits yet: the arrivals must still be counted, per sending peer.
    for peer in ex.peers:
        wait_until(
            f"{writes} arrivals from peer {peer} are counted",
            lambda p=peer: engine.core.imm_count(tag, p) >= writes,
        )
    time.sleep(0.05)  # a late duplicate would show up in the counts now
    for peer in ex.peers:
        assert engine.core.imm_count(tag, peer) == writes, f"peer {peer}"
        assert engine.core.imm_count(unused_tag, peer) == 0
    assert engine.core.imm_count(tag, rank) == 0  # nobody writes to themselves

    for peer in ex.peers:
        start = time.monotonic()
        engine.core.wait_imm(tag, peer, writes - 2, 0.01)  # already there: returns at once
        assert time.monotonic() - start < 1.0
        assert engine.core.imm_count(tag, peer) == 2, "a wait consumes exactly what it asked for"
        engine.core.wait_imm(tag, peer, 2, 0.01)
        assert engine.core.imm_count(tag, peer) == 0
        with pytest.raises(FabricTimeoutError, match=r"waiting for 1 arrival\(s\).*0 arrived"):
            engine.core.wait_imm(tag, peer, 1, 0.05)

        sent = random_bytes(seed, peer, 8, size=writes * size)
        base = ex.position(peer, rank) * writes * size
        assert np.array_equal(ex.recv[base : base + writes * size], sent), f"data from peer {peer}"
    engine.core.wait_tx(WAIT_S)
    bootstrap.barrier()


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(240)
def test_zero_length_writes(engine: Engine, next_tag: Callable[[], int], bootstrap: Any) -> None:
    """A zero-length write with a tag still delivers its immediate; without a tag it posts nothing."""
    ex = make_exchange(engine, 16, 16)
    peer = first_peer(engine.rank)
    tag = next_tag()
    submitted = engine.core.tx_submitted
    engine.core.write(ex.src_region, 16, 0, ex.remotes[peer], 16, None)  # at the very end, no tag
    assert engine.core.tx_submitted == submitted
    bootstrap.barrier()
    engine.core.write(ex.src_region, 16, 0, ex.remotes[peer], 16, tag)
    engine.core.wait_tx(WAIT_S)
    for s in senders_to(engine.rank, engine.world_size, first_peer):
        engine.core.wait_imm(tag, s, 1, WAIT_S)
    bootstrap.barrier()


# ---------------------------------------------------------------- errors


@pytest.mark.mpi(min_size=1)
@pytest.mark.timeout(240)
def test_unknown_provider_fails_on_every_rank(bootstrap: Any) -> None:
    # Opening fails before any collective, so every rank raises and none waits.
    with pytest.raises(FabricError) as info:
        Engine(bootstrap, "no-such-provider")
    message = str(info.value)
    assert "libfabric provider 'no-such-provider' is not available on this machine" in message
    assert "providers offered here:" in message and "tcp" in message


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(240)
def test_unregistered_ranges_are_rejected(
    engine: Engine, seed: int, next_tag: Callable[[], int], bootstrap: Any
) -> None:
    rank = engine.rank
    if engine.world_size > 64:
        pytest.skip("the health check gives each sender 64 of the 4096 receive bytes")
    ex = make_exchange(engine, 4096, 4096)
    peer = last_peer(rank, engine.world_size)
    remote = ex.remotes[peer]
    core = engine.core
    cases: list[tuple[Callable[[], None], str]] = [
        (
            lambda: core.write(ex.src_region, 4000, 200, remote, 0),
            rf"write to peer {peer}: source range \[4000, 4200\) is outside the registered region of 4096 b",
        ),
        (
            lambda: core.write(ex.src_region, 0, 200, remote, 3900, 1),
            rf"write to peer {peer}: destination range \[3900, 4100\) is outside the peer's registered",
        ),
        (lambda: core.write(ex.src_region, 4097, 0, remote, 0), r"source range \[4097, 4097\)"),
        (lambda: core.write(ex.src_region, 0, 1, remote, 4096), r"destination range \[4096, 4097\)"),
        (lambda: core.write(ex.src_region, 2**64 - 1, 2, remote, 0), "source range"),  # no wrap-around
        (lambda: core.write(ex.src_region, 0, 2**64 - 1, remote, 0), "source range"),
        (
            lambda: core.scatter(
                ex.group, ex.src_region, [ScatterItem(0, 0, 16, 0), ScatterItem(0, 0, 4097, 0)], 1
            ),
            r"scatter to peer \d+: source range \[0, 4097\)",
        ),
        (lambda: core.write(Region(999), 0, 1, remote, 0), "unknown local region 999"),
        (lambda: core.write(ex.src_region, 0, 1, RemoteRegion(999), 0), "unknown remote region 999"),
        (lambda: core.scatter(ex.group, Region(999), [ScatterItem(0, 0, 1, 0)]), "unknown local region 999"),
        (lambda: core.scatter(Group(999), ex.src_region, [ScatterItem(0, 0, 1, 0)]), "unknown group 999"),
        (lambda: core.write(ex.src_region, 0, 1, remote, 0, 0x10000), "immediate tag 65536 exceeds 16 bits"),
    ]
    submitted = core.tx_submitted
    for call, pattern in cases:
        with pytest.raises(FabricError, match=pattern) as info:
            call()
        assert f"rank {rank} (provider" in str(info.value)
    # Rejected before anything was posted (the scatter's valid first item too); the engine is healthy.
    assert core.tx_submitted == submitted
    assert core.error == ""
    tag = next_tag()
    ex.src[:] = random_bytes(seed, rank, 9, size=4096)
    bootstrap.barrier()
    # Every sender its own 64 bytes (several ranks may share a last peer).
    core.write(ex.src_region, 0, 64, remote, rank * 64, tag)
    for s in senders_to(rank, engine.world_size, last_peer):
        core.wait_imm(tag, s, 1, WAIT_S)
        assert np.array_equal(ex.recv[s * 64 : (s + 1) * 64], random_bytes(seed, s, 9, size=4096)[:64])
    core.wait_tx(WAIT_S)
    bootstrap.barrier()


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(240)
def test_peer_out_of_range_is_rejected(engine: Engine, bootstrap: Any) -> None:
    world = engine.world_size
    ex = make_exchange(engine, 64, 64)
    core = engine.core
    n = len(ex.peers)
    with pytest.raises(FabricError, match=rf"scatter item 1 names peer index {n}; the group has {n} peers"):
        core.scatter(ex.group, ex.src_region, [ScatterItem(0, 0, 8, 0), ScatterItem(n, 0, 8, 0)], 3)
    for bad in (world, world + 5, -1):
        with pytest.raises(FabricError, match=rf"wait_imm: peer {bad} is out of range \[0, {world}\)"):
            core.wait_imm(3, bad, 1, 0.01)
        with pytest.raises(FabricError, match=rf"create_group: peer {bad} is out of range \[0, {world}\)"):
            core.create_group([bad], [ex.remotes[ex.peers[0]]])
    with pytest.raises(FabricError, match="got 2 peers and 1 remote regions"):
        core.create_group(ex.peers[:1] * 2, [ex.remotes[ex.peers[0]]])
    if world >= 3:
        a, b = ex.peers[0], ex.peers[1]
        with pytest.raises(
            FabricError, match=rf"binds peer {a} to remote region \d+, which belongs to rank {b}"
        ):
            core.create_group([a], [ex.remotes[b]])
    assert core.error == ""
    bootstrap.barrier()


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(240)
def test_peer_that_never_writes_times_out_naming_peer_and_immediate(
    engine: Engine, next_tag: Callable[[], int], bootstrap: Any, provider: str
) -> None:
    rank, world = engine.rank, engine.world_size
    tag = next_tag()
    silent = (rank + 1) % world
    start = time.monotonic()
    with pytest.raises(FabricTimeoutError) as info:
        engine.core.wait_imm(tag, silent, 1, 0.3)
    elapsed = time.monotonic() - start
    message = str(info.value)
    imm = _core.make_imm(tag, silent)
    assert f"rank {rank} (provider '{provider}'): timed out after 0.3" in message
    assert f"immediate 0x{imm:08x} (tag {tag} from peer {silent})" in message
    assert "0 arrived" in message and f"Is peer {silent} alive" in message
    assert isinstance(info.value, FabricError)  # callers may catch either
    assert 0.3 <= elapsed < 10, elapsed
    bootstrap.barrier()


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(240)
def test_peer_that_writes_too_few_times_out_with_the_count(
    engine: Engine, next_tag: Callable[[], int], bootstrap: Any
) -> None:
    ex = make_exchange(engine, 64, 64 * engine.world_size)
    rank = engine.rank
    tag = next_tag()
    bootstrap.barrier()
    for peer in ex.peers:
        engine.core.write(ex.src_region, 0, 64, ex.remotes[peer], ex.position(rank, peer) * 64, tag)
    for peer in ex.peers:
        wait_until(f"the write of peer {peer} arrived", lambda p=peer: engine.core.imm_count(tag, p) == 1)
        with pytest.raises(
            FabricTimeoutError, match=rf"waiting for 2 arrival\(s\) of .*from peer {peer}\); 1 arrived"
        ):
            engine.core.wait_imm(tag, peer, 2, 0.1)
        engine.core.wait_imm(tag, peer, 1, WAIT_S)  # the one that came is still there
    engine.core.wait_tx(WAIT_S)
    bootstrap.barrier()


# ---------------------------------------------------------------- benchmark


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(300)
def test_bench_fabric_runs_and_checks_bytes(bootstrap: Any, provider: str, tmp_path_factory: Any) -> None:
    """`moe-a2a bench fabric` end to end on small sizes (its byte check raises on wrong data)."""
    parser = argparse.ArgumentParser()
    bench.add_parser(parser.add_subparsers())
    args = parser.parse_args(
        ["fabric", "--provider", provider, "--sizes", "1K,3000,64K", "--iters", "3", "--progress", "never"]
    )
    assert args.func is bench.main and args.warmup == 10
    args.warmup = 1
    rows = bench.run(args, bootstrap)
    if bootstrap.rank != 0:
        assert rows == []
        return
    assert [r.size for r in rows] == [1024, 3000, 65536]
    for r in rows:
        assert 0 < r.moe_a2a_p50_us <= r.moe_a2a_p90_us and 0 < r.baseline_p50_us <= r.baseline_p90_us
        assert r.ratio == pytest.approx(r.baseline_p50_us / r.moe_a2a_p50_us)
        sent = (bootstrap.world_size - 1) * r.size
        assert r.moe_a2a_gbps == pytest.approx(sent / r.moe_a2a_p50_us / 1e3)
    out = tmp_path_factory.mktemp("bench")
    write_output(out / "fabric.json", [asdict(r) for r in rows], {"provider": provider})
    write_output(out / "fabric.csv", [asdict(r) for r in rows], {})
    assert json.loads((out / "fabric.json").read_text())["rows"][2]["size"] == 65536
    assert [int(row["size"]) for row in csv.DictReader((out / "fabric.csv").open())] == [1024, 3000, 65536]


# ---------------------------------------------------------------- test infrastructure


@pytest.mark.skipif(
    os.environ.get("MOE_A2A_TEST_DELIBERATE_FAILURE") != "1",
    reason="demonstrates abort-on-failure; run by tests/unit/test_fabric_pure.py",
)
@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)  # tests/unit/test_fabric_pure.py tells an abort from this timeout
def test_deliberate_failure_on_one_rank_aborts_the_job(bootstrap: Any) -> None:
    if bootstrap.rank == 1:
        pytest.fail("deliberate failure on rank 1")
    bootstrap.barrier()  # without the abort hook, rank 0 would wait here until the timeout
