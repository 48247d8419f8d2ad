"""`moe-a2a run --mode train` end to end across real MPI ranks, on the CPU.

Run under `mpirun -n N python -m pytest --with-mpi tests/mpi/test_train_cli.py`.
The tiny preset with 24 experts, so that 1, 2, 3, 4 and 8 ranks all split them
evenly. Every rank runs the command in-process; rank 0 checks what it printed and
the trace it wrote. `--verify` compares the loss and every gradient with plain
autograd over the whole layer on rank 0; the tests here also check that it fails
when a gradient is wrong or missing.
"""

from __future__ import annotations

import os
import re
from typing import Any

import pytest
import torch
from mpi4py import MPI
from tests.mpi import test_run_cli as run_cli

from moe_a2a import trace_tools
from moe_a2a.layers.moe import MoELayer
from moe_a2a.trace import TRAIN_PHASES, read_trace

COMM = MPI.COMM_WORLD
RANK, WORLD = COMM.Get_rank(), COMM.Get_size()
EXPERTS = 24
TWO_NODES = str(max(1, WORLD // 2))
SMALL = ["--model", "tiny", "--num-experts", str(EXPERTS), "--tokens", "24", "--hidden", "128"]
FP32 = [f"--{what}-dtype=fp32" for what in ("dispatch", "combine", "weight", "grad")]

run = run_cli.run
shared_dir = run_cli.shared_dir  # the fixture: a folder of rank 0's, the same path on every rank

pytestmark = [
    pytest.mark.mpi(min_size=1),
    pytest.mark.timeout(240),
    pytest.mark.skipif(EXPERTS % WORLD != 0, reason=f"{EXPERTS} experts do not split over {WORLD} ranks"),
]


def losses(out: str) -> list[float]:
    return [float(v) for v in re.findall(r"step \d+/\d+(?: \(warm-up\))?: loss (\S+)", out)]


@pytest.mark.parametrize(
    "flags",
    [
        # The defaults: fp8 dispatch, bf16 combine and gradients, the router, AdamW.
        [],
        # fp32 throughout (tight limit), padded segments, two virtual nodes, node-limited
        # routing, SGD and the expert-bias update.
        [
            *FP32,
            "--expert-padding",
            "8",
            "--ranks-per-node",
            TWO_NODES,
            "--max-nodes",
            "1",
            "--optimizer",
            "sgd",
            "--lr",
            "0.05",
            "--load-balance-coeff",
            "0.001",
        ],
        # Fixed random routing: the gate gets no gradient, here and in the reference.
        ["--routing", "random", "--dispatch-dtype", "bf16", "--num-shared-experts", "0"],
    ],
    ids=["defaults", "fp32-two-nodes-sgd-balanced", "random-routing-no-shared"],
)
def test_train_verifies_and_traces_the_backward(
    flags: list[str], shared_dir: str, capsys: pytest.CaptureFixture[str]
) -> None:
    path = os.path.join(shared_dir, "train.h5")
    status = run(
        *SMALL, "--mode", "train", "--iters", "3", "--warmup", "1", "--verify", "--trace", path, *flags
    )
    assert COMM.allgather(status) == [0] * WORLD
    if RANK != 0:
        return
    out = capsys.readouterr().out
    assert "verify: OK" in out, out
    assert len(losses(out)) == 4, out
    for phase in ("dispatch", "experts", "combine", "combine_bwd", "dispatch_bwd", "optimizer"):
        assert re.search(rf"^\| {phase} ", out, re.M), out  # a row of the summary table
    trace = read_trace(path)
    assert trace.phases == TRAIN_PHASES and trace.config["mode"] == "train"
    recorded = trace.recorded()
    for phase in ("combine_bwd", "dispatch_bwd"):
        assert recorded[:, :, TRAIN_PHASES.index(phase)].all(), phase
    assert (trace.tokens_per_expert.sum(axis=1) == WORLD * 24 * 4).all()
    summary = trace_tools.format_summary(trace_tools.summarize(trace), path)
    assert "combine_bwd" in summary and "dispatch_bwd" in summary
    compared = trace_tools.compare(trace, trace)
    assert compared["phases"]["dispatch_bwd"]["ratio_p50"] == 1.0


def test_training_lowers_the_loss(capsys: pytest.CaptureFixture[str]) -> None:
    """New tokens every step, one teacher: the loss falls (compared over three steps, it is noisy)."""
    flags = [*SMALL, "--tokens", "64", "--mode", "train", "--iters", "12", "--warmup", "0", "--lr", "0.01"]
    status = run(*flags)
    assert COMM.allgather(status) == [0] * WORLD
    if RANK == 0:
        values = losses(capsys.readouterr().out)
        assert len(values) == 12 and sum(values[-3:]) < 0.9 * sum(values[:3]), values


def _experts_detached(original: Any) -> Any:
    def experts(self: MoELayer, d: object) -> torch.Tensor:
        return original(self, d).detach()

    return experts


def _weights_detached(original: Any) -> Any:
    def route(self: MoELayer, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ids, weights = original(self, x)
        return ids, weights.detach()

    return route


@pytest.mark.parametrize(
    ("method", "cut", "expected"),
    [
        (
            "experts",
            _experts_detached,
            [
                rf"gradient of routed_experts\.inner_experts\.{n}: None here"
                for n in ("w1_EFD", "w2_EDF", "w3_EFD")
            ],
        ),
        ("route", _weights_detached, [r"gradient of router\.gate\.weight: all zero here"]),
    ],
    ids=["routed-experts", "gate"],
)
def test_verify_fails_when_a_parameter_gets_no_gradient(
    method: str,
    cut: Any,
    expected: list[str],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Parameters cut out of autograd (the silent failure of issue 15) fail the run, named."""
    monkeypatch.setattr(MoELayer, method, cut(getattr(MoELayer, method)))
    status = run(*SMALL, "--mode", "train", "--iters", "1", "--warmup", "0", "--verify")
    assert COMM.allgather(status) == [1] * WORLD
    if RANK == 0:
        out = capsys.readouterr().out
        assert "verify: FAILED" in out, out
        for pattern in expected:
            assert re.search(pattern, out), out


def test_verify_fails_on_a_wrong_gradient(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The last rank's experts pass back 1.5x their gradient (forward unchanged): named with its error."""
    run_cli.wrap_last_rank_experts(monkeypatch, lambda y: y + 0.5 * (y - y.detach()))
    status = run(*SMALL, *FP32, "--mode", "train", "--iters", "1", "--verify")
    assert COMM.allgather(status) == [1] * WORLD
    if RANK == 0:
        out = capsys.readouterr().out
        assert "verify: FAILED" in out, out
        wrong = r"gradient of routed_experts\.inner_experts\.w2_EDF: max relative error \S+"
        assert re.search(wrong, out), out
