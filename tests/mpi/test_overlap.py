"""Peer-by-peer overlap on the fabric path: a late peer's rows are taken last, and results stay exact.

One rank (rank 0) is made late with MOE_A2A_TEST_DELAY_WRITES_MS: its proxy
holds each dispatch's token writes back, so its rows land after everyone
else's at every receiver (combines then come in varied orders too). The receive half copies each
sender's rows out as soon as they have landed, so on every other rank the
late sender must come last in `unpack_order()` (CPU), and every result must
still equal the reference (CPU and CUDA). Run under mpirun at 2, 4 and 8
ranks, tcp and shm.

On the CPU, late peers whose rows land in any order, over capacity too, run in
one process (tests/protocol/test_slices_and_capacity.py); here the CPU keeps one
case over each real provider, and CUDA runs them all.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from ranks import COMM, DEVICE, RANK, WORLD, device_pytestmark
from test_a2a import EXPERTS_PER_RANK, check_round, make_a2a, make_inputs, mine

from moe_a2a.all_to_all import AllToAll, CapacityError

pytestmark = [device_pytestmark, pytest.mark.skipif(WORLD < 2, reason="overlap needs a remote peer")]
# Rank 0: with everything copied at once it would come first (senders are
# taken in rank order), so only a receive that follows arrivals puts it last.
LATE = 0
DELAY_MS = 1500  # far above the time a call's rows take to land, even on a loaded machine


def remote_layouts() -> list[int]:
    """Every rank its own node; with 4+ ranks also nodes of two (same-node and fabric peers at once)."""
    return [1, 2] if WORLD >= 4 and WORLD % 2 == 0 else [1]


@contextmanager
def late_a2a(rpn: int, **overrides: object) -> Iterator[AllToAll]:
    """An instance whose rank LATE has a late proxy (the core reads the switch at construction)."""
    name = "MOE_A2A_TEST_DELAY_WRITES_MS"
    if RANK == LATE:
        os.environ[name] = str(DELAY_MS)
    try:
        a2a = make_a2a(rpn, **overrides)
    finally:
        os.environ.pop(name, None)
    with a2a:
        yield a2a


def late_sends_to_me(ids: list[torch.Tensor]) -> bool:
    return bool((ids[LATE] // EXPERTS_PER_RANK == RANK).any())


CASES = [("bf16", None), ("fp8", 0), ("bf16", 2)]  # 0: every row through the shared section; 2: both sections
IN_PROCESS = "on the CPU this case runs in one process: tests/protocol/test_slices_and_capacity.py"


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("rpn", remote_layouts())
@pytest.mark.parametrize(("dispatch_dtype", "private"), CASES if DEVICE == "cuda" else CASES[:1])
def test_late_peer_is_unpacked_last(rpn: int, dispatch_dtype: str, private: int | None) -> None:
    overrides: dict[str, object] = {"dispatch_dtype": dispatch_dtype}
    if private is not None:
        overrides["max_private_tokens"] = private
    wrong = []
    with late_a2a(rpn, **overrides) as a2a:
        cfg = a2a.cfg
        for it in range(2):
            inp = make_inputs(500 + it, cfg, tokens=[cfg.max_tokens] * WORLD)
            COMM.Barrier()  # everyone sends at once, so only the delay makes rank LATE late
            check_round(a2a, inp, split=it == 1)
            if DEVICE != "cpu":  # the order is the CPU backend's record; on CUDA the results are the test
                continue
            order = a2a._backend.unpack_order()
            remote_late = LATE // rpn != RANK // rpn
            if sorted(order) != list(range(WORLD)) or (
                RANK != LATE and remote_late and late_sends_to_me(inp.ids) and order[-1] != LATE
            ):
                wrong.append(order)
    # After the collective close, so that every rank gets here and all fail together.
    everyone = COMM.allgather(wrong)
    assert not any(everyone), f"late rank {LATE} not copied last; unpack orders by rank: {everyone}"


@pytest.mark.mpi(min_size=2)
@pytest.mark.skipif(DEVICE == "cpu", reason=IN_PROCESS)
def test_late_peer_over_capacity_then_next_call_works() -> None:
    """Private writes still go out peer by peer when a call overflows; the next call finds no stale rows."""
    with late_a2a(1, max_recv_tokens=4, max_private_tokens=1) as a2a:
        cfg = a2a.cfg
        big = make_inputs(77, cfg, tokens=[cfg.max_tokens] * WORLD)
        with pytest.raises(CapacityError, match="max_recv_tokens=4"):
            a2a.dispatch(*mine(big))
        check_round(a2a, make_inputs(78, cfg, tokens=[1] + [0] * (WORLD - 1)))
