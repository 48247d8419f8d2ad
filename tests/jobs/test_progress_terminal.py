"""The progress bar on rank 0 of an mpirun job follows mpirun's terminal (moe_a2a.report)."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys

import pytest

PROBE = "from moe_a2a.report import progress_enabled as p; import sys; print(p('auto', 0, sys.stderr))"


@pytest.mark.timeout(120)
def test_auto_progress_follows_mpiruns_terminal() -> None:
    """Open MPI gives a rank a pipe for stderr even where mpirun writes to a terminal: auto asks mpirun's."""
    mpirun, script = shutil.which("mpirun"), shutil.which("script")
    if mpirun is None or script is None:
        pytest.skip("needs mpirun and script (util-linux)")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_COMM_", "PMIX_", "OMPI_MCA_ess"))}
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    cmd = [mpirun, "-n", "1", "--oversubscribe", sys.executable, "-c", PROBE]
    piped = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env)
    assert piped.stdout.strip() == "False", piped.stderr
    # `script` runs mpirun on a pseudo-terminal, as a person at a shell does.
    line = shlex.join(cmd)
    watched = subprocess.run(
        [script, "-qec", line, "/dev/null"], capture_output=True, text=True, timeout=60, env=env
    )
    assert watched.stdout.strip().splitlines()[-1].strip() == "True", watched.stdout + watched.stderr
