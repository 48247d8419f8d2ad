"""Call stamps in one process: ranks whose call sequences differ fail at once, on every rank.

The in-process twin of tests/mpi/test_call_order.py (which keeps the front end's
part: the refused next call, reopen(), the real providers). Here a late peer is
one whose writes the fabric holds until the others are blocked on it, not one
that sleeps. Layouts: one node (no fabric), every rank its own node (fabric
only), nodes of two (both).
"""

from __future__ import annotations

import random
import re
import time
from collections.abc import Callable

import pytest
import torch
from world import Inputs, Rank, World, expert_fn, make_inputs

from moe_a2a import _core

ODD = 0  # the rank whose sequence differs
NOTICE_S = 2.0  # every rank fails within this, far below the timeout (30 s)
LAYOUTS = [(2, 2), (2, 1), (4, 2), (3, 1)]  # (world, ranks per node)
NOTICED = r"rank \d+ is in the (dispatch|combine) of epoch \d+ \((un)?cached\); peer \d+ "


def full(w: World, seed: int, **kwargs: object) -> Inputs:
    """Every rank at max_tokens: each sends each peer more than one private row (two writes)."""
    tokens = [w.cfg.max_tokens] * w.size
    return make_inputs(seed, w.cfg, w.size, tokens=tokens, **kwargs)  # type: ignore[arg-type]


def all_fail(results: list[object], started: float, words: list[str], limit: float = NOTICE_S) -> None:
    """Every rank raised a fabric error (its own or a peer's announcement) naming `words` within `limit` s."""
    took = time.monotonic() - started
    for r, got in enumerate(results):
        assert isinstance(got, (_core.FabricError, _core.PeerFailedError)), f"rank {r}: {got!r}"
        for word in words:
            assert word in str(got), f"rank {r}: {got}"
    assert took < limit, f"the ranks failed after {took:.1f} s; expected < {limit} s"


def layout_ids(layout: tuple[int, int]) -> str:
    return f"{layout[0]}ranks-rpn{layout[1]}"


# Each pattern: the calls before the mismatch (run by every rank alike), then the mismatched one.
def odd_runs_it_cached(w: World, seed: int) -> Callable[[Rank], object]:
    """The odd rank runs call 2 along call 1's routing (a backward the others skipped)."""
    first = full(w, seed)
    r1 = [d.routing for d, _ in w.run(lambda r: r.round(first))]
    second = full(w, seed + 1)
    return lambda r: r.round(first, r1[r.rank]) if r.rank == ODD else r.round(second)


def odd_runs_it_uncached(w: World, seed: int) -> Callable[[Rank], object]:
    """The odd rank skips the backward (call 2 along call 1's routing) that the others run."""
    first = full(w, seed)
    r1 = [d.routing for d, _ in w.run(lambda r: r.round(first))]
    second = full(w, seed + 1)
    return lambda r: r.round(second) if r.rank == ODD else r.round(first, r1[r.rank])


def odd_runs_a_second_backward(w: World, seed: int) -> Callable[[Rank], object]:
    """Every rank runs call 2 cached; the odd rank runs call 3 cached too, the others their next forward."""
    first = full(w, seed)
    r1 = [d.routing for d, _ in w.run(lambda r: r.round(first))]
    w.check(first, w.run(lambda r: r.round(first, r1[r.rank])))
    third = full(w, seed + 2)
    return lambda r: r.round(first, r1[r.rank]) if r.rank == ODD else r.round(third)


@pytest.mark.parametrize("layout", LAYOUTS, ids=layout_ids)
@pytest.mark.parametrize(
    "pattern",
    [odd_runs_it_cached, odd_runs_it_uncached, odd_runs_a_second_backward],
    ids=lambda p: p.__name__,
)
def test_different_call_sequences_fail_at_once(make_world, layout: tuple[int, int], pattern) -> None:
    w = make_world(layout[0], ranks_per_node=layout[1], max_private_tokens=1)
    mismatched = pattern(w, 10)
    started = time.monotonic()
    results = w.run(mismatched)
    epoch = 3 if pattern is odd_runs_a_second_backward else 2
    all_fail(results, started, ["call sequences differ", f"of epoch {epoch} ("])
    for r, got in enumerate(results):
        assert re.search(NOTICED, str(got)), f"rank {r}: {got}"


