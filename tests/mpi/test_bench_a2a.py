"""`moe-a2a bench a2a` end to end: both baselines agree with moe-a2a, a table is printed."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import pytest
from mpi4py import MPI

from moe_a2a.bench import a2a

COMM = MPI.COMM_WORLD
PROVIDER = os.environ.get("MOE_A2A_TEST_PROVIDER", "tcp")


def parse(extra: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    a2a.add_parser(parser.add_subparsers())
    return parser.parse_args(["a2a", *extra])


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(240)
@pytest.mark.parametrize("baseline", ["mpi", "gloo"])
def test_bench_a2a_runs_and_checks(baseline: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = Path(COMM.bcast(str(tmp_path / "a2a.json")))
    args = parse(
        [
            "--mode",
            "decode",
            "--tokens",
            "8",
            "--hidden",
            "256",
            "--num-experts",
            str(4 * COMM.Get_size()),
            "--topk",
            "2",
            "--iters",
            "2",
            "--warmup",
            "1",
            "--baseline",
            baseline,
            "--provider",
            PROVIDER,
            "--ranks-per-node",
            "1",
            "--output",
            str(out),
        ]
    )
    # run_shape compares both combine outputs on the first iteration and raises on a mismatch.
    assert a2a.main(args) == 0
    COMM.Barrier()
    if COMM.Get_rank() == 0:
        table = capsys.readouterr().out
        assert f"baseline: {baseline.upper()}" in table and "decode" in table
        doc = json.loads(out.read_text())
        assert doc["benchmark"] == "a2a" and "switches" in doc and doc["moe_a2a_version"]
        (result,) = doc["results"]
        assert result["baseline"] == baseline.upper() and result["world"] == COMM.Get_size()
        assert all(v > 0 for v in result["ours_dispatch"] + result["mpi_combine"])


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(240)
@pytest.mark.parametrize("ranks_per_node", ["1", "world"])
def test_bench_a2a_times_the_engine_alone_where_every_peer_is_remote(
    ranks_per_node: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = Path(COMM.bcast(str(tmp_path / "a2a.json")))
    rpn = str(COMM.Get_size()) if ranks_per_node == "world" else ranks_per_node
    args = parse(
        ["--mode", "decode", "--tokens", "8", "--hidden", "256", "--num-experts", str(4 * COMM.Get_size())]
        + ["--topk", "2", "--iters", "3", "--warmup", "1", "--provider", PROVIDER]
        + ["--ranks-per-node", rpn, "--output", str(out)]
    )
    assert a2a.main(args) == 0
    COMM.Barrier()
    if COMM.Get_rank() != 0:
        return
    table = capsys.readouterr().out
    (result,) = json.loads(out.read_text())["results"]
    if ranks_per_node == "world":  # one node: no byte goes through the engine, nothing to compare
        assert "engine_dispatch" not in result and "phase/engine" not in table
        return
    assert all(v > 0 for v in result["engine_dispatch"] + result["engine_combine"])
    lines = [line.split() for line in table.splitlines() if line.startswith("decode") and "x" in line[-2:]]
    ratios = {words[2]: words[-1] for words in lines if len(words) == 6}
    assert set(ratios) == {"dispatch", "combine"}, table
    for phase, ratio in ratios.items():
        want = result[f"ours_{phase}"][0] / result[f"engine_{phase}"][0]
        assert ratio == f"{want:.2f}x", (phase, ratio, want)
