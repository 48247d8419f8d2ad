"""`moe-a2a cleanup`: the /dev/shm files of a killed rank are removed, those of live processes kept;
an instance left open at interpreter exit goes without a word."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from moe_a2a import _core, cli
from moe_a2a.cleanup import SHM_DIR, dead_files, remove_dead_files

# A process with an open shm endpoint (world of one), killed before it can close it.
CHILD = """
from moe_a2a import _core
e = _core.TransferEngine(0, 1, "shm")
print("ready", flush=True)
import time
time.sleep(120)
"""


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait(timeout=30)
    return p.pid


@pytest.mark.skipif("shm" not in _core.libfabric_providers(), reason="libfabric offers no shm provider here")
@pytest.mark.timeout(120)
def test_killed_rank_files_are_removed() -> None:
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        mine = [n for n in os.listdir(SHM_DIR) if n.startswith(f"{child.pid}:")]
        assert mine, "the shm endpoint made no /dev/shm file"
        assert dead_files(pids=[child.pid]) == []  # alive: left alone
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
        left = sorted(f.path for f in dead_files(pids=[child.pid]))
        assert left == sorted(os.path.join(SHM_DIR, n) for n in mine), "SIGKILL leaks no more: fix the docs"
        assert cli.main(["cleanup", "--pid", str(child.pid)]) == 0
        assert [n for n in os.listdir(SHM_DIR) if n.startswith(f"{child.pid}:")] == []
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(timeout=30)


# A process whose pid a killed rank had: that rank's file, under the name libfabric's
# shm would give this process's first endpoint, is still there.
REUSED_PID = """
import os
stale = f"/dev/shm/{os.getpid()}:{os.getuid()}:0"
with open(stale, "wb") as f:
    f.write(b"x" * 64)
try:
    from moe_a2a import _core
    _core.TransferEngine(0, 1, "shm")
    print("opened", flush=True)
finally:
    os.unlink(stale)
"""


@pytest.mark.skipif("shm" not in _core.libfabric_providers(), reason="libfabric offers no shm provider here")
@pytest.mark.timeout(120)
def test_a_dead_process_file_under_this_pid_does_not_block_an_endpoint() -> None:
    out = subprocess.run([sys.executable, "-c", REUSED_PID], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "opened", out.stderr[-2000:]


def test_only_dead_processes_files_go(tmp_path) -> None:  # type: ignore[no-untyped-def]
    dead, live = _dead_pid(), os.getpid()
    names = [
        f"{dead}:0:0",
        f"{dead}:3:1",
        f"moe-a2a-{dead}-0123456789ab-r1",
        f"{live}:0:0",
        f"moe-a2a-{live}-0123456789ab-r0",
        "vader_segment.vm.0.1",
        f"{dead}.txt",
    ]
    for n in names:
        (tmp_path / n).write_bytes(b"x" * 8)
    removed = remove_dead_files(str(tmp_path))
    assert sorted(os.path.basename(f.path) for f in removed) == sorted(names[:3])
    assert sorted(os.listdir(tmp_path)) == sorted(names[3:])
    assert remove_dead_files(str(tmp_path)) == []


# An instance left open when the interpreter exits: torch imported first, so its modules (and
# moe_a2a's) are torn down before the instance is collected.
LEFT_OPEN = """
import torch
from mpi4py import MPI
from moe_a2a import Config
from moe_a2a.autograd import ExpertParallel
ep = ExpertParallel(Config(max_tokens=8, hidden=128, num_experts=4, topk=2), MPI.COMM_WORLD, device="cpu")
"""


@pytest.mark.timeout(120)
def test_an_instance_left_open_at_exit_prints_nothing() -> None:
    run = subprocess.run([sys.executable, "-c", LEFT_OPEN], capture_output=True, text=True, timeout=100)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "Exception ignored" not in run.stderr, run.stderr[-2000:]
