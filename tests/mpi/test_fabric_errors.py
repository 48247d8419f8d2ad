"""The transfer engine across ranks: bad calls and silent peers fail, naming what was wrong.

Run under mpirun as tests/mpi/test_fabric.py says; the shared exchange and data are in
tests/mpi/fabric_exchange.py.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from fabric_exchange import WAIT_S, last_peer, make_exchange, random_bytes, senders_to, wait_until

from moe_a2a import FabricError, FabricTimeoutError, _core
from moe_a2a.fabric import Engine, Group, Region, RemoteRegion, ScatterItem

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
