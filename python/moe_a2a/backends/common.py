"""What every backend is built from: the configuration and the connected fabric session."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from moe_a2a import _core
from moe_a2a._core import FP8_BLOCK

CORE_DTYPE = {
    torch.bfloat16: _core.DType.bf16,
    torch.float32: _core.DType.fp32,
    torch.float8_e4m3fn: _core.DType.fp8,
}


def routing_rows(matrix: torch.Tensor, rank: int, padding: int) -> tuple[int, int]:
    """Along a routing matrix ([world, num_experts + world], on the host): the output rows
    `rank` receives (each expert's padded to `padding`), and the most copies any rank receives."""
    world = matrix.shape[0]
    per_expert = matrix[:, : matrix.shape[1] - world].numpy().sum(axis=0, dtype=np.int64)  # copies
    local = per_expert.shape[0] // world
    most = int(per_expert.reshape(world, local).sum(axis=1).max())
    mine = per_expert[rank * local : (rank + 1) * local]
    return int(((mine + padding - 1) // padding * padding).sum()), most


def num_scales(hidden: int) -> int:
    """fp32 scales per token for fp8 (one per 128-element block)."""
    return (hidden + FP8_BLOCK - 1) // FP8_BLOCK


@dataclass
class RowMath:
    """A weighted receive: each output row delivered times `scale[r]` and, with `dot_y`,
    `dot[r]` = <row r as received, dot_y[r]> in fp32 (the weighted combine's backward)."""

    scale: torch.Tensor  # [rows] fp32
    dot_y: torch.Tensor | None  # [rows, hidden], bf16 or fp32


@dataclass
class RecvRequest:
    """What a dispatch's receive half delivers, made before its send half: a whole call's
    receive can then be launched right after the send, with no Python between the two.
    The backend fills the outputs."""

    dtype: torch.dtype  # the rows' (the dispatch dtype)
    routing_out: torch.Tensor | None = None  # [world, num_experts + world] int32, the call's matrix
    math: RowMath | None = None
    row_weights: bool = False
    dequant: torch.dtype | None = None  # fp8 rows delivered dequantised, in this dtype
    launched: bool = False  # the backend launched it with the send half
    out: tuple[Any, ...] = ()  # the backend's buffers, once made


def apply_row_math(rows: torch.Tensor, math: RowMath) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The torch form of a weighted receive, which the tests compare with: both backends
    store the same scaled rows in their receive pass, and sum the same products in another
    order (the CPU in fp64, rounded once)."""
    f = rows.float()
    dot = (f * math.dot_y.float()).sum(dim=1) if math.dot_y is not None else None
    return (f * math.scale[:, None]).to(rows.dtype), dot


@dataclass
class Setup:
    """One rank's connected session: core config, shared-memory workspace, engine, peer group."""

    cfg: Any  # moe_a2a.all_to_all.Config
    core_cfg: Any  # _core.A2AConfig
    workspace: Any  # _core.Workspace
    engine: Any  # moe_a2a.fabric.Engine, shared by the instances of the process; None without remote peers
    region: Any  # moe_a2a.fabric.Region of the workspace; None without an engine
    group: Any  # moe_a2a.fabric.Group of the remote peers; None without an engine
    remote_peers: list[int]
    node: set[int]
    bootstrap: Any
    pids: list[int]  # index = rank: its pid where it shares our host, else 0 (a dead one fails waits at once)
    transfer: Any = None  # moe_a2a.gpu_direct.PathChoice, agreed by every rank
    remotes: Any = None  # index = rank: its RemoteRegion of the workspace (None: ours, or no engine)
    device_remotes: Any = None  # GPU-direct: the same for the device workspaces

    @property
    def rails(self) -> int:
        """The ranks per node where rows cross only to our local index on other nodes (mode
        node), which groups spread over the NICs by node distance; else 0."""
        return int(self.core_cfg.ranks_per_node) if self.cfg.fabric_rows == "node" else 0


class Backend(Protocol):
    """What `AllToAll` drives: the four halves of a step on one device, and their bookkeeping."""

    device: torch.device
    ids_dtypes: tuple[torch.dtype, ...]
    checks_ids: bool  # the device checks the expert id range itself (the receive half raises)

    @property
    def epoch(self) -> int: ...

    def dispatch_send(
        self,
        x: torch.Tensor,
        scale: torch.Tensor | None,
        ids: torch.Tensor,
        routing: torch.Tensor | None,
        in_place: bool = False,
        weights: torch.Tensor | None = None,
        rows: tuple[int, int] | None = None,
        then_recv: RecvRequest | None = None,
    ) -> None:
        """`in_place`: `x` stays unchanged until the receive half, which may read this rank's
        own copies from it instead of a copy the send half made. `weights` ([T, topk] fp32)
        go in the rows' tails. `rows`: a cached call's `routing_rows` of `routing`.
        `then_recv`: the receive half follows at once (a whole call); a backend may start it."""

    def dispatch_recv(
        self, req: RecvRequest
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """(rows, fp8 scales, tokens per local expert, math's dot products or None, the rows'
        weights from their tails or None)."""

    def combine_send(
        self,
        y: torch.Tensor,
        in_place: bool = False,
        row_values: torch.Tensor | None = None,
        weighted: bool = True,
    ) -> None:
        """`in_place`: as for dispatch_send, with `y`. `row_values` go in the rows' tails.
        `weighted`: as the combine's; rows per rank are weighted (or not) where the experts are."""

    def combine_recv(
        self, weights: torch.Tensor, out: torch.Tensor, values_out: torch.Tensor | None = None
    ) -> None:
        """`values_out` ([T, topk] fp32): each copy's returned tail, unreduced."""

    def announce_failure(self, text: str) -> None:
        """Tell every peer that this rank failed, so their waits end at once."""

    def check(self) -> None:
        """Raise the outcome of the last call (asynchronous devices)."""

    def wire_rows(self) -> tuple[np.ndarray, np.ndarray]:
        """Rows this rank sent to / received from each rank in the last dispatch, as they
        crossed: one per copy, or per token towards a rank of another node with
        fabric_rows="rank" (docs/protocol.md, "Rows per destination rank")."""

    def routing_rows(self) -> tuple[int, int]: ...

    def close(self) -> None: ...
