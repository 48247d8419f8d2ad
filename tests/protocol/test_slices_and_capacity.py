"""Slices landing in any order, late peers and calls over capacity, in one process.

The in-process twin of the slice, overlap and capacity cases under mpirun
(tests/mpi/test_slices.py, test_overlap.py, test_a2a.py): the fabric holds a
peer's writes and releases them in the order the test names, so "late" and
"out of order" are facts of the run, not likely effects of a sleep.
"""

from __future__ import annotations

import math

import pytest
import torch
from world import Rank, World, make_inputs

from moe_a2a import _core

MAX_SLICES = 16  # per part (slices.h)
KIND_DISPATCH = 2  # signals.h: Tag kTagDispatch, in a tag's low 3 bits


def slices(rows: int, row_bytes: int, slice_bytes: int) -> int:
    """Writes of one part (slices.h, restated): about slice_bytes each, at most MAX_SLICES,
    equal rows but the last."""
    if rows == 0:
        return 0
    k = 1 if slice_bytes == 0 else min(max(math.ceil(rows * row_bytes / slice_bytes), 1), MAX_SLICES)
    per = math.ceil(rows / k)
    return math.ceil(rows / per)


def expected_writes(
    w: World, rank: int, ids: list[torch.Tensor], slice_bytes: int, combine: bool = True
) -> int:
    """Writes `rank` posts in one uncached call within capacity: to each remote peer a routing row,
    its dispatch slices (private part, overflow), then its combine slices (one, empty, where it
    sent us nothing)."""
    core = w.core[rank]
    P = w.max_private_tokens
    n = 0
    for r in w.remote_peers(rank):
        to, back = w.wire_rows(ids, rank, r), w.wire_rows(ids, r, rank)
        n += 1
        n += slices(min(to, P), core.dispatch_row_bytes, slice_bytes)
        n += slices(max(to - P, 0), core.dispatch_row_bytes, slice_bytes)
        n += max(slices(back, core.combine_row_bytes, slice_bytes), 1) if combine else 0
    return n


def row_bytes(dispatch_dtype: str) -> int:
    c = _core.A2AConfig()
    c.hidden, c.dispatch_dtype = 200, getattr(_core.DType, dispatch_dtype)
    return c.dispatch_row_bytes


@pytest.mark.parametrize(("size", "rpn"), [(2, 1), (4, 2)])
@pytest.mark.parametrize(
    ("dispatch_dtype", "private", "rows_per_slice"),
    [("bf16", None, 1), ("bf16", 0, 3), ("fp8", 2, 2), ("bf16", 5, 0)],  # 0: one write a part
)
def test_sliced_rows_are_exact_and_cut_as_the_rule_says(
    make_world, size: int, rpn: int, dispatch_dtype: str, private: int | None, rows_per_slice: int
) -> None:
    overrides: dict[str, object] = {"dispatch_dtype": dispatch_dtype}
    if private is not None:
        overrides["max_private_tokens"] = private
    slice_bytes = rows_per_slice * row_bytes(dispatch_dtype)
    w = make_world(size, ranks_per_node=rpn, slice_bytes=slice_bytes, **overrides)
    engines = [w.fabric.engine(r) for r in range(size)]
    for it in range(3):
        inp = make_inputs(700 + it, w.cfg, size, tokens=[w.cfg.max_tokens] * size)
        before = [e.tx_submitted for e in engines]
        w.check(inp, w.run(lambda r, inp=inp: r.round(inp)))
        for r, e in enumerate(engines):
            want = expected_writes(w, r, inp.ids, slice_bytes)
            assert e.tx_submitted - before[r] == want, (
                f"call {it}, rank {r}: {e.tx_submitted - before[r]} writes"
            )


def dispatch_slices_from(w: World, src: int) -> list[tuple[int, int]]:
    """(receiver, slice index) of src's dispatch writes, in the order they landed."""
    return [
        (dst, (tag >> 3) & 15) for s, dst, tag, _ in w.fabric.log() if s == src and tag & 7 == KIND_DISPATCH
    ]


