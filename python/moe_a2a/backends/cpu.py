"""The CPU backend: compute steps on the calling thread, the proxy thread on the fabric."""

from __future__ import annotations

import numpy as np
import torch

from moe_a2a import _core
from moe_a2a.backends.common import CORE_DTYPE, RecvRequest, Setup, num_scales
from moe_a2a.reference import dequantize_fp8


class CpuBackend:
    """Drives `_core.CpuAllToAll`; outputs are allocated at their exact size."""

    device = torch.device("cpu")
    ids_dtypes: tuple[torch.dtype, ...] = (torch.int32,)
    checks_ids = False  # the front end checks the id range (no stream to synchronise)

    def __init__(self, setup: Setup, masked: list[int] | None = None, first_epoch: int = 0) -> None:
        """`masked` (per rank, 1: lost) and `first_epoch` (dispatches already started): a backend
        rebuilt after a loss (moe_a2a.masking)."""
        self.cfg = setup.cfg
        engine = setup.engine.core if setup.engine is not None else None  # None: no remote peer
        self._impl = _core.CpuAllToAll(
            setup.workspace,
            engine,
            setup.region,
            setup.group,
            setup.remote_peers,
            setup.pids,
            masked or [],
            first_epoch,
        )

    @property
    def epoch(self) -> int:
        return int(self._impl.epoch)

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
        """`routing`: a cached call's matrix (the core copies it before returning). `in_place`
        changes nothing here: the CPU send half packs every row before it returns. `weights`
        ([T, topk] float32) go with the copies' rows. `rows` and `then_recv` change nothing
        here: the receive half waits for the peers' rows on this thread."""
        self._impl.dispatch_send(
            x.data_ptr(),
            CORE_DTYPE[x.dtype],
            scale.data_ptr() if scale is not None else 0,
            ids.data_ptr(),
            x.shape[0],
            routing.data_ptr() if routing is not None else 0,
            weights.data_ptr() if weights is not None else 0,
        )

    def dispatch_recv(
        self, req: RecvRequest
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """`req.routing_out`: [world, num_experts + world] int32 that receives the call's routing matrix.
        Returns (rows, fp8 scales, tokens per expert, row_dot, row weights)."""
        dtype, routing_out, math = req.dtype, req.routing_out, req.math
        rows = self._impl.dispatch_wait()
        if routing_out is not None:
            self._impl.copy_routing(routing_out.data_ptr())
        expert_x = torch.empty(rows, self.cfg.hidden, dtype=dtype)
        scale = None
        if dtype == torch.float8_e4m3fn:
            scale = torch.empty(rows, num_scales(self.cfg.hidden), dtype=torch.float32)
        weights = torch.empty(rows, dtype=torch.float32) if req.row_weights else None
        dot_y = math.dot_y if math is not None else None
        dot = torch.empty(rows, dtype=torch.float32) if dot_y is not None else None
        # The weighted receive in the pass that copies the rows (backends.common.apply_row_math's values).
        self._impl.dispatch_unpack(
            expert_x.data_ptr(),
            scale.data_ptr() if scale is not None else 0,
            weights.data_ptr() if weights is not None else 0,
            math.scale.data_ptr() if math is not None else 0,
            dot_y.data_ptr() if dot_y is not None else 0,
            CORE_DTYPE[dot_y.dtype] if dot_y is not None else _core.DType.bf16,
            dot.data_ptr() if dot is not None else 0,
        )
        if req.dequant is not None and scale is not None:  # the rows as they were sent, then dequantised
            expert_x, scale = dequantize_fp8(expert_x, scale).to(req.dequant), None
        counts = torch.tensor(self._impl.tokens_per_expert, dtype=torch.int32)
        return expert_x, scale, counts, dot, weights

    def combine_send(
        self,
        y: torch.Tensor,
        in_place: bool = False,
        row_values: torch.Tensor | None = None,
        weighted: bool = True,
    ) -> None:  # in_place: as dispatch_send
        self._impl.combine_send(
            y.data_ptr(),
            CORE_DTYPE[y.dtype],
            row_values.data_ptr() if row_values is not None else 0,
            weighted,
        )

    def combine_recv(
        self, weights: torch.Tensor, out: torch.Tensor, values_out: torch.Tensor | None = None
    ) -> None:
        self._impl.combine_recv(
            weights.data_ptr(), out.data_ptr(), values_out.data_ptr() if values_out is not None else 0
        )

    def unpack_order(self) -> list[int]:
        """The senders in the order the last dispatch copied their rows out (each as soon as they landed)."""
        return list(self._impl.unpack_order())

    def wire_rows(self) -> tuple[np.ndarray, np.ndarray]:
        """Wire rows this rank sent to / received from each rank in the last dispatch: copies,
        but one per token towards a rank of another node with fabric_rows="rank"."""
        return np.array(self._impl.sent_counts()), np.array(self._impl.received_counts())

    def forwarded(self) -> tuple[np.ndarray, np.ndarray]:
        """Rows per node (fabric_rows="node") in the last call, per node peer: the rows we forwarded
        that it read its entries from, and the bytes of its outputs (as it staged them: its y's
        dtype) and row values that our combine read."""
        rows, output_bytes = self._impl.forwarded_traffic()
        return np.array(rows, dtype=np.int64), np.array(output_bytes, dtype=np.int64)

    def announce_failure(self, text: str) -> None:
        """Tell every peer that this rank failed, so their waits end at once."""
        self._impl.announce_failure(text)

    def routing_rows(self) -> tuple[int, int]:
        return int(self._impl.routing_rows_sent), int(self._impl.routing_rows_received)

    def close(self) -> None:
        self._impl = None  # type: ignore[assignment]

    def check(self) -> None:
        """Nothing runs asynchronously on the CPU: every error was raised where it happened."""
