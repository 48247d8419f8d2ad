"""Rows per destination rank (fabric_rows="rank"), per destination node ("node", forwarded
inside it) and per copy ("expert"), in one process: every rank's dispatch and combine equal the
reference bit for bit, in every mode, with and without virtual nodes, and the rows that cross are
the ones docs/protocol.md counts."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from world import EXPERTS_PER_RANK, Rank, World, expert_fn, make_inputs

from inputs import Inputs
from moe_a2a import Config, _core
from moe_a2a.backends.common import CORE_DTYPE

MODES = ("rank", "node", "expert")
Ids = Callable[[torch.Generator, int, int], torch.Tensor]  # (g, rank, tokens) -> [tokens, topk]


def with_ids(inp: Inputs, ids: Ids, seed: int) -> Inputs:
    """`inp` with every rank's topk_ids from `ids`."""
    g = torch.Generator().manual_seed(seed)
    return Inputs(inp.xs, [ids(g, r, x.shape[0]) for r, x in enumerate(inp.xs)], inp.weights)


def check_wire_rows(w: World, inp: Inputs) -> None:
    """Each rank's rows sent and received per peer, as the last dispatch counted them."""
    for r, rank in enumerate(w.ranks):
        sent = [w.wire_rows(inp.ids, r, p) for p in range(w.size)]
        got = [w.wire_rows(inp.ids, p, r) for p in range(w.size)]
        assert list(rank.impl.sent_counts()) == sent, f"rank {r}: rows sent"
        assert list(rank.impl.received_counts()) == got, f"rank {r}: rows received"


def rounds(w: World, inputs: list[Inputs]) -> None:
    for inp in inputs:
        w.check(inp, w.run(lambda r, inp=inp: r.round(inp)))
        check_wire_rows(w, inp)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    ("size", "rpn", "combine_dtype"),
    [
        (1, 1, "bf16"),
        (2, 1, "fp32"),
        (3, 1, "bf16"),
        (4, 2, "bf16"),
        (5, 1, "fp32"),
        (6, 3, "bf16"),
        (8, 2, "bf16"),
        (8, 1, "fp32"),
    ],
)
def test_random_rounds_equal_the_reference(
    make_world, mode: str, size: int, rpn: int, combine_dtype: str
) -> None:
    """Random routing and token counts (some ranks none), in both modes and with virtual nodes."""
    topk = min(4, EXPERTS_PER_RANK * size)
    w = make_world(size, ranks_per_node=rpn, fabric_rows=mode, combine_dtype=combine_dtype, topk=topk)
    rounds(w, [make_inputs(seed, w.cfg, size) for seed in range(2)])


def duplicate_expert(size: int) -> Ids:
    """Each token picks one expert twice (k 0 and 2), two others once."""

    def ids(g: torch.Generator, rank: int, tokens: int) -> torch.Tensor:
        experts = EXPERTS_PER_RANK * size
        picks = torch.stack(
            [torch.randperm(experts, generator=g)[:3] for _ in range(tokens)] or [torch.empty(0, 3)]
        )
        picks = picks.reshape(tokens, 3).long()
        return torch.stack([picks[:, 0], picks[:, 1], picks[:, 0], picks[:, 2]], dim=1)

    return ids


def one_rank(size: int) -> Ids:
    """All of a token's experts on one random rank (K > L: one expert twice)."""

    def ids(g: torch.Generator, rank: int, tokens: int) -> torch.Tensor:
        owner = torch.randint(0, size, (tokens, 1), generator=g)
        return owner * EXPERTS_PER_RANK + torch.arange(4).remainder(EXPERTS_PER_RANK)

    return ids


def own_rank(size: int) -> Ids:
    """All of a token's experts on its own rank: nothing crosses."""

    def ids(g: torch.Generator, rank: int, tokens: int) -> torch.Tensor:
        return (rank * EXPERTS_PER_RANK + torch.arange(4).remainder(EXPERTS_PER_RANK)).repeat(tokens, 1)

    return ids


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("size", "rpn"), [(3, 1), (4, 2)])
@pytest.mark.parametrize("router", [duplicate_expert, one_rank, own_rank], ids=lambda f: f.__name__)
def test_routings_that_share_rows(
    make_world, mode: str, size: int, rpn: int, router: Callable[[int], Ids]
) -> None:
    """A token picking one expert twice, all its experts on one rank, all on its own rank;
    uneven tokens with none on rank 1, and no private rows (every row in the shared part)."""
    w = make_world(size, ranks_per_node=rpn, fabric_rows=mode, max_private_tokens=0)
    tokens = [7, 0] + [24 - r for r in range(size - 2)]
    rounds(
        w, [with_ids(make_inputs(seed, w.cfg, size, tokens=tokens), router(size), seed) for seed in (5, 6)]
    )


