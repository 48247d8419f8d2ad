"""Issue 17, item 5: a peer killed mid-call is noticed within a second, not at timeout_s."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("kill_job.py")
TIMEOUT_S = 30.0  # the job's Config.timeout_s; before, the survivor failed only then


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.timeout(180)
@pytest.mark.parametrize("rpn", ["1", "none"])  # every peer over the fabric; one node (shared memory)
@pytest.mark.parametrize("provider", ["tcp", "shm"])
def test_a_killed_peer_fails_the_survivor_within_a_second(provider: str, rpn: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_"))}
    env |= {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
    procs = [
        subprocess.Popen(
            [sys.executable, str(SCRIPT), provider, rpn],
            env=env | {"RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(2)
    ]
    try:
        out, _ = procs[0].communicate(timeout=120)
        procs[1].wait(timeout=30)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert procs[1].returncode == -9, f"rank 1 was not killed (rc {procs[1].returncode})"
    found = re.search(r"rank 0 failed after ([0-9.]+) s: (\w+): (.*)", out)
    assert found, out
    took, kind, message = float(found[1]), found[2], found[3]
    assert kind == "FabricError" and "peer 1" in message and "is gone" in message, out
    assert took < 2.0, f"the survivor failed after {took:.2f} s (timeout_s={TIMEOUT_S})\n{out}"
    assert procs[0].returncode == 3, out
