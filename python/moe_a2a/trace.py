"""HDF5 run traces: schema, writer, reader, and the per-rank recorder.

One file per run, written by rank 0 from data gathered over MPI (h5py wheels
have no MPI-IO). The schema is documented in docs/trace-format.md; bump
`SCHEMA_VERSION` whenever a change would make an older reader misread a file.

Time stamps are taken with `time.perf_counter_ns()`, which on Linux reads
CLOCK_MONOTONIC: stamps of different processes on one host share a clock,
stamps of different hosts do not (each host's clock has its own origin). The
tools therefore align the ranks of an iteration by subtracting, per iteration,
the earliest start over all ranks (`RunTrace.aligned_ns`); across hosts that
alignment is only approximate.
"""

from __future__ import annotations

import json
import math
import os
import platform
import shlex
import socket
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

import numpy as np

from moe_a2a import switches

if TYPE_CHECKING:
    import h5py

PHASES = ("dispatch_send", "dispatch_recv", "shared_expert", "experts", "combine_send", "combine_recv")
#: Backward phases of a training step: the backward of the combine (a dispatch of the
#: output gradient) and of the dispatch (a combine of the row gradients).
BACKWARD_PHASES = ("combine_bwd", "dispatch_bwd")
#: Phases of `moe-a2a run --mode train`: the forward dispatch and combine run whole
#: (autograd owns them), then the backward phases, the all-reduce of the gradients of
#: the replicated weights (router, shared expert) and the optimizer step.
TRAIN_PHASES = (
    "dispatch",
    "shared_expert",
    "experts",
    "combine",
    *BACKWARD_PHASES,
    "grad_allreduce",
    "optimizer",
)
PATHS = ("same_node", "fabric")
SCHEMA_VERSION = 1

#: Value of the root attribute ``format`` that marks an HDF5 file as a moe-a2a trace.
FORMAT_MARKER = "moe-a2a-trace"
#: Start and end stamp of a phase that was not recorded (a phase a mode skips).
MISSING = -1

# Datasets at least this many elements are gzip-compressed; smaller ones are
# stored contiguously, where chunking would cost more than it saves.
_COMPRESS_MIN_ELEMENTS = 4096
_GZIP_LEVEL = 4

_DATASETS = (
    "hosts",
    "phases",
    "paths",
    "timing/start_ns",
    "timing/end_ns",
    "tokens_per_expert",
    "bytes_per_peer",
)


class TraceFormatError(ValueError):
    """A file that is not a moe-a2a trace, or one this version cannot read."""


@dataclass
class RunTrace:
    """Everything one run recorded, for all ranks (see docs/trace-format.md)."""

    config: dict[str, Any]  # JSON-serialisable run configuration
    environment: dict[str, str]  # versions, creation time, command line
    hosts: list[str]  # host name of each rank, index = rank
    start_ns: np.ndarray  # int64 [ranks, iters, phases]; MISSING where not recorded
    end_ns: np.ndarray  # int64 [ranks, iters, phases]
    tokens_per_expert: np.ndarray  # int64 [iters, num_experts]
    bytes_per_peer: np.ndarray  # int64 [ranks, iters, ranks, len(PATHS)]
    phases: tuple[str, ...] = field(default=PHASES)

    @property
    def num_ranks(self) -> int:
        return int(self.start_ns.shape[0])

    @property
    def num_iters(self) -> int:
        return int(self.start_ns.shape[1])

    @property
    def num_experts(self) -> int:
        return int(self.tokens_per_expert.shape[1])

    def recorded(self) -> np.ndarray:
        """bool [ranks, iters, phases]: which phases carry a measurement."""
        return self.start_ns != MISSING

    def durations_ns(self) -> np.ndarray:
        """float64 [ranks, iters, phases]: end - start, NaN where not recorded."""
        d = (self.end_ns - self.start_ns).astype(np.float64)
        d[~self.recorded()] = np.nan
        return d

    def total_ns(self) -> np.ndarray:
        """float64 [ranks, iters]: first recorded start to last recorded end; NaN if none."""
        rec = self.recorded()
        start = np.where(rec, self.start_ns, np.iinfo(np.int64).max).min(axis=2)
        end = np.where(rec, self.end_ns, np.iinfo(np.int64).min).max(axis=2)
        out = (end - start).astype(np.float64)
        out[~rec.any(axis=2)] = np.nan
        return out

    def aligned_ns(self) -> tuple[np.ndarray, np.ndarray]:
        """Start and end relative to each iteration's earliest start over all ranks.

        float64 [ranks, iters, phases], NaN where not recorded. Exact for ranks
        on one host; across hosts the clocks are not synchronised.
        """
        rec = self.recorded()
        origin = np.where(rec, self.start_ns, np.iinfo(np.int64).max).min(axis=(0, 2))  # [iters]
        origin = np.where(rec.any(axis=(0, 2)), origin, 0)
        start = (self.start_ns - origin[None, :, None]).astype(np.float64)
        end = (self.end_ns - origin[None, :, None]).astype(np.float64)
        start[~rec] = np.nan
        end[~rec] = np.nan
        return start, end

    def validate(self) -> None:
        """Raise ValueError naming the field, what it holds and what was expected."""
        _validate(self)


