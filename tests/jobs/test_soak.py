"""Issue 17, item 8: resident memory is flat after warm-up (a short run of the documented soak)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

PROBE = Path(__file__).parents[2] / "tools" / "probes" / "soak.py"
LIMIT_KB = 300  # per 10k rounds after warm-up; before the fix tcp grew 2870 kB (docs/reliability.md)


@pytest.mark.timeout(300)
@pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs mpirun")
def test_rss_is_flat_after_warm_up() -> None:
    # Its own job: libfabric reads FI_UNIVERSE_SIZE once per process, when it starts.
    cmd = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-n", "2", sys.executable, str(PROBE)]
    cmd += ["--calls", "30000", "--every", "3000", "--warmup", "6000", "--provider", "tcp", "--rpn", "1"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=280)
    assert p.returncode == 0, p.stdout + p.stderr
    slopes = [float(s) for s in re.findall(r"after warm-up ([-+0-9.]+) kB per 10k rounds", p.stdout)]
    assert len(slopes) == 2, p.stdout
    assert max(slopes) < LIMIT_KB, f"RSS grew {slopes} kB per 10k rounds after warm-up\n{p.stdout}"
