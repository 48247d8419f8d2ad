"""`moe-a2a cleanup` counts a dead but unreaped rank (a zombie) as gone (issue 36, item 4)."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from moe_a2a import cli
from moe_a2a.cleanup import dead_files, pid_alive


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        stat = f.read()
    return stat[stat.rfind(")") + 2]


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs /proc to see a process's state")
@pytest.mark.timeout(60)
def test_a_zombies_files_are_found_and_removed(tmp_path: Path) -> None:
    child = subprocess.Popen(["true"])  # not waited for: it stays a zombie until reaped
    try:
        deadline = time.monotonic() + 30
        while _state(child.pid) != "Z":  # polling the process's state, not waiting for time to pass
            assert time.monotonic() < deadline, "the child did not end"
            time.sleep(0.005)
        names = [f"{child.pid}:0:0", f"moe-a2a-{child.pid}-0123456789ab-r0"]
        for n in names:
            (tmp_path / n).write_bytes(b"x" * 8)
        assert not pid_alive(child.pid)
        assert sorted(f.path for f in dead_files(str(tmp_path), [child.pid])) == sorted(
            str(tmp_path / n) for n in names
        )
        assert cli.main(["cleanup", "--dir", str(tmp_path), "--pid", str(child.pid)]) == 0
        assert os.listdir(tmp_path) == []
    finally:
        child.wait(timeout=30)


def test_a_live_process_is_alive() -> None:
    assert pid_alive(os.getpid())