# --------------------------------------------------------------------------- validation


def _check_int_array(name: str, value: Any, ndim: int, dims: str) -> np.ndarray:
    if not isinstance(value, np.ndarray):
        raise ValueError(
            f"RunTrace.{name}: expected a numpy int64 array [{dims}], got {type(value).__name__}"
        )
    if value.dtype.kind not in "iu":
        raise ValueError(
            f"RunTrace.{name}: expected an integer array (int64) [{dims}], got dtype {value.dtype}"
        )
    if value.ndim != ndim:
        raise ValueError(f"RunTrace.{name}: expected {ndim} dimensions [{dims}], got shape {value.shape}")
    return value


def _check_json(name: str, value: Any) -> None:
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise ValueError(f"RunTrace.{name}: expected a dict with str keys, got {type(value).__name__}")
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"RunTrace.{name}: must be JSON-serialisable: {exc}") from None


def _validate(t: RunTrace) -> None:
    _check_json("config", t.config)
    _check_json("environment", t.environment)
    phases = tuple(t.phases)
    if not phases or not all(isinstance(p, str) and p for p in phases) or len(set(phases)) != len(phases):
        raise ValueError(f"RunTrace.phases: expected unique non-empty names, got {phases!r}")

    start = _check_int_array("start_ns", t.start_ns, 3, "ranks, iters, phases")
    end = _check_int_array("end_ns", t.end_ns, 3, "ranks, iters, phases")
    ranks, iters, nphases = start.shape
    if ranks < 1 or iters < 1:
        raise ValueError(
            f"RunTrace.start_ns: expected at least one rank and one iteration, got shape {start.shape}"
        )
    if nphases != len(phases):
        raise ValueError(
            f"RunTrace.start_ns: last dimension must match the {len(phases)} phases {phases}, "
            f"got shape {start.shape}"
        )
    if end.shape != start.shape:
        raise ValueError(f"RunTrace.end_ns: expected shape {start.shape} (as start_ns), got {end.shape}")
    missing_start, missing_end = start == MISSING, end == MISSING
    if not np.array_equal(missing_start, missing_end):
        r, i, p = np.argwhere(missing_start != missing_end)[0]
        raise ValueError(
            f"RunTrace: rank {r} iteration {i} phase {phases[p]!r} has start {start[r, i, p]} and end "
            f"{end[r, i, p]}: both must be recorded or both {MISSING}"
        )
    bad = ~missing_start & ((start < 0) | (end < start))
    if bad.any():
        r, i, p = np.argwhere(bad)[0]
        raise ValueError(
            f"RunTrace: rank {r} iteration {i} phase {phases[p]!r} has start {start[r, i, p]} ns and end "
            f"{end[r, i, p]} ns: expected 0 <= start <= end"
        )

    if not isinstance(t.hosts, (list, tuple)) or not all(isinstance(h, str) for h in t.hosts):
        raise ValueError(f"RunTrace.hosts: expected a list of str, got {type(t.hosts).__name__}")
    if len(t.hosts) != ranks:
        raise ValueError(f"RunTrace.hosts: expected one host per rank ({ranks}), got {len(t.hosts)}")

    tok = _check_int_array("tokens_per_expert", t.tokens_per_expert, 2, "iters, num_experts")
    if tok.shape[0] != iters or tok.shape[1] < 1:
        raise ValueError(
            f"RunTrace.tokens_per_expert: expected shape ({iters}, num_experts >= 1), got {tok.shape}"
        )
    if (tok < 0).any():
        raise ValueError("RunTrace.tokens_per_expert: counts must be >= 0, got a negative count")

    nbytes = _check_int_array("bytes_per_peer", t.bytes_per_peer, 4, "ranks, iters, ranks, paths")
    want = (ranks, iters, ranks, len(PATHS))
    if nbytes.shape != want:
        raise ValueError(
            f"RunTrace.bytes_per_peer: expected shape {want} (sender, iter, receiver, path {PATHS}), "
            f"got {nbytes.shape}"
        )
    if (nbytes < 0).any():
        raise ValueError("RunTrace.bytes_per_peer: byte counts must be >= 0, got a negative count")