@pytest.mark.parametrize("mode", MODES)
def test_cached_and_unweighted_calls(make_world, mode: str) -> None:
    """A call along a kept routing (new rows, the same ids) and an unweighted combine
    (the plain sum, weighted=False on every rank) equal the reference."""
    w = make_world(4, ranks_per_node=2, fabric_rows=mode, max_private_tokens=2)
    first = make_inputs(11, w.cfg, 4)
    kept = w.run(lambda r: r.round(first))
    w.check(first, kept)
    again = make_inputs(12, w.cfg, 4, tokens=[x.shape[0] for x in first.xs])
    again = Inputs(again.xs, first.ids, again.weights)

    def cached(r: Rank) -> tuple:
        d = r.dispatch(again.xs[r.rank], again.ids[r.rank], again.weights[r.rank], kept[r.rank][0].routing)
        return d, r.combine(expert_fn(d.expert_x, d.expert_x_scale))

    w.check(again, w.run(cached))
    check_wire_rows(w, again)

    def unweighted(r: Rank) -> tuple:
        d = r.dispatch(again.xs[r.rank], again.ids[r.rank], again.weights[r.rank])
        return d, r.combine(expert_fn(d.expert_x, d.expert_x_scale), weighted=False)

    ones = Inputs(again.xs, again.ids, [torch.ones_like(x) for x in again.weights])
    w.check(ones, w.run(unweighted))


def test_the_modes_differ_by_rounding_only(make_world) -> None:
    """Across nodes the modes deliver the same rows and combine within bf16 rounding;
    within one node (no row crosses) they are the same bit for bit."""
    outs = {}
    for rpn in (1, 4):
        for mode in MODES:
            w = make_world(4, ranks_per_node=rpn, fabric_rows=mode)
            inp = make_inputs(21, w.cfg, 4)
            outs[rpn, mode] = w.run(lambda r, inp=inp: r.round(inp))
    for r in range(4):
        for rpn in (1, 4):
            for mode in ("rank", "node"):
                assert torch.equal(outs[rpn, mode][r][0].expert_x, outs[rpn, "expert"][r][0].expert_x)
        assert torch.equal(outs[4, "rank"][r][1], outs[4, "expert"][r][1])
        assert torch.equal(outs[4, "node"][r][1], outs[4, "expert"][r][1])
        # A node of one rank: its forwarder is the rank itself, the same sums in the same order.
        assert torch.equal(outs[1, "node"][r][1], outs[1, "rank"][r][1])
        torch.testing.assert_close(
            outs[1, "rank"][r][1].float(), outs[1, "expert"][r][1].float(), rtol=2e-2, atol=2e-2
        )


def test_config_takes_the_modes_it_has() -> None:
    base = dict(max_tokens=4, hidden=8, num_experts=4, topk=2)
    assert Config(**base).fabric_rows == "auto"  # type: ignore[arg-type]
    assert Config(**base, fabric_rows="node").fabric_rows == "node"  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="'node' with on_peer_loss='mask' is not built yet"):
        Config(**base, fabric_rows="node", on_peer_loss="mask")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="fabric_rows: got 'ranks'"):
        Config(**base, fabric_rows="ranks")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("world", "rpn", "overrides", "graph_safe", "mode"),
    [
        (8, 2, {}, False, "node"),  # several ranks a node, peers on other nodes
        (8, 4, {}, False, "node"),
        (8, 1, {}, False, "rank"),  # a node of one rank: nothing to forward inside it
        (8, 8, {}, False, "rank"),  # one node: no fabric (rank and node alike)
        (8, 2, {}, True, "rank"),  # graph-safe: a replayed decode step measured faster with rank
        (8, 2, {"fabric_rows": "node"}, True, "node"),  # and node runs there when named
        (8, 2, {"on_peer_loss": "mask"}, False, "rank"),  # mask: node is not built
        (8, 2, {"fabric_rows": "expert"}, False, "expert"),  # a mode named is the mode
        (8, 1, {"fabric_rows": "node"}, False, "node"),
    ],
)
def test_auto_is_the_fastest_mode_the_instance_runs(
    world: int, rpn: int, overrides: dict[str, str], graph_safe: bool, mode: str
) -> None:
    cfg = Config(max_tokens=4, hidden=8, num_experts=16, topk=2, **overrides)  # type: ignore[arg-type]
    assert cfg.fabric_rows_for(world, rpn, graph_safe) == mode


def test_a_world_of_virtual_nodes_runs_node_by_default(make_world) -> None:
    """The default ("auto") over nodes of 2 is rows per node, and exact: AllToAll resolves it alike."""
    w = make_world(4, ranks_per_node=2)
    assert w.cfg.fabric_rows == "node"
    inp = make_inputs(53, w.cfg, 4)
    w.check(inp, w.run(lambda r: r.round(inp)))


