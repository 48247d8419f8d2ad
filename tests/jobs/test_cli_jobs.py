"""Usage errors of the `moe-a2a` command under mpirun reach the terminal, every time.

mpirun kills the other ranks as soon as one exits with a non-zero status; only
rank 0 prints the error, so it must have written it before any rank exits
(moe_a2a.usage: the ranks exit together). The error was lost when rank 0 ran
behind the others; the test starts rank 0 late by a different delay in each of
its runs, from none to well past the time a rank needs to parse its arguments.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs mpirun (Open MPI)")

MOE_A2A = str(Path(sys.executable).with_name("moe-a2a"))
MPIRUN = ["mpirun", "--allow-run-as-root", "--oversubscribe"]
RUNS = 20
AT_ONCE = 4


def _job(
    argv: list[str], ranks: int = 2, timeout: float = 120, rank0_late_s: float = 0.0, **env: str
) -> subprocess.CompletedProcess[str]:
    """`mpirun -n ranks moe-a2a argv`; rank 0 starts `rank0_late_s` after the others."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("OMPI_COMM_WORLD")} | env
    late = ["sh", "-c", f'sleep {rank0_late_s}; exec "$0" "$@"'] if rank0_late_s else []
    command = [*MPIRUN, "-n", "1", *late, MOE_A2A, *argv]
    if ranks > 1:
        command += [":", "-n", str(ranks - 1), MOE_A2A, *argv]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=environ)


def _error_lines(done: subprocess.CompletedProcess[str]) -> list[str]:
    return [line for line in (done.stdout + done.stderr).splitlines() if line.startswith("moe-a2a")]


@pytest.mark.timeout(600)
def test_usage_errors_reach_the_terminal_in_every_run() -> None:
    """20 jobs of 2 ranks with a usage error (a misspelled flag, an unknown provider), rank 0
    late by 0 to 0.95 s: each shows the one-line error once and ends with status 2."""
    cases = [
        (["run", "--bogus-flag"], "moe-a2a run: error: unrecognized arguments: --bogus-flag"),
        (["run", "--provider", "tpc"], "moe-a2a run: error: --provider: got 'tpc'"),
    ]
    jobs = [(*cases[i % len(cases)], i / 20) for i in range(RUNS)]
    with ThreadPoolExecutor(AT_ONCE) as pool:
        results = list(pool.map(lambda job: _job(job[0], rank0_late_s=job[2]), jobs))
    lost = []
    for (argv, expected, late), done in zip(jobs, results, strict=True):
        lines = _error_lines(done)
        if done.returncode != 2 or len(lines) != 1 or not lines[0].startswith(expected):
            lost.append(
                f"{' '.join(argv)} (rank 0 late by {late:.1f} s): status {done.returncode}, lines {lines}"
            )
    assert lost == [], f"{len(lost)} of {RUNS} runs lost or garbled the error:\n" + "\n".join(lost)


@pytest.mark.timeout(300)
def test_capacity_error_names_the_command_line_flag() -> None:
    """A run whose routing overflows --max-recv-tokens names that flag, not the library's Config field."""
    done = _job(
        ["run", "--model", "tiny", "--max-recv-tokens", "1", "--iters", "1", "--warmup", "0"],
        ranks=1,
        MOE_A2A_PROVIDER="tcp",
    )
    text = done.stdout + done.stderr
    assert done.returncode != 0
    lines = [line for line in _error_lines(done) if "max_recv_tokens=1" in line]
    assert len(lines) == 1, text
    assert "raise --max-recv-tokens" in lines[0] and "Config" not in lines[0]
    assert "Traceback" not in text


@pytest.mark.timeout(300)
def test_bench_a2a_off_a_terminal_says_what_finished_and_ctrl_c_keeps_it() -> None:
    """stderr to a pipe (a log): a line per finished shape; Ctrl-C during the next one prints the
    finished shape's table, says what finished and exits 130."""
    small = ["--hidden", "256", "--num-experts", "8", "--topk", "2", "--warmup", "0", "--provider", "tcp"]
    # prefill moves 8x decode's tokens: still running when decode's line arrives.
    argv = [MOE_A2A, "bench", "a2a", *small, "--iters", "30", "--mode", "both"]
    environ = {k: v for k, v in os.environ.items() if not k.startswith("OMPI_")}
    with subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environ
    ) as proc:
        assert proc.stderr is not None
        first = proc.stderr.readline()  # blocks until the line comes: no timing assumed
        proc.send_signal(signal.SIGINT)
        out, rest = proc.communicate(timeout=120)
    assert first == "moe-a2a bench a2a: decode done\n", first + rest
    assert proc.returncode == 130, rest
    assert rest.strip().splitlines()[-1] == "moe-a2a bench a2a: interrupted; finished: decode"
    assert "| decode " in out and "| prefill " not in out and "moe-a2a/engine" not in out


@pytest.mark.timeout(300)
def test_main_job_prints_its_command_and_next_steps_that_work_in_a_plain_shell(tmp_path: Path) -> None:
    """tools/main_job.sh (the quick start's `run`) shows the mpirun line it runs, and its
    `next` commands work in a shell that has not activated the virtualenv."""
    root = Path(__file__).resolve().parents[2]
    venv_bin = str(Path(sys.executable).parent)
    environ = {k: v for k, v in os.environ.items() if not k.startswith("OMPI_")}
    environ |= {"MOE_A2A_OUT": str(tmp_path), "PATH": f"{venv_bin}:{environ['PATH']}"}
    done = subprocess.run(
        ["bash", str(root / "tools" / "main_job.sh")],
        capture_output=True,
        text=True,
        timeout=240,
        env=environ,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    trace = tmp_path / "decode-tiny.h5"
    assert lines[0].startswith("$ mpirun -n 4 ") and "moe-a2a run --mode decode" in lines[0]
    assert lines[0].endswith(f"--trace {trace}")
    assert "  ranks:      4 in 2 virtual node(s) of 2 (--ranks-per-node 2)" in lines
    assert any(line.startswith("verify: OK") for line in lines)
    steps = [line.strip() for line in lines[lines.index("next, in your shell:") + 1 :] if line.strip()]
    assert steps[0] == f"source {root}/.venv/bin/activate"
    assert steps[1] == f"moe-a2a trace summary {trace}"
    # The user's shell: without the virtualenv on PATH, as after the quick start.
    plain = {k: v for k, v in environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    plain["PATH"] = os.pathsep.join(p for p in environ["PATH"].split(os.pathsep) if p != venv_bin)
    shell = subprocess.run(
        ["bash", "-c", f"{steps[0]} && {steps[1]}"], capture_output=True, text=True, timeout=120, env=plain
    )
    assert shell.returncode == 0 and "microseconds" in shell.stdout, shell.stderr