# --------------------------------------------------------------------------- writer


def _put(group: h5py.Group, name: str, data: np.ndarray, units: str, dims: str) -> None:
    kwargs: dict[str, Any] = {}
    if data.size >= _COMPRESS_MIN_ELEMENTS:
        # shuffle groups the mostly-zero high bytes of int64 stamps and counts: 3-10x smaller.
        kwargs = {"compression": "gzip", "compression_opts": _GZIP_LEVEL, "shuffle": True}
    ds = group.create_dataset(name, data=np.ascontiguousarray(data, dtype=np.int64), **kwargs)
    ds.attrs["units"] = units
    ds.attrs["dims"] = dims


def write_trace(path: str | os.PathLike[str], trace: RunTrace) -> None:
    """Validate `trace` and write it to `path` (HDF5), replacing any existing file.

    The file is written under a temporary name and renamed, so an interrupted
    run never leaves a truncated trace behind.
    """
    import h5py

    trace.validate()
    path = os.fspath(path)
    tmp = f"{path}.tmp{os.getpid()}"
    str_dt = h5py.string_dtype("utf-8")
    try:
        with h5py.File(tmp, "w") as f:
            f.attrs["format"] = FORMAT_MARKER
            f.attrs["schema_version"] = np.int64(SCHEMA_VERSION)
            f.attrs["config"] = json.dumps(trace.config, sort_keys=True, allow_nan=False)
            f.attrs["environment"] = json.dumps(trace.environment, sort_keys=True, allow_nan=False)
            f.create_dataset("hosts", data=list(trace.hosts), dtype=str_dt)
            f.create_dataset("phases", data=list(trace.phases), dtype=str_dt)
            f.create_dataset("paths", data=list(PATHS), dtype=str_dt)
            timing = f.create_group("timing")
            _put(timing, "start_ns", trace.start_ns, "ns", "rank,iteration,phase")
            _put(timing, "end_ns", trace.end_ns, "ns", "rank,iteration,phase")
            timing["start_ns"].attrs["missing"] = np.int64(MISSING)
            timing["end_ns"].attrs["missing"] = np.int64(MISSING)
            _put(f, "tokens_per_expert", trace.tokens_per_expert, "tokens", "iteration,expert")
            _put(f, "bytes_per_peer", trace.bytes_per_peer, "bytes", "sender,iteration,receiver,path")
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


# --------------------------------------------------------------------------- reader


def _json_attr(path: object, f: Any, name: str) -> Any:
    """Attribute `name` of the file, parsed as the JSON it must be; the error names it."""
    value = f.attrs[name]
    try:
        return json.loads(value)
    except (TypeError, ValueError) as exc:
        raise TraceFormatError(
            f"{path}: corrupt moe-a2a trace: attribute {name!r} is not JSON ({type(exc).__name__}: {exc})"
        ) from None


