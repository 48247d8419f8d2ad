"""on_peer_loss="mask" under the suite's mpirun (issue 32): with nobody lost it is a plain
instance; where masking is not built (peers over the fabric, CUDA) every rank refuses it at
construction. Losses themselves are tested outside mpirun, which ends a job whose rank dies:
tests/jobs/test_peer_loss.py."""

from __future__ import annotations

import pytest
import torch
from ranks import COMM, DEVICE, PROVIDER, RANK, WORLD

from inputs import draw_inputs, expert_fn
from moe_a2a.all_to_all import AllToAll, Config
from moe_a2a.reference import combine_reference, dispatch_reference


def make(rpn: int | None) -> AllToAll:
    cfg = Config(max_tokens=8, hidden=64, num_experts=2 * WORLD, topk=2, timeout_s=30.0, on_peer_loss="mask")
    return AllToAll(cfg, device=DEVICE, provider=PROVIDER, ranks_per_node=rpn)


@pytest.mark.timeout(120)
def test_mask_with_nobody_lost_is_a_plain_instance() -> None:
    if DEVICE != "cpu":
        with pytest.raises(ValueError, match="on_peer_loss='mask': device='cuda' is not built yet"):
            make(None)
        return
    with make(WORLD) as a2a:
        for seed in range(3):
            inp = draw_inputs(seed, a2a.cfg, WORLD)
            d = a2a.dispatch(inp.xs[RANK], inp.ids[RANK].int(), inp.weights[RANK])
            assert d.dropped is None
            out = a2a.combine(expert_fn(d.expert_x, None), d)
            ref = dispatch_reference(inp.xs, inp.ids, a2a.cfg.num_experts)
            ys = [expert_fn(r.expert_x, None) for r in ref]
            expected = combine_reference(ys, ref, inp.weights, ranks_per_node=WORLD)[RANK]
            assert torch.equal(out, expected)
        assert a2a.masked_ranks == () and a2a.masked_calls == 0


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
def test_mask_over_the_fabric_is_refused_on_every_rank() -> None:
    with pytest.raises(ValueError) as err:
        make(1)
    assert "needs every rank on one node" in str(err.value) or "is not built yet" in str(err.value)
    assert COMM.allgather(str(err.value)) == [str(err.value)] * WORLD
