"""Start-up fails on every rank together: a local failure on one rank is an error everywhere.

Each rank's part of building an AllToAll (its arguments and switches, its NICs,
its memory, its backend) sits between collectives; a rank that only raised would
leave its peers waiting in the next one. Here the last rank fails at each step,
for real where it can (a NIC name, a mistyped switch) and by an injected error
where the failure needs a machine out of memory; every rank must raise, the
failing one its own error and the others `PeerFailedError` naming it, and a new
instance must then work (nothing half-built is left holding the engine).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from ranks import COMM, DEVICE, PROVIDER, RANK, WORLD, device_pytestmark
from test_a2a import check_round, make_inputs, make_params

from moe_a2a import AllToAll, Config, _core, fabric, memory_plan
from moe_a2a.all_to_all import PeerFailedError
from moe_a2a.nics import NicError

pytestmark = [device_pytestmark, pytest.mark.mpi(min_size=2), pytest.mark.timeout(120)]
LAST = WORLD - 1


def busy_slots() -> int:
    """Engine slots held by this process's open instances (not the retired ones, which an
    earlier test's failure left and which expire on their own)."""
    with fabric._shared_lock:
        return sum(len(shared.slots) for shared in fabric._shared.values())


def build(nics: str | None = None) -> AllToAll:
    """Every rank its own node: the fabric engine opens too."""
    return AllToAll(Config(**make_params()), device=DEVICE, provider=PROVIDER, ranks_per_node=1, nics=nics)  # type: ignore[arg-type]


def expect_every_rank_fails(step: str, own: type[Exception], own_match: str, nics: str | None = None) -> None:
    """Build an AllToAll; the last rank must raise `own`, every other rank PeerFailedError."""
    if RANK == LAST:
        with pytest.raises(own, match=own_match):
            build(nics)
    else:
        with pytest.raises(PeerFailedError, match=f"{step} failed on rank {LAST} \\({own.__name__}: "):
            build()


def still_works(seed: int, slots_before: int) -> None:
    assert busy_slots() == slots_before, "a failed start-up left an engine slot held"
    a2a = build()
    try:
        check_round(a2a, make_inputs(seed, a2a.cfg))
    finally:
        a2a.close()
    COMM.Barrier()


@pytest.fixture
def on_last_rank(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch | None]:
    """A monkeypatch that only the last rank applies (None elsewhere)."""
    yield monkeypatch if RANK == LAST else None


def test_a_nic_name_one_rank_lacks_fails_every_rank(seed: int) -> None:
    before = busy_slots()
    expect_every_rank_fails("opening the fabric engine", NicError, "no-such-nic", nics="no-such-nic")
    still_works(seed, before)


def test_a_switch_mistyped_on_one_rank_fails_every_rank(
    seed: int, on_last_rank: pytest.MonkeyPatch | None
) -> None:
    before = busy_slots()
    if on_last_rank is not None:
        on_last_rank.setenv("MOE_A2A_SLICE_BYTES", "lots")
    expect_every_rank_fails("checking AllToAll's arguments", ValueError, "MOE_A2A_SLICE_BYTES")
    if on_last_rank is not None:
        on_last_rank.undo()
    still_works(seed, before)


def _raise(what: str) -> object:
    def fail(*args: object, **kwargs: object) -> object:
        raise MemoryError(f"injected: {what}")

    return fail


# Steps whose real failures need a machine out of memory: the last rank's call
# raises instead (the others run the real thing).
INJECTED = {
    "checking that the workspace fits in memory": (memory_plan, "check_fits"),
    "allocating the workspace": (_core, "Workspace"),
    "creating the peer group": (fabric.Engine, "group"),
    "starting the cpu backend": (_core, "CpuAllToAll"),
    "allocating the cuda backend": (_core, "CudaAllToAll"),
}
BACKEND_STEP = {"cpu": "starting the cpu backend", "cuda": "allocating the cuda backend"}


@pytest.mark.parametrize("step", list(INJECTED))
def test_a_local_failure_at_each_step_fails_every_rank(
    step: str, seed: int, on_last_rank: pytest.MonkeyPatch | None
) -> None:
    where = INJECTED[step]
    if step in BACKEND_STEP.values() and step != BACKEND_STEP[DEVICE]:
        pytest.skip(f"the {DEVICE} backend starts otherwise")
    before = busy_slots()
    if on_last_rank is not None:
        on_last_rank.setattr(*where, _raise(step))
    expect_every_rank_fails(step, MemoryError, f"injected: {step}")
    if on_last_rank is not None:
        on_last_rank.undo()
    still_works(seed, before)
