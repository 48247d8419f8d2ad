"""The in-memory fabric itself (src/fabric/memory_engine.h): it keeps ProxyEngine's promises,
and does what the protocol tests ask of it (hold, release in an order, fail, kill, tell who waits)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from moe_a2a import _core

TAG = 7


class Pair:
    """Two ranks with a 64-byte region each, each in a group with the other."""

    def __init__(self) -> None:
        self.fabric = _core.MemoryFabric(2)
        self.engines = [self.fabric.engine(r) for r in range(2)]
        self.memory = [np.zeros(64, dtype=np.uint8) for _ in range(2)]
        self.regions = [
            e.register_region(m.ctypes.data, m.nbytes) for e, m in zip(self.engines, self.memory, strict=True)
        ]
        self.groups = [
            e.create_group([1 - r], [e.add_remote_region(1 - r, self.regions[1 - r])])
            for r, e in enumerate(self.engines)
        ]

    def send(self, src: int, offset: int, length: int, tag: int | None = TAG) -> None:
        item = _core.ScatterItem(0, offset, length, offset)
        self.engines[src].scatter(self.groups[src], self.regions[src], [item], tag)


def test_a_write_places_its_bytes_before_its_arrival_counts() -> None:
    p = Pair()
    p.memory[0][:8] = np.arange(1, 9)
    p.send(0, 0, 8)
    assert p.engines[1].imm_count(TAG, 0) == 1 and list(p.memory[1][:8]) == list(range(1, 9))
    p.engines[1].wait_imm(TAG, 0, 1, 1.0)
    assert p.engines[1].imm_count(TAG, 0) == 0  # consumed
    assert p.fabric.log() == [(0, 1, TAG, 8)]
    assert p.engines[0].tx_submitted == p.engines[0].tx_completed == 1


def test_held_writes_land_only_when_released_in_the_order_asked() -> None:
    p = Pair()
    p.memory[0][:4] = [1, 2, 3, 4]
    p.fabric.hold(0)
    for i in range(4):
        p.send(0, i, 1, tag=i)
    assert p.fabric.held(0) == 4 and not p.memory[1].any() and p.fabric.log() == []
    assert p.engines[0].tx_completed == 0
    with pytest.raises(_core.FabricTimeoutError, match="4 of 4 writes not completed"):
        p.engines[0].wait_tx(0.05)
    assert p.fabric.release(0, -1, "reversed") == 4
    assert [tag for _, _, tag, _ in p.fabric.log()] == [3, 2, 1, 0]
    assert list(p.memory[1][:4]) == [1, 2, 3, 4]
    p.send(0, 5, 1)  # no longer held
    assert p.fabric.held() == 0 and p.engines[1].imm_count(TAG, 0) == 1


def test_a_bad_item_posts_nothing() -> None:
    p = Pair()
    with pytest.raises(_core.FabricError, match="source range \\[60, 70\\) is outside"):
        p.send(0, 60, 10)
    with pytest.raises(_core.FabricError, match="immediate tag 65536 exceeds 16 bits"):
        p.send(0, 0, 1, tag=1 << 16)
    assert p.engines[0].tx_submitted == 0 and p.fabric.log() == []


def test_a_wait_times_out_naming_the_peer_and_the_fabric_says_who_waits() -> None:
    p = Pair()
    with pytest.raises(_core.FabricTimeoutError, match="0 arrived. Is peer 0 alive"):
        p.engines[1].wait_imm(TAG, 0, 1, 0.05)
    assert not p.fabric.wait_blocked(1, 0, 0.01)  # not waiting now
    waiter = threading.Thread(target=p.engines[1].wait_imm, args=(TAG, 0, 1, 10.0))
    waiter.start()
    assert p.fabric.wait_blocked(1, 0, 5.0)
    p.send(0, 0, 1)
    waiter.join(5.0)
    assert not waiter.is_alive()


def test_failed_writes_and_a_dead_peer_fail_the_sender_with_the_cause() -> None:
    p = Pair()
    p.fabric.fail_writes(0, 1, "cable pulled")
    p.send(0, 0, 1)
    assert "write to peer 1 failed: cable pulled" in p.engines[0].error
    with pytest.raises(_core.FabricError, match="cable pulled"):
        p.send(0, 0, 1)  # a failed engine refuses every later call
    q = Pair()
    q.fabric.hold(1)
    q.send(1, 0, 1)
    q.fabric.kill(1)
    assert q.fabric.held() == 0 and "killed" in q.engines[1].error  # its writes are lost, it stops
    q.send(0, 0, 1)
    assert "peer 1 is gone" in q.engines[0].error
    with pytest.raises(_core.FabricError, match="peer 1 is gone"):
        q.engines[0].wait_imm(TAG, 1, 1, 5.0)  # an engine error ends a wait at once


def test_barrier_waits_for_every_peer() -> None:
    p = Pair()
    other = threading.Thread(target=p.engines[1].barrier, args=(p.groups[1], 9, 5.0))
    other.start()
    p.engines[0].barrier(p.groups[0], 9, 5.0)
    other.join(5.0)
    assert not other.is_alive()
    assert sorted((s, d, t) for s, d, t, _ in p.fabric.log()) == [(0, 1, 9), (1, 0, 9)]
