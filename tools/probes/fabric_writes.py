"""Probe of the engine's large writes (run under mpirun -n 2; figures in docs/benchmarks.md).

  mpirun -n 2 python tools/probes/fabric_writes.py memory --provider shm
  mpirun -n 2 python tools/probes/fabric_writes.py split --provider shm

Both ranks write to each other at once, through one transfer engine, timed
from a barrier to the slowest rank's end (the writes landed and completed).

memory: one 235 MB write (a prefill combine's rows to one peer) out of and
into numpy arrays, and out of and into AllToAll workspaces whose rows are in
shared memory (4 KB pages) or private memory (huge pages where the kernel
gives them).
split: 120 MB (a prefill dispatch's rows) in 1, 4 or 16 writes posted at once,
and in 16 writes posted one after another's completion.
"""

from __future__ import annotations

import argparse
import ctypes
import time
from collections.abc import Callable

import numpy as np
from mpi4py import MPI

from moe_a2a import _core
from moe_a2a.bootstrap import Bootstrap
from moe_a2a.fabric import Engine, ScatterItem

COMM = MPI.COMM_WORLD
RANK = COMM.Get_rank()
PEER = 1 - RANK
TIMEOUT_S = 60.0
_kept: list[object] = []  # workspaces outlive the arrays that view them


def timed(
    engine: Engine, src: np.ndarray, dst: np.ndarray, writes: int, paced: bool, reps: int
) -> list[float]:
    """ms of each repetition: `writes` equal writes of src to the peer's dst, each with its own tag."""
    core = engine.core
    region = engine.register(src)
    group = engine.group([PEER], engine.exchange_region(engine.register(dst)))
    per = src.size // writes
    out = []
    for _ in range(reps):
        COMM.Barrier()
        start = time.perf_counter()
        for i in range(writes):
            if paced and i:
                engine.core.wait_tx(TIMEOUT_S)
            core.scatter(group, region, [ScatterItem(0, i * per, per, i * per)], 8 + i)
        for i in range(writes):
            core.wait_imm(8 + i, PEER, 1, TIMEOUT_S)
        core.wait_tx(TIMEOUT_S)
        out.append(COMM.allreduce(time.perf_counter() - start, op=MPI.MAX) * 1e3)
    return out


def workspace_rows(nbytes: int, share_rows: bool) -> np.ndarray:
    """nbytes of the row sections of a fresh workspace (prefill-sized), as an array."""
    c = _core.A2AConfig()
    c.rank, c.world, c.max_tokens, c.hidden, c.num_experts, c.topk = 0, 1, 4096, 7168, 8, 8
    c.max_private_tokens, c.max_recv_tokens = 0, 32768
    ws = _core.Workspace(c, f"/moe-a2a-probe-{RANK}-{len(_kept)}-{int(time.time() * 1e6)}", share_rows)
    ws.unlink()
    _kept.append(ws)
    at = 64 << 20  # inside the rows, past the head
    if at + nbytes > ws.size:
        raise ValueError(f"nbytes: got {nbytes}; a workspace holds {ws.size - at} row bytes past the head")
    rows = np.ctypeslib.as_array((ctypes.c_uint8 * ws.size).from_address(ws.ptr))[at : at + nbytes]
    rows[:] = 1  # touch every page, as a packing kernel would
    return rows


def report(label: str, ms: list[float]) -> None:
    if RANK == 0:
        print(f"{label:<28} ms {[round(t, 1) for t in ms]}  median {np.median(ms):.1f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("what", choices=("memory", "split"))
    ap.add_argument("--provider", default="shm")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    if COMM.Get_size() != 2:
        raise SystemExit(f"fabric_writes.py: got {COMM.Get_size()} ranks; expected 2 (mpirun -n 2)")
    engine = Engine(Bootstrap(COMM), args.provider)
    if args.what == "memory":
        n = 235 << 20
        kinds: dict[str, Callable[[], np.ndarray]] = {
            "numpy": lambda: np.ones(n, np.uint8),
            "workspace, shared rows": lambda: workspace_rows(n, True),
            "workspace, private rows": lambda: workspace_rows(n, False),
        }
        for label, make in kinds.items():
            report(label, timed(engine, make(), make(), 1, False, args.reps))
    else:
        n = 120 << 20
        src, dst = np.ones(n, np.uint8), np.zeros(n, np.uint8)
        for writes, paced in ((1, False), (4, False), (16, False), (16, True), (1, False)):
            report(
                f"{writes} write(s){', paced' if paced else ''}",
                timed(engine, src, dst, writes, paced, args.reps),
            )


if __name__ == "__main__":
    main()
