"""Shared test infrastructure: fabric fixtures and the rules that keep MPI runs from hanging.

Unit tests (tests/unit) and the in-process protocol tests (tests/protocol) run with
plain `python -m pytest tests/unit tests/protocol`; tests/jobs start jobs of their own. MPI tests
(tests/mpi) run under `mpirun -n N python -m pytest --with-mpi -q tests/mpi`.

Under MPI with more than one rank:
- a test that fails on one rank prints its report to stderr and aborts the
  whole job (`MPI.COMM_WORLD.Abort`), so the other ranks never wait for it in
  a collective or an engine wait;
- a test that runs past its timeout (pytest-timeout: `timeout = 300` in
  pyproject, smaller per test) dumps every thread's stack and aborts the job
  the same way. pytest-timeout's own methods cannot do that: `signal` never
  fires while the main thread sits in a blocking MPI call, and `thread` ends
  only this rank. Before aborting (after a failure too) it also asks the
  other ranks on its host for their stacks (SIGUSR1: each rank dumps into a
  file of its own) and adds them to its report, since the rank that holds
  the others up may be outside any test's timer, or unable to write to its
  console.

Environment:
- `MOE_A2A_TEST_PROVIDER`: libfabric provider of the fabric tests (default `tcp`).
- `MOE_A2A_TEST_NUM_NICS`: NICs per rank of the default engine (default 1).
- `MOE_A2A_TEST_SEED`: seed of the random test data (default: drawn by rank 0;
  shown in the header and in every failure report, so a failure can be replayed).

Only rank 0 should write to the console: run the other ranks with their output
redirected to per-rank log files (tools/rank0_console.sh does that). A failing
or timed-out rank writes its report to its own stderr, which is then in its
log; mpirun names the rank that aborted.
"""

from __future__ import annotations

import contextlib
import faulthandler
import glob
import itertools
import os
import secrets
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

# Tests check fabric errors as exceptions; under mpirun the library would end the
# job on one instead (abort_on_error). tests/jobs/test_abort_on_error.py turns it back on.
os.environ.setdefault("MOE_A2A_ABORT_ON_ERROR", "0")

_seed: int | None = None  # the job's seed, fixed in pytest_configure
_host_peers: list[tuple[int, int]] = []  # (rank, pid) of the other ranks on this host
_stacks_file: Any = None  # where this rank dumps its stacks when a peer asks (SIGUSR1)
STACKS_GRACE_S = 2.0  # how long a failed or timed-out rank waits for the others' stacks


def _with_mpi(config: pytest.Config) -> bool:
    return bool(
        config.getoption("--with-mpi", default=False) or config.getoption("--only-mpi", default=False)
    )


def _world() -> tuple[int, int]:
    """(rank, world size) of COMM_WORLD; only called under --with-mpi, where MPI is wanted."""
    from mpi4py import MPI

    return MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()


