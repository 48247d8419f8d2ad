"""Issue 17 across ranks: idle CPU, one engine per process, zero padding rows, failures on one rank.

Run like the other multi-rank tests (tests/conftest.py), with MOE_A2A_TEST_PROVIDER
tcp or shm; every rank runs the same tests in the same order.
"""

from __future__ import annotations

import os
import time

import pytest
import torch
from ranks import COMM, RANK, WORLD, device_pytestmark, layouts
from test_a2a import check_round, expert_fn, make_a2a, make_inputs, mine

from moe_a2a import fabric
from moe_a2a.all_to_all import FabricError, PeerFailedError
from moe_a2a.reference import combine_reference, dispatch_reference

pytestmark = device_pytestmark
IDLE_LIMIT = 0.05  # CPU-s per s of an idle rank (the bound)


def cpu_seconds() -> float:
    """utime + stime of this process, every thread included."""
    with open("/proc/self/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def shm_endpoint_files() -> list[str]:
    """libfabric shm endpoint files of this process (`<pid>:<n>:<m>`)."""
    return [n for n in os.listdir("/dev/shm") if n.startswith(f"{os.getpid()}:")]


def idle_rate(seconds: float = 1.5) -> float:
    """CPU-s/s of this process over the better of two windows.

    Best of two: a rank of the 2-core CI machine may be descheduled and then
    catch up on work that is not idling (the test's own bookkeeping).
    """
    rates = []
    for _ in range(2):
        t0, c0 = time.monotonic(), cpu_seconds()
        time.sleep(seconds)
        rates.append((cpu_seconds() - c0) / (time.monotonic() - t0))
    return min(rates)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("rpn", layouts())
def test_idle_rank_uses_little_cpu(rpn: int | None, seed: int) -> None:
    """An open instance with nothing in flight sleeps: < 0.05 CPU-s/s (shm spun a full core)."""
    a2a = make_a2a(rpn)
    try:
        check_round(a2a, make_inputs(seed, a2a.cfg))
        COMM.Barrier()
        time.sleep(0.3)  # past the waits' short-sleep phase
        rate = idle_rate()
        assert rate < IDLE_LIMIT, f"idle rank {RANK} used {rate:.3f} CPU-s/s; expected < {IDLE_LIMIT}"
        # Still working after the idle spell.
        check_round(a2a, make_inputs(seed + 1, a2a.cfg))
    finally:
        COMM.Barrier()
        a2a.close()


@pytest.mark.mpi(min_size=1)
@pytest.mark.timeout(240)
def test_many_idle_instances_use_little_cpu(seed: int) -> None:
    """32 open instances (a layer each) idle under the same bound as one: their proxies block.

    Before, each proxy woke every 1 ms: 32 of them cost 0.05-0.09 CPU-s/s per rank.
    """
    rpn = layouts()[min(1, len(layouts()) - 1)]  # over the fabric where there are peers
    made = [make_a2a(rpn) for _ in range(32)]
    try:
        for i, a2a in enumerate(made):
            check_round(a2a, make_inputs(seed + i, a2a.cfg))
        COMM.Barrier()
        time.sleep(0.3)
        rate = idle_rate()
        assert rate < IDLE_LIMIT, f"rank {RANK} with 32 idle instances used {rate:.3f} CPU-s/s"
        check_round(made[-1], make_inputs(seed + 99, made[-1].cfg))
    finally:
        COMM.Barrier()
        for a2a in made:
            a2a.close()


@pytest.mark.mpi(min_size=1)
def test_one_node_opens_no_endpoint(seed: int) -> None:
    """Every peer on this node: no engine, so no shm endpoint file that a killed rank could leak."""
    before = set(shm_endpoint_files())  # engines that earlier tests keep (tests/mpi/test_fabric*.py)
    a2a = make_a2a(None)
    try:
        engine = a2a._setup.engine if a2a._setup is not None else "closed"
        opened = set(shm_endpoint_files()) - before
        check_round(a2a, make_inputs(seed, a2a.cfg))
    finally:
        a2a.close()
    # Checked after the collective close, so a failing rank leaves none waiting.
    assert engine is None and opened == set(), f"engine {engine!r}, new endpoint files {opened}"


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(240)
def test_instances_share_one_engine(seed: int) -> None:
    """Instances over the fabric lease one engine; their traffic stays apart, even overlapped."""
    first = make_a2a(1)
    fds, threads = _fds(), _threads()
    more = [make_a2a(1) for _ in range(3)]
    every = [first, *more]
    shared = first._lease._shared
    others = shared.slots - {a._lease.slot for a in every}  # instances earlier tests left open
    try:
        engines = {id(a._setup.engine) for a in every}
        assert len(engines) == 1, "each instance opened its own engine"
        assert len({a._lease.slot for a in every}) == len(every)
        # An engine was 10 fds and 2 threads on tcp; a shared one adds a proxy thread
        # per instance and, on shm, the fds of its workspace mappings at most.
        assert _fds() - fds <= 2 * len(more), f"fds grew from {fds} to {_fds()}"
        assert _threads() - threads <= len(more), f"threads grew from {threads} to {_threads()}"
        # Overlapped halves: a dispatch of each instance in flight at once, then the
        # other order, so each instance's arrivals must be counted apart.
        inputs = [make_inputs(seed + i, a.cfg) for i, a in enumerate(every)]
        pending = [a.dispatch(*mine(inp), recv=False) for a, inp in zip(every, inputs, strict=True)]
        for a, inp, p in reversed(list(zip(every, inputs, pending, strict=True))):
            d = a.dispatch(handle=p, send=False)
            ours = dispatch_reference(inp.xs, inp.ids, a.cfg.num_experts, a.cfg.dispatch_dtype, 1)[RANK]
            assert torch.equal(d.tokens_per_expert.cpu(), ours.tokens_per_expert)
            assert torch.equal(d.expert_x.cpu().view(torch.uint8), ours.expert_x.view(torch.uint8))
            a.combine(d.expert_x.to(torch.bfloat16), d)
        for i, a in enumerate(every):
            check_round(a, make_inputs(seed + 10 + i, a.cfg), split=True)
        # Closing one leaves the others working; its slot is free for the next, which
        # takes the lowest free one: the closed slot, or a lower one that a failed
        # instance of an earlier test had retired and whose retirement ran out meanwhile.
        COMM.Barrier()
        closed_slot = more[0]._lease.slot
        more[0].close()
        assert closed_slot not in shared.busy()
        again = make_a2a(1)
        every[1] = again
        assert again._lease.slot <= closed_slot and id(again._setup.engine) in engines
        assert again._lease.slot not in {a._lease.slot for a in every if a is not again}
        for i, a in enumerate(every):
            check_round(a, make_inputs(seed + 20 + i, a.cfg))
    finally:
        COMM.Barrier()
        for a in every:
            a.close()
    assert shared.slots == others, f"slots {shared.slots} still leased; expected {others}"
    if not others and not shared.retired:  # failed instances of earlier tests keep theirs a while
        assert shared not in fabric._shared.values(), "the engine did not close with its last instance"


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("rpn", layouts())
@pytest.mark.parametrize("dispatch_dtype", ["bf16", "fp8"])
def test_padding_rows_are_zero(rpn: int | None, dispatch_dtype: str, seed: int) -> None:
    """Rows between an expert's tokens and its padded end are zeros, also expert_x_scale's."""
    a2a = make_a2a(rpn, dispatch_dtype=dispatch_dtype, expert_padding=8)
    try:
        padding_rows = 0
        for r in range(4):
            # Freed memory full of NaN, so an output left unwritten shows it.
            junk = torch.full((4096, a2a.cfg.hidden), float("nan"))
            del junk
            inp = make_inputs(seed + r, a2a.cfg)
            check_round(a2a, inp)
            d = a2a.dispatch(*mine(inp))
            ref = dispatch_reference(inp.xs, inp.ids, a2a.cfg.num_experts, dispatch_dtype, 8)[RANK]
            pad = ref.origin[:, 0] < 0
            padding_rows += int(pad.sum())
            rows = d.expert_x.cpu()[pad]
            assert torch.equal(rows.view(torch.uint8), torch.zeros_like(rows.view(torch.uint8))), (
                f"round {r}: padding rows of expert_x are not zero"
            )
            if dispatch_dtype == "fp8":
                scale = d.expert_x_scale.cpu()[pad]
                assert torch.equal(scale, torch.zeros_like(scale)), f"round {r}: expert_x_scale padding"
            a2a.combine(expert_fn(d.expert_x, d.expert_x_scale), d)
        assert padding_rows > 0, "the inputs produced no padding rows to check"
    finally:
        a2a.close()


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(240)
def test_reopening_after_failures_leaves_the_shared_engine_working(seed: int) -> None:
    """Every rank fails `a` at once (each announces it to the others), reopens it, and runs a round.

    A failed instance closes without waiting for its peers, whose writes (their
    announcements here) may still be on the way. Before, its region was
    deregistered at once: over tcp the connection between the ranks broke within
    five cycles in every run (broken pipe, then the timeout), for `b` on the same
    engine too. Now the region, its memory and its tag slot are retired for a while.
    """
    a, b = make_a2a(1, timeout_s=30.0), make_a2a(1, timeout_s=30.0)
    try:
        for cycle in range(5):
            x, ids, w = mine(make_inputs(seed + cycle, a.cfg))
            pending = a.dispatch(x, ids, w, recv=False)
            a.dispatch(handle=pending, send=False)
            with pytest.raises(RuntimeError, match="is not the dispatch in flight"):
                a.dispatch(handle=pending, send=False)  # fails a on every rank, its combine pending
            a = a.reopen()
            check_round(a, make_inputs(seed + 10 + cycle, a.cfg))
            check_round(b, make_inputs(seed + 20 + cycle, b.cfg))
    finally:
        a.close()
        b.close()


@pytest.mark.mpi(min_size=1)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("rpn", layouts()[:2])
def test_a_handle_of_another_instance_or_call_is_refused(rpn: int | None, seed: int) -> None:
    """Issue 17, item 1: layers in lockstep have equal epochs; another layer's handle corrupted the heap.

    Each handle names the instance that made it and its call; both are checked
    before any buffer is touched. Every rank passes the same wrong handle here,
    so every rank raises it (a wrong handle on one rank stops the others, as any
    failed call does).
    """
    a, b = make_a2a(rpn, timeout_s=30.0), make_a2a(rpn, timeout_s=30.0)
    try:
        inp = make_inputs(seed, a.cfg)
        x, ids, w = mine(inp)
        pa, pb = a.dispatch(x, ids, w, recv=False), b.dispatch(x, ids, w, recv=False)
        assert pa.epoch == pb.epoch
        COMM.Barrier()  # a's failure on a fast rank must not reach a slow one before its send
        with pytest.raises(
            RuntimeError, match=r"dispatch: the handle belongs to AllToAll #\d+, not to this one"
        ):
            a.dispatch(handle=pb, send=False)
        # b never saw the mistake: its call completes; a is stopped on every rank.
        db = b.dispatch(handle=pb, send=False)
        ref = dispatch_reference(inp.xs, inp.ids, b.cfg.num_experts, b.cfg.dispatch_dtype, 1)[RANK]
        assert torch.equal(db.tokens_per_expert.cpu(), ref.tokens_per_expert)
        b.combine(expert_fn(db.expert_x, db.expert_x_scale), db)
        with pytest.raises(RuntimeError, match="unusable after an earlier failure.*reopen"):
            a.dispatch(handle=pa, send=False)
        a = a.reopen()
        # Another instance's Dispatched, and a stale one of our own, in combine.
        a.dispatch(x, ids, w)  # a's combine is next: with b's Dispatched, refused
        db = b.dispatch(x, ids, w)
        with pytest.raises(
            RuntimeError, match=r"combine: d \(epoch \d+\) is not the latest dispatch of this AllToAll"
        ):
            a.combine(expert_fn(db.expert_x, db.expert_x_scale), db)
        b.combine(expert_fn(db.expert_x, db.expert_x_scale), db)
        a = a.reopen()
        old = a.dispatch(x, ids, w)
        a.combine(expert_fn(old.expert_x, old.expert_x_scale), old)
        pending = a.dispatch(x, ids, w, recv=False)
        a.dispatch(handle=pending, send=False)
        with pytest.raises(RuntimeError, match=r"dispatch: handle of epoch 2 is not the dispatch in flight"):
            a.dispatch(handle=pending, send=False)  # the same handle twice
        a = a.reopen()
        check_round(a, make_inputs(seed + 1, a.cfg))
        check_round(b, make_inputs(seed + 2, b.cfg))
    finally:
        a.close()
        b.close()


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("rpn", layouts()[:2])
def test_bad_input_on_one_rank_stops_every_rank(rpn: int | None, seed: int) -> None:
    """Issue 17, item 4: rank 0 gets a bad input, the others a good one: no rank pairs with a wrong call."""
    a2a = make_a2a(rpn, timeout_s=30.0)
    inp = make_inputs(seed, a2a.cfg)
    x, ids, w = mine(inp)
    started = time.monotonic()
    if RANK == 0:
        with pytest.raises(ValueError, match="topk_weights"):
            a2a.dispatch(x, ids, w[:, :1])
    else:
        # Before: this call paired with rank 0's next one and "succeeded" with its tokens.
        with pytest.raises(
            PeerFailedError, match="peer 0 failed .*call 1 \\(dispatch.*ValueError.*topk_weights"
        ):
            a2a.dispatch(x, ids, w)
        took = time.monotonic() - started
        assert took < 2.0, f"rank {RANK} noticed rank 0's failure after {took:.1f} s (timeout_s=30)"
    with pytest.raises(RuntimeError, match="unusable after an earlier failure.*reopen"):
        a2a.dispatch(x, ids, w)
    a2a = a2a.reopen()
    check_round(a2a, make_inputs(seed + 1, a2a.cfg))
    a2a.close()


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("rpn", layouts()[:2])
def test_after_a_timeout_no_call_pairs_with_a_stale_one(rpn: int | None, seed: int) -> None:
    """A rank that timed out stops its peers at their next call; the reopened instance pairs cleanly."""
    late = WORLD - 1
    a2a = make_a2a(rpn, timeout_s=1.0)
    inp = make_inputs(seed, a2a.cfg)
    if RANK != late:
        # A timeout naming the late rank, or another rank's announcement of one.
        with pytest.raises((FabricError, PeerFailedError), match=f"timed out.*peer {late}"):
            a2a.dispatch(*mine(inp))
    COMM.Barrier()  # the late rank calls only after the others timed out
    if RANK == late:
        # Its dispatch may still complete with what the others sent before they
        # failed (the same call, so the right tokens); the round cannot.
        started = time.monotonic()
        with pytest.raises(PeerFailedError, match=r"failed on rank \d+: Fabric\w*Error: .*timed out"):
            d = a2a.dispatch(*mine(inp))
            a2a.combine(expert_fn(d.expert_x, d.expert_x_scale), d)
        assert time.monotonic() - started < 0.9, "the late rank waited instead of stopping at once"
    a2a = a2a.reopen()
    # The stale routing rows and writes of the failed calls must not pair with these.
    for r in range(3):
        check_round(a2a, make_inputs(seed + 1 + r, a2a.cfg))
    a2a.close()


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("rpn", layouts()[:2])
def test_a_failure_after_a_call_does_not_fail_that_call_elsewhere(rpn: int | None, seed: int) -> None:
    """Rank 0 completes a round, then fails its next call; the others, still in that round, complete it.

    Ranks agree on which calls succeeded: before, a peer still waiting in the round's
    combine saw rank 0's abort record and failed a call that rank 0 had completed.
    """
    a2a = make_a2a(rpn, timeout_s=30.0)
    inp = make_inputs(seed, a2a.cfg)
    x, ids, w = mine(inp)
    d = a2a.dispatch(x, ids, w)
    y = expert_fn(d.expert_x, d.expert_x_scale)
    if RANK == 0:
        a2a.combine(y, d)
        with pytest.raises(ValueError, match="topk_weights"):
            a2a.dispatch(x, ids, w[:, :1])  # announced to the others before it raises
        COMM.Barrier()
    else:
        pending = a2a.combine(y, d, recv=False)
        # Rank 0 has its rows and has sent word that its next call failed: whether that lands
        # before or during this receive, this call must complete (in one process the order is
        # fixed: tests/protocol/test_failures.py).
        COMM.Barrier()
        out = a2a.combine(handle=pending, send=False)  # before: PeerFailedError
        cfg = a2a.cfg
        ref = dispatch_reference(inp.xs, inp.ids, cfg.num_experts, cfg.dispatch_dtype, cfg.expert_padding)
        ys = [expert_fn(r.expert_x, r.expert_x_scale) for r in ref]
        expected = combine_reference(
            ys, ref, inp.weights, cfg.combine_dtype, cfg.fabric_rows, a2a._boot.topology.local_size
        )[RANK]
        torch.testing.assert_close(out.cpu().float(), expected.float(), rtol=1.6e-2, atol=1e-2)
        with pytest.raises(PeerFailedError, match="peer 0 failed .*call 3 \\(dispatch"):
            a2a.dispatch(x, ids, w)
    COMM.Barrier()
    a2a = a2a.reopen()
    check_round(a2a, make_inputs(seed + 1, a2a.cfg))
    a2a.close()


@pytest.mark.mpi(min_size=2)
def test_leaving_the_with_block_on_an_exception_does_not_wait_for_peers() -> None:
    """Rank 0 leaves `with AllToAll(...)` on an error of its own while the others wait in a call
    for it: it closes without the barrier and its error surfaces at once, not after their
    timeout; the others fail within theirs, naming rank 0."""
    timeout_s = 3.0
    left_after = 0.0
    if RANK == 0:
        started = time.monotonic()
        with pytest.raises(RuntimeError, match="the caller's own error"), make_a2a(1, timeout_s=timeout_s):
            started = time.monotonic()
            raise RuntimeError("the caller's own error")
        left_after = time.monotonic() - started
    else:
        a2a = make_a2a(1, timeout_s=timeout_s)
        inp = make_inputs(6, a2a.cfg, tokens=[4] * WORLD)
        with pytest.raises((FabricError, PeerFailedError), match="peer 0"):
            a2a.dispatch(*mine(inp))
        a2a.close(wait_for_peers=False)
    left_after = COMM.bcast(left_after, root=0)  # every rank checks it: none passes alone
    assert left_after < timeout_s / 2, f"rank 0 left the with block {left_after:.2f} s after its error"
