"""`moe-a2a bench a2a --train` end to end at a tiny shape: table, agreement check, JSON and CSV."""

from __future__ import annotations

import argparse
import csv
import json
import os
from pathlib import Path

import pytest
from mpi4py import MPI

from moe_a2a.bench import a2a, train
from moe_a2a.usage import UsageError

COMM = MPI.COMM_WORLD
PROVIDER = os.environ.get("MOE_A2A_TEST_PROVIDER", "tcp")
torch = pytest.importorskip("torch")


def parse(extra: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    a2a.add_parser(parser.add_subparsers())
    return parser.parse_args(["a2a", *extra])


def tiny(output: Path, dtype: str) -> list[str]:
    world = COMM.Get_size()
    return [
        "--train",
        *("--tokens", "8", "--hidden", "256", "--num-experts", str(2 * world), "--topk", "2"),
        *("--iters", "2", "--warmup", "1", "--dispatch-dtype", dtype),
        *("--provider", PROVIDER, "--ranks-per-node", "1", "--output", str(output)),
    ]


def titan_importable() -> str | None:
    try:
        import torchtitan.models.common.token_dispatcher  # noqa: F401
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return None


@pytest.mark.mpi(min_size=1)
@pytest.mark.timeout(240)
@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_bench_train_runs_and_agrees(dtype: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    world = COMM.Get_size()
    if world > 4 and dtype == "fp8":
        pytest.skip(f"{world} ranks: the bf16 case covers this world size; fp8 is run at 1 to 4 ranks")
    out = Path(COMM.bcast(str(tmp_path / "train.json")))
    # main returns 1 when a baseline's out or gradients disagree with moe-a2a's.
    assert a2a.main(parse(tiny(out, dtype))) == 0
    COMM.Barrier()
    if COMM.Get_rank() != 0:
        return
    text = capsys.readouterr().out
    titan = titan_importable()
    result = json.loads(out.read_text())
    # A baseline that did not run says why; where TorchTitan imports and this torch has
    # what its all-to-all path calls, AllToAllTokenDispatcher must have run.
    baselines = ["AllToAllTokenDispatcher", "LocalTokenDispatcher"]
    expected = ["moe-a2a", *(b for b in baselines if b not in result["skipped"])]
    assert all(result["skipped"][b] for b in baselines if b not in expected)
    if titan is None and hasattr(torch.compiler, "_is_non_strict_tracing"):
        assert "AllToAllTokenDispatcher" in expected
        assert ("LocalTokenDispatcher" in expected) == (world == 1)
    else:
        print(f"TorchTitan baselines: skipped {result['skipped']}; checking the rows that ran")
    rows = result["rows"]
    phases = ("fwd", "bwd", "fwd+bwd")
    # One row per phase and baseline that ran; moe-a2a's alone where none did.
    assert [(r["phase"], r["baseline"]) for r in rows] == [
        (p, b) for p in phases for b in (expected[1:] or [None])
    ]
    settings = result["settings"]
    assert (
        settings["world"] == world
        and settings["dispatch_dtype"] == dtype
        and settings["grad_dtype"] == "bf16"
    )
    for r in rows:
        assert 0 < r["moe_a2a_p50_us"] <= r["moe_a2a_p90_us"] <= r["moe_a2a_p99_us"]
        if r["baseline"] is not None:
            assert r["ratio"] == pytest.approx(r["baseline_p50_us"] / r["moe_a2a_p50_us"])
        else:
            assert r["baseline_p50_us"] is None and r["ratio"] is None
    assert [a["baseline"] for a in result["agreement"]] == expected[1:]
    assert all(a["ok"] for a in result["agreement"])
    assert result["max_recv_tokens"] >= 1 and settings["iters"] == 2
    if world > 1:
        assert "LocalTokenDispatcher" in result["skipped"]
    lines = text.splitlines()
    assert lines[0] == "moe-a2a bench a2a --train"
    head = next(line for line in lines if line.startswith("| phase"))
    assert [c.strip() for c in head.strip("|").split("|")] == [h for _, h in train.COLUMNS]
    for name in expected[1:]:
        assert f"| {name} " in text
    assert "baseline/moe-a2a = baseline p50 / moe-a2a p50: above 1, moe-a2a is faster" in text
    for name in expected[1:]:
        assert f"agreement with {name}: ok" in text


@pytest.mark.mpi(min_size=1)
@pytest.mark.timeout(300)
def test_bench_train_compiled_csv(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--compile: every contender's forward compiled fullgraph (the first, untimed call compiles),
    moe-a2a's with capacity rows; the results still agree, the header says so; and the figures
    go to a CSV. --compiled-rows without --compile is refused."""
    out = Path(COMM.bcast(str(tmp_path / "train.csv")))
    with pytest.raises(UsageError, match=r"^--compiled-rows: got 'capacity'; only used with --compile"):
        a2a.main(parse([*tiny(out, "bf16"), "--compiled-rows", "capacity"]))
    assert a2a.main(parse([*tiny(out, "bf16"), "--compile", "--compiled-rows", "capacity"])) == 0
    COMM.Barrier()
    if COMM.Get_rank() == 0:
        text = capsys.readouterr().out
        assert "  compile:    each forward torch.compile'd, fullgraph; moe-a2a's rows capacity" in text
        with out.open() as f:
            rows = list(csv.DictReader(f))
        assert rows[0]["phase"] == "fwd"
        assert {"baseline", "moe_a2a_p50_us", "baseline_p50_us", "ratio"} <= set(rows[0])


@pytest.mark.mpi(min_size=2)
def test_bench_train_refuses_uneven_experts() -> None:
    world = COMM.Get_size()
    args = parse(["--train", "--num-experts", str(2 * world + 1), "--tokens", "8", "--hidden", "256"])
    # Alike on every rank, before any exchange; moe_a2a.cli prints it as one line from rank 0.
    with pytest.raises(UsageError, match=rf"^--num-experts: got {2 * world + 1}, which is not divisible"):
        a2a.main(args)