def rotated_within_owner(inp: Inputs, num_experts: int, world: int) -> Inputs:
    """The same tokens to the next expert of the same rank: equal per-peer counts, another matrix."""
    per = num_experts // world
    ids = [(i // per) * per + (i % per + 1) % per for i in inp.ids]
    return Inputs(inp.xs, ids, inp.weights)


@pytest.mark.parametrize("layout", LAYOUTS, ids=layout_ids)
def test_cached_calls_along_different_routings_fail_at_once(make_world, layout: tuple[int, int]) -> None:
    """The odd rank runs a cached call along another call's routing with the same per-peer counts:
    no count can tell, the hash of the sender's routing does (protocol.md, Call order)."""
    w = make_world(layout[0], ranks_per_node=layout[1])
    first = full(w, 20)
    second = rotated_within_owner(first, w.cfg.num_experts, w.size)
    r1 = [d.routing for d, _ in w.run(lambda r: r.round(first))]
    r2 = [d.routing for d, _ in w.run(lambda r: r.round(second))]
    assert not torch.equal(r1[0], r2[0]), "the two routings should differ"
    started = time.monotonic()
    results = w.run(lambda r: r.round(first, (r2 if r.rank == ODD else r1)[r.rank]))
    all_fail(results, started, ["runs the cached dispatch of epoch 3 along routing"])


def avoiding_the_odd_rank(size: int):
    def route(g: torch.Generator, tokens: int, experts: int, topk: int) -> torch.Tensor:
        """Distinct experts per token, none of them the odd rank's: it receives nothing."""
        per = experts // size
        others = torch.tensor([e for e in range(experts) if e // per != ODD])
        if tokens == 0:
            return torch.empty(0, topk, dtype=torch.int64)
        return torch.stack([others[torch.randperm(len(others), generator=g)[:topk]] for _ in range(tokens)])

    return route


@pytest.mark.parametrize("layout", [(2, 1), (4, 2), (3, 1)], ids=layout_ids)
def test_a_cached_rank_that_needs_nothing_stops_a_late_uncached_peer(make_world, layout: tuple[int, int]):
    """The odd rank runs call 2 cached, receiving nothing; the others run it uncached, late.

    Their writes are held until the odd rank is blocked waiting for them: it has
    finished its dispatch and posted what it can, so their rows look like the
    next call's to it, and its writes like this call's to them. Its routing
    stamp, sent first in every cached call, is what they see.
    """
    w = make_world(layout[0], ranks_per_node=layout[1], topk=2)
    first = full(w, 30, router=avoiding_the_odd_rank(w.size))
    r1 = [d.routing for d, _ in w.run(lambda r: r.round(first))]
    others = [r for r in range(w.size) if r != ODD]
    for o in others:
        w.fabric.hold(o)
    started = time.monotonic()
    running = w.start(lambda r: r.round(first, r1[r.rank] if r.rank == ODD else None))
    assert w.fabric.wait_blocked(ODD, -1, 10.0), "the odd rank never waited for its peers"
    for o in others:
        w.fabric.release(o)
    all_fail(running.join(), started, ["call sequences differ", "of epoch 2 ("], limit=10.0 + NOTICE_S)


@pytest.mark.parametrize("layout", LAYOUTS, ids=layout_ids)
def test_a_rank_that_skips_its_combine_stops_everyone_at_once(make_world, layout: tuple[int, int]) -> None:
    """The odd rank dispatches again without its combine (the front end refuses it; the core must too)."""
    w = make_world(layout[0], ranks_per_node=layout[1])
    inp = full(w, 40)
    dispatched = w.run(lambda r: r.dispatch(inp.xs[r.rank], inp.ids[r.rank], inp.weights[r.rank]))

    def second(r: Rank) -> object:
        if r.rank == ODD:
            return r.dispatch(inp.xs[r.rank], inp.ids[r.rank], inp.weights[r.rank])
        d = dispatched[r.rank]
        return r.combine(expert_fn(d.expert_x, d.expert_x_scale))

    started = time.monotonic()
    all_fail(w.run(second), started, ["epoch 2", "the ranks' call sequences differ"])


def all_to_first_rank(g: torch.Generator, tokens: int, experts: int, topk: int) -> torch.Tensor:
    """Every token to experts 0..topk-1: rank 0 gets most copies (an over-capacity call)."""
    return torch.arange(topk).repeat(tokens, 1)


@pytest.mark.parametrize("layout", [(2, 1), (4, 2), (3, 1)], ids=layout_ids)
def test_a_peer_one_call_ahead_never_trips_it(make_world, layout: tuple[int, int]) -> None:
    """Same sequences, uneven pace: uncached, cached, halves and over-capacity calls while the
    fabric holds a random rank's writes and releases them, shuffled, once a peer waits for them."""
    size, rpn = layout
    probe = make_world(size, ranks_per_node=rpn)
    full_copies = size * probe.cfg.max_tokens * min(probe.cfg.topk, probe.cfg.num_experts // size)
    w = make_world(size, ranks_per_node=rpn, max_private_tokens=2, max_recv_tokens=full_copies - 1)
    rounds = 40
    inputs = [make_inputs(100 + i, w.cfg, size) for i in range(rounds)]
    over = full(w, 99, router=all_to_first_rank)

    def sequence(r: Rank) -> int:
        done = 0
        for i, inp in enumerate(inputs):
            if i % 11 == 10:  # over capacity on every rank alike: a barrier instead of a combine
                with pytest.raises(_core.CapacityError):
                    r.dispatch(over.xs[r.rank], over.ids[r.rank], over.weights[r.rank])
                continue
            d, out = r.round(inp)
            w.check_rank(inp, r.rank, d, out)
            if i % 4 == 0:  # a cached call along the routing of a fresh one, as a backward runs it
                w.check_rank(inp, r.rank, *r.round(inp, d.routing))
            done += 1
        return done

    pace = random.Random(7)
    running = w.start(sequence)
    late_calls = 0
    while running.alive():
        late = pace.choice(range(size))
        w.fabric.hold(late)
        # Until a peer waits for its writes (or, briefly, while the peers wait elsewhere).
        late_calls += w.fabric.wait_blocked(pace.choice(w.remote_peers(late)), late, 0.05)
        w.fabric.release(late, -1, "shuffled", pace.randrange(1 << 30))
    assert late_calls > rounds // 4, f"a peer waited for a held rank only {late_calls} times"
    for r, got in enumerate(running.join()):
        assert got == rounds - rounds // 11, f"rank {r}: {got!r}"
