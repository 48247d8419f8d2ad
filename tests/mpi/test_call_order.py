"""Call stamps (issue 17): ranks whose call sequences differ fail at once, on every rank.

A rank that runs a call cached while its peers run it uncached (a backward one
rank skipped, or ran once more) used to be found only at the timeout. Run like
the other multi-rank tests (tests/conftest.py), tcp or shm, any world size >= 2.

Every case here also runs in one process, deterministically, on the in-memory
fabric (tests/protocol/test_call_order.py). On the CPU this file keeps what
only real processes show: the front end's refused next call and reopen() after
a mismatch, over a real provider; on CUDA it runs whole, as the CUDA backend's
own test of these cases.
"""

from __future__ import annotations

import random
import re
import time
from collections.abc import Callable

import pytest
import torch
from ranks import COMM, DEVICE, RANK, WORLD, device_pytestmark, layouts
from test_a2a import Inputs, check_round, expert_fn, make_a2a, make_inputs, mine

from moe_a2a import FabricError, PeerFailedError
from moe_a2a.all_to_all import AllToAll, CapacityError, Dispatched, Routing
from moe_a2a.backends.common import RecvRequest

pytestmark = device_pytestmark
ODD = 0  # the rank whose sequence differs
TIMEOUT_S = 30.0
NOTICE_S = 2.0  # every rank fails within this, far below TIMEOUT_S


def one_round(a2a: AllToAll, inp: Inputs, routing: Routing | None = None) -> Dispatched:
    """Dispatch (along `routing` when given, keeping the routing otherwise) and combine."""
    x, ids, w = mine(inp)
    if routing is not None:
        d = a2a.dispatch(x, routing=routing)
    else:
        d = a2a.dispatch(x, ids, w, keep_routing=True)
    a2a.combine(expert_fn(d.expert_x, d.expert_x_scale), d)
    return d


def full(seed: int, a2a: AllToAll) -> Inputs:
    """Every rank at max_tokens: each sends each peer more than one private row (two writes)."""
    return make_inputs(seed, a2a.cfg, tokens=[a2a.cfg.max_tokens] * WORLD)


def stops_at_once_then_reopens(
    a2a: AllToAll,
    info: pytest.ExceptionInfo,
    started: float,
    words: list[str],
    seed: int,
    limit: float = NOTICE_S,
) -> None:
    """The error names `words` within `limit` s of `started`; after reopen() a round matches the reference."""
    took = time.monotonic() - started
    text = str(info.value)
    for w in words:
        assert w in text, text
    assert took < limit, f"rank {RANK} failed after {took:.1f} s (timeout_s={TIMEOUT_S}): {text}"
    a2a = a2a.reopen()
    check_round(a2a, make_inputs(seed + 1, a2a.cfg))
    a2a.close()


# Each pattern runs the calls before the mismatch, then the mismatched one.
def odd_runs_it_cached(a2a: AllToAll, seed: int) -> None:
    """The odd rank runs call 2 along call 1's routing (a backward the others skipped)."""
    first = full(seed, a2a)
    r1 = one_round(a2a, first).routing
    COMM.Barrier()
    if RANK == ODD:
        one_round(a2a, first, routing=r1)
    else:
        one_round(a2a, full(seed + 1, a2a))


def odd_runs_it_uncached(a2a: AllToAll, seed: int) -> None:
    """The odd rank skips the backward (call 2 along call 1's routing) that the others run."""
    first = full(seed, a2a)
    r1 = one_round(a2a, first).routing
    COMM.Barrier()
    if RANK == ODD:
        one_round(a2a, full(seed + 1, a2a))
    else:
        one_round(a2a, first, routing=r1)


def odd_runs_a_second_backward(a2a: AllToAll, seed: int) -> None:
    """Every rank runs call 2 cached; the odd rank runs call 3 cached too, the others their next forward."""
    first = full(seed, a2a)
    r1 = one_round(a2a, first).routing
    one_round(a2a, first, routing=r1)
    COMM.Barrier()
    if RANK == ODD:
        one_round(a2a, first, routing=r1)
    else:
        one_round(a2a, full(seed + 2, a2a))


