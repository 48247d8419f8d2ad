"""moe_a2a.report: percentiles, the one table style, CSV/JSON output, the progress bar on rank 0."""

from __future__ import annotations

import argparse
import csv
import io
import json
from pathlib import Path

import numpy as np
import pytest

from moe_a2a import report


def test_percentiles_are_numpys_over_the_finite_values() -> None:
    ns = np.array([5_000.0, np.nan, 1_000.0, 3_000.0, np.inf, 2_000.0])
    got = report.percentiles_us(ns)
    finite = np.array([5.0, 1.0, 3.0, 2.0])
    assert got["n"] == 4
    for q in (50, 90, 99):
        assert got[f"p{q}"] == pytest.approx(np.percentile(finite, q))
    assert got["mean"] == pytest.approx(2.75) and got["max"] == pytest.approx(5.0)
    empty = report.percentiles_us(np.array([np.nan]), (50,))
    assert empty == {"n": 0, "p50": None, "mean": None, "max": None}


def test_ratio_reads_baseline_over_moe_a2a() -> None:
    assert report.ratio(30.0, 10.0) == pytest.approx(3.0)  # the baseline takes 3x: moe-a2a is faster
    assert report.ratio(None, 10.0) is None and report.ratio(1.0, 0.0) is None
    assert report.RATIO == "baseline/moe-a2a" and "above 1, moe-a2a is faster" in report.RATIO_NOTE


def test_table_is_github_style_with_dashes_for_missing() -> None:
    lines = report.table(["phase", "p50 (us)", "ratio"], [["dispatch", 12.345, None]]).splitlines()
    assert lines[0].startswith("| phase") and set(lines[1]) <= {"|", "-", ":"}
    assert [c.strip() for c in lines[2].strip("|").split("|")] == ["dispatch", "12.3", "-"]


def test_config_block_lists_every_setting() -> None:
    text = report.config_block("moe-a2a bench a2a", {"ranks": 4, "provider": "tcp"})
    assert text.splitlines() == ["moe-a2a bench a2a", "  ranks:    4", "  provider: tcp"]


def test_switches_set_names_the_set_switches(monkeypatch: pytest.MonkeyPatch) -> None:
    from moe_a2a import switches

    for name in switches.REGISTRY:
        monkeypatch.delenv(name, raising=False)
    assert report.switches_set() == "none set"
    monkeypatch.setenv("MOE_A2A_CUDA_PDL", "0")
    assert report.switches_set() == "MOE_A2A_CUDA_PDL=0"


@pytest.mark.parametrize("name", ["x.csv", "out/x.JSON"])
def test_output_path_takes_csv_and_json(name: str) -> None:
    assert report.output_path(name) == Path(name)


@pytest.mark.parametrize("name", ["x.txt", "x", "x.csv.gz"])
def test_output_path_refuses_other_names(name: str) -> None:
    expected = rf"got '{name}'; expected a file name ending in .csv"
    with pytest.raises(argparse.ArgumentTypeError, match=expected):
        report.output_path(name)


def test_write_output_csv_is_csv_and_json_has_the_settings(tmp_path: Path) -> None:
    rows = [{"phase": "dispatch", "moe_a2a_p50_us": 1.5, "ratio": 2.0}, {"phase": "combine", "ratio": None}]
    report.write_output(tmp_path / "a" / "x.csv", rows, {"ignored": True})
    with (tmp_path / "a" / "x.csv").open(newline="") as f:
        got = list(csv.DictReader(f))
    assert got == [
        {"phase": "dispatch", "moe_a2a_p50_us": "1.5", "ratio": "2.0"},
        {"phase": "combine", "moe_a2a_p50_us": "", "ratio": ""},
    ]
    meta = report.run_meta("a2a", {"world": 4})
    report.write_output(tmp_path / "x.json", rows, meta)
    doc = json.loads((tmp_path / "x.json").read_text())
    assert doc["benchmark"] == "a2a" and doc["moe_a2a_version"] and doc["settings"] == {"world": 4}
    assert doc["command"] and "switches" in doc and doc["rows"] == rows
    with pytest.raises(ValueError, match="--output: got '.*x.txt'; expected"):
        report.write_output(tmp_path / "x.txt", rows, meta)


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_only_on_rank_0_and_only_when_asked_or_watched() -> None:
    assert report.progress_enabled("always", 0, io.StringIO())
    assert not report.progress_enabled("always", 1, _Terminal())  # never on another rank
    assert not report.progress_enabled("never", 0, _Terminal())
    assert report.progress_enabled("auto", 0, _Terminal())
    assert not report.progress_enabled("auto", 0, io.StringIO())  # a log file: no bar
    with pytest.raises(ValueError, match="--progress: got 'sometimes'; expected one of auto, always, never"):
        report.progress_enabled("sometimes", 0, io.StringIO())


def test_progress_bar_draws_on_its_stream() -> None:
    shown = io.StringIO()
    with report.progress(4, "decode", rank=0, mode="always", stream=shown) as bar:
        for _ in range(4):
            bar.update()
    assert "decode:" in shown.getvalue() and "/4 [" in shown.getvalue()  # tqdm draws at most every 0.1 s
    hidden = io.StringIO()
    with report.progress(4, "decode", rank=1, mode="always", stream=hidden) as bar:
        bar.update(4)
    assert hidden.getvalue() == ""
