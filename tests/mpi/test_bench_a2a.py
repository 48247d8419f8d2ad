"""`moe-a2a bench a2a` end to end: both baselines agree with moe-a2a, a table is printed."""

from __future__ import annotations

import argparse
import csv
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


def tiny(baseline: str, output: Path, *more: str) -> list[str]:
    return [
        *("--mode", "decode", "--tokens", "8", "--hidden", "256", "--num-experts", str(4 * COMM.Get_size())),
        *("--topk", "2", "--iters", "2", "--warmup", "1", "--baseline", baseline, "--provider", PROVIDER),
        *("--ranks-per-node", "1", "--output", str(output), *more),
    ]


def cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(240)
@pytest.mark.parametrize("baseline", ["mpi", "gloo"])
def test_bench_a2a_runs_and_checks(baseline: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = Path(COMM.bcast(str(tmp_path / "a2a.json")))
    # run_shape compares both combine outputs on the first iteration and raises on a mismatch.
    assert a2a.main(parse(tiny(baseline, out, "--progress", "always"))) == 0
    COMM.Barrier()
    captured = capsys.readouterr()
    # The bar is rank 0's, on stderr; no other rank draws one, and none goes to stdout.
    assert ("decode:" in captured.err) == (COMM.Get_rank() == 0), captured.err
    assert "it/s" not in captured.out
    if COMM.Get_rank() != 0:
        return
    lines = captured.out.splitlines()
    # The configuration, then the table.
    assert lines[0] == "moe-a2a bench a2a"
    head = next(i for i, line in enumerate(lines) if line.startswith("| shape"))
    config = {k.strip(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:head] if line.strip())}
    assert config["ranks"] == f"{COMM.Get_size()} (1 per node)" and config["provider"] == PROVIDER
    assert config["device"] == "cpu" and config["baseline"].startswith(baseline.upper())
    assert config["payloads"] == "dispatch fp8, combine bf16" and config["switches"]
    assert config["sizes"] == f"decode 8 tokens/rank, hidden 256, {4 * COMM.Get_size()} experts, top-2"
    # every peer remote (--ranks-per-node 1): the engine-alone columns follow
    assert cells(lines[head]) == [h for _, h in a2a.COLUMNS + a2a.ENGINE_COLUMNS]
    body = [cells(line) for line in lines[head + 2 : head + 8]]
    assert [(c[2], c[3]) for c in body] == [(m, p) for m in ("expert", "rank") for p in a2a.PHASES]
    assert "baseline/moe-a2a = baseline p50 / moe-a2a p50: above 1, moe-a2a is faster" in captured.out
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "a2a" and "switches" in doc and doc["moe_a2a_version"] and doc["command"]
    assert doc["settings"]["world"] == COMM.Get_size() and doc["settings"]["baseline"] == baseline.upper()
    assert [r["phase"] for r in doc["rows"]] == list(a2a.PHASES) * 2
    # the byte table, one row per mode: wire rows are copies (expert) or distinct ranks (rank)
    bytes_head = next(i for i, line in enumerate(lines) if cells(line)[:2] == ["shape", "fabric_rows"])
    assert [cells(line)[1] for line in lines[bytes_head + 2 : bytes_head + 4]] == ["expert", "rank"]
    expert, rank = doc["bytes"]
    assert expert["fabric_rows_per_token"] == pytest.approx(expert["copies_per_token"])
    assert rank["fabric_rows_per_token"] == pytest.approx(rank["remote_ranks_per_token"])
    assert 0 < rank["fabric_b_per_token"] <= expert["fabric_b_per_token"] and rank["node_b_per_token"] == 0
    assert rank["ranks_max"] <= rank["ranks_bound"] == 2  # top-2
    for r in doc["rows"]:
        assert 0 < r["moe_a2a_p50_us"] <= r["moe_a2a_p99_us"] and 0 < r["baseline_p50_us"]
        assert r["ratio"] == pytest.approx(r["baseline_p50_us"] / r["moe_a2a_p50_us"])


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "ranks_per_node", ["1", "world", *(["2"] if COMM.Get_size() >= 4 and COMM.Get_size() % 2 == 0 else [])]
)
def test_bench_a2a_times_the_engine_alone_where_every_peer_is_remote(
    ranks_per_node: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Also: without --fabric-rows, expert and rank, and node where the default runs it (nodes of 2)."""
    out = Path(COMM.bcast(str(tmp_path / "a2a.json")))
    rpn = str(COMM.Get_size()) if ranks_per_node == "world" else ranks_per_node
    args = parse(
        ["--mode", "decode", "--tokens", "8", "--hidden", "256", "--num-experts", str(4 * COMM.Get_size())]
        + ["--topk", "2", "--iters", "3", "--warmup", "1", "--provider", PROVIDER, "--progress", "never"]
        + ["--ranks-per-node", rpn, "--output", str(out)]
    )
    assert a2a.main(args) == 0
    COMM.Barrier()
    if COMM.Get_rank() != 0:
        return
    table = capsys.readouterr().out
    rows = json.loads(out.read_text())["rows"]
    head = next(line for line in table.splitlines() if line.startswith("| shape"))
    modes = ["expert", "rank", "node"] if ranks_per_node == "2" else ["expert", "rank"]
    assert list(dict.fromkeys(r["fabric_rows"] for r in rows)) == modes
    if ranks_per_node != "1":  # a same-node peer: not every byte goes through the engine, nothing to compare
        assert all("engine_p50_us" not in r for r in rows) and cells(head) == [h for _, h in a2a.COLUMNS]
        return
    assert cells(head)[-2:] == [h for _, h in a2a.ENGINE_COLUMNS], head
    for r in rows:
        assert r["engine_p50_us"] > 0, r
        assert r["phase_engine"] == pytest.approx(r["moe_a2a_p50_us"] / r["engine_p50_us"]), r


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(240)
def test_bench_a2a_writes_csv(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = Path(COMM.bcast(str(tmp_path / "a2a.csv")))
    assert a2a.main(parse(tiny("mpi", out, "--progress", "never"))) == 0
    COMM.Barrier()
    assert capsys.readouterr().err == ""  # --progress never: no bar on any rank
    if COMM.Get_rank() != 0:
        return
    with out.open(newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["phase"] for r in rows] == list(a2a.PHASES) * 2
    assert {"shape", "tokens", "moe_a2a_p50_us", "baseline_p99_us", "ratio"} <= set(rows[0])
    assert all(float(r["moe_a2a_p50_us"]) > 0 for r in rows)
