"""The job as the multi-rank tests see it: ranks, provider, device (MOE_A2A_TEST_DEVICE)."""

from __future__ import annotations

import os

import pytest
import torch
from mpi4py import MPI

COMM = MPI.COMM_WORLD
RANK, WORLD = COMM.Get_rank(), COMM.Get_size()
PROVIDER = os.environ.get("MOE_A2A_TEST_PROVIDER", "tcp")
DEVICE = os.environ.get("MOE_A2A_TEST_DEVICE", "cpu")
if DEVICE not in ("cpu", "cuda"):
    raise pytest.UsageError(f"MOE_A2A_TEST_DEVICE: got {DEVICE!r}; expected cpu or cuda")
# Why the device cannot run, or None; test modules skip on it.
DEVICE_REASON: str | None = None
if DEVICE == "cuda":
    from moe_a2a.backends.cuda import cuda_available

    DEVICE_REASON = cuda_available()
    if DEVICE_REASON is None:
        local = COMM.Split_type(MPI.COMM_TYPE_SHARED).Get_rank()
        torch.cuda.set_device(local % torch.cuda.device_count())
device_pytestmark = pytest.mark.skipif(
    DEVICE_REASON is not None, reason=f"MOE_A2A_TEST_DEVICE=cuda: {DEVICE_REASON}"
)


def layouts() -> list[int | None]:
    """Node layouts that make both the same-node and the fabric path carry traffic."""
    out: list[int | None] = [None]  # one node: shared memory only
    if WORLD > 1:
        out.append(1)  # every rank its own node: fabric only
    if WORLD > 2 and WORLD % 2 == 0:
        out.append(2)  # both at once
    return out
