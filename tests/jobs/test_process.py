"""Issue 36: the process stays the user's.

Signal handlers are kept through `import moe_a2a` and the opening of an
engine, Ctrl-C ends a call blocked in a wait (and stops the instance on every
rank), and an instance is refused in a forked child without disturbing the
parent's job. docs/process.md, "Signals" and "Forked children".
"""

from __future__ import annotations

import os
import platform
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from moe_a2a import _core

JOB = Path(__file__).with_name("process_job.py")
HAVE_SHM = "shm" in _core.libfabric_providers()


def _python(code: str, **kwargs: object) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", code],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=os.environ | {"FI_TCP_IFACE": "lo"},
        **kwargs,  # type: ignore[arg-type]
    )


# Opens an engine of each provider here: libfabric 1.17's shm provider installs
# handlers at its first endpoint, which the core puts back.
OPEN_ENGINES = """
from moe_a2a import _core
engines = [_core.TransferEngine(0, 1, p) for p in PROVIDERS]
"""


def _open_engines_code() -> str:
    providers = ["tcp", "shm"] if HAVE_SHM else ["tcp"]
    return OPEN_ENGINES.replace("PROVIDERS", repr(providers))


@pytest.mark.timeout(60)
def test_a_sigterm_handler_installed_before_the_import_still_runs() -> None:
    code = (
        "import os, signal\n"
        "signal.signal(signal.SIGTERM, lambda *_: print('handled SIGTERM', flush=True))\n"
        "import moe_a2a\n" + _open_engines_code() + "os.kill(os.getpid(), signal.SIGTERM)\n"
        "print('after', flush=True)\n"
    )
    p = _python(code)
    out, err = p.communicate(timeout=50)
    lines = out.split("\n")[:2]
    assert (p.returncode, lines) == (0, ["handled SIGTERM", "after"]), f"rc {p.returncode}\n{err[-2000:]}"


# Every disposition as the C library has it (the handler's address, which Python's
# signal.getsignal does not show for handlers installed by C code).
DISPOSITIONS = """
import ctypes, signal
def dispositions():
    sigaction = ctypes.CDLL(None).sigaction
    out = {}
    for s in range(1, signal.NSIG):
        buf = ctypes.create_string_buffer(512)
        if sigaction(s, None, buf) == 0:
            out[s] = buf.raw[:ctypes.sizeof(ctypes.c_void_p)]
    return out
"""


@pytest.mark.skipif(not HAVE_SHM, reason="no shm provider here, whose first endpoint takes handlers")
@pytest.mark.timeout(60)
def test_opening_engines_changes_no_disposition() -> None:
    code = (
        DISPOSITIONS
        + "import moe_a2a\nbefore = dispositions()\n"
        + _open_engines_code()
        + "print(sorted(s for s, h in dispositions().items() if h != before[s]), flush=True)\n"
    )
    p = _python(code)
    out, err = p.communicate(timeout=50)
    assert (p.returncode, out.strip()) == (0, "[]"), f"rc {p.returncode}\n{err[-2000:]}"


@pytest.mark.timeout(60)
def test_sigint_in_time_sleep_raises_keyboard_interrupt() -> None:
    code = (
        "import sys, time\n"
        "import moe_a2a\n" + _open_engines_code() + "try:\n"
        "    print('ready', flush=True)  # inside the try: the signal may come as soon as it is out\n"
        "    time.sleep(40)\n"
        "except KeyboardInterrupt:\n"
        "    print('KeyboardInterrupt', flush=True)\n"
        "    sys.exit(5)\n"
    )
    p = _python(code)
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
    assert (p.returncode, out.strip()) == (5, "KeyboardInterrupt"), f"rc {p.returncode}\n{err[-2000:]}"


@pytest.mark.timeout(60)
def test_a_segfault_is_death_by_signal() -> None:
    code = "import ctypes\nimport moe_a2a\n" + _open_engines_code() + "ctypes.string_at(0)\n"
    p = _python(code)
    _, err = p.communicate(timeout=50)
    assert p.returncode == -signal.SIGSEGV, f"rc {p.returncode}\n{err[-2000:]}"


