"""A rank that runs a dispatch cached while its peers run it uncached fails, and so do they."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("cached_mismatch_job.py")


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs mpirun")
@pytest.mark.parametrize(
    ("provider", "layout"), [("tcp", "1"), ("shm", "node")], ids=["tcp-own-nodes", "shm-one-node"]
)
def test_cached_and_uncached_ranks_do_not_pair(provider: str, layout: str) -> None:
    mpirun = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-n", "2"]
    cmd = [*mpirun, sys.executable, str(SCRIPT), provider, layout]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out
    # Each rank fails at once: one with its own FabricError naming both calls
    # (call stamps, docs/protocol.md "Call order"), the other with its announcement.
    # A report starts a line, or follows the other rank's report directly: mpirun may
    # forward one rank's line before the other's newline.
    errors = {rank: re.search(rf"(?:^|differ)rank {rank}: (\w+): (.*?differ)", out, re.M) for rank in (0, 1)}
    for rank, m in errors.items():
        assert m is not None and m[1] in ("FabricError", "PeerFailedError"), out
        assert "call sequences differ" in m[2] and "of epoch 2 (" in m[2], out
        if m[1] == "PeerFailedError":
            assert f"peer {1 - rank} failed" in m[2], out
