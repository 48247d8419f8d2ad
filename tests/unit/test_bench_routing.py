"""Group-limited routing for the benchmarks (moe_a2a.bench.routing) and its bound on copies per token."""

from __future__ import annotations

import numpy as np
import pytest

from moe_a2a.bench.routing import Routing, destinations


def test_group_limited_ids_stay_in_their_groups_and_under_the_bound() -> None:
    r = Routing(num_experts=64, topk=8, num_groups=8, topk_groups=4)
    ids, w = r.ids_weights(seed=3, rank=1, tokens=500)
    assert ids.shape == (500, 8) and w.shape == (500, 8) and bool((w > 0).all())
    groups = ids.numpy() // 8
    assert max(len(set(row)) for row in groups.tolist()) == 4  # 4 groups used, and reached
    assert all(len(set(row)) == 8 for row in ids.tolist())  # distinct experts
    # 8 ranks of 8 experts: a group is a rank, so at most 4 ranks; 2 ranks per node: 4 nodes
    assert r.bound(world=8, ranks_per_node=2) == {"ranks": 4, "nodes": 4}
    d = destinations(ids.numpy(), 64, world=8, ranks_per_node=2, rank=1)
    assert d["ranks"].max() <= 4 and d["nodes"].max() <= 3  # own node (ranks 0, 1) excluded
    assert bool((d["ranks"] <= d["copies"]).all()) and bool((d["nodes"] <= d["ranks"]).all())
    again, _ = r.ids_weights(seed=3, rank=1, tokens=500)
    assert bool((again == ids).all())  # seeded


def test_bounds_of_deepseek_v3_and_plain_top_k() -> None:
    v3 = Routing(num_experts=256, topk=8, num_groups=8, topk_groups=4)
    assert v3.bound(world=64, ranks_per_node=8) == {"ranks": 8, "nodes": 4}  # a group per node
    assert v3.bound(world=16, ranks_per_node=2) == {"ranks": 8, "nodes": 4}
    plain = Routing(num_experts=64, topk=8)
    assert not plain.limited and plain.bound(world=4, ranks_per_node=1) == {"ranks": 4, "nodes": 4}
    # groups straddling ranks: 12 experts in groups of 3 over 6 ranks of 2; one group spans 2 ranks
    assert Routing(12, 3, 4, 1).bound(world=6, ranks_per_node=1) == {"ranks": 2, "nodes": 2}


def test_destinations_count_copies_ranks_and_nodes_off_the_own_node() -> None:
    ids = np.array([[0, 1, 4, 6], [2, 3, 2, 3], [7, 6, 5, 4]])  # 8 experts, 4 ranks of 2, 2 per node
    d = destinations(ids, 8, world=4, ranks_per_node=2, rank=0)
    assert d["copies"].tolist() == [2, 0, 4]
    assert d["ranks"].tolist() == [2, 0, 2]
    assert d["nodes"].tolist() == [1, 0, 1]


@pytest.mark.parametrize(
    ("kw", "msg"),
    [
        (dict(num_groups=3), "num_groups: got 3"),
        (dict(num_groups=8, topk_groups=9), "topk_groups: got 9"),
        (dict(num_groups=8, topk_groups=1, topk=9), "topk: got 9"),
    ],
)
def test_bad_routing_is_refused_by_name(kw: dict[str, int], msg: str) -> None:
    with pytest.raises(ValueError, match=msg):
        Routing(**{"num_experts": 64, "topk": 8, **kw})
