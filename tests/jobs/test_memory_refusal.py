"""`moe-a2a run` refuses, up front and in one line, a configuration whose memory cannot fit."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time

import pytest

TIMEOUT_S = 120


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs mpirun")
def test_run_with_ten_million_tokens_says_why_instead_of_being_killed() -> None:
    argv = [
        "mpirun",
        "--allow-run-as-root",
        "--oversubscribe",
        "-n",
        "2",
        sys.executable,
        "-m",
        "moe_a2a.cli",
    ]
    argv += ["run", "--mode", "decode", "--model", "tiny", "--tokens", "10000000"]
    start = time.monotonic()
    p = subprocess.run(argv, capture_output=True, text=True, timeout=TIMEOUT_S)
    took = time.monotonic() - start
    out = p.stdout + p.stderr
    assert p.returncode == 2, out  # a usage error, not the kernel's kill (137)
    assert "moe-a2a run: error: memory: this configuration needs" in out, out
    assert "of host memory per node (2 ranks x" in out and "is available (MemAvailable)" in out, out
    assert "max_tokens=10000000" in out, out
    assert "Traceback" not in out, out
    assert took < 60, f"refused after {took:.0f} s: not up front\n{out}"
