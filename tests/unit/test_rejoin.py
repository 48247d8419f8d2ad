"""moe_a2a.rejoin's rendezvous over /dev/shm (docs/peer-loss.md, "Rejoin"): its participants are
processes forked from this one, as a node's ranks are separate processes. What a whole job does
is tested in tests/jobs/test_peer_loss.py."""

from __future__ import annotations

import glob
import multiprocessing as mp
import os
import time
import uuid
from datetime import timedelta
from typing import Any

import pytest

from moe_a2a.rejoin import REPLACEMENT, SURVIVOR, NodeRendezvous, RejoinError, leftovers, replacement

CTX = mp.get_context("fork")


def _join(key: str, rank: int, world: int, role: str, masked: tuple[int, ...], epoch: int, q: Any) -> None:
    try:
        rdzv = NodeRendezvous(key, rank, world, role, 5.0, masked, epoch)
        got = rdzv.allgather(str(rank).encode())
        rdzv.close()
        q.put((rank, "ok", rdzv.first_epoch, rdzv.joining, [g.decode() for g in got]))
    except Exception as exc:
        q.put((rank, type(exc).__name__, str(exc)))


def _run(
    key: str, parts: list[tuple[int, str, tuple[int, ...], int]], world: int
) -> dict[int, tuple[Any, ...]]:
    q = CTX.Queue()
    procs = [CTX.Process(target=_join, args=(key, r, world, role, m, e, q)) for r, role, m, e in parts]
    for p in procs:
        p.start()
    out = {}
    for _ in procs:
        got = q.get(timeout=30)
        out[got[0]] = got[1:]
    for p in procs:
        p.join(timeout=10)
    return out


@pytest.fixture
def key() -> str:
    k = f"unit-{uuid.uuid4().hex[:8]}"
    yield k
    for path in glob.glob(f"/dev/shm/moe-a2a-rejoin-{k}-*"):
        os.unlink(path)


def test_survivors_and_a_replacement_meet_and_take_the_survivors_epoch(key: str) -> None:
    out = _run(key, [(0, SURVIVOR, (2,), 7), (1, SURVIVOR, (2,), 7), (2, REPLACEMENT, (), 0)], 3)
    for r in range(3):
        assert out[r] == ("ok", 7, (2,), ["0", "1", "2"]), out
    assert leftovers(key) == []


def test_a_replacement_for_a_rank_that_is_not_masked_fails_every_participant(key: str) -> None:
    """Rank 1 is masked, but the replacement comes for rank 2, which is live: the replacement is
    refused at once (rank 2 is claimed) or the survivors find rank 1 missing; nobody hangs."""
    start = time.monotonic()
    parts = [(0, SURVIVOR, (1,), 4), (2, SURVIVOR, (1,), 4)]
    q = CTX.Queue()
    procs = [CTX.Process(target=_join, args=(key, r, 3, role, m, e, q)) for r, role, m, e in parts]
    for p in procs:
        p.start()
    time.sleep(0.2)  # the survivors have claimed their ranks
    with pytest.raises(RejoinError, match="rank 2 already claimed by a survivor"):
        NodeRendezvous(key, 2, 3, REPLACEMENT, 5.0)
    results = [q.get(timeout=30) for _ in procs]
    for p in procs:
        p.join(timeout=10)
    assert all(kind == "RejoinError" and "rank 1" in text for _, kind, text in results), results
    assert time.monotonic() - start < 10


def test_replacements_must_be_exactly_the_masked_ranks(key: str) -> None:
    """Two survivors, masked (2, 3); only rank 3 is replaced and rank 2 is claimed as a survivor
    by mistake: the same verdict on every participant."""
    parts = [
        (0, SURVIVOR, (2, 3), 9),
        (1, SURVIVOR, (2, 3), 9),
        (2, SURVIVOR, (3,), 9),
        (3, REPLACEMENT, (), 0),
    ]
    out = _run(key, parts, 4)
    assert {kind for kind, *_ in out.values()} == {"RejoinError"}, out
    assert all("the survivors disagree" in text for _, text in out.values()), out