def read_trace(path: str | os.PathLike[str]) -> RunTrace:
    """Read a trace written by `write_trace`.

    Raises FileNotFoundError for a missing file, and TraceFormatError (a
    ValueError) for a file that is not HDF5, not a moe-a2a trace, of a newer or
    unknown schema version, or missing a dataset.
    """
    import h5py

    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"trace file not found: {path}")
    if os.path.isdir(path):
        raise TraceFormatError(f"{path}: is a directory, expected a moe-a2a trace file (HDF5)")
    if not h5py.is_hdf5(path):
        raise TraceFormatError(f"{path}: not a moe-a2a trace: not an HDF5 file")
    try:
        f = h5py.File(path, "r")
    except OSError as exc:
        raise TraceFormatError(f"{path}: not a moe-a2a trace: cannot open as HDF5 ({exc})") from None
    with f:
        marker = f.attrs.get("format")
        if isinstance(marker, bytes):
            marker = marker.decode("utf-8", "replace")
        if marker != FORMAT_MARKER:
            got = "no 'format' attribute" if marker is None else f"format attribute {marker!r}"
            raise TraceFormatError(
                f"{path}: not a moe-a2a trace: HDF5 file has {got}, expected format={FORMAT_MARKER!r}"
            )
        version = f.attrs.get("schema_version")
        if not isinstance(version, (int, np.integer)) or isinstance(version, bool) or version < 1:
            raise TraceFormatError(
                f"{path}: unknown trace schema version {version!r}: "
                f"expected an integer from 1 to {SCHEMA_VERSION}"
            )
        if version > SCHEMA_VERSION:
            raise TraceFormatError(
                f"{path}: trace schema version {int(version)} is newer than this moe-a2a reads "
                f"(schema version {SCHEMA_VERSION}); read it with a newer moe-a2a"
            )
        missing = [name for name in _DATASETS if name not in f]
        missing += [f"@{name}" for name in ("config", "environment") if name not in f.attrs]
        if missing:
            raise TraceFormatError(f"{path}: incomplete moe-a2a trace: missing {', '.join(missing)}")
        config, environment = (_json_attr(path, f, name) for name in ("config", "environment"))
        try:
            trace = RunTrace(
                config=config,
                environment=environment,
                hosts=list(f["hosts"].asstr()[()]),
                start_ns=f["timing/start_ns"][()],
                end_ns=f["timing/end_ns"][()],
                tokens_per_expert=f["tokens_per_expert"][()],
                bytes_per_peer=f["bytes_per_peer"][()],
                phases=tuple(f["phases"].asstr()[()]),
            )
            paths = tuple(f["paths"].asstr()[()])
        except (TypeError, ValueError, KeyError, AttributeError, OSError) as exc:
            raise TraceFormatError(f"{path}: corrupt moe-a2a trace: {exc}") from None
    if paths != PATHS:
        raise TraceFormatError(f"{path}: corrupt moe-a2a trace: paths are {paths}, expected {PATHS}")
    try:
        trace.validate()
    except ValueError as exc:
        raise TraceFormatError(f"{path}: corrupt moe-a2a trace: {exc}") from None
    return trace


# --------------------------------------------------------------------------- recording


class _PhaseTimer:
    """Context manager of `TraceRecorder.phase`; a class, not a generator, to keep overhead low."""

    __slots__ = ("_rec", "_it", "_idx", "_start")

    def __init__(self, rec: TraceRecorder, it: int, idx: int) -> None:
        self._rec, self._it, self._idx, self._start = rec, it, idx, 0

    def __enter__(self) -> _PhaseTimer:
        self._start = time.perf_counter_ns()
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        end = time.perf_counter_ns()
        # A phase that raised is not a measurement: leave it unrecorded.
        if exc_type is None:
            self._rec._store(self._it, self._idx, self._start, end)


