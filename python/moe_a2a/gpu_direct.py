"""Which way a CUDA rank's rows cross the fabric: GPU-direct or staged through host memory.

GPU-direct registers the device workspace with the provider (FI_HMEM, iface CUDA)
and the proxy writes rows from and into GPU memory; staged copies them to pinned
host memory first and back after (docs/transport.md). The choice is made once, at
construction, from what each rank's engine reports (`capabilities()`), the
provider and the switch MOE_A2A_GPU_DIRECT, and every rank takes the same path.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

GPU_DIRECT = "gpu-direct"
STAGED = "staged"
NO_FABRIC = "no fabric"

# shm moves CUDA memory with CUDA IPC copies, which cost ~130 us each: measured on
# the H200 (issue 31) its writes from GPU memory beat host memory from 1 MiB up
# (5.4 vs 3.6 GB/s; 64 KiB: 0.48 vs 5.3 GB/s). Below this, staging stays the default
# (MOE_A2A_GPU_DIRECT_SHM_MIN_BYTES moves it).
SHM_MIN_WRITE_BYTES = 1 << 20


def shm_min_write_bytes() -> int:
    """MOE_A2A_GPU_DIRECT_SHM_MIN_BYTES, whose default is SHM_MIN_WRITE_BYTES."""
    from moe_a2a import switches

    return int(switches.get("MOE_A2A_GPU_DIRECT_SHM_MIN_BYTES"))


@dataclass(frozen=True)
class PathChoice:
    """One rank's (or, once agreed, every rank's) path and why."""

    path: str  # GPU_DIRECT, STAGED or NO_FABRIC
    reason: str

    def as_dict(self) -> dict[str, str]:
        return {"path": self.path, "reason": self.reason}


def choose_path(
    device: str,
    provider: str,
    caps: Sequence[dict[str, Any]] | None,
    forced: bool | None,
    largest_write: int,
    graph_safe: bool = False,
) -> PathChoice:
    """This rank's path. `caps`: each NIC's capabilities (None: no engine, every peer on
    this node); `forced`: MOE_A2A_GPU_DIRECT (None: auto); `largest_write`: bytes of the
    largest single write of a call to one peer; `graph_safe`: the kernels wait for landed
    rows themselves. Raises where the switch forces a path this rank cannot take."""
    if device != "cuda":
        return PathChoice(STAGED, f"device={device!r}: the rows are host memory")
    if caps is None:
        return PathChoice(NO_FABRIC, "every peer is on this node (CUDA IPC, no fabric)")
    if forced is False:
        return PathChoice(STAGED, "MOE_A2A_GPU_DIRECT=0")
    if graph_safe:
        # Between landing and reading, GPU-direct needs the host: shm's CUDA copies queue
        # behind kernels of the default stream that spin for them, and a NIC's writes may
        # need a flush (docs/transport.md).
        why = "graph_safe=True: the kernels wait for landed rows themselves, which GPU-direct does not allow"
        if forced:
            raise RuntimeError(f"MOE_A2A_GPU_DIRECT=1: {why}")
        return PathChoice(STAGED, why)
    missing = [c for c in caps if not c.get("gpu_memory")]
    if missing:
        why = missing[0].get("gpu_memory_why") or "no FI_HMEM"
        if forced:
            raise RuntimeError(
                f"MOE_A2A_GPU_DIRECT=1: provider {provider!r} cannot register CUDA memory here: {why}"
            )
        return PathChoice(STAGED, f"provider {provider!r} cannot register CUDA memory: {why}")
    how = caps[0].get("gpu_memory_why", "FI_HMEM")
    if forced:
        return PathChoice(GPU_DIRECT, f"MOE_A2A_GPU_DIRECT=1; {how}")
    threshold = shm_min_write_bytes()
    if caps[0].get("provider") == "shm" and largest_write < threshold:
        return PathChoice(
            STAGED,
            f"shm offers {how}, but its writes from GPU memory are slower below "
            f"{threshold} B (MOE_A2A_GPU_DIRECT_SHM_MIN_BYTES; largest write here {largest_write} B); "
            "MOE_A2A_GPU_DIRECT=1 forces it",
        )
    return PathChoice(GPU_DIRECT, how)


def agree(choices: Sequence[PathChoice], forced: bool | None) -> PathChoice:
    """Every rank's choice (index = rank) -> the one every rank takes: GPU-direct only where
    every rank can; forced on and one rank cannot, the same error on every rank."""
    paths = {c.path for c in choices}
    if len(paths) == 1:
        return choices[0]
    others = [(r, c) for r, c in enumerate(choices) if c.path != GPU_DIRECT]
    rank, c = others[0]
    if forced:
        raise RuntimeError(f"MOE_A2A_GPU_DIRECT=1: rank {rank} cannot take the GPU-direct path: {c.reason}")
    return PathChoice(STAGED, f"rank {rank} stages ({c.reason}), so every rank does")


def largest_write(core_cfg: Any, row_bytes: int) -> int:
    """About the largest single write of a call to one peer: a peer's private rows of
    `row_bytes` each (the wider of dispatch's and combine's), or one slice of them."""
    rows = int(core_cfg.max_private_tokens) * row_bytes
    slice_bytes = int(core_cfg.slice_bytes)
    return min(rows, slice_bytes) if slice_bytes > 0 else rows
