"""Memory one rank of an AllToAll takes, known before it is taken, and the check that it fits.

The workspace's bytes come from the core (`_core.plan_memory`: the same Layout
and CUDA scratch sections the core allocates by); this module adds what the
Python side allocates (the unweighted combine's weights, and each call's
outputs at their largest) and compares the whole with what the machine has
free: MemAvailable and /dev/shm's free space for the node's ranks together,
and the GPU's free memory (torch.cuda.mem_get_info) for a CUDA rank.

Host memory is touched as rows are written, so a call that fills fewer rows
than the maxima (`max_recv_tokens`, `max_tokens * topk` send rows) uses less;
the check is against the maxima, which skewed routing can reach. The CUDA
backend pins its whole host workspace, and allocates device memory whole.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from moe_a2a import _core
from moe_a2a.a2a_types import COMBINE_DTYPES, DEVICES, DISPATCH_DTYPES

if TYPE_CHECKING:
    from moe_a2a.a2a_types import Config

GiB = 2**30
MEMINFO = "/proc/meminfo"
SHM_DIR = "/dev/shm"


class MemoryPlanError(ValueError):
    """A configuration whose workspace cannot fit in the memory this machine has free."""


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes per rank of one AllToAll, by kind (the core's fields: src/a2a/memory_plan.h)."""

    device: str
    max_tokens: int
    world_size: int
    ranks_per_node: int
    max_private_tokens: int
    max_recv_tokens: int
    max_output_rows: int
    workspace: int  # one host workspace
    host_shared: int  # of it, a /dev/shm file the node's ranks map
    host_private: int  # of it, private memory (rows no peer reads)
    fabric_registered: int  # registered with the transfer engine (0 without remote peers)
    cuda_pinned: int  # host memory registered with CUDA (page-locked)
    peer_mapped: int  # same-node peers' workspaces mapped (their memory, counted on their rank)
    device_workspace: int
    device_scratch: int
    python_buffers: int  # the unweighted combine's [max_tokens, topk] fp32 weights, on `device`
    dispatch_output: int  # one dispatch's outputs at their most rows, on `device`
    combine_output: int  # one combine's output at max_tokens, on `device`

    @property
    def per_call(self) -> int:
        return self.dispatch_output + self.combine_output

    @property
    def host_total(self) -> int:
        """Host bytes of this rank: its workspace, plus the Python side's where device='cpu'."""
        python = self.python_buffers + self.per_call if self.device == "cpu" else 0
        return self.host_shared + self.host_private + python

    @property
    def device_total(self) -> int:
        """GPU bytes of this rank (0 for device='cpu')."""
        if self.device != "cuda":
            return 0
        return self.device_workspace + self.device_scratch + self.python_buffers + self.per_call

    def rows(self) -> list[tuple[str, str, str]]:
        """(what, bytes per rank, where) for a table."""
        on = "host" if self.device == "cpu" else "GPU"
        out = [
            ("workspace, shared (/dev/shm)", self.host_shared, "host, mapped by the node's ranks"),
            ("workspace, private rows", self.host_private, "host, not shared"),
            ("registered with the fabric", self.fabric_registered, "of the workspace, with remote peers"),
        ]
        if self.device == "cuda":
            out += [
                ("pinned for CUDA", self.cuda_pinned, "host, page-locked"),
                ("device workspace", self.device_workspace, "GPU"),
                ("device scratch", self.device_scratch, "GPU"),
            ]
        out += [
            ("unweighted combine's weights", self.python_buffers, on),
            ("dispatch output, at most", self.dispatch_output, f"{on}, each call"),
            ("combine output, at most", self.combine_output, f"{on}, each call"),
            ("peers' workspaces mapped", self.peer_mapped, "host, counted on their ranks"),
            ("host total", self.host_total, f"x {self.ranks_per_node} ranks per node"),
        ]
        if self.device == "cuda":
            out.append(("GPU total", self.device_total, "per GPU"))
        return [(what, size_text(n), where) for what, n, where in out]