class TraceRecorder:
    """One rank's measurements during a run, later merged by `gather_trace`.

    Each phase may be recorded once per iteration (a second time is an error,
    which usually means an iteration index was not advanced). Token counts and
    byte counts accumulate.
    """

    def __init__(
        self, num_iters: int, num_ranks: int, num_experts: int, phases: tuple[str, ...] = PHASES
    ) -> None:
        for name, value in (("num_iters", num_iters), ("num_ranks", num_ranks), ("num_experts", num_experts)):
            if not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"TraceRecorder: {name} must be an integer >= 1, got {value!r}")
        phases = tuple(phases)
        if not phases or not all(isinstance(p, str) and p for p in phases) or len(set(phases)) != len(phases):
            raise ValueError(f"TraceRecorder: phases: got {phases!r}; expected unique non-empty names")
        self.num_iters, self.num_ranks, self.num_experts = int(num_iters), int(num_ranks), int(num_experts)
        self.phases = phases
        self.start_ns = np.full((num_iters, len(phases)), MISSING, dtype=np.int64)
        self.end_ns = np.full((num_iters, len(phases)), MISSING, dtype=np.int64)
        self.tokens_per_expert = np.zeros((num_iters, num_experts), dtype=np.int64)
        self.bytes_per_peer = np.zeros((num_iters, num_ranks, len(PATHS)), dtype=np.int64)
        self._phase_index = {p: i for i, p in enumerate(phases)}
        self._path_index = {p: i for i, p in enumerate(PATHS)}

    def _iteration(self, iteration: int) -> int:
        if not isinstance(iteration, (int, np.integer)) or not 0 <= iteration < self.num_iters:
            raise IndexError(f"TraceRecorder: iteration must be in [0, {self.num_iters}), got {iteration!r}")
        return int(iteration)

    def _phase(self, name: str) -> int:
        idx = self._phase_index.get(name)
        if idx is None:
            raise ValueError(f"TraceRecorder: unknown phase {name!r}, expected one of {self.phases}")
        return idx

    def _store(self, it: int, idx: int, start_ns: int, end_ns: int) -> None:
        if self.start_ns[it, idx] != MISSING:
            raise ValueError(
                f"TraceRecorder: phase {self.phases[idx]!r} of iteration {it} was already recorded"
            )
        self.start_ns[it, idx] = start_ns
        self.end_ns[it, idx] = end_ns

    def phase(self, iteration: int, name: str) -> _PhaseTimer:
        """`with rec.phase(i, "experts"): ...` stamps start and end with time.perf_counter_ns()."""
        return _PhaseTimer(self, self._iteration(iteration), self._phase(name))

    def record(self, iteration: int, name: str, start_ns: int, end_ns: int) -> None:
        """Record a phase measured elsewhere (same clock as time.perf_counter_ns())."""
        it, idx = self._iteration(iteration), self._phase(name)
        if not 0 <= start_ns <= end_ns:
            raise ValueError(
                f"TraceRecorder.record: phase {name!r} iteration {it}: expected 0 <= start_ns <= end_ns, "
                f"got start_ns={start_ns} end_ns={end_ns}"
            )
        self._store(it, idx, int(start_ns), int(end_ns))

    def add_tokens(self, iteration: int, expert_offset: int, counts: np.ndarray) -> None:
        """Add the tokens this rank's experts `[expert_offset, expert_offset + len(counts))` received."""
        it = self._iteration(iteration)
        c = np.asarray(counts)
        if c.ndim != 1 or (c.size and c.dtype.kind not in "iu"):
            raise ValueError(
                f"TraceRecorder.add_tokens: counts must be a 1-D integer array, got "
                f"shape {c.shape} dtype {c.dtype}"
            )
        if not 0 <= expert_offset <= self.num_experts - c.size:
            raise ValueError(
                f"TraceRecorder.add_tokens: experts [{expert_offset}, {expert_offset + c.size}) are outside "
                f"[0, {self.num_experts})"
            )
        if (c < 0).any():
            raise ValueError("TraceRecorder.add_tokens: counts must be >= 0")
        self.tokens_per_expert[it, expert_offset : expert_offset + c.size] += c.astype(np.int64)

    def add_bytes(self, iteration: int, peer: int, path: str, nbytes: int) -> None:
        """Add `nbytes` sent by this rank to `peer` over `path` ("same_node" or "fabric")."""
        it = self._iteration(iteration)
        if not 0 <= peer < self.num_ranks:
            raise ValueError(f"TraceRecorder.add_bytes: peer must be in [0, {self.num_ranks}), got {peer!r}")
        p = self._path_index.get(path)
        if p is None:
            raise ValueError(f"TraceRecorder.add_bytes: unknown path {path!r}, expected one of {PATHS}")
        if nbytes < 0:
            raise ValueError(f"TraceRecorder.add_bytes: nbytes must be >= 0, got {nbytes}")
        self.bytes_per_peer[it, peer, p] += int(nbytes)


