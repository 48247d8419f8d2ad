"""The transfer engine across ranks: connecting, scatter and split writes, and its benchmark.

Run under mpirun with pytest-mpi, for example
    mpirun -n 4 --oversubscribe python -m pytest --with-mpi -q tests/mpi/test_fabric.py
with MOE_A2A_TEST_PROVIDER=tcp (default) or shm.

Every rank runs the same tests in the same order, so collective steps (engine
creation, region exchange) line up. Test data are random, drawn from the job's
seed (tests/mpi/fabric_exchange.py).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import numpy as np
import pytest
from fabric_exchange import SPLIT_THRESHOLD, WAIT_S, make_exchange, random_bytes

from moe_a2a import _core
from moe_a2a.bench import fabric as bench
from moe_a2a.fabric import Engine, ScatterItem
from moe_a2a.report import write_output

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
    items = [ScatterItem(i, peer * payload, payload, rank * payload) for i, peer in enumerate(ex.peers)]

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
    reason="demonstrates abort-on-failure; run by tests/jobs/test_mpi_infrastructure.py",
)
@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)  # tests/jobs/test_mpi_infrastructure.py tells an abort from this timeout
def test_deliberate_failure_on_one_rank_aborts_the_job(bootstrap: Any) -> None:
    if bootstrap.rank == 1:
        pytest.fail("deliberate failure on rank 1")
    bootstrap.barrier()  # without the abort hook, rank 0 would wait here until the timeout