def size_text(n: int) -> str:
    """Bytes as people read them: GiB above 1 GiB, MiB above 1 MiB, else KiB."""
    for unit, scale in (("GiB", GiB), ("MiB", 2**20), ("KiB", 1024)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def plan_of(core: Any, cfg: Config, device: str) -> MemoryPlan:
    """The plan of one rank whose core configuration is `core` (as AllToAll opens it)."""
    from moe_a2a.backends.common import num_scales

    if device not in DEVICES:
        raise ValueError(f"device: got {device!r}; expected one of {list(DEVICES)}")
    share_rows = device == "cpu" and core.ranks_per_node > 1
    has_remote = core.ranks_per_node < core.world
    fields = _core.plan_memory(core, device == "cuda", share_rows, has_remote)
    local_experts = core.num_experts // core.world
    rows = core.max_recv_tokens + local_experts * (core.expert_padding - 1)
    row = cfg.hidden * DISPATCH_DTYPES[cfg.dispatch_dtype].itemsize
    if cfg.dispatch_dtype == "fp8":
        row += 4 * num_scales(cfg.hidden)
    return MemoryPlan(
        device=device,
        max_tokens=core.max_tokens,
        world_size=core.world,
        ranks_per_node=core.ranks_per_node,
        max_private_tokens=core.max_private_tokens,
        max_recv_tokens=core.max_recv_tokens,
        max_output_rows=rows,
        python_buffers=cfg.max_tokens * cfg.topk * 4,
        dispatch_output=rows * row + 4 * local_experts,
        combine_output=cfg.max_tokens * cfg.hidden * COMBINE_DTYPES[cfg.combine_dtype].itemsize,
        **fields,
    )


def plan(
    cfg: Config,
    world_size: int,
    ranks_per_node: int | None = None,
    device: str = "cpu",
    graph_safe: bool = False,
) -> MemoryPlan:
    """Bytes per rank of `AllToAll(cfg, device=device, graph_safe=graph_safe)` over `world_size`
    ranks, `ranks_per_node` of them on each node (default: all on one), computed without
    allocating anything (fabric_rows="auto" resolved as the instance would)."""
    for name, value in (("world_size", world_size), ("ranks_per_node", ranks_per_node)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ValueError(f"{name}: got {value!r}; expected a positive integer")
    if not isinstance(graph_safe, bool):
        raise ValueError(f"graph_safe: got {graph_safe!r}; expected True or False")
    local = world_size if ranks_per_node is None else ranks_per_node
    if world_size % local:
        raise ValueError(f"ranks_per_node: got {local}; expected a divisor of the world size {world_size}")
    from moe_a2a.a2a_startup import core_config

    cfg = replace(cfg, fabric_rows=cfg.fabric_rows_for(world_size, local, graph_safe))
    return plan_of(core_config(cfg, 0, world_size, local), cfg, device)


@dataclass(frozen=True)
class Free:
    """What this machine has free now (None: not known here)."""

    host: int | None  # MemAvailable
    shm: int | None  # free space of /dev/shm
    gpu: int | None  # the current GPU's free memory (device='cuda' only)


def free_memory(device: str = "cpu") -> Free:
    host = None
    try:
        with open(MEMINFO) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    host = int(line.split()[1]) * 1024
    except OSError:
        pass
    shm = None
    if os.path.isdir(SHM_DIR):
        st = os.statvfs(SHM_DIR)
        shm = st.f_bavail * st.f_frsize
    gpu = None
    if device == "cuda":
        import torch

        if torch.cuda.is_available():  # AllToAll has refused device='cuda' without one
            gpu = int(torch.cuda.mem_get_info()[0])
    return Free(host, shm, gpu)


def check_fits(p: MemoryPlan, free: Free | None = None) -> None:
    """Raise MemoryPlanError naming the sizes when `p` cannot fit in what is free: the host's
    for all `p.ranks_per_node` ranks of a node, the GPU's for this rank."""
    free = free if free is not None else free_memory(p.device)
    n = p.ranks_per_node
    per_node = f"{n} rank{'s' if n > 1 else ''} x {size_text(p.host_total)}"
    fix = (
        f"(sized by max_tokens={p.max_tokens} and max_recv_tokens={p.max_recv_tokens}; "
        "`moe-a2a plan` shows each part)"
    )
    if free.host is not None and n * p.host_total > free.host:
        raise MemoryPlanError(
            f"memory: this configuration needs {size_text(n * p.host_total)} of host memory per node "
            f"({per_node}); {size_text(free.host)} is available (MemAvailable) {fix}"
        )
    if free.shm is not None and n * p.host_shared > free.shm:
        raise MemoryPlanError(
            f"memory: the workspaces need {size_text(n * p.host_shared)} of {SHM_DIR} per node "
            f"({n} x {size_text(p.host_shared)}); {size_text(free.shm)} is free there {fix}"
        )
    if free.gpu is not None and p.device_total > free.gpu:
        raise MemoryPlanError(
            f"memory: this configuration needs {size_text(p.device_total)} of GPU memory per rank; "
            f"{size_text(free.gpu)} is free on this GPU (torch.cuda.mem_get_info) {fix}"
        )