def _version(dist: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def default_environment() -> dict[str, str]:
    """Versions, creation time, host and command line of this process."""
    env = {
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join(sys.argv),
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "moe_a2a": _version("moe-a2a"),
        "numpy": np.__version__,
        "torch": _version("torch"),
        "h5py": _version("h5py"),
        "mpi4py": _version("mpi4py"),
        # the switches that were set (moe_a2a.switches): which path the figures measured
        "switches": json.dumps(switches.recorded(), sort_keys=True),
    }
    # Only ask MPI when the caller already initialised it: importing mpi4py.MPI here would start MPI.
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None:
        try:
            env["mpi_library"] = " ".join(mpi.Get_library_version().replace("\x00", " ").split())
        except Exception as exc:  # informational only: never fail the trace for it
            env["mpi_library"] = f"unknown ({exc})"
    try:
        from moe_a2a import __version__, _core

        env["moe_a2a"] = __version__
        env["libfabric_providers"] = ",".join(_core.libfabric_providers())
        # the kernels' launch tuning of this build (src/a2a/cuda/tuning.h): {"cuda": false} without them
        env["cuda_tuning"] = json.dumps(_core.cuda_tuning(), sort_keys=True)
    except Exception as exc:  # a trace must not fail for lack of the extension
        env["libfabric_providers"] = f"unknown ({type(exc).__name__})"
    return env


def gather_trace(
    comm: Any,
    recorder: TraceRecorder,
    config: dict[str, Any],
    hosts: list[str] | None = None,
    *,
    environment: dict[str, str] | None = None,
) -> RunTrace | None:
    """Gather every rank's recorder to rank 0 (collective) and build the RunTrace there.

    `comm` is an mpi4py communicator (anything with Get_rank, Get_size and
    gather). `hosts` defaults to each rank's socket.gethostname(). `environment`
    entries are added to (and override) `default_environment()`. Returns None
    on ranks other than 0.
    """
    rank, size = comm.Get_rank(), comm.Get_size()
    if recorder.num_ranks != size:
        # Every rank sees the same size, so all ranks raise here together and none waits in gather.
        raise ValueError(
            f"gather_trace: recorder has num_ranks={recorder.num_ranks}, communicator has {size} ranks"
        )
    payload = {
        "host": socket.gethostname(),
        "shape": (recorder.num_iters, recorder.num_ranks, recorder.num_experts),
        "phases": recorder.phases,
        "start_ns": recorder.start_ns,
        "end_ns": recorder.end_ns,
        "tokens_per_expert": recorder.tokens_per_expert,
        "bytes_per_peer": recorder.bytes_per_peer,
    }
    parts = comm.gather(payload, root=0)
    if rank != 0:
        return None
    assert parts is not None and len(parts) == size
    for r, part in enumerate(parts):
        if part["shape"] != payload["shape"]:
            raise ValueError(
                f"gather_trace: rank {r} recorded (num_iters, num_ranks, num_experts)={part['shape']}, "
                f"rank 0 recorded {payload['shape']}"
            )
        if part["phases"] != payload["phases"]:
            raise ValueError(
                f"gather_trace: rank {r} recorded phases {part['phases']}, "
                f"rank 0 recorded {payload['phases']}"
            )
    if hosts is None:
        hosts = [part["host"] for part in parts]
    elif len(hosts) != size:
        raise ValueError(f"gather_trace: hosts must name each of the {size} ranks, got {len(hosts)} names")
    env = default_environment()
    env.update(environment or {})
    trace = RunTrace(
        config=dict(config),
        environment=env,
        hosts=[str(h) for h in hosts],
        start_ns=np.stack([p["start_ns"] for p in parts]),
        end_ns=np.stack([p["end_ns"] for p in parts]),
        # Each rank counts only its own experts (zeros elsewhere), so the sum is the global count.
        tokens_per_expert=np.stack([p["tokens_per_expert"] for p in parts]).sum(axis=0, dtype=np.int64),
        bytes_per_peer=np.stack([p["bytes_per_peer"] for p in parts]),
        phases=recorder.phases,
    )
    trace.validate()
    return trace


def median_iteration(trace: RunTrace) -> int:
    """The iteration whose span (earliest start to latest end over all ranks) is the median one."""
    _, end = trace.aligned_ns()
    span = np.where(np.isnan(end), -np.inf, end).max(axis=(0, 2))  # starts are aligned to 0
    span = np.where(np.isfinite(span), span, math.inf)  # an iteration with no record sorts last
    order = np.argsort(span, kind="stable")
    return int(order[(len(order) - 1) // 2])
