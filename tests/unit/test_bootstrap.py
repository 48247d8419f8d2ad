"""Node layout from host names and virtual nodes, and the torch.distributed bootstrap."""

from __future__ import annotations

from pathlib import Path

import pytest

from moe_a2a.bootstrap import Bootstrap, _layout


def test_layout_from_hosts() -> None:
    hosts = ["a", "a", "b", "b"]
    topo = _layout(3, 4, hosts, None)
    assert (topo.node, topo.local_rank, topo.local_size, topo.node_ranks) == (1, 1, 2, (2, 3))
    assert topo.num_nodes == 2
    assert [topo.node_of(r) for r in range(4)] == [0, 0, 1, 1]


def test_virtual_nodes_split_one_host() -> None:
    topo = _layout(5, 8, ["h"] * 8, 4)
    assert (topo.node, topo.local_rank, topo.node_ranks) == (1, 1, (4, 5, 6, 7))


@pytest.mark.parametrize("rpn", [0, 3, -1, 2.0])
def test_bad_ranks_per_node(rpn: object) -> None:
    with pytest.raises(ValueError, match=rf"ranks_per_node: got {rpn!r}; expected a positive integer"):
        _layout(0, 4, ["h"] * 4, rpn)  # type: ignore[arg-type]


def test_virtual_node_may_not_span_hosts() -> None:
    with pytest.raises(ValueError, match="different hosts"):
        _layout(0, 4, ["a", "b", "b", "b"], 2)


def test_hosts_must_be_contiguous_blocks() -> None:
    with pytest.raises(ValueError, match="contiguous, equal blocks"):
        _layout(0, 4, ["a", "b", "a", "b"], None)


def test_torch_process_group(tmp_path: Path) -> None:
    """A world of one through torch.distributed (gloo): layout and blob all-gather."""
    import torch.distributed as dist

    store = f"file://{tmp_path}/store"
    dist.init_process_group("gloo", init_method=store, rank=0, world_size=1)
    try:
        boot = Bootstrap(dist.group.WORLD)
        assert (boot.rank, boot.world_size, boot.topology.local_size) == (0, 1, 1)
        assert boot.allgather(b"\x00blob\xff") == [b"\x00blob\xff"]
        boot.barrier()
    finally:
        dist.destroy_process_group()
