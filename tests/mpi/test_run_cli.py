"""`moe-a2a run` end to end across real MPI ranks, on the CPU.

Run under `mpirun -n 4 python -m pytest --with-mpi tests/mpi/test_run_cli.py` (any
world size that divides 16 works: the tiny preset has 16 experts). Every rank runs
the command in-process, as `mpirun moe-a2a run ...` would; rank 0 checks what it
printed and the trace it wrote. `MOE_A2A_TEST_PROVIDER` picks the provider (tcp).
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator

import numpy as np
import pytest
import torch
from mpi4py import MPI

from moe_a2a.layers import driver
from moe_a2a.layers.moe import MoELayer
from moe_a2a.layers.presets import PRESETS
from moe_a2a.trace import read_trace

COMM = MPI.COMM_WORLD
RANK, WORLD = COMM.Get_rank(), COMM.Get_size()
PROVIDER = os.environ.get("MOE_A2A_TEST_PROVIDER", "tcp")
TINY = PRESETS["tiny"]
TWO_NODES = str(max(1, WORLD // 2))  # --ranks-per-node that makes two virtual nodes

pytestmark = [
    pytest.mark.mpi(min_size=2),
    pytest.mark.timeout(240),
    pytest.mark.skipif(
        TINY.num_experts % WORLD != 0, reason=f"tiny's 16 experts do not split over {WORLD} ranks"
    ),
]


def run(*argv: str) -> int:
    """`moe-a2a run ARGV` on every rank; its exit status.

    Parsed with the `run` parser alone: moe_a2a.cli adds it unchanged, and this
    keeps the test independent of the other subcommands' modules.
    """
    parser = argparse.ArgumentParser(prog="moe-a2a")
    driver.add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["run", "--provider", PROVIDER, "--progress", "never", *argv])
    try:
        return args.func(args)
    except SystemExit as exc:  # a usage error ends every rank with status 2 (moe_a2a.usage)
        return int(exc.code)


@pytest.fixture
def shared_dir() -> Iterator[str]:
    """A temporary folder made by rank 0, the same path on every rank.

    Not pytest's tmp_path: every rank would make (and prune) its own under one root.
    """
    folder = COMM.bcast(tempfile.mkdtemp(prefix="moe-a2a-run-") if RANK == 0 else None, root=0)
    yield folder
    COMM.Barrier()
    if RANK == 0:
        shutil.rmtree(folder, ignore_errors=True)


def all_ranks(value: int) -> list[int]:
    return COMM.allgather(value)


@pytest.mark.parametrize(
    ("flags", "iters"),
    [
        # The README's job: fp8 dispatch, bf16 combine, random routing, one node.
        (["--mode", "decode"], 5),
        # Two virtual nodes (fabric, and same-node from 4 ranks), the router with node-limited
        # routing, padded expert segments, fp32 throughout (tight verify tolerance).
        (
            [
                "--routing",
                "router",
                "--ranks-per-node",
                TWO_NODES,
                "--max-nodes",
                "1",
                "--expert-padding",
                "8",
                "--dispatch-dtype",
                "fp32",
                "--combine-dtype",
                "fp32",
                "--weight-dtype",
                "fp32",
            ],
            3,
        ),
        # Prefill-sized with skewed routing; shape flags on top of the preset, no shared expert.
        (
            [
                "--mode",
                "prefill",
                "--tokens",
                "96",
                "--routing",
                "skewed",
                "--skew",
                "1.2",
                "--dispatch-dtype",
                "bf16",
                "--num-shared-experts",
                "0",
                "--hidden",
                "192",
            ],
            3,
        ),
    ],
    ids=["decode-fp8", "router-two-nodes-fp32", "prefill-skewed-bf16"],
)
def test_tiny_run_verifies_and_writes_a_trace(
    flags: list[str], iters: int, shared_dir: str, capsys: pytest.CaptureFixture[str]
) -> None:
    path = os.path.join(shared_dir, "run.h5")
    status = run(
        "--model",
        "tiny",
        "--iters",
        str(iters),
        "--warmup",
        "1",
        "--seed",
        "7",
        "--verify",
        "--trace",
        path,
        *flags,
    )
    assert all_ranks(status) == [0] * WORLD
    if RANK != 0:
        return
    out = capsys.readouterr().out
    assert "verify: OK" in out, out
    for phase in (
        "dispatch_send",
        "dispatch_recv",
        "shared_expert",
        "experts",
        "combine_send",
        "combine_recv",
        "layer",
    ):
        assert phase in out or (phase == "shared_expert" and "--num-shared-experts" in flags), out
    assert "tokens/s" in out and f"trace: {path}" in out

    trace = read_trace(path)
    assert (trace.num_ranks, trace.num_iters, trace.num_experts) == (WORLD, iters, TINY.num_experts)
    assert trace.config["model"] == "tiny" and trace.config["verify"] is True
    tokens = int(flags[flags.index("--tokens") + 1]) if "--tokens" in flags else TINY.decode_tokens
    # Every token copy arrives at exactly one expert: per iteration, all ranks' tokens x top-k.
    assert (trace.tokens_per_expert.sum(axis=1) == WORLD * tokens * TINY.topk).all()
    assert trace.recorded()[:, :, list(trace.phases).index("experts")].all()
    # Each rank sent something to some peer in every iteration (routing rows at least).
    assert (trace.bytes_per_peer.sum(axis=(2, 3)) > 0).all()
    if "--ranks-per-node" in flags:
        assert trace.bytes_per_peer[..., 1].sum() > 0  # the fabric path carried bytes
    if "--routing" in flags and "skewed" in flags:
        per_expert = trace.tokens_per_expert.sum(axis=0)
        assert per_expert.max() > 2 * np.median(per_expert)


def wrap_last_rank_experts(
    monkeypatch: pytest.MonkeyPatch, wrap: Callable[[torch.Tensor], torch.Tensor]
) -> None:
    """On the last rank only, MoELayer.experts returns `wrap` of what it computed."""
    if RANK == WORLD - 1:
        original = MoELayer.experts

        def wrapped(self: MoELayer, d: object) -> torch.Tensor:
            return wrap(original(self, d))  # type: ignore[arg-type]

        monkeypatch.setattr(MoELayer, "experts", wrapped)


def test_verify_catches_a_wrong_expert_on_one_rank(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """--verify is not vacuous: one rank's experts off by 5% fail the run on every rank."""
    wrap_last_rank_experts(monkeypatch, lambda y: y * 1.05)
    status = run("--model", "tiny", "--iters", "2", "--warmup", "0", "--verify", "--dispatch-dtype", "bf16")
    assert all_ranks(status) == [1] * WORLD
    if RANK == 0:
        out = capsys.readouterr().out
        assert "verify: FAILED" in out and "iteration 0: max relative error" in out, out


