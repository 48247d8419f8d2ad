"""on_peer_loss="mask" under the suite's mpirun (issue 32): with nobody lost it is a plain
instance, on one node and across nodes (where it holds a control connection to every rank), on
the CPU and CUDA backends (CUDA: eager and graph-safe). Losses themselves are tested outside
mpirun, which ends a job whose rank dies: tests/jobs/test_peer_loss.py."""

from __future__ import annotations

import pytest
import torch
from ranks import DEVICE, PROVIDER, RANK, WORLD

from inputs import draw_inputs, expert_fn
from moe_a2a.all_to_all import AllToAll, Config
from moe_a2a.reference import combine_reference, dispatch_reference


def make(rpn: int | None, graph_safe: bool = False) -> AllToAll:
    cfg = Config(max_tokens=8, hidden=64, num_experts=2 * WORLD, topk=2, timeout_s=30.0, on_peer_loss="mask")
    return AllToAll(cfg, device=DEVICE, provider=PROVIDER, ranks_per_node=rpn, graph_safe=graph_safe)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("graph_safe", [False, True], ids=["eager", "graph-safe"])
@pytest.mark.parametrize("across_nodes", [False, True], ids=["one-node", "nodes-of-1"])
def test_mask_with_nobody_lost_is_a_plain_instance(across_nodes: bool, graph_safe: bool) -> None:
    if graph_safe and DEVICE != "cuda":
        pytest.skip("graph_safe is CUDA's")
    if across_nodes and WORLD == 1:
        pytest.skip("one rank has no other node")
    rpn = 1 if across_nodes else WORLD
    with make(rpn, graph_safe) as a2a:
        if across_nodes:  # a connection to every other rank, for the survivors' agreement
            assert a2a._live is not None and a2a._live.mesh is not None
            assert a2a._live.mesh.check() == set()
        for seed in range(3):
            inp = draw_inputs(seed, a2a.cfg, WORLD)
            d = a2a.dispatch(
                inp.xs[RANK].to(DEVICE), inp.ids[RANK].int().to(DEVICE), inp.weights[RANK].to(DEVICE)
            )
            assert d.dropped is None
            out = a2a.combine(expert_fn(d.expert_x, None), d).cpu()
            if graph_safe:
                torch.cuda.synchronize()
                a2a.check()
            ref = dispatch_reference(inp.xs, inp.ids, a2a.cfg.num_experts)
            ys = [expert_fn(r.expert_x, None) for r in ref]
            expected = combine_reference(ys, ref, inp.weights, ranks_per_node=rpn)[RANK]
            assert torch.equal(out, expected)
        assert a2a.masked_ranks == () and a2a.masked_calls == 0