def test_nobody_arriving_ends_in_an_error_naming_the_rank_within_the_timeout(key: str) -> None:
    start = time.monotonic()
    with pytest.raises(RejoinError, match=r"waited 0.3 s for rank 1 .* never arrived"):
        NodeRendezvous(key, 0, 2, SURVIVOR, 0.3, (1,), 5)
    assert time.monotonic() - start < 3
    # What stays is its error, for the others to read (removed when rank 0 is next claimed).
    left = [os.path.basename(p) for p in leftovers(key)]
    assert (
        len(left) == 1 and left[0].startswith(f"moe-a2a-rejoin-{key}-r0-") and left[0].endswith("-error")
    ), left


def _claim_and_die(key: str) -> None:
    NodeRendezvous._welcome = lambda *a: os._exit(0)  # type: ignore[method-assign]
    NodeRendezvous(key, 1, 2, REPLACEMENT, 5.0)


def test_a_participant_that_dies_is_an_error_at_once(key: str) -> None:
    p = CTX.Process(target=_claim_and_die, args=(key,))
    p.start()
    p.join(timeout=10)
    start = time.monotonic()
    with pytest.raises(RejoinError, match=r"rank 1 \(pid \d+\) is gone"):
        NodeRendezvous(key, 0, 2, SURVIVOR, 20.0, (1,), 5)
    assert time.monotonic() - start < 3


def _gather_close_and_exit(key: str) -> None:
    rdzv = NodeRendezvous(key, 1, 2, REPLACEMENT, 5.0)
    rdzv.allgather(b"1")
    rdzv.close()
    os._exit(0)


class _Preempted(NodeRendezvous):
    """Looks for rank 1's last all-gather file once just before it appears, then is held off
    the CPU until rank 1 has written it, closed and exited."""

    peer: Any = None

    def _read(self, suffix: str) -> bytes | None:
        if self.peer is not None and suffix.startswith("r1-") and suffix.endswith(f"-g{self._gen}"):
            self.peer.join(timeout=10)
            self.peer = None
            return None
        return super()._read(suffix)


def test_a_participant_that_wrote_its_part_and_exited_has_not_died(key: str) -> None:
    """A rank leaves the job right after its last all-gather and close; a rank slower to read
    that all-gather still gets its part (found once on the CPU VM: "rank 1 is gone")."""
    p = CTX.Process(target=_gather_close_and_exit, args=(key,))
    p.start()
    rdzv = _Preempted(key, 0, 2, SURVIVOR, 5.0, (1,), 3)
    rdzv.peer = p
    assert rdzv.allgather(b"0") == [b"0", b"1"]
    assert p.exitcode == 0
    rdzv.close()
    assert leftovers(key) == []


