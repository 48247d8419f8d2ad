"""Late, failing and dead peers in one process: every rank stops, and ranks agree on which calls succeeded.

The in-process twin of the late-peer cases of tests/mpi/test_reliability.py
(which keeps the front end's part: the refused next call and reopen()), with
failures the real providers cannot be made to produce on demand: a write that
fails, a peer that dies in the middle of a call.
"""

from __future__ import annotations

import time

import pytest
from world import Rank, expert_fn, make_inputs

from moe_a2a import _core

LAYOUTS = [(2, 1), (4, 2), (3, 1)]


def layout_ids(layout: tuple[int, int]) -> str:
    return f"{layout[0]}ranks-rpn{layout[1]}"


@pytest.mark.parametrize("layout", LAYOUTS + [(2, 2)], ids=layout_ids)
def test_after_a_timeout_the_late_rank_stops_at_once(make_world, layout: tuple[int, int]) -> None:
    """The last rank calls only after the others timed out waiting for it: they name it; it stops
    at once on their announcements instead of pairing with a call they gave up."""
    size, rpn = layout
    late = size - 1
    w = make_world(size, ranks_per_node=rpn, timeout_s=1.0)
    inp = make_inputs(5, w.cfg, size)
    others = [r for r in range(size) if r != late]
    send = lambda r: r.round(inp)  # noqa: E731
    for r, got in enumerate(w.run(send, others)):
        if r != late:
            assert isinstance(got, (_core.FabricError, _core.PeerFailedError)), f"rank {r}: {got!r}"
            assert "timed out" in str(got) and f"peer {late}" in str(got), f"rank {r}: {got}"
    started = time.monotonic()
    got = w.run(send, [late])[late]
    assert isinstance(got, _core.PeerFailedError) and "timed out" in str(got), repr(got)
    assert time.monotonic() - started < 0.9, "the late rank waited instead of stopping at once"


@pytest.mark.parametrize("layout", LAYOUTS + [(2, 2)], ids=layout_ids)
def test_a_failure_after_a_call_does_not_fail_that_call_elsewhere(
    make_world, layout: tuple[int, int]
) -> None:
    """Rank 0 completes a round, then fails its next call and announces it; the others, whose
    combine was still in flight when the announcement landed, complete the round exactly and
    stop at their next call. Phases in order: no sleep decides who is where."""
    size, rpn = layout
    w = make_world(size, ranks_per_node=rpn)
    inp = make_inputs(6, w.cfg, size)
    d = w.run(lambda r: r.dispatch(inp.xs[r.rank], inp.ids[r.rank], inp.weights[r.rank]))

    def first_half(r: Rank) -> object:
        y = expert_fn(d[r.rank].expert_x, d[r.rank].expert_x_scale)
        if r.rank != 0:
            return r.impl.combine_send(y.data_ptr(), _core.DType.bf16)  # the receive half waits
        out = r.combine(y)
        r.impl.announce_failure("rank 0: ValueError: topk_weights (its next call)")
        return out

    halves = w.run(first_half)
    assert w.fabric.held() == 0  # rank 0's announcement has landed everywhere

    def second_half(r: Rank) -> object:
        import torch

        out = torch.empty(r.tokens, w.cfg.hidden, dtype=torch.bfloat16)
        r.impl.combine_recv(r.weights.data_ptr(), out.data_ptr())
        return out

    outs = w.run(second_half, list(range(1, size)))
    outs[0] = halves[0]
    w.check(inp, [(d[r], outs[r]) for r in range(size)])
    for r, got in enumerate(w.run(lambda r: r.round(inp), list(range(1, size)))):
        if r:
            assert isinstance(got, _core.PeerFailedError) and "peer 0 failed" in str(got), (
                f"rank {r}: {got!r}"
            )


@pytest.mark.parametrize("layout", LAYOUTS, ids=layout_ids)
def test_a_failed_write_stops_every_rank(make_world, layout: tuple[int, int]) -> None:
    """Rank 1's writes to a remote peer fail (its connection broke): rank 1's engine fails with the cause,
    and no rank completes the call (the others time out on it, or hear from a peer that did)."""
    size, rpn = layout
    w = make_world(size, ranks_per_node=rpn, timeout_s=1.0)
    inp = make_inputs(7, w.cfg, size, tokens=[w.cfg.max_tokens] * size)
    w.check(inp, w.run(lambda r: r.round(inp)))
    peer = w.remote_peers(1)[0]
    w.fabric.fail_writes(1, peer, "connection reset by the test")
    results = w.run(lambda r: r.round(inp))
    assert f"write to peer {peer} failed: connection reset by the test" in str(results[1]), repr(results[1])
    for r, got in enumerate(results):
        assert isinstance(got, (_core.FabricError, _core.PeerFailedError)), f"rank {r}: {got!r}"


@pytest.mark.parametrize("layout", LAYOUTS, ids=layout_ids)
def test_a_peer_that_dies_in_a_call_is_an_error_on_every_survivor(
    make_world, layout: tuple[int, int]
) -> None:
    """Rank 1 dies while its peers wait for its rows: each survivor's call fails naming it."""
    size, rpn = layout
    w = make_world(size, ranks_per_node=rpn, timeout_s=1.0)
    inp = make_inputs(8, w.cfg, size, tokens=[w.cfg.max_tokens] * size)
    w.fabric.hold(1)
    survivors = [r for r in range(size) if r != 1]
    running = w.start(lambda r: r.round(inp), survivors)
    assert w.fabric.wait_blocked(w.remote_peers(1)[0], 1, 10.0)
    w.fabric.kill(1)
    w.fabric.release(1)  # nothing: a dead rank's writes are lost
    for r, got in enumerate(running.join()):
        if r != 1:
            assert isinstance(got, (_core.FabricError, _core.PeerFailedError)), f"rank {r}: {got!r}"
            assert "peer 1" in str(got), f"rank {r}: {got}"
