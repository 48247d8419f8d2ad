"""Mask and continue (issue 32) in one process: the survivors' agreement on the dead ranks
(`_core.agree_on_live`, src/a2a/live_ranks.h) with ranks as threads, and rounds of the real
core with a rank masked against the reference (docs/reliability.md, "Mask and continue")."""

from __future__ import annotations

import os
import subprocess
import threading
import time

import pytest
import torch
from world import World, make_inputs

from inputs import expert_fn
from moe_a2a import _core
from moe_a2a.masking import LiveRanks
from moe_a2a.reference import combine_reference, dispatch_reference

SIZE = 4


def dead_pid() -> int:
    """The pid of a process that has ended and been reaped."""
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def agree(
    world: World,
    who: list[int],
    pids: list[int],
    dead: dict[int, list[int]],
    epochs: dict[int, int],
    first_round: int = 1,
    timeout_s: float = 10.0,
) -> dict[int, object]:
    """agree_on_live on a thread per rank of `who`; each rank's result or exception."""
    out: dict[int, object] = {}

    def body(r: int) -> None:
        d = [1 if p in dead.get(r, []) else 0 for p in range(world.size)]
        try:
            out[r] = _core.agree_on_live(
                world.workspaces[r], pids, d, epochs.get(r, 0), first_round, timeout_s
            )
        except Exception as exc:  # reported per rank
            out[r] = exc

    threads = [threading.Thread(target=body, args=(r,)) for r in who]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out


@pytest.fixture
def node(make_world):
    return make_world(SIZE, ranks_per_node=SIZE)


def test_survivors_that_suspect_differently_agree_on_the_union(node: World) -> None:
    pids = [os.getpid()] * SIZE
    pids[2] = pids[3] = dead_pid()
    # Rank 0 has seen 3 die, rank 1 has seen 2 die: two failures in different orders.
    got = agree(node, [0, 1], pids, {0: [3], 1: [2]}, {0: 5, 1: 7})
    assert got[0] == got[1], got
    dead, epoch, _ = got[0]  # type: ignore[misc]
    assert list(dead) == [0, 0, 1, 1] and epoch == 7


def test_a_rank_that_proposed_then_died_is_seen_alike_by_everyone(node: World) -> None:
    pids = [os.getpid()] * SIZE
    pids[3] = dead_pid()
    # Rank 3 writes its proposal of round 1 (epoch 9, nobody dead), then stops for good.
    late = agree(node, [3], pids, {}, {3: 9}, timeout_s=0.2)
    assert isinstance(late[3], _core.FabricTimeoutError)
    got = agree(node, [0, 1, 2], pids, {}, {0: 8, 1: 8, 2: 8})
    assert got[0] == got[1] == got[2], got
    dead, epoch, round_ = got[0]  # type: ignore[misc]
    # Its proposal is final and read in place by all: each survivor takes it, or none would.
    assert list(dead) == [0, 0, 0, 0] and epoch == 9 and round_ == 1


def test_a_rank_that_died_before_proposing_is_masked_by_all(node: World) -> None:
    pids = [os.getpid()] * SIZE
    pids[1] = dead_pid()
    got = agree(node, [0, 2, 3], pids, {}, {0: 3, 2: 4, 3: 4}, first_round=5)
    assert got[0] == got[2] == got[3], got
    dead, epoch, round_ = got[0]  # type: ignore[misc]
    assert list(dead) == [0, 1, 0, 0] and epoch == 4 and round_ == 6  # one round to learn, one to agree


def test_a_live_rank_that_never_joins_is_a_timeout(node: World) -> None:
    pids = [os.getpid()] * SIZE
    pids[3] = dead_pid()
    started = time.monotonic()
    got = agree(node, [0, 1], pids, {}, {}, timeout_s=0.5)  # rank 2 lives and never proposes
    assert time.monotonic() - started < 5
    for r in (0, 1):
        assert isinstance(got[r], _core.FabricTimeoutError) and "rank 2 (alive) never proposed" in str(got[r])


