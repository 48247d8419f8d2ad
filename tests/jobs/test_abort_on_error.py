"""A fatal fabric error ends the whole job under mpirun, so no survivor waits in MPI_Finalize."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("abort_job.py")
STUCK_S = 90  # how long rank 1 stays alive without calling


def _run(provider: str, **env: str) -> tuple[int, float, str]:
    environ = {k: v for k, v in os.environ.items() if k != "MOE_A2A_ABORT_ON_ERROR"} | env
    start = time.monotonic()
    try:
        p = _mpirun(provider, environ)
    except subprocess.TimeoutExpired as e:  # say what the ranks printed, not only that they ran long
        text = b"".join(x if isinstance(x, bytes) else x.encode() for x in (e.stdout or b"", e.stderr or b""))
        printed = text.decode(errors="replace")[-4000:]
        pytest.fail(f"mpirun ran past {e.timeout} s; the ranks printed:\n{printed}")
    return p.returncode, time.monotonic() - start, p.stdout + p.stderr


def _mpirun(provider: str, environ: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            "mpirun",
            "--allow-run-as-root",
            "--oversubscribe",
            "-n",
            "2",
            sys.executable,
            str(SCRIPT),
            provider,
            str(STUCK_S),
        ],
        capture_output=True,
        text=True,
        timeout=STUCK_S + 60,
        env=environ,
    )


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs mpirun")
@pytest.mark.parametrize("provider", ["tcp", "shm"])
def test_a_timed_out_rank_ends_the_job(provider: str) -> None:
    rc, took, out = _run(provider)
    assert rc != 0, out
    assert "ending the job (abort_on_error" in out, out
    # rank 0 times out within a few seconds; without the abort the job lasts as long as rank 1 does
    assert took < STUCK_S / 2, f"the job took {took:.0f} s; its stuck rank lives {STUCK_S} s\n{out}"
