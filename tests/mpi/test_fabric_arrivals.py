"""The transfer engine across ranks: barriers and immediate counters (how a receiver learns writes landed).

Run under mpirun as tests/mpi/test_fabric.py says; the shared exchange and data are in
tests/mpi/fabric_exchange.py.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from fabric_exchange import WAIT_S, first_peer, make_exchange, random_bytes, senders_to, wait_until

from moe_a2a import FabricTimeoutError
from moe_a2a.fabric import Engine, ScatterItem

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