# -- jobs -------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ranks(mode: str, provider: str, rpn: str, world: int) -> list[subprocess.Popen[str]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_"))}
    env |= {"WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
    env |= {"FI_TCP_IFACE": "lo", "MOE_A2A_ABORT_ON_ERROR": "0"}
    return [
        subprocess.Popen(
            [sys.executable, str(JOB), mode, provider, rpn],
            env=env | {"RANK": str(r)},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(world)
    ]


def _in_sleep(pid: int) -> bool:
    """Whether the main thread of `pid` sleeps in (clock_)nanosleep, as the core's waits do."""
    task = f"/proc/{pid}/task/{pid}"
    try:
        with open(f"{task}/wchan") as f:
            wchan = f.read()
        if wchan not in ("", "0"):
            return "nanosleep" in wchan
        with open(f"{task}/syscall") as f:
            number = f.read().split()[0]
    except (OSError, IndexError):
        return False
    sleeps = {"x86_64": {"35", "230"}, "aarch64": {"101", "115"}}.get(platform.machine(), set())
    return number in sleeps


def _until(what: str, done: object, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s} s: {what}")
        time.sleep(0.002)  # polling a condition, not waiting for one to hold


def _line(p: subprocess.Popen[str], prefix: str) -> str:
    """The next line of `p` that starts with `prefix` (other lines are the job's chatter)."""
    assert p.stdout is not None
    for line in p.stdout:
        if line.startswith(prefix):
            return line.strip()
    raise AssertionError(f"rank ended (rc {p.wait()}) before printing {prefix!r}")


RAISED = re.compile(r"raised (\w+) at ([0-9.]+):\s?(.*)")


@pytest.mark.timeout(180)
@pytest.mark.parametrize("rpn", ["none", "1"])  # one node (shared memory); every rank its own (tcp)
def test_ctrl_c_ends_a_blocked_call_and_every_rank_fails_together(rpn: str) -> None:
    ranks = _ranks("interrupt", "tcp", rpn, 3)
    try:
        for p in ranks[:2]:
            _line(p, "calling")
        # Rank 2 has not called: ranks 0 and 1 wait in the core, whose waits sleep.
        _until("rank 1 sleeps in its call's wait", lambda: _in_sleep(ranks[1].pid), 20.0)
        ranks[1].send_signal(signal.SIGUSR1)  # its handler runs in the wait, and may not close the instance
        handler = _line(ranks[1], "handler")
        _until("rank 0 sleeps in its call's wait", lambda: _in_sleep(ranks[0].pid), 20.0)
        sent = time.monotonic()
        ranks[0].send_signal(signal.SIGINT)
        got = [RAISED.match(_line(p, "raised")) for p in ranks[:2]]
        assert ranks[2].stdin is not None
        ranks[2].stdin.write("go\n")
        ranks[2].stdin.flush()
        got.append(RAISED.match(_line(ranks[2], "raised")))
        nexts = [_line(p, "next") for p in ranks]
        for p in ranks:
            p.wait(timeout=60)
    finally:
        for p in ranks:
            if p.poll() is None:
                p.kill()
    assert "the dispatch of this AllToAll is still under way" in handler, handler
    assert all(got), got
    kinds = [m[1] for m in got]  # type: ignore[index]
    took = [float(m[2]) - sent for m in got]  # type: ignore[index]
    print(f"rpn {rpn}: raised {kinds} at {', '.join(f'{t:.3f}' for t in took)} s after the SIGINT")
    assert kinds == ["KeyboardInterrupt", "PeerFailedError", "PeerFailedError"], got
    assert took[0] < 0.5, f"rank 0 raised KeyboardInterrupt {took[0]:.2f} s after SIGINT"
    assert took[1] < 2.0, f"rank 1 failed {took[1]:.2f} s after rank 0's SIGINT"
    for m in got[1:]:
        assert "peer 0 failed" in m[3] and "KeyboardInterrupt" in m[3], m[3]  # type: ignore[index]
    for line in nexts:
        assert "unusable after an earlier failure" in line, line
    assert [p.returncode for p in ranks] == [0, 0, 0]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("rpn", ["none", "1"])  # one node (the child shares the workspaces); tcp
def test_a_forked_child_is_refused_and_the_parent_goes_on_exact(rpn: str) -> None:
    ranks = _ranks("fork", "tcp", rpn, 2)
    try:
        outs = [p.communicate(timeout=150)[0] for p in ranks]
    finally:
        for p in ranks:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in ranks] == [0, 0], outs
    child = re.search(r"child raised (\w+) after ([0-9.]+) s: (.*)", outs[0])
    assert child, outs[0]
    assert child[1] == "RuntimeError" and "not usable in a forked child" in child[3], child[0]
    assert f"created in process {ranks[0].pid}" in child[3], child[0]
    assert float(child[2]) < 0.1, child[0]
    assert "child exit 0" in outs[0], outs[0]
    for out in outs:
        assert "rounds 6 exact" in out, out
