"""The MPI test infrastructure itself: a rank that fails a test ends the whole mpirun job."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(120)
def test_failing_rank_aborts_the_mpi_job() -> None:
    """A test that fails on rank 1 while rank 0 waits in MPI_Barrier must end the job, not hang it."""
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        pytest.skip("mpirun is not on PATH")
    # A clean environment: no variables of an MPI job this test may itself run in.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_COMM_", "PMIX_", "OMPI_MCA_ess"))}
    env.update(
        OMPI_ALLOW_RUN_AS_ROOT="1",
        OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
        MOE_A2A_TEST_DELIBERATE_FAILURE="1",
    )
    cmd = [
        mpirun, "-n", "2", "--allow-run-as-root", "--oversubscribe",
        sys.executable, "-m", "pytest", "--with-mpi", "-q", "-p", "no:cacheprovider",
        str(REPO / "tests" / "mpi" / "test_fabric.py::test_deliberate_failure_on_one_rank_aborts_the_job"),
    ]  # fmt: skip
    start = time.monotonic()
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=100)
    elapsed = time.monotonic() - start
    output = done.stdout + done.stderr
    assert done.returncode != 0, output
    # The failing rank reports what failed before it aborts. (mpirun's own MPI_ABORT
    # banner is not checked: OpenMPI 4.1 sometimes loses it with "Data unpack" errors.)
    assert "rank 1 of 2" in output and "FAILED during call; aborting the MPI job" in output, output
    assert "deliberate failure on rank 1" in output, output
    # Rank 0 would wait forever in the barrier; the test's own timeout is 60 s.
    assert elapsed < 50, f"the job took {elapsed:.1f} s to end: was it aborted or did it time out?"