def test_a_forwarder_over_capacity_fails_on_every_rank(make_world) -> None:
    """Rows per node share the forwarder's sections: 4 tokens of rank 0 for the two ranks of node 1
    (2 copies each) fit max_recv_tokens=3 in mode rank, but not as 4 rows to rank 0's forwarder
    there: a CapacityError on every rank, and the next call is exact."""
    w = make_world(4, ranks_per_node=2, fabric_rows="node", topk=1, max_recv_tokens=3, max_private_tokens=1)

    def node_1(g: torch.Generator, t: int, e: int, k: int) -> torch.Tensor:
        return torch.tensor([[(2 + i % 2) * EXPERTS_PER_RANK] for i in range(t)])

    big = make_inputs(51, w.cfg, 4, tokens=[4, 0, 0, 0], router=node_1)
    small = make_inputs(52, w.cfg, 4, tokens=[1, 1, 0, 0])

    def overflows(r: Rank) -> str:
        with pytest.raises(_core.CapacityError, match="max_recv_tokens=3") as info:
            r.dispatch(big.xs[r.rank], big.ids[r.rank], big.weights[r.rank])
        return str(info.value)

    for r, text in enumerate(w.run(overflows)):
        assert isinstance(text, str) and "to rank 2" in text, f"rank {r}: {text!r}"
    w.check(small, w.run(lambda r: r.round(small)))


def send_cached(w: World, inp: Inputs, r: int, matrix: torch.Tensor) -> None:
    """Rank r's dispatch send half of `inp` along `matrix` (a cached call), straight to its core."""
    x, ids = inp.xs[r].contiguous(), inp.ids[r].to(torch.int32).contiguous()
    weights = inp.weights[r].contiguous()
    w.ranks[r].impl.dispatch_send(
        x.data_ptr(),
        CORE_DTYPE[x.dtype],
        0,
        ids.data_ptr(),
        x.shape[0],
        matrix.data_ptr(),
        weights.data_ptr(),
    )


def test_rows_per_node_cross_once_per_node(make_world) -> None:
    """Two nodes of 2: a token with experts on both ranks of the other node crosses once, to the
    rank with its sender's local index, which passes the other rank its entries; combine equals
    the reference, which sums the node's part at the forwarder."""
    w = make_world(4, ranks_per_node=2, fabric_rows="node", max_private_tokens=1)

    def both_ranks_of_the_other_node(g: torch.Generator, rank: int, tokens: int) -> torch.Tensor:
        other = (rank // 2 + 1) % 2 * 2  # the first rank of the other node
        pick = torch.stack(
            [torch.randperm(EXPERTS_PER_RANK, generator=g)[:2] for _ in range(tokens)] or [torch.empty(2)]
        )
        pick = pick[:tokens].long()
        return torch.cat([other * EXPERTS_PER_RANK + pick, (other + 1) * EXPERTS_PER_RANK + pick], dim=1)

    inp = with_ids(make_inputs(41, w.cfg, 4, tokens=[5, 3, 0, 4]), both_ranks_of_the_other_node, 41)
    rounds(w, [inp])
    for s, x in enumerate(inp.xs):
        forwarder = (s // 2 + 1) % 2 * 2 + s % 2
        assert list(w.ranks[s].impl.sent_counts()) == [x.shape[0] if r == forwarder else 0 for r in range(4)]


def test_a_changed_wire_row_count_is_refused_per_node(make_world) -> None:
    """Rows per node: a cached matrix that names rows for a rank of another node that is not the
    sender's forwarder there is refused before anything is sent."""
    w = make_world(4, ranks_per_node=2, fabric_rows="node")
    inp = make_inputs(32, w.cfg, 4, tokens=[6, 5, 4, 3])
    kept = w.run(lambda r: r.round(inp))
    w.check(inp, kept)
    bad = kept[0][0].routing.clone()
    bad[0, w.cfg.num_experts + 3] = 1  # sender 0's forwarder on node 1 is rank 2
    with pytest.raises(ValueError, match="row 0 holds 1 wire rows for rank 3 with 0 copies on its node"):
        send_cached(w, inp, 0, bad)
    w.check(inp, w.run(lambda r: r.round(inp)))


def test_a_changed_wire_row_count_is_refused(make_world) -> None:
    """A cached call whose matrix names more wire rows than copies, or other wire rows than our
    own ids make, is refused before anything is sent; the next call is exact."""
    w = make_world(4, ranks_per_node=2, fabric_rows="rank")
    inp = make_inputs(31, w.cfg, 4, tokens=[6, 5, 4, 3])
    kept = w.run(lambda r: r.round(inp))
    w.check(inp, kept)
    matrix, E = kept[0][0].routing, w.cfg.num_experts
    copies = int(matrix[0, 2 * EXPERTS_PER_RANK : 3 * EXPERTS_PER_RANK].sum())
    own = w.wire_rows(inp.ids, 1, 3)
    cases = ((0, 2, copies + 1, 0, "wire rows for rank 2 with"), (1, 3, own + 1, 1, "topk_ids make"))
    for s, r, value, more, words in cases:  # `more` copies, so that only the wire rows are wrong
        bad = matrix.clone()
        bad[s, E + r] = value
        bad[s, r * EXPERTS_PER_RANK] += more
        with pytest.raises(ValueError, match=f"dispatch: routing: row {s} .*{words}"):
            send_cached(w, inp, 1, bad)
    w.check(inp, w.run(lambda r: r.round(inp)))
