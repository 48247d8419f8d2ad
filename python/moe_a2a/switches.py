"""Every environment switch of moe-a2a, in one typed registry.

Python reads its switches through `get`; the core reads the CUDA ones itself
(src/a2a/env.h) with the same words for on and off, and `check_all` refuses a
value neither would understand before the core starts. `moe-a2a info` lists
them, docs/running.md has the table, and every HDF5 trace and benchmark JSON
records the ones that are set (`recorded`), so a figure says which path it
measured. Launcher and job-script variables are listed too (`where="jobs"`,
`"tests"`): they are read by the shell scripts and the test harness, not here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

_ON = ("1", "true", "yes", "on")
_OFF = ("0", "false", "no", "off")


@dataclass(frozen=True)
class Switch:
    name: str
    kind: str  # "bool" (on/off words below), "int" (a positive integer), "count" (0 or more), "str", "choice"
    default: Any
    doc: str
    where: str = "library"  # who reads it: library, core, jobs, tests or build
    choices: tuple[str, ...] = ()

    def parse(self, raw: str) -> Any:
        """The typed value of `raw`; a ValueError names the variable, what it got and what it takes."""
        if self.kind == "bool":
            word = raw.strip().lower()
            if word in _ON:
                return True
            if word in _OFF:
                return False
            expected = "one of " + ", ".join(_ON + _OFF)
        elif self.kind == "int":
            if raw.strip().isdigit() and int(raw) >= 1:
                return int(raw)
            expected = "a positive integer"
        elif self.kind == "count":
            if raw.strip().isdigit():
                return int(raw)
            expected = "a whole number, 0 or more"
        elif self.kind == "choice":
            if raw in self.choices:
                return raw
            expected = f"one of {list(self.choices)}"
        else:
            return raw
        raise ValueError(f"{self.name}: got {raw!r}; expected {expected}")


REGISTRY: dict[str, Switch] = {
    s.name: s
    for s in (
        Switch(
            "MOE_A2A_PROVIDER",
            "choice",
            None,
            "libfabric provider when none is passed (default: efa where offered, else tcp)",
            choices=("tcp", "shm", "efa", "verbs"),
        ),
        Switch(
            "MOE_A2A_NICS",
            "str",
            None,
            "NICs (libfabric domains) by name: 'a,b' for every rank, 'a,b;c,d' one group per local rank",
        ),
        Switch("MOE_A2A_NUM_NICS", "int", 1, "NICs per rank where num_nics is not given (presets set it)"),
        Switch(
            "MOE_A2A_ABORT_ON_ERROR",
            "bool",
            None,
            "end the whole job on a fatal fabric error (default: on under mpirun or srun)",
        ),
        Switch(
            "MOE_A2A_CUDA_PDL",
            "bool",
            True,
            "programmatic dependent launch between the CUDA kernels (Hopper); off for A/B measurements",
            where="core",
        ),
        Switch(
            "MOE_A2A_CUDA_BULK",
            "bool",
            True,
            "the bulk-copy dispatch packer (Hopper); off for A/B measurements",
            where="core",
        ),
        Switch(
            "MOE_A2A_CUDA_FUSED_RECV",
            "bool",
            None,
            "force the one-launch eager receive on or off (default: on for a rank alone on its GPU)",
            where="core",
        ),
        Switch(
            "MOE_A2A_TORCHTITAN_BACKEND",
            "choice",
            None,
            "torch.distributed backend moe_a2a.integrations.torchtitan_train starts before TorchTitan "
            "(gloo lets ranks share one GPU; default: TorchTitan's own choice)",
            choices=("gloo", "nccl"),
        ),
        Switch(
            "MOE_A2A_GPU_DIRECT",
            "bool",
            None,
            "CUDA ranks with fabric peers: the provider moves rows from and into GPU memory (FI_HMEM) "
            "instead of staging them through host memory; default: where every rank's provider can and it "
            "measured faster (moe-a2a info says which); on or off forces it for A/B runs",
        ),
        Switch(
            "MOE_A2A_REJOIN_STORE",
            "str",
            None,
            "host:port of a TCPStore every rank reaches, where a rejoin across nodes meets (survivors "
            "and replacement alike)",
        ),
        Switch(
            "MOE_A2A_GPU_DIRECT_SHM_MIN_BYTES",
            "count",
            1 << 20,
            "shm only: the smallest largest-write of a call (bytes to one peer) for which the default takes "
            "GPU-direct (shm's CUDA IPC copies lose below about 1 MiB on the H200); 0: every call",
        ),
        Switch(
            "MOE_A2A_CUDA_OVERLAP",
            "bool",
            True,
            "with peers on other nodes: stage rows to the fabric peer by peer and receive sender by sender; "
            "off for A/B measurements",
            where="core",
        ),
        Switch(
            "MOE_A2A_CUDA_COMBINE_DMA",
            "bool",
            True,
            "with peers on other nodes, eager calls: copy each remote peer's combine rows to GPU memory "
            "with the copy engine as they land, so the reduction reads GPU memory only; off for A/B",
            where="core",
        ),
        Switch(
            "MOE_A2A_SLICE_BYTES",
            "count",
            0,
            "rows to one peer cross the fabric in writes of about this many bytes (at most 16 a part), "
            "so staging, the fabric and the read-back can overlap within a peer; 0 (the default): one "
            "write a part. Every rank must set the same",
        ),
        Switch(
            "MOE_A2A_TEST_FAIL_GPU_REGISTRATION",
            "bool",
            None,
            "tests only: registering the device workspace with the fabric (GPU-direct) fails on the rank "
            "where it is set",
        ),
        Switch(
            "MOE_A2A_TEST_FAIL_STEP",
            "str",
            None,
            "tests only: the start-up step (Bootstrap.together) whose description starts with this fails "
            "on the rank where it is set, after its body ran",
        ),
        Switch(
            "MOE_A2A_TEST_DELAY_WRITES_MS",
            "int",
            None,
            "tests only: ms this rank's proxy holds each dispatch's token writes back (a late peer)",
            where="core",
        ),
        Switch(
            "MOE_A2A_FABRIC",
            "choice",
            "cpu",
            "the fabric spack.yaml builds for",
            where="build",
            choices=("cpu", "efa", "cx7"),
        ),
        Switch("MOE_A2A_HOME", "str", None, "the checkout the job scripts run from", where="jobs"),
        Switch("MOE_A2A_PYTHON", "str", None, "the Python the job scripts start", where="jobs"),
        Switch("MOE_A2A_MPIRUN", "str", None, "the mpirun the job scripts call", where="jobs"),
        Switch("MOE_A2A_SRUN_MPI", "str", None, "srun's --mpi plugin in the Slurm scripts", where="jobs"),
        Switch("MOE_A2A_TCP_IFACE", "str", None, "network interface of the tcp preset", where="jobs"),
        Switch("MOE_A2A_IB_DEVICE", "str", None, "InfiniBand device of the cx7 preset", where="jobs"),
        Switch("MOE_A2A_IB_IFACE", "str", None, "IPoIB interface of the cx7 preset", where="jobs"),
        Switch("MOE_A2A_TRACE_DIR", "str", None, "where the job scripts write traces", where="jobs"),
        Switch("MOE_A2A_OUT", "str", None, "where the job scripts write their output", where="jobs"),
        Switch(
            "MOE_A2A_TEST_PROVIDER",
            "choice",
            "tcp",
            "provider of the multi-rank tests",
            where="tests",
            choices=("tcp", "shm", "efa", "verbs"),
        ),
        Switch(
            "MOE_A2A_TEST_DEVICE",
            "choice",
            "cpu",
            "device of the multi-rank tests",
            where="tests",
            choices=("cpu", "cuda"),
        ),
        Switch("MOE_A2A_TEST_SEED", "str", None, "seed of the tests' random data", where="tests"),
        Switch(
            "MOE_A2A_TEST_NUM_NICS", "str", None, "NICs per rank of the tests' default engine", where="tests"
        ),
        Switch("MOE_A2A_TEST_LOGS", "str", None, "where tools/run_tests.sh writes its logs", where="tests"),
        Switch(
            "MOE_A2A_TEST_BARRIER_ROUNDS",
            "str",
            None,
            "rounds of the fabric barrier soak test",
            where="tests",
        ),
        Switch(
            "MOE_A2A_TEST_DELIBERATE_FAILURE",
            "str",
            None,
            "runs the test that fails on purpose (the abort-path test sets it)",
            where="tests",
        ),
        Switch(
            "MOE_A2A_RANK_LOGS", "str", None, "where tools/rank0_console.sh writes rank logs", where="tests"
        ),
    )
}


def get(name: str) -> Any:
    """The switch's typed value from the environment, or its default."""
    s = REGISTRY[name]
    raw = os.environ.get(name)
    return s.default if raw is None or raw == "" else s.parse(raw)


def slice_bytes() -> int:
    """MOE_A2A_SLICE_BYTES: about how many bytes each write of a peer's rows carries (0: one a part)."""
    return int(get("MOE_A2A_SLICE_BYTES"))


def check_all() -> None:
    """Refuse any set switch that the library or the core would misread (a ValueError naming it)."""
    for s in REGISTRY.values():
        if s.where in ("library", "core"):
            get(s.name)


def recorded() -> dict[str, str]:
    """The library's and the core's switches that are set, as given: for traces and benchmark JSON."""
    return {
        s.name: os.environ[s.name]
        for s in REGISTRY.values()
        if s.where in ("library", "core") and os.environ.get(s.name)
    }


def table() -> list[tuple[str, str, str, str]]:
    """(name, where, value now, what it does) for every switch."""
    rows = []
    for s in REGISTRY.values():
        raw = os.environ.get(s.name)
        now = raw if raw else f"(unset; default {s.default})" if s.default is not None else "(unset)"
        rows.append((s.name, s.where, now, s.doc))
    return rows