def test_unknown_preset_is_one_line_on_rank_zero(capsys: pytest.CaptureFixture[str]) -> None:
    status = run("--model", "mixtral")
    assert all_ranks(status) == [2] * WORLD
    err = capsys.readouterr().err
    if RANK == 0:
        lines = err.strip().splitlines()
        assert len(lines) == 1, err
        assert "unknown preset 'mixtral'" in lines[0] and all(name in lines[0] for name in PRESETS)
    else:
        assert err == ""


def test_verify_refuses_a_layer_too_big_for_one_process(capsys: pytest.CaptureFixture[str]) -> None:
    # The whole DeepSeek-V3 layer is about 21 GiB; nothing is allocated before the refusal.
    status = run("--model", "deepseek-v3", "--verify", "--verify-max-gib", "4")
    assert all_ranks(status) == [2] * WORLD
    err = capsys.readouterr().err
    if RANK == 0:
        assert "--verify: the whole layer's weights need 21.1 GiB" in err and "--verify-max-gib 4" in err, err


def test_experts_that_do_not_split_over_the_ranks_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    experts = 4 * WORLD + 1
    status = run("--model", "tiny", "--num-experts", str(experts))
    assert all_ranks(status) == [2] * WORLD
    if RANK == 0:
        assert f"--num-experts: got {experts}, not divisible by the {WORLD} ranks" in capsys.readouterr().err


def test_a_trace_path_rank_0_cannot_write_is_refused_before_the_run(
    shared_dir: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Rank 0 writes the trace, so rank 0 checks its path; every rank ends with status 2."""
    status = run("--model", "tiny", "--iters", "1", "--warmup", "0", "--trace", shared_dir)
    assert all_ranks(status) == [2] * WORLD
    err = capsys.readouterr().err
    if RANK == 0:
        expected = f"--trace: got {shared_dir}, a folder; expected the path of a file to write"
        assert err.strip() == f"moe-a2a run: error: {expected}"
    else:
        assert err == ""
