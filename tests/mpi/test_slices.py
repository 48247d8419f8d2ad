"""Slices: a peer's rows cross the fabric in several writes (MOE_A2A_SLICE_BYTES), results stay exact.

With a slice size of a few rows every peer's rows are cut into many writes,
each with its own tag, which the receiver counts and copies out apart. Here
every result must equal the reference (private part only, overflow only,
both; split halves; a late peer), and each rank must post exactly the writes
the slicing rule says (src/a2a/slices.h, restated below), no more and no
fewer. Run under mpirun at 2, 4 and 8 ranks, tcp and shm, cpu and cuda.

On the CPU every case but the first slicing also runs in one process, with the
slices landing reversed and shuffled (tests/protocol/test_slices_and_capacity.py):
here it keeps one slicing over each real provider and the ranks' agreement.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from ranks import COMM, DEVICE, RANK, WORLD, device_pytestmark
from test_a2a import EXPERTS_PER_RANK, check_round, make_a2a, make_inputs

from moe_a2a.all_to_all import AllToAll

pytestmark = [device_pytestmark, pytest.mark.skipif(WORLD < 2, reason="slices need a remote peer")]
MAX_SLICES = 16  # per part (slices.h)
IN_PROCESS = "on the CPU this case runs in one process: tests/protocol/test_slices_and_capacity.py"
CUTS = [("bf16", None, 1), ("bf16", 0, 3), ("fp8", 2, 2), ("bf16", 5, 0)]  # 0: one write a part


def slices(rows: int, row_bytes: int, slice_bytes: int) -> int:
    """Writes of one part: about slice_bytes each, at most MAX_SLICES, equal rows but the last."""
    if rows == 0:
        return 0
    k = 1 if slice_bytes == 0 else min(max(math.ceil(rows * row_bytes / slice_bytes), 1), MAX_SLICES)
    per = math.ceil(rows / k)
    return math.ceil(rows / per)


@contextmanager
def sliced(rpn: int, slice_bytes: int, **overrides: object) -> Iterator[AllToAll]:
    """An instance built with MOE_A2A_SLICE_BYTES=slice_bytes on every rank."""
    name = "MOE_A2A_SLICE_BYTES"
    old = os.environ.get(name)
    os.environ[name] = str(slice_bytes)
    try:
        a2a = make_a2a(rpn, **overrides)
    finally:
        if old is None:
            os.environ.pop(name)
        else:
            os.environ[name] = old
    with a2a:
        yield a2a


def expected_writes(a2a: AllToAll, ids: list, slice_bytes: int) -> int:
    """Writes this rank posts in one uncached call within capacity: a routing row, then each
    remote peer's dispatch slices (private part, overflow), then its combine slices (one, empty,
    where it sent us nothing)."""
    core = a2a._core_cfg
    P = a2a.max_private_tokens
    n = 0

    def wire_rows(s: int, r: int) -> int:  # docs/protocol.md, "Rows per destination rank" and "node"
        owner = torch.as_tensor(ids[s]) // EXPERTS_PER_RANK
        if a2a.cfg.fabric_rows == "node":  # to s's forwarder on r's node: a row per token with a k there
            rpn = core.ranks_per_node
            return int((owner // rpn == r // rpn).any(dim=1).sum()) if r % rpn == s % rpn else 0
        on_r = owner == r
        return int(on_r.any(dim=1).sum() if a2a.cfg.fabric_rows == "rank" else on_r.sum())

    for r in range(WORLD):
        if r // a2a._boot.topology.local_size == RANK // a2a._boot.topology.local_size:
            continue  # same node: no fabric write
        to, back = wire_rows(RANK, r), wire_rows(r, RANK)
        n += 1  # routing row
        n += slices(min(to, P), core.dispatch_row_bytes, slice_bytes)
        n += slices(max(to - P, 0), core.dispatch_row_bytes, slice_bytes)
        n += max(slices(back, core.combine_row_bytes, slice_bytes), 1)
    return n


def layouts() -> list[int]:
    """Every rank its own node; with 4+ ranks also nodes of two."""
    return [1, 2] if WORLD >= 4 and WORLD % 2 == 0 else [1]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("rpn", layouts())
@pytest.mark.parametrize(
    ("dispatch_dtype", "private", "rows_per_slice"), CUTS if DEVICE == "cuda" else CUTS[:1]
)  # on the CPU the other cuts run in one process
def test_sliced_rows_are_exact_and_cut_as_the_rule_says(
    rpn: int, dispatch_dtype: str, private: int | None, rows_per_slice: int
) -> None:
    overrides: dict[str, object] = {"dispatch_dtype": dispatch_dtype}
    if private is not None:
        overrides["max_private_tokens"] = private
    probe = make_a2a(rpn, **overrides)  # only for the row size the slice size is given in
    row = probe._core_cfg.dispatch_row_bytes
    probe.close()
    slice_bytes = rows_per_slice * row
    failures = []
    with sliced(rpn, slice_bytes, **overrides) as a2a:
        cfg = a2a.cfg
        engine = a2a._lease.engine.core
        for it in range(3):
            inp = make_inputs(700 + it, cfg, tokens=[cfg.max_tokens] * WORLD)
            before = engine.tx_submitted
            check_round(a2a, inp, split=it == 1)
            got, want = engine.tx_submitted - before, expected_writes(a2a, inp.ids, slice_bytes)
            if got != want:
                failures.append(f"call {it}: {got} writes posted, {want} expected")
    assert not failures, f"rank {RANK}: " + "; ".join(failures)


@pytest.mark.mpi(min_size=2)
@pytest.mark.skipif(DEVICE == "cpu", reason=IN_PROCESS)
def test_sliced_rows_with_a_late_peer_are_exact() -> None:
    """Rank 0's writes are held back: every receiver copies its slices last, and the results are exact."""
    name = "MOE_A2A_TEST_DELAY_WRITES_MS"
    if RANK == 0:
        os.environ[name] = "500"
    try:
        with sliced(1, 1024, max_private_tokens=4) as a2a:
            os.environ.pop(name, None)
            for it in range(2):
                inp = make_inputs(800 + it, a2a.cfg, tokens=[a2a.cfg.max_tokens] * WORLD)
                COMM.Barrier()
                check_round(a2a, inp, split=it == 0)
    finally:
        os.environ.pop(name, None)


@pytest.mark.mpi(min_size=2)
def test_ranks_with_different_slice_sizes_fail_together() -> None:
    """The slice size is part of the protocol: ranks that differ get one error, on every rank."""
    mine = 4096 if RANK == 0 else 8192
    with pytest.raises(ValueError, match="slice_bytes: 4096 on rank 0"), sliced(1, mine):
        pass