def masked_expected(world: World, inp, lost: int) -> tuple[list[torch.Tensor], list[torch.Tensor], list]:
    """Survivors' ids with -1 on the lost rank's experts, and the reference with those copies
    weighted 0 (the lost rank sends nothing: its tokens are none)."""
    L = world.cfg.num_experts // world.size
    ids = [i.to(torch.int32) for i in inp.ids]
    dropped = [(i // L) == lost for i in ids]
    weights = [w.masked_fill(d, 0.0) for w, d in zip(inp.weights, dropped, strict=True)]
    cfg = world.cfg
    ref = dispatch_reference(inp.xs, inp.ids, cfg.num_experts, cfg.dispatch_dtype, cfg.expert_padding)
    ys = [expert_fn(x.expert_x, x.expert_x_scale) for x in ref]
    expected = combine_reference(ys, ref, weights, cfg.combine_dtype, cfg.fabric_rows, world.rpn)
    return [i.masked_fill(d, -1) for i, d in zip(ids, dropped, strict=True)], expected, ref


@pytest.mark.parametrize("first_epoch", [1, 7])
def test_rounds_with_a_rank_masked_equal_the_reference(node: World, first_epoch: int) -> None:
    lost, survivors = 3, [0, 1, 2]
    node.check(make_inputs(0, node.cfg, SIZE), node.run(lambda r: r.round(make_inputs(0, node.cfg, SIZE))))
    for rank in node.ranks:  # every proxy stops (the lost rank's with it), as after a loss
        rank.impl = None
    masked = [1 if r == lost else 0 for r in range(SIZE)]
    for r in survivors:
        node.ranks[r].impl = _core.CpuAllToAll(
            node.workspaces[r], None, None, None, [], [0] * SIZE, masked, first_epoch
        )
    for seed in range(1, 4):
        inp = make_inputs(seed, node.cfg, SIZE, tokens=[node.cfg.max_tokens, 5, 0, 0])
        ids, expected, ref = masked_expected(node, inp, lost)

        def call(r, inp=inp, ids=ids):
            d = r.dispatch(inp.xs[r.rank], ids[r.rank], inp.weights[r.rank])
            return d, r.combine(expert_fn(d.expert_x, d.expert_x_scale))

        results = node.run(call, survivors)
        for r in survivors:
            got = results[r]
            assert not isinstance(got, Exception), f"rank {r}: {got!r}"
            d, out = got
            assert torch.equal(d.tokens_per_expert, ref[r].tokens_per_expert), f"rank {r}"
            assert torch.equal(d.expert_x.view(torch.uint8), ref[r].expert_x.view(torch.uint8)), f"rank {r}"
            assert torch.equal(out.view(torch.uint8), expected[r].view(torch.uint8)), f"rank {r}: combine"
            assert node.ranks[r].impl.epoch == first_epoch + seed
            # The lost rank's stale routing row counts for nothing, and nobody sends to its experts.
            L = node.cfg.num_experts // SIZE
            assert d.routing[lost].abs().sum() == 0 and d.routing[:, lost * L : (lost + 1) * L].sum() == 0


def test_a_masked_remote_peer_must_have_left_the_group(make_world) -> None:
    """Across nodes a masked peer leaves the peer group (moe_a2a.masking rebuilds it without it):
    one still among remote_peers is refused."""
    w = make_world(2, ranks_per_node=1)
    for rank in w.ranks:
        rank.impl = None
    with pytest.raises(ValueError, match="rank 1 is masked and in remote_peers; expected a group without it"):
        _core.CpuAllToAll(w.workspaces[0], None, None, None, [1], [0, 0], [0, 1], 0)
    with pytest.raises(ValueError, match="this rank is masked"):
        _core.CpuAllToAll(w.workspaces[0], None, None, None, [], [0, 0], [1, 0], 0)
    with pytest.raises(ValueError, match="expected none or one per rank"):
        _core.CpuAllToAll(w.workspaces[0], None, None, None, [], [0, 0], [0], 0)


def test_dropped_weights_and_renormalisation() -> None:
    live = LiveRanks(num_experts=8, world_size=4, rank=0)
    live.masked = frozenset({2})
    live.experts = torch.tensor([False] * 4 + [True] * 2 + [False] * 2)
    ids = torch.tensor([[0, 4], [5, 4], [1, 7]], dtype=torch.int32)
    w = torch.tensor([[0.25, 0.75], [0.5, 0.5], [0.4, 0.6]])
    got, kept, dropped = live.drop(ids, w, renormalize=False)
    assert dropped.tolist() == [[False, True], [True, True], [False, False]]
    m = _core.MASKED_EXPERT  # a dropped (token, k): no row, nothing back, no error
    assert got.tolist() == [[0, m], [m, m], [1, 7]]
    assert torch.equal(kept, torch.tensor([[0.25, 0.0], [0.0, 0.0], [0.4, 0.6]]))
    _, renorm, _ = live.drop(ids, w, renormalize=True)
    # Each token's remaining weights sum to what all of them did; a token with none left keeps zeros.
    assert torch.allclose(renorm, torch.tensor([[1.0, 0.0], [0.0, 0.0], [0.4, 0.6]]))
    assert live.calls == 2


def test_a_rank_that_dies_while_the_others_agree_is_masked_too(node: World) -> None:
    """Rank 3 is already dead; rank 2 lives (never proposing) until 0.3 s into the agreement, then
    dies: the survivors add it in a later round instead of timing out."""
    pids = [os.getpid()] * SIZE
    pids[3] = dead_pid()
    doomed = subprocess.Popen(["sleep", "30"])
    pids[2] = doomed.pid
    threading.Timer(0.3, lambda: (doomed.kill(), doomed.wait())).start()
    started = time.monotonic()
    got = agree(node, [0, 1], pids, {0: [3]}, {0: 2, 1: 2}, timeout_s=10.0)
    assert time.monotonic() - started < 3
    assert got[0] == got[1], got
    assert list(got[0][0]) == [0, 0, 1, 1]  # type: ignore[index]