@pytest.mark.parametrize("order", ["reversed", "shuffled"])
@pytest.mark.parametrize(("size", "rpn"), [(2, 1), (3, 1), (4, 2)])
@pytest.mark.parametrize(
    ("dispatch_dtype", "private"),
    [("bf16", 4), ("fp8", 0), ("bf16", 2)],  # 0: every row through the shared section; 2: both sections
)
def test_a_late_peers_slices_landing_out_of_order_are_exact(
    make_world, size: int, rpn: int, order: str, dispatch_dtype: str, private: int
) -> None:
    """Rank 0's writes are held until every remote receiver waits for them, then land last-first
    (or shuffled): receivers take each slice by its own tag, whatever the order, private part
    and overflow alike."""
    w = make_world(
        size, ranks_per_node=rpn, slice_bytes=1024, max_private_tokens=private, dispatch_dtype=dispatch_dtype
    )
    for it in range(2):
        inp = make_inputs(800 + it, w.cfg, size, tokens=[w.cfg.max_tokens] * size)
        w.fabric.hold(0)
        running = w.start(lambda r, inp=inp: r.round(inp))
        # Its routing rows and every dispatch slice: what it posts before it needs its peers' rows.
        dispatch = expected_writes(w, 0, inp.ids, 1024, combine=False)
        assert w.fabric.wait_held(0, -1, dispatch, 10.0), f"rank 0 posted {w.fabric.held(0)} of {dispatch}"
        for r in w.remote_peers(0):
            assert w.fabric.wait_blocked(r, 0, 10.0), f"rank {r} never waited for rank 0"
        landed = len(dispatch_slices_from(w, 0))
        w.fabric.release(0, -1, order, it)
        w.check(inp, running.join())
        mine = dispatch_slices_from(w, 0)[landed:]
        to_one = [k for dst, k in mine if dst == w.remote_peers(0)[0]]
        assert len(to_one) > 2 and to_one != sorted(to_one), (
            f"slices to one receiver landed in order: {to_one}"
        )


def over(w: World, seed: int) -> object:
    """Every token to experts 0..topk-1: rank 0 gets more copies than max_recv_tokens."""
    route = lambda g, t, e, k: torch.arange(k).repeat(t, 1)  # noqa: E731
    return make_inputs(seed, w.cfg, w.size, tokens=[w.cfg.max_tokens] * w.size, router=route)


@pytest.mark.parametrize("late", [None, 0, 1])
@pytest.mark.parametrize(("size", "rpn"), [(2, 1), (4, 2), (3, 3)])
def test_over_capacity_fails_on_every_rank_then_the_next_call_works(
    make_world, size: int, rpn: int, late: int | None
) -> None:
    """Rows past max_private_tokens and over max_recv_tokens: a CapacityError naming it on every
    rank (also with a late peer, whose private writes still land), cached too; the next call is exact."""
    w = make_world(size, ranks_per_node=rpn, max_recv_tokens=4, max_private_tokens=1)
    big = over(w, 77)
    small = make_inputs(78, w.cfg, size, tokens=[1] + [0] * (size - 1))
    w.check(small, w.run(lambda r: r.round(small)))
    matrix = w.matrix(big.ids)  # the big call's, as a cached call brings it

    def overflows(r: Rank, cached: bool) -> str:
        with pytest.raises(_core.CapacityError, match="max_recv_tokens=4") as info:
            r.dispatch(big.xs[r.rank], big.ids[r.rank], big.weights[r.rank], matrix if cached else None)
        return str(info.value)

    for cached in (False, True):
        if late is not None and late < size:
            w.fabric.hold(late)
        running = w.start(lambda r, cached=cached: overflows(r, cached))
        if late is not None and w.remote_peers(late):
            assert w.fabric.wait_blocked(w.remote_peers(late)[0], late, 10.0)
        if late is not None:
            w.fabric.release(late)
        for r, text in enumerate(running.join()):
            assert isinstance(text, str) and "more than max_recv_tokens=4" in text, f"rank {r}: {text!r}"
        w.check(small, w.run(lambda r: r.round(small)))