PATTERNS = [odd_runs_it_cached, odd_runs_it_uncached, odd_runs_a_second_backward]
IN_PROCESS = "on the CPU this case runs in one process: tests/protocol/test_call_order.py"
cuda_only = pytest.mark.skipif(DEVICE == "cpu", reason=IN_PROCESS)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(150)
@pytest.mark.parametrize("rpn", layouts())
@pytest.mark.parametrize(
    "pattern", PATTERNS if DEVICE == "cuda" else PATTERNS[:1], ids=lambda p: p.__name__
)  # on the CPU the other patterns run in one process (tests/protocol/test_call_order.py)
def test_different_call_sequences_fail_at_once(
    rpn: int | None, pattern: Callable[[AllToAll, int], None], seed: int
) -> None:
    """Every rank errors within NOTICE_S naming the mismatched call; the next call refuses; reopen() works."""
    a2a = make_a2a(rpn, timeout_s=TIMEOUT_S, max_private_tokens=1)
    started = time.monotonic()
    with pytest.raises((FabricError, PeerFailedError)) as info:
        pattern(a2a, seed)
    took = time.monotonic() - started
    text = str(info.value)
    # The rank that noticed names its own call and the peer's; the others carry its words.
    assert "call sequences differ" in text, text
    noticed = r"rank \d+ is in the (dispatch|combine) of epoch \d+ \((un)?cached\); peer \d+ "
    assert re.search(noticed, text), text
    epoch = 3 if pattern is odd_runs_a_second_backward else 2
    assert f"of epoch {epoch} (" in text, text
    assert took < NOTICE_S, f"rank {RANK} failed after {took:.1f} s (timeout_s={TIMEOUT_S}): {text}"
    with pytest.raises(RuntimeError, match="unusable after an earlier failure.*reopen"):
        one_round(a2a, full(seed + 5, a2a))
    a2a = a2a.reopen()
    check_round(a2a, make_inputs(seed + 6, a2a.cfg))
    check_round(a2a, make_inputs(seed + 7, a2a.cfg))
    a2a.close()


