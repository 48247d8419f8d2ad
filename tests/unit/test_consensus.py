"""The survivors' agreement across nodes (moe_a2a.consensus): flooding consensus over control
connections, with ranks that die before, during and right after it. Each rank is a thread holding
its ends of connected socket pairs; a rank dies by closing its ends (what the kernel does when a
process ends)."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import pytest

from moe_a2a.consensus import DECIDE, HEADER, PROPOSE, ControlMesh, Vote


def socket_mesh(world: int) -> list[dict[int, socket.socket]]:
    """Each rank's sockets to every other rank (index = rank)."""
    ends: list[dict[int, socket.socket]] = [{} for _ in range(world)]
    for a in range(world):
        for b in range(a + 1, world):
            ends[a][b], ends[b][a] = socket.socketpair()
    return ends


def meshes(world: int) -> tuple[list[ControlMesh], list[dict[int, socket.socket]]]:
    ends = socket_mesh(world)
    return [ControlMesh(r, world, ends[r]) for r in range(world)], ends


def run_all(calls: dict[int, Any]) -> dict[int, Any]:
    """Each rank's call in its own thread; its result or exception."""
    out: dict[int, Any] = {}

    def run(r: int) -> None:
        try:
            out[r] = calls[r]()
        except Exception as e:  # noqa: BLE001 - the test looks at it
            out[r] = e

    threads = [threading.Thread(target=run, args=(r,)) for r in calls]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out


def kill(mesh: ControlMesh) -> None:
    mesh.close()


def message(kind: int, agreement: int, rnd: int, vote: Vote, world: int) -> bytes:
    return HEADER.pack(kind, agreement, rnd, vote.epoch, (world + 7) // 8) + vote.encode(world)


def test_a_vote_round_trips_through_its_bitmap() -> None:
    vote = Vote(frozenset({0, 7, 8, 69}), 12)
    assert Vote.decode(vote.encode(70), 12) == vote
    assert Vote(frozenset({1}), 3).merge(Vote(frozenset({2}), 5)) == Vote(frozenset({1, 2}), 5)


def test_survivors_agree_on_a_rank_dead_before_the_agreement() -> None:
    m, _ = meshes(4)
    kill(m[3])
    # Each survivor started a different number of dispatches; rank 0 alone already knows.
    votes = {0: Vote(frozenset({3}), 7), 1: Vote(frozenset(), 8), 2: Vote(frozenset(), 6)}
    out = run_all({r: (lambda r=r: m[r].agree(votes[r], 10.0)) for r in range(3)})
    decided = {out[r][0] for r in range(3)}
    assert decided == {Vote(frozenset({3}), 8)}, out
    assert all(m[r].agreements == 1 for r in range(3))


def test_nobody_dead_decides_in_the_first_round() -> None:
    m, _ = meshes(3)
    out = run_all({r: (lambda r=r: m[r].agree(Vote(frozenset(), r), 10.0)) for r in range(3)})
    assert {out[r] for r in range(3)} == {(Vote(frozenset(), 2), 1)}, out


def test_a_rank_that_dies_during_the_agreement_is_masked_alike() -> None:
    """Rank 3 sends its first proposal to rank 0 only, then dies: rank 0 heard it, ranks 1 and 2
    did not; all three still decide the same."""
    world = 4
    m, ends = meshes(world)
    ends[3][0].sendall(message(PROPOSE, 0, 1, Vote(frozenset(), 99), world))
    kill(m[3])
    out = run_all({r: (lambda r=r: m[r].agree(Vote(frozenset(), 1), 10.0)) for r in range(3)})
    decided = {out[r][0] for r in range(3)}
    assert len(decided) == 1, out
    assert next(iter(decided)).dead == frozenset({3})


def test_a_decision_that_reached_one_survivor_is_everyones() -> None:
    """Rank 3 decides, tells rank 0 only and dies: rank 0 relays it, and ranks 1 and 2, which
    never heard rank 3's decision, decide it too."""
    world = 4
    m, ends = meshes(world)
    decision = Vote(frozenset({3}), 41)
    ends[3][0].sendall(message(DECIDE, 0, 1, decision, world))
    out: dict[int, Any] = {}
    started = threading.Thread(
        target=lambda: out.update(
            run_all({r: (lambda r=r: m[r].agree(Vote(frozenset(), 40), 10.0)) for r in range(3)})
        )
    )
    started.start()
    # Rank 3 dies only once ranks 1 and 2 proposed to it, as a decider would have heard them:
    # neither can have taken it for gone before the agreement began.
    deadline = time.monotonic() + 10.0
    while {msg.peer for msg in m[3]._inbox} < {1, 2} and time.monotonic() < deadline:
        m[3].poll(0.01)
    kill(m[3])
    started.join()
    assert {out[r][0] for r in range(3)} == {decision}, out


def test_two_deaths_seen_in_different_orders() -> None:
    m, _ = meshes(5)
    kill(m[4])
    kill(m[1])
    votes = {0: Vote(frozenset({1}), 3), 2: Vote(frozenset({4}), 3), 3: Vote(frozenset(), 3)}
    out = run_all({r: (lambda r=r: m[r].agree(votes[r], 10.0)) for r in votes})
    assert {out[r][0] for r in votes} == {Vote(frozenset({1, 4}), 3)}, out


def test_agreements_in_a_row_with_ready_between_them() -> None:
    """A loss, everyone ready, then a second loss: the second agreement does not take the first
    one's late relays, and its number is the same everywhere."""
    m, _ = meshes(4)
    kill(m[3])
    first = run_all({r: (lambda r=r: m[r].agree(Vote(frozenset(), 5), 10.0)) for r in range(3)})
    assert {first[r][0] for r in range(3)} == {Vote(frozenset({3}), 5)}
    live = frozenset({0, 1, 2})
    ready = run_all({r: (lambda r=r: m[r].ready(live, 10.0)) for r in range(3)})
    assert all(ready[r] is None for r in range(3)), ready
    kill(m[2])
    second = run_all({r: (lambda r=r: m[r].agree(Vote(frozenset({3}), 9), 10.0)) for r in range(2)})
    assert {second[r][0] for r in range(2)} == {Vote(frozenset({2, 3}), 9)}, second
    assert m[0].agreements == m[1].agreements == 2


def test_a_silent_live_peer_times_the_agreement_out_with_its_rank() -> None:
    m, _ = meshes(3)  # rank 2 stays connected and never answers
    out = run_all({r: (lambda r=r: m[r].agree(Vote(frozenset(), 0), 0.5)) for r in range(2)})
    for r in range(2):
        assert isinstance(out[r], TimeoutError), out
        assert "rank(s) [2]" in str(out[r])


def test_check_sees_a_peer_end_without_blocking() -> None:
    m, _ = meshes(3)
    assert m[0].check() == set()
    kill(m[2])
    for _ in range(50):
        if m[0].check() == {2}:
            break
    assert m[0].check() == {2}


def test_a_stranger_on_the_connection_is_taken_for_gone() -> None:
    m, ends = meshes(2)
    ends[1][0].sendall(b"\xff" * 64)
    assert m[0].check() == {1}


@pytest.mark.parametrize("world", [2, 8])
def test_no_survivor_but_oneself(world: int) -> None:
    m, _ = meshes(world)
    for r in range(1, world):
        kill(m[r])
    vote, _ = m[0].agree(Vote(frozenset(), 1), 5.0)
    assert vote.dead == frozenset(range(1, world))