def test_a_claim_left_by_a_dead_process_is_taken_over(key: str) -> None:
    p = CTX.Process(target=_claim_and_die, args=(key,))
    p.start()
    p.join(timeout=10)
    time.sleep(0.2)  # an earlier attempt's
    out = _run(key, [(0, SURVIVOR, (1,), 2), (1, REPLACEMENT, (), 0)], 2)
    assert out[0][0] == out[1][0] == "ok", out


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (("bad key!", 0, 2), r"key: got 'bad key!'"),
        (("k", 2, 2), r"rank: got 2; expected an int in \[0, 2\)"),
        (("k", 0, 0), r"world_size: got 0"),
        (("k", 0, 2, 0.0), r"timeout_s: got 0.0; expected a positive number of seconds"),
    ],
)
def test_bad_arguments_name_what_was_wrong(args: tuple[Any, ...], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        replacement(*args[:3], timeout_s=args[3] if len(args) == 4 else 0.1)


def test_rejoin_with_nothing_to_rejoin_is_an_error_naming_why() -> None:
    from moe_a2a import AllToAll, Config

    base = dict(max_tokens=4, hidden=16, num_experts=4, topk=2)
    stopping = AllToAll(Config(**base))  # type: ignore[arg-type]
    with stopping, pytest.raises(ValueError, match="rejoin: needs Config\\(on_peer_loss='mask'\\)"):
        stopping.rejoin("k")
    masking = AllToAll(Config(**base, on_peer_loss="mask"))  # type: ignore[arg-type]
    with masking, pytest.raises(ValueError, match="rejoin: no rank is masked"):
        masking.rejoin("k")


# -- across nodes: the meeting in a torch.distributed.Store (StoreRendezvous) --------------------


def _store_meet(
    parts: list[tuple[int, str, tuple[int, ...], int]], world: int, rpn: int | None, staged: bool = False
) -> dict:
    """Each participant (rank, role, masked, epoch) as a thread meeting in one in-process store.
    `staged`: the first starts and claims its rank, each middle one then starts and ends (a
    refused claim), and the last starts after them: the order the test means, whatever the load."""
    import threading

    import torch.distributed as dist

    from moe_a2a.rejoin import StoreRendezvous

    store = dist.HashStore()
    key = f"s{uuid.uuid4().hex[:8]}"
    out: dict[int, Any] = {}

    def run(rank: int, role: str, masked: tuple[int, ...], epoch: int) -> None:
        try:
            layout = rpn if role == SURVIVOR else None  # a replacement does not know the layout
            rdzv = StoreRendezvous(store, key, rank, world, role, 5.0, masked, epoch, layout)
            got = rdzv.allgather(str(rank).encode())
            topo = rdzv.topology
            rdzv.close()
            result: tuple = ("ok", rdzv.first_epoch, rdzv.joining, [g.decode() for g in got], topo.local_size)
        except Exception as exc:  # noqa: BLE001 - the test looks at it
            result = (type(exc).__name__, str(exc))
        out[rank] = out[rank] + [result] if rank in out else [result]

    threads = [threading.Thread(target=run, args=part) for part in parts]
    for i, t in enumerate(threads):
        t.start()
        if staged and i == 0:
            store.wait([f"moe-a2a-rejoin/{key}/r{parts[0][0]}"], timedelta(seconds=30))
        elif staged and i < len(threads) - 1:
            t.join(30)
    for t in threads:
        t.join(30)
    out["keys"] = store.num_keys()
    return out


def test_across_nodes_the_meeting_is_in_the_store_with_the_survivors_layout() -> None:
    parts = [(0, SURVIVOR, (2,), 9), (1, SURVIVOR, (2,), 9), (2, REPLACEMENT, (), 0), (3, SURVIVOR, (2,), 9)]
    out = _store_meet(parts, 4, 2)
    for r in range(4):
        assert out[r] == [("ok", 9, (2,), ["0", "1", "2", "3"], 2)], out  # nodes of 2, as the survivors'
    assert out["keys"] == 0, "the meeting left keys in the store"


def test_across_nodes_a_replacement_for_a_live_rank_fails_every_participant() -> None:
    parts = [(0, SURVIVOR, (2,), 4), (1, REPLACEMENT, (), 0), (2, REPLACEMENT, (), 0)]
    out = _store_meet(parts, 3, 1)
    for r in range(3):
        ((kind, message),) = out[r]
        assert kind == "RejoinError" and "replacements came for ranks [1, 2]" in message, out


def test_across_nodes_a_rank_comes_once_per_key() -> None:
    """Two replacements for rank 1 with one key: the second's claim is refused, naming why; the
    first meets the survivor."""
    parts = [(1, REPLACEMENT, (), 0), (1, REPLACEMENT, (), 0), (0, SURVIVOR, (1,), 4)]
    out = _store_meet(parts, 2, 1, staged=True)  # the second comes while the first's claim is held
    kinds = sorted(r[0] for r in out[1])
    assert kinds == ["RejoinError", "ok"], out
    refused = next(r for r in out[1] if r[0] == "RejoinError")[1]
    assert "already claimed" in refused and "a key names one attempt" in refused, refused