def rotated_within_owner(inp: Inputs, num_experts: int) -> Inputs:
    """The same tokens to the next expert of the same rank: equal per-peer counts, another matrix."""
    per = num_experts // WORLD
    ids = [(i // per) * per + (i % per + 1) % per for i in inp.ids]
    return Inputs(inp.xs, ids, inp.weights)


@cuda_only
@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(150)
@pytest.mark.parametrize("rpn", layouts())
def test_cached_calls_along_different_routings_fail_at_once(rpn: int | None, seed: int) -> None:
    """The odd rank runs a cached call along another call's routing with the same per-peer counts.

    No count can tell (each peer gets as many rows as it expects): before, the rows
    were placed by the wrong matrix without an error. Every peer compares the hash of
    the sender's routing with its own (protocol.md, Call order).
    """
    a2a = make_a2a(rpn, timeout_s=TIMEOUT_S)
    first = full(seed, a2a)
    second = rotated_within_owner(first, a2a.cfg.num_experts)
    r1 = one_round(a2a, first).routing
    r2 = one_round(a2a, second).routing
    assert r1 is not None and r2 is not None
    assert not torch.equal(r1.matrix, r2.matrix), "the two routings should differ"
    COMM.Barrier()
    started = time.monotonic()
    with pytest.raises((FabricError, PeerFailedError)) as info:
        one_round(a2a, first, routing=r2 if RANK == ODD else r1)
    stops_at_once_then_reopens(
        a2a, info, started, ["runs the cached dispatch of epoch 3 along routing"], seed
    )


def avoiding_the_odd_rank(g: torch.Generator, tokens: int, experts: int, topk: int) -> torch.Tensor:
    """Distinct experts per token, none of them the odd rank's: it receives nothing."""
    per = experts // WORLD
    others = torch.tensor([e for e in range(experts) if e // per != ODD])
    if tokens == 0:
        return torch.empty(0, topk, dtype=torch.int64)
    return torch.stack([others[torch.randperm(len(others), generator=g)[:topk]] for _ in range(tokens)])


LATE_S = 0.5  # how much later than the odd rank the others start the mismatched call


@cuda_only
@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(150)
@pytest.mark.parametrize("rpn", layouts())
def test_a_cached_rank_that_needs_nothing_stops_a_late_uncached_peer(rpn: int | None, seed: int) -> None:
    """The odd rank runs call 2 cached, receiving nothing; the others run it uncached, later.

    It finishes its dispatch and posts its combine before their routing rows land,
    so their rows look like the next call's to it, and its combine like this
    call's to them. Its routing stamp, sent first in every cached call, is what
    they see (protocol.md, Call order); before, every rank waited for the timeout.
    """
    a2a = make_a2a(rpn, timeout_s=TIMEOUT_S, topk=2)  # within the others' experts at 2 ranks
    first = make_inputs(seed, a2a.cfg, router=avoiding_the_odd_rank, tokens=[a2a.cfg.max_tokens] * WORLD)
    r1 = one_round(a2a, first).routing
    COMM.Barrier()
    started = time.monotonic()
    with pytest.raises((FabricError, PeerFailedError)) as info:
        if RANK == ODD:
            one_round(a2a, first, routing=r1)
        else:
            time.sleep(LATE_S)
            one_round(a2a, first)
    words = ["call sequences differ", "of epoch 2 ("]
    stops_at_once_then_reopens(a2a, info, started, words, seed, limit=LATE_S + NOTICE_S)


@cuda_only
@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(150)
@pytest.mark.parametrize("rpn", layouts())
def test_a_rank_that_skips_its_combine_stops_everyone_at_once(rpn: int | None, seed: int) -> None:
    """The odd rank dispatches again without its combine (below the front end, which refuses it).

    Its own proxy, still waiting for that combine's rows, sees the next call
    start; its same-node peers see its flags of epoch 2 without its combine of
    epoch 1. Either announcement stops the rest (remote peers alone could not
    tell: it sends them nothing of epoch 2 before its combine of epoch 1).
    """
    a2a = make_a2a(rpn, timeout_s=TIMEOUT_S)
    inp = full(seed, a2a)
    x, ids, w = mine(inp)
    d = a2a.dispatch(x, ids, w)
    COMM.Barrier()
    started = time.monotonic()
    if RANK == ODD:
        with pytest.raises((FabricError, PeerFailedError)) as info:
            try:
                a2a._backend.dispatch_send(x, None, ids.to(torch.int32), None)
                a2a._backend.dispatch_recv(RecvRequest(torch.bfloat16))
            except Exception as exc:
                a2a._fail("dispatch", exc)  # as the front end does with a failed call (check(), replays)
                raise
    else:
        with pytest.raises((FabricError, PeerFailedError)) as info:
            a2a.combine(expert_fn(d.expert_x, d.expert_x_scale), d)
    # Which check fires first is a race: a same-node peer whose proxy has not yet
    # seen its own combine begin reports the odd rank "already in epoch 2", once
    # it has, "started epoch 2 without combining epoch 1"; either may be announced.
    words = ["epoch 2", "the ranks' call sequences differ"]
    stops_at_once_then_reopens(a2a, info, started, words, seed)


def all_to_first_rank(g: torch.Generator, tokens: int, experts: int, topk: int) -> torch.Tensor:
    """Every token to experts 0..topk-1: rank 0 gets most copies (an over-capacity call)."""
    return torch.arange(topk).repeat(tokens, 1)


@cuda_only
@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(300)
@pytest.mark.parametrize("rpn", layouts())
def test_a_peer_one_call_ahead_never_trips_it(rpn: int | None, seed: int) -> None:
    """Same sequences, uneven pace: uncached, cached, split and over-capacity calls with random delays."""
    base = make_a2a(rpn)
    cfg = base.cfg
    full_copies = WORLD * cfg.max_tokens * min(cfg.topk, cfg.num_experts // WORLD)
    base.close()
    # Room for any random call, not for every token on rank 0's experts.
    a2a = make_a2a(rpn, timeout_s=TIMEOUT_S, max_private_tokens=2, max_recv_tokens=full_copies - 1)
    pace = random.Random(seed * 31 + RANK)  # each rank its own delays

    def pause() -> None:
        time.sleep(pace.choice([0.0, 0.0, 0.0, 0.0005, 0.002, 0.005]))

    rounds = 0
    for r in range(120):
        inp = make_inputs(seed + 100 + r, a2a.cfg)
        pause()
        if r % 11 == 10:  # over capacity on every rank alike: a barrier instead of a combine
            over = make_inputs(seed + r, a2a.cfg, router=all_to_first_rank, tokens=[cfg.max_tokens] * WORLD)
            with pytest.raises(CapacityError):
                a2a.dispatch(*mine(over))
            continue
        check_round(a2a, inp, split=r % 3 == 1)
        if r % 4 == 0:  # a cached call along the routing of a fresh one, as a backward runs it
            x, ids, w = mine(inp)
            d = a2a.dispatch(x, ids, w, keep_routing=True)
            pause()
            a2a.combine(expert_fn(d.expert_x, d.expert_x_scale), d)
            pause()
            again = a2a.dispatch(x * 2, routing=d.routing)
            assert torch.equal(again.tokens_per_expert, d.tokens_per_expert)
            pause()
            a2a.combine(expert_fn(again.expert_x, again.expert_x_scale), again)
        rounds += 1
    assert rounds > 100
    a2a.close()
