"""What every benchmark shares: the one clock, and the per-host setup of a rank.

Timing: `elapsed_ns` times one call on this rank, with CUDA events on a CUDA
device (the GPU's own clock, no device synchronisation, so other streams and
ranks run on) and `time.perf_counter_ns` otherwise; `timed` starts every rank
together and reports the slowest rank, since a collective phase takes as long
as its slowest rank. Every benchmark times through these two.

Ranks that share one GPU run by time slices, so their event times overlap and
each rank's time includes the others' work; the benchmarks' figures assume one
GPU per rank, as on the H200 machines.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

T = TypeVar("T")


def elapsed_ns(
    fn: Callable[[], T], device: Any = None, lead: Callable[[], None] | None = None
) -> tuple[T, float]:
    """fn's result and how long it took on this rank, in ns.

    On a CUDA `device` the span is between two CUDA events on the current stream:
    everything fn queued is in it, and the host waits on the end event only. `lead`
    (CUDA only) queues GPU work before the start event, which then fires once that work
    is done: fn's host time before its first kernel runs meanwhile, out of the span.
    """
    if device is not None and getattr(device, "type", device) == "cuda":
        import torch

        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if lead is not None:
            lead()
        start.record()
        result = fn()
        end.record()
        end.synchronize()
        return result, start.elapsed_time(end) * 1e6
    t0 = time.perf_counter_ns()
    result = fn()
    return result, float(time.perf_counter_ns() - t0)


def timed(
    comm: Any, fn: Callable[[], T], device: Any = None, lead: Callable[[], None] | None = None
) -> tuple[T, float]:
    """After a barrier, fn's result and the slowest rank's `elapsed_ns`."""
    comm.Barrier()
    result, ns = elapsed_ns(fn, device, lead)
    return result, float(comm.allreduce(ns, op=max_op()))


class Interrupts:
    """Ctrl-C (SIGINT, or the SIGTERM mpirun passes it on as) ends a benchmark between iterations.

    The first signal is noted and `check()` raises KeyboardInterrupt at the next
    iteration's start, outside any call, so the all-to-all closes from a state it
    knows; a second signal interrupts at once.
    """

    def __init__(self) -> None:
        self.requested = False

    def install(self) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._note)

    def _note(self, signum: int, frame: Any) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True

    def check(self) -> None:
        if self.requested:
            raise KeyboardInterrupt


INTERRUPTS = Interrupts()


def max_op() -> Any:
    """MPI.MAX, imported late so that importing a benchmark does not start MPI."""
    from mpi4py import MPI

    return MPI.MAX


def local_rank(comm: Any) -> int:
    """This rank's index among the ranks of its host."""
    from mpi4py import MPI

    return comm.Split_type(MPI.COMM_TYPE_SHARED).Get_rank()


def share_cores(comm: Any) -> None:
    """Give torch's intra-op threads an equal share of the host's cores."""
    import torch
    from mpi4py import MPI

    on_host = comm.Split_type(MPI.COMM_TYPE_SHARED).Get_size()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // on_host))


def mpi_transport(environ: Mapping[str, str], one_host: bool) -> str:
    """What the MPI baseline moved its bytes over, as far as the launcher's settings say.

    mpirun passes `--mca btl X` to the ranks as OMPI_MCA_btl; without it Open MPI
    picks shared memory between the ranks of a host and tcp between hosts.
    """
    btl, pml = environ.get("OMPI_MCA_btl"), environ.get("OMPI_MCA_pml")
    if btl:
        return f"Open MPI btl {btl}" + (f", pml {pml}" if pml else "")
    if "OMPI_COMM_WORLD_SIZE" not in environ:
        return "the MPI library's own choice"
    default = "shared memory (one host)" if one_host else "shared memory within a host, tcp between hosts"
    return f"Open MPI's default: {default}"


def transport_warning(provider: str, mpi: str) -> str | None:
    """A line saying the two sides did not use the same transport, where that is plain."""
    if (
        mpi.startswith("Open MPI's default: shared memory (one host)")
        and provider.split()[0].split(";")[0] != "shm"
    ):
        return (
            f"note: MPI used shared memory, moe-a2a {provider}: not like with like; for both over tcp: "
            "mpirun --mca btl self,tcp ..., for both over shared memory: --provider shm"
        )
    return None
