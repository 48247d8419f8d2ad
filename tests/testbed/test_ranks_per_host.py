"""Several ranks per emulated host, testbeds side by side, and tools/testbed.py's command line.

Needs root and network namespaces; skips with the reason elsewhere.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_testbed import ROOT, run_ranks, testbed

TOOL = [sys.executable, str(ROOT / "tools" / "testbed.py")]

_why = testbed.unavailable()
pytestmark = pytest.mark.skipif(_why is not None, reason=f"testbed: {_why}")


def _namespaces() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout


def test_two_hosts_of_two_ranks_exchange_exactly(tmp_path: Path) -> None:
    """The 2 ranks of a host are one node (host name, /dev/shm) and reach the other host's over its NICs."""
    with testbed.Testbed(2, ranks_per_host=2) as bed:
        before = [bed.counters(h) for h in range(2)]
        reports = run_ranks(bed, tmp_path, "node", "va1,va2")
        after = [bed.counters(h) for h in range(2)]
    assert [r["host"] for r in reports] == [bed.namespaces[0]] * 2 + [bed.namespaces[1]] * 2
    assert [r["node_ranks"] for r in reports] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [r["local_size"] for r in reports] == [2] * 4
    for rank, r in enumerate(reports):
        mate = rank ^ 1  # the other rank of its host: shared memory only, nothing over the fabric
        others = [p for p in range(4) if p // 2 != rank // 2]
        assert r["fabric_bytes"][mate] == 0 and r["node_bytes"][mate] > 0, (rank, r)
        assert all(r["node_bytes"][p] == 0 and r["fabric_bytes"][p] > 0 for p in others), (rank, r)
    for h in range(2):  # the fabric bytes of the host's two ranks left through its NICs
        nic_tx = sum(after[h][n]["tx"] - before[h][n]["tx"] for n in ("va1", "va2"))
        fabric = sum(sum(reports[r]["fabric_bytes"]) for r in (2 * h, 2 * h + 1))
        assert nic_tx >= fabric, (h, nic_tx, fabric)


def test_two_testbeds_at_once_leave_each_other_alone() -> None:
    dead = f"{testbed.PREFIX}999999999-0-h0"  # a run whose process is gone left this behind
    subprocess.run(["ip", "netns", "add", dead], check=True)
    try:
        with testbed.Testbed(1) as a, testbed.Testbed(1, ranks_per_host=2) as b:
            assert a.prefix != b.prefix and a.port != b.port
            listed = _namespaces()
            assert a.namespaces[0] in listed and b.namespaces[0] in listed  # b's entry kept a's
            assert dead not in listed  # and removed the dead run's
            got = [
                subprocess.run(bed.wrap(0, ["ip", "-o", "-4", "addr", "show", "va1"]), capture_output=True,
                               text=True, check=True).stdout
                for bed in (a, b)
            ]  # fmt: skip
            assert all("10.77.1.1/24" in g for g in got), got  # same addresses, separate namespaces
            with pytest.raises(RuntimeError, match="exist already"), testbed.Testbed(1, prefix=a.prefix):
                pass
            assert a.namespaces[0] in _namespaces()  # the refused one deleted nothing of a's
        assert a.prefix not in _namespaces() and b.prefix not in _namespaces()
    finally:
        subprocess.run(["ip", "netns", "del", dead], capture_output=True)


def _tool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*TOOL, *args], capture_output=True, text=True, timeout=120)


def test_command_line_up_exec_down() -> None:
    name = f"t{os.getpid()}"
    assert _tool("--help").returncode == 0
    up = _tool("up", "--name", name, "--hosts", "2", "--ranks-per-host", "2")
    try:
        assert up.returncode == 0, up.stderr
        assert f"{testbed.PREFIX}{name}-h0 {testbed.PREFIX}{name}-h1" in up.stdout, up.stdout
        host = _tool("exec", "--name", name, "1", "--", "hostname")
        assert (host.returncode, host.stdout.strip()) == (0, f"{testbed.PREFIX}{name}-h1"), host
        env = _tool(
            "exec",
            "--name",
            name,
            "--rank",
            "3",
            "1",
            "--",
            "sh",
            "-c",
            "echo $RANK $LOCAL_RANK $MASTER_ADDR",
        )
        assert env.stdout.split() == ["3", "1", "10.77.0.1"], env
        wrong = _tool("exec", "--name", name, "--rank", "3", "0", "--", "true")
        assert wrong.returncode == 2 and "rank 3 lives on host 1, not 0" in wrong.stderr, wrong
        assert _tool("exec", "--name", name, "0", "--", "sh", "-c", "exit 7").returncode == 7
        again = _tool("up", "--name", name)
        assert again.returncode == 1 and "is up already" in again.stderr, again
    finally:
        down = _tool("down", "--name", name)
    assert down.returncode == 0 and f"{testbed.PREFIX}{name}-h0" in down.stdout, down
    assert f"{testbed.PREFIX}{name}-" not in _namespaces()
    gone = _tool("exec", "--name", name, "0", "--", "true")
    assert gone.returncode == 1 and "is not up" in gone.stderr, gone
