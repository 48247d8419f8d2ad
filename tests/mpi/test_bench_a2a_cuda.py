"""The CUDA benchmark's pass against the engine alone (`a2a_cuda.whole_phases`), on the tests' device.

On the CPU it runs with a CPU AllToAll (the bench itself needs a GPU); with
MOE_A2A_TEST_DEVICE=cuda it runs the GPU path it was written for.
"""

from __future__ import annotations

import argparse

import pytest
import torch
from ranks import COMM, DEVICE, PROVIDER, RANK, WORLD, device_pytestmark

from moe_a2a import report
from moe_a2a.all_to_all import AllToAll, Config
from moe_a2a.bench import a2a, a2a_cuda, engine_ref
from moe_a2a.bench.routing import Routing

pytestmark = [device_pytestmark]
TOKENS, HIDDEN, TOPK = 16, 256, 2


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(240)
@pytest.mark.parametrize("ranks_per_node", [1, None], ids=["every peer remote", "one node"])
def test_whole_phases_are_timed_beside_the_engine_alone(ranks_per_node: int | None) -> None:
    cfg = Config(
        max_tokens=TOKENS,
        hidden=HIDDEN,
        num_experts=4 * WORLD,
        topk=TOPK,
        dispatch_dtype="fp8",
        combine_dtype="bf16",
        timeout_s=60.0,
    )
    device = torch.device("cuda", torch.cuda.current_device()) if DEVICE == "cuda" else torch.device("cpu")
    with AllToAll(cfg, comm=COMM, device=DEVICE, provider=PROVIDER, ranks_per_node=ranks_per_node) as ata:
        alone = engine_ref.start_for(ata, COMM, PROVIDER)
        if ranks_per_node is None:  # no byte goes through the engine: nothing to compare
            assert alone is None
            return
        assert alone is not None
        rounds = [a2a.make_round(i, RANK, TOKENS, HIDDEN, Routing(cfg.num_experts, TOPK)) for i in range(2)]
        rounds = [a2a_cuda.Round(r.x.to(device), r.ids.to(device), r.weights.to(device)) for r in rounds]
        # Expert outputs for the most rows a call can deliver (graph-safe size on the GPU, else all copies).
        rows = max(ata.max_output_rows, WORLD * TOKENS * TOPK)
        y = torch.randn(rows, HIDDEN, device=device).to(torch.bfloat16)
        args = argparse.Namespace(warmup=1, iters=3)
        with report.progress(4, "whole phases", rank=RANK, mode="never") as bar:
            whole = a2a_cuda.whole_phases(ata, alone, rounds, y, COMM, args, bar)
        alone.close()
    # The timed iterations only, each phase and the engine's, every rank the same span.
    for samples in (whole, alone.samples):
        assert sorted(samples) == ["combine", "dispatch"]
        assert all(len(v) == args.iters and min(v) > 0 for v in samples.values()), samples
    assert COMM.allgather((whole, alone.samples)) == [(whole, alone.samples)] * WORLD
    got = a2a_cuda.engine_rows(whole, alone.samples)
    assert [r["phase"] for r in got] == list(a2a_cuda.ENGINE_PHASES)
    for r in got:
        assert r["engine_p50_us"] > 0, r
        assert r["phase_engine"] == pytest.approx(r["moe_a2a_us"] / r["engine_p50_us"]), r
