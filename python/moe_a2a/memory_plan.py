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

import argparse
import os
from dataclasses import dataclass
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


def plan(cfg: Config, world_size: int, ranks_per_node: int | None = None, device: str = "cpu") -> MemoryPlan:
    """Bytes per rank of `AllToAll(cfg, device=device)` over `world_size` ranks, `ranks_per_node`
    of them on each node (default: all on one), computed without allocating anything."""
    for name, value in (("world_size", world_size), ("ranks_per_node", ranks_per_node)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ValueError(f"{name}: got {value!r}; expected a positive integer")
    local = world_size if ranks_per_node is None else ranks_per_node
    if world_size % local:
        raise ValueError(f"ranks_per_node: got {local}; expected a divisor of the world size {world_size}")
    from moe_a2a.a2a_startup import core_config

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


# --------------------------------------------------------------------------- moe-a2a plan


def add_parser(sub: Any) -> None:
    from moe_a2a.layers.presets import PRESETS

    p = sub.add_parser(
        "plan",
        help="memory per rank of a configuration, before it is allocated",
        description="Memory one rank of an AllToAll takes for a model preset, world size and ranks "
        "per node, by part (host and GPU, shared and private, registered), and whether the node's "
        "ranks fit in what this machine has free. Nothing is allocated.",
        epilog="example: moe-a2a plan --model deepseek-v3 --mode prefill --ranks 16 --ranks-per-node 8",
    )
    p.add_argument(
        "--model", default="deepseek-v3", help=f"model preset: {', '.join(PRESETS)} (default: %(default)s)"
    )
    p.add_argument(
        "--mode",
        choices=("decode", "prefill"),
        default="decode",
        help="token count of the preset (default: %(default)s)",
    )
    p.add_argument(
        "--tokens",
        type=int,
        metavar="N",
        help="tokens per rank, max_tokens (default: the preset's for --mode)",
    )
    p.add_argument("--ranks", type=int, default=8, metavar="N", help="world size (default: %(default)s)")
    p.add_argument(
        "--ranks-per-node", type=int, metavar="N", help="ranks per node (default: --ranks, one node)"
    )
    p.add_argument("--device", choices=DEVICES, default="cpu", help="backend (default: %(default)s)")
    p.add_argument(
        "--dispatch-dtype", choices=("fp8", "bf16", "fp32"), default="fp8", help="(default: %(default)s)"
    )
    p.add_argument("--combine-dtype", choices=("bf16", "fp32"), default="bf16", help="(default: %(default)s)")
    p.add_argument("--expert-padding", type=int, default=1, metavar="N", help="(default: %(default)s)")
    p.add_argument("--max-private-tokens", type=int, metavar="N", help="(default: AllToAll's)")
    p.add_argument("--max-recv-tokens", type=int, metavar="N", help="(default: AllToAll's, the worst case)")
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    from moe_a2a.a2a_types import Config
    from moe_a2a.layers.presets import get_preset
    from moe_a2a.report import table

    try:
        shape = get_preset(args.model)
        tokens = args.tokens if args.tokens is not None else shape.tokens(args.mode)
        cfg = Config(
            max_tokens=tokens,
            hidden=shape.hidden,
            num_experts=shape.num_experts,
            topk=shape.topk,
            dispatch_dtype=args.dispatch_dtype,
            combine_dtype=args.combine_dtype,
            expert_padding=args.expert_padding,
            max_private_tokens=args.max_private_tokens,
            max_recv_tokens=args.max_recv_tokens,
        )
        p = plan(cfg, args.ranks, args.ranks_per_node, args.device)
    except ValueError as err:
        raise SystemExit(f"plan: {_flag_names(str(err))}") from None
    print(
        f"{args.model}: hidden {shape.hidden}, {shape.num_experts} experts, top-{shape.topk}; "
        f"{tokens} tokens per rank, {args.dispatch_dtype} dispatch, {args.combine_dtype} combine, "
        f"device {args.device}"
    )
    print(
        f"{p.world_size} ranks, {p.ranks_per_node} per node: up to {p.max_recv_tokens} rows received "
        f"(max_recv_tokens), {p.max_private_tokens} private rows per peer"
    )
    print(table(["per rank", "bytes", "where"], p.rows()))
    try:
        free = free_memory(args.device)
        check_fits(p, free)
        unknown = (
            "; GPU not checked: no CUDA device here" if args.device == "cuda" and free.gpu is None else ""
        )
        print(f"fits here: yes ({_free_text(free)}{unknown})")
    except MemoryPlanError as err:
        print(f"fits here: no: {err}")
    return 0


def _free_text(free: Free) -> str:
    parts = [
        f"{what} {size_text(n)} free"
        for what, n in (("host", free.host), (SHM_DIR, free.shm), ("GPU", free.gpu))
        if n is not None
    ]
    return ", ".join(parts)


def _flag_names(message: str) -> str:
    """Config's argument names as this command's flags."""
    for name, flag in (
        ("max_tokens", "--tokens"),
        ("max_recv_tokens", "--max-recv-tokens"),
        ("max_private_tokens", "--max-private-tokens"),
        ("expert_padding", "--expert-padding"),
        ("world_size", "--ranks"),
        ("ranks_per_node", "--ranks-per-node"),
    ):
        if message.startswith(f"{name}:") or message.startswith(f"{name} "):
            return flag + message[len(name) :]
    return message
