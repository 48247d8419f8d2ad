"""examples/moe_layer.py, the README's API example as a whole program, under mpirun: 2 ranks over tcp."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "moe_layer.py"
TIMEOUT_S = 180


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs mpirun")
def test_example_runs_across_two_nodes_over_tcp() -> None:
    argv = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-n", "2"]
    argv += [sys.executable, str(EXAMPLE), "--ranks-per-node", "1", "--provider", "tcp"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("OMPI_")}
    p = subprocess.run(argv, capture_output=True, text=True, timeout=TIMEOUT_S, env=env)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out
    lines = {int(m["rank"]): m for m in re.finditer(
        r"rank (?P<rank>\d): (?P<tokens>\d+) tokens out, (?P<rows>\d+) rows in for experts "
        r"(?P<experts>\S+) \(torch\.bfloat16\), relative error (?P<error>[\d.]+)", out)}  # fmt: skip
    assert sorted(lines) == [0, 1], out
    assert [lines[r]["experts"] for r in (0, 1)] == ["0-3", "4-7"]
    assert [int(lines[r]["tokens"]) for r in (0, 1)] == [32, 48]
    # every copy lands somewhere: 80 tokens, top-2
    assert sum(int(lines[r]["rows"]) for r in (0, 1)) == (32 + 48) * 2
    # fp8's rounding, not a misrouted row (that would be of the order of 1)
    assert all(0 < float(lines[r]["error"]) < 0.05 for r in (0, 1)), out