def _env_int(name: str, default: int, minimum: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        value = minimum - 1
    if value < minimum:
        raise pytest.UsageError(f"{name}: got {raw!r}; expected an integer >= {minimum}")
    return value


def _to_stderr(config: pytest.Config, text: str) -> None:
    """Write to this rank's real stderr, past pytest's output capture."""
    capman = config.pluginmanager.getplugin("capturemanager")
    if capman is not None:
        capman.suspend_global_capture(in_=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os.write(2, text.encode(errors="replace"))


def _abort(config: pytest.Config, text: str) -> None:
    """Report, then end every rank of the job. The report also goes to
    $MOE_A2A_RANK_LOGS/rankN.abort.log, where tools/run_tests.sh names the failed test from
    (rank 0 writes to the console alone, tools/rank0_console.sh)."""
    from mpi4py import MPI

    _to_stderr(config, text)
    logs = os.environ.get("MOE_A2A_RANK_LOGS")
    if logs:
        with (
            contextlib.suppress(OSError),
            open(os.path.join(logs, f"rank{MPI.COMM_WORLD.Get_rank()}.abort.log"), "w") as f,
        ):
            f.write(text)
    MPI.COMM_WORLD.Abort(1)


# ---------------------------------------------------------------- configuration


def pytest_configure(config: pytest.Config) -> None:
    global _seed, _watchdog
    seed = _env_int("MOE_A2A_TEST_SEED", -1, 0)
    if seed < 0:
        seed = secrets.randbits(32)
    if _with_mpi(config):
        from mpi4py import MPI

        # Rank 0's choice wins, so every rank generates the same data for every rank.
        seed = MPI.COMM_WORLD.bcast(seed, root=0)
        _answer_stack_requests()
        if MPI.COMM_WORLD.Get_size() > 1:
            _watchdog = _Watchdog()
    _seed = seed


_STACKS_FILE = "moe-a2a-stacks-{}.txt"  # in the temporary directory, by pid


def _stacks_path(pid: int | str) -> str:
    return os.path.join(tempfile.gettempdir(), _STACKS_FILE.format(pid))


def _answer_stack_requests() -> None:
    """Collective: learn the other ranks on this host; dump our stacks to a file on SIGUSR1."""
    global _stacks_file, _host_peers
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    ranks = comm.allgather((socket.gethostname(), os.getpid()))
    host = ranks[comm.Get_rank()][0]
    _host_peers = [(r, pid) for r, (h, pid) in enumerate(ranks) if h == host and r != comm.Get_rank()]
    _remove_dead_stack_files()
    _stacks_file = open(_stacks_path(os.getpid()), "w")  # noqa: SIM115 (open for the whole session)
    faulthandler.register(signal.SIGUSR1, file=_stacks_file, all_threads=True)


def _remove_dead_stack_files() -> None:
    """Stack files of aborted runs (an aborted rank never reaches pytest_unconfigure)."""
    for path in glob.glob(_stacks_path("*")):
        prefix, suffix = _STACKS_FILE.split("{}")
        pid = os.path.basename(path).removeprefix(prefix).removesuffix(suffix)
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            with contextlib.suppress(OSError):
                os.unlink(path)
        except OSError:
            pass  # alive, another user's


def pytest_unconfigure(config: pytest.Config) -> None:
    if _stacks_file is not None:
        faulthandler.unregister(signal.SIGUSR1)
        _stacks_file.close()
        os.unlink(_stacks_file.name)


def _peer_stacks(rank: int) -> str:
    """Asks the other ranks on this host for their stacks; returns them as text."""
    for _, pid in _host_peers:
        with contextlib.suppress(OSError):  # already gone
            os.kill(pid, signal.SIGUSR1)
    time.sleep(STACKS_GRACE_S)
    parts = []
    for r, pid in _host_peers:
        try:
            with open(_stacks_path(pid)) as f:
                text = f.read()
        except OSError as err:
            text = f"(none: {err})\n"
        parts.append(f"\n--- rank {r}'s stacks, as rank {rank} asked for them ---\n{text}")
    return "".join(parts)


def pytest_report_header(config: pytest.Config) -> list[str]:
    lines = [
        f"moe-a2a tests: provider={os.environ.get('MOE_A2A_TEST_PROVIDER', 'tcp')}, MOE_A2A_TEST_SEED={_seed}"
    ]
    if _with_mpi(config):
        rank, world = _world()
        lines.append(f"MPI: rank {rank} of {world}")
    return lines


# ---------------------------------------------------------------- failure => abort


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    report: pytest.TestReport = outcome.get_result()
    if not report.failed or not _with_mpi(item.config):
        return
    rank, world = _world()
    if world == 1:
        return  # nobody waits for us: let pytest report as usual
    # The others' stacks too: a failure here is often a wait for a rank that is stuck.
    _abort(
        item.config,
        f"\n=== moe-a2a: rank {rank} of {world}: {item.nodeid} FAILED during {report.when}; "
        f"aborting the MPI job (replay with MOE_A2A_TEST_SEED={_seed}) ===\n{report.longreprtext}\n"
        + _peer_stacks(rank),
    )


@pytest.hookimpl(tryfirst=True, optionalhook=True)  # optional: a hook of pytest-timeout
def pytest_timeout_set_timer(item: pytest.Item, settings: Any) -> bool | None:
    """Under MPI with several ranks: on timeout dump all stacks and abort the job."""
    if not _with_mpi(item.config) or not settings.timeout or settings.timeout <= 0:
        return None  # pytest-timeout's own methods
    rank, world = _world()
    if world == 1:
        return None

    def expire() -> None:
        _to_stderr(
            item.config,
            f"\n=== moe-a2a: rank {rank} of {world}: {item.nodeid} timed out after {settings.timeout} s; "
            "stacks follow, then the MPI job is aborted ===\n",
        )
        faulthandler.dump_traceback(file=2, all_threads=True)
        os.write(2, _peer_stacks(rank).encode(errors="replace"))
        from mpi4py import MPI

        MPI.COMM_WORLD.Abort(1)

    # pytest-timeout's pytest_timeout_cancel_timer calls item.cancel_timeout.
    item.cancel_timeout = _watchdog.disarm  # type: ignore[attr-defined]
    _watchdog.arm(settings.timeout, expire)
    return True


class _Watchdog:
    """One thread for the whole session that times out the current test.

    Not a timer thread per test: on the 2-vCPU CI machine, starting a new
    thread once took over a minute (its first mmap waited on the process's
    memory-map lock; the rank sat in Thread.start, outside any test's timer,
    while the others timed out waiting for it in a collective).
    """

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._deadline: float | None = None
        self._on_expire: Callable[[], None] | None = None
        threading.Thread(target=self._run, name="moe-a2a test watchdog", daemon=True).start()

    def arm(self, seconds: float, on_expire: Callable[[], None]) -> None:
        with self._cv:
            self._deadline = time.monotonic() + seconds
            self._on_expire = on_expire
            self._cv.notify()

    def disarm(self) -> None:
        with self._cv:
            self._deadline = None
            self._cv.notify()

    def _run(self) -> None:
        with self._cv:
            while True:
                if self._deadline is None:
                    self._cv.wait()
                    continue
                left = self._deadline - time.monotonic()
                if left <= 0:
                    break
                self._cv.wait(left)
            on_expire = self._on_expire
        assert on_expire is not None
        on_expire()  # aborts the job


_watchdog: Any = None  # the session's _Watchdog (MPI runs of several ranks)


# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="session")
def provider() -> str:
    """Libfabric provider under test: MOE_A2A_TEST_PROVIDER, default tcp."""
    name = os.environ.get("MOE_A2A_TEST_PROVIDER", "tcp")
    if not name:
        raise pytest.UsageError(
            "MOE_A2A_TEST_PROVIDER: got an empty string; expected a provider such as tcp or shm"
        )
    return name


@pytest.fixture(scope="session")
def num_nics() -> int:
    """NICs (endpoints) per rank of the default engine: MOE_A2A_TEST_NUM_NICS, default 1."""
    return _env_int("MOE_A2A_TEST_NUM_NICS", 1, 1)


@pytest.fixture(scope="session")
def bootstrap() -> Any:
    """The job's Bootstrap over MPI.COMM_WORLD."""
    from moe_a2a.bootstrap import Bootstrap

    return Bootstrap()


@pytest.fixture(scope="session")
def seed() -> int:
    """One seed for the whole job, the same on every rank: MOE_A2A_TEST_SEED or drawn by rank 0."""
    assert _seed is not None
    return _seed


@pytest.fixture(scope="session")
def next_tag() -> Callable[[], int]:
    """Fresh 16-bit immediate tags. Every rank runs the same tests in the same order, so
    the n-th tag is the same everywhere; a fresh tag per use keeps a test's leftover
    arrivals out of the next test's counts."""
    counter = itertools.count(1000)

    def take() -> int:
        tag = next(counter)
        if tag > 0xFFFF:
            raise RuntimeError(f"next_tag: ran out of 16-bit tags (got {tag})")
        return tag

    return take


@pytest.fixture(scope="module")
def make_engine(bootstrap: Any, provider: str) -> Iterator[Callable[..., Any]]:
    """Engines for one test module, cached by (num_nics, split_threshold); collective on first use.

    At the end of the module every rank meets in a barrier before the engines
    go, so no peer is still writing into a region being deregistered.
    """
    from moe_a2a import _core
    from moe_a2a.fabric import Engine, prepare_environment

    engines: dict[tuple[int, int], Any] = {}
    prepare_environment(bootstrap, provider)
    domains = _core.libfabric_domains(provider)

    def make(num_nics: int = 1, split_threshold: int = 1 << 20) -> Any:
        key = (num_nics, split_threshold)
        # This machine offers one device per provider (lo, shm): the multi-NIC
        # tests open several endpoints on it, by naming it once per NIC.
        nics = None if num_nics <= len(domains) else [domains[0]] * num_nics
        if key not in engines:
            engines[key] = Engine(
                bootstrap, provider, num_nics=num_nics, split_threshold=split_threshold, nics=nics
            )
        return engines[key]

    yield make
    bootstrap.barrier()
    engines.clear()


@pytest.fixture(scope="module")
def engine(make_engine: Callable[..., Any], num_nics: int) -> Any:
    """The module's default engine (MOE_A2A_TEST_NUM_NICS NICs)."""
    return make_engine(num_nics=num_nics)
