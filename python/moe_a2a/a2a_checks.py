"""The checks of an AllToAll call's arguments: each bad one is named, with what it got and
what was expected, before anything is sent (docs/design.md, "Errors")."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from moe_a2a.a2a_types import Config, Routing, describe
from moe_a2a.backends.common import RowMath, num_scales


def resolve_in_place(what: str, in_place: Any, send: bool, recv: bool) -> bool:
    """A whole call reads its input in place unless told otherwise; a send half only when asked."""
    if in_place is None:
        return send and recv
    if not isinstance(in_place, bool):
        raise ValueError(f"{what}: in_place: got {in_place!r}; expected True, False or None")
    if not send:
        raise ValueError(f"{what}: in_place= belongs to the send half (send=True)")
    return in_place


def split_x(x: Any) -> tuple[Any, Any]:
    """dispatch's `x`: rows, or already-quantised fp8 rows with their scales, `(x, x_scale)`."""
    if isinstance(x, (tuple, list)):
        if len(x) != 2:
            raise ValueError(
                f"dispatch: x: got a sequence of {len(x)}; expected rows or the pair (x, x_scale)"
            )
        return x[0], x[1]
    return x, None


@dataclass(frozen=True)
class CallChecks:
    """What one AllToAll checks its calls against: its shape, its place, what its backend takes."""

    cfg: Config
    device: torch.device
    rank: int
    world_size: int
    checks_ids: bool  # the device checks the expert id range itself (the receive half raises)
    ids_dtypes: tuple[torch.dtype, ...]  # what the core takes unconverted

    def row_math(self, routing: Any, row_scale: Any, row_dot: Any) -> RowMath | None:
        """The receive half's row_scale and row_dot, checked against the rows `routing` delivers."""
        if row_scale is None:
            if row_dot is not None:
                raise ValueError(
                    "dispatch: row_dot= needs row_scale= (pass ones to only take the dot products)"
                )
            return None
        if not isinstance(routing, Routing):
            raise ValueError(
                "dispatch: row_scale= needs a call along routing= (whose rows are known before they arrive)"
            )
        if self.cfg.dispatch_dtype == "fp8":
            raise ValueError("dispatch: row_scale=: the rows are fp8; expected dispatch_dtype bf16 or fp32")
        rows, _ = routing.received_rows(self.cfg.expert_padding)
        if (
            not isinstance(row_scale, torch.Tensor)
            or row_scale.dtype != torch.float32
            or tuple(row_scale.shape) != (rows,)
            or row_scale.device != self.device
        ):
            raise ValueError(
                f"dispatch: row_scale: got {describe(row_scale)}; expected float32 of shape ({rows},) "
                f"on {self.device} (one per row this rank receives)"
            )
        if row_dot is not None and (
            not isinstance(row_dot, torch.Tensor)
            or row_dot.dtype not in (torch.bfloat16, torch.float32)
            or tuple(row_dot.shape) != (rows, self.cfg.hidden)
            or row_dot.device != self.device
        ):
            raise ValueError(
                f"dispatch: row_dot: got {describe(row_dot)}; expected bfloat16 or float32 of shape "
                f"({rows}, {self.cfg.hidden}) on {self.device}"
            )
        # Detached: the backend keeps them until its kernels ran, and no autograd graph (with
        # the routing handles behind it) may outlive its step.
        dot_y = row_dot.detach().contiguous() if row_dot is not None else None
        return RowMath(row_scale.detach().contiguous(), dot_y)

    def routing(self, routing: Any, x: Any, topk_ids: Any) -> None:
        """A Routing made by an instance of the same ranks and shape, and no ids beside it."""
        if not isinstance(routing, Routing):
            raise TypeError(f"dispatch: routing: got {type(routing).__name__}; expected a moe_a2a.Routing")
        if topk_ids is not None:
            raise ValueError("dispatch: with routing=, leave topk_ids out (the routing has them)")
        want = (self.rank, self.world_size, self.cfg.num_experts, self.cfg.topk)
        experts = routing.matrix.shape[1] - routing.world_size  # the rest: wire rows per rank
        got = (routing.rank, routing.world_size, experts, routing.topk_ids.shape[1])
        if got != want or routing.max_tokens > self.cfg.max_tokens:
            raise ValueError(
                f"dispatch: routing: made for (rank, world size, num_experts, topk) = {got} and "
                f"max_tokens {routing.max_tokens}; expected {want} and at most {self.cfg.max_tokens}"
            )
        if routing.ids_version is not None and routing.topk_ids._version != routing.ids_version:
            raise ValueError(
                "dispatch: routing: its topk_ids were changed in place after dispatch returned it; "
                "expected the Routing unchanged"
            )
        if routing.topk_ids.device != self.device:
            raise ValueError(
                f"dispatch: routing: its topk_ids are on {routing.topk_ids.device}; expected {self.device}"
            )
        tokens = routing.topk_ids.shape[0]
        x, _ = split_x(x)
        if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[0] != tokens:
            raise ValueError(f"dispatch: x: got {describe(x)}; expected {tokens} rows (the routing's tokens)")

    def own_row(self, routing: Routing, ids: torch.Tensor) -> None:
        """Where it costs no stream synchronisation: our row of the matrix is what the ids count."""
        counts = torch.bincount(ids.flatten().to(torch.int64), minlength=self.cfg.num_experts)
        if not torch.equal(counts.to(torch.int32), routing.matrix[self.rank, : self.cfg.num_experts]):
            raise ValueError(
                f"dispatch: routing: row {self.rank} of its matrix does not count its topk_ids; "
                "expected the Routing as dispatch returned it, unchanged"
            )

    def on_device(self, name: str, t: torch.Tensor) -> None:
        if t.device != self.device:
            raise ValueError(f"dispatch: {name} is on {t.device}; expected {self.device}")

    def dispatch_inputs(
        self, x: Any, topk_ids: Any, topk_weights: Any, routing: Routing | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """x, ids, weights and x's fp8 scales as the core takes them. Along `routing` its ids (and
        its weights, unless others are given) were checked when the routing was made."""
        x, x_scale = self.x_and_scale(*split_x(x))
        shape = (x.shape[0], self.cfg.topk)
        ids = routing.topk_ids if routing is not None else self.ids(topk_ids, shape)
        if routing is not None and topk_weights is None:
            weights = routing.topk_weights
        else:
            weights = self.weights(topk_weights, shape)
        return x, ids, weights, x_scale

    def x_and_scale(self, x: Any, x_scale: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        cfg = self.cfg
        if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[1] != cfg.hidden:
            raise ValueError(f"dispatch: x: got {describe(x)}; expected [T, {cfg.hidden}]")
        tokens = x.shape[0]
        if tokens > cfg.max_tokens:
            raise ValueError(f"dispatch: x has {tokens} tokens; expected at most max_tokens={cfg.max_tokens}")
        self.on_device("x", x)
        if x.dtype == torch.float8_e4m3fn:
            if cfg.dispatch_dtype != "fp8":
                raise ValueError(f"dispatch: x is fp8 but dispatch_dtype is {cfg.dispatch_dtype!r}")
            blocks = num_scales(cfg.hidden)
            if (
                not isinstance(x_scale, torch.Tensor)
                or tuple(x_scale.shape) != (tokens, blocks)
                or x_scale.dtype != torch.float32
                or x_scale.device != self.device
            ):
                raise ValueError(
                    f"dispatch: x: fp8 rows come as the pair (x, x_scale); got x_scale {describe(x_scale)}; "
                    f"expected float32 [{tokens}, {blocks}] on {self.device}"
                )
            x_scale = x_scale.contiguous()
        elif x.dtype in (torch.bfloat16, torch.float32):
            if x_scale is not None:
                raise ValueError(
                    f"dispatch: x: got a pair of {x.dtype} rows and scales; the pair (x, x_scale) "
                    "is only for already-quantised fp8 x"
                )
        else:
            raise ValueError(f"dispatch: x: got dtype {x.dtype}; expected bfloat16, float32 or float8_e4m3fn")
        return x.contiguous(), x_scale

    def ids(self, topk_ids: Any, shape: tuple[int, int]) -> torch.Tensor:
        cfg = self.cfg
        if not isinstance(topk_ids, torch.Tensor) or tuple(topk_ids.shape) != shape:
            raise ValueError(f"dispatch: topk_ids: got {describe(topk_ids)}; expected shape {shape}")
        if topk_ids.dtype.is_floating_point or topk_ids.dtype == torch.bool or topk_ids.is_complex():
            raise ValueError(f"dispatch: topk_ids: got dtype {topk_ids.dtype}; expected an integer dtype")
        self.on_device("topk_ids", topk_ids)
        # On the GPU, reading the ids back would synchronise the stream (about 50 us
        # on an H200, more than the decode step's kernels): the CUDA kernels check
        # the range instead, drop bad copies and raise from the receive half.
        if shape[0] > 0 and not self.checks_ids:
            low, high = (int(v) for v in torch.aminmax(topk_ids))
            if low < 0 or high >= cfg.num_experts:
                bad = low if low < 0 else high
                raise ValueError(
                    f"dispatch: topk_ids: found expert id {bad}; expected ids in [0, {cfg.num_experts})"
                )
        ids_dtypes = self.ids_dtypes
        ids = topk_ids if topk_ids.dtype in ids_dtypes else topk_ids.to(ids_dtypes[-1])
        return ids.contiguous()

    def weights(self, topk_weights: Any, shape: tuple[int, int]) -> torch.Tensor:
        if not isinstance(topk_weights, torch.Tensor) or tuple(topk_weights.shape) != shape:
            raise ValueError(f"dispatch: topk_weights: got {describe(topk_weights)}; expected shape {shape}")
        if not topk_weights.dtype.is_floating_point:
            raise ValueError(f"dispatch: topk_weights: got dtype {topk_weights.dtype}; expected float32")
        self.on_device("topk_weights", topk_weights)
        return topk_weights.to(torch.float32).contiguous()

    def combine_inputs(self, y: Any, rows: int, row_values: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A combine's y ([rows, hidden], those of its dispatch) and row_values, as the core takes them."""
        expected = (rows, self.cfg.hidden)
        if not isinstance(y, torch.Tensor) or y.dim() != 2 or tuple(y.shape) != expected:
            raise ValueError(f"combine: y: got {describe(y)}; expected shape {expected} (that of d.expert_x)")
        if y.dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"combine: y: got dtype {y.dtype}; expected torch.bfloat16 or torch.float32")
        if y.device != self.device:
            raise ValueError(f"combine: y is on {y.device}; expected {self.device}")
        if row_values is not None and (
            not isinstance(row_values, torch.Tensor)
            or row_values.dtype != torch.float32
            or tuple(row_values.shape) != (expected[0],)
            or row_values.device != self.device
        ):
            raise ValueError(
                f"combine: row_values: got {describe(row_values)}; expected float32 of shape "
                f"({expected[0]},) on {self.device} (one per row of d.expert_x)"
            )
        values = row_values.detach().contiguous() if row_values is not None else None
        return y.contiguous(), values

    def values_out(self, values_out: Any, tokens: int) -> None:
        """A combine receive's values_out: [tokens, topk] float32, contiguous, on the device."""
        if values_out is not None:
            want = (tokens, self.cfg.topk)
            if (
                not isinstance(values_out, torch.Tensor)
                or values_out.dtype != torch.float32
                or tuple(values_out.shape) != want
                or values_out.device != self.device
                or not values_out.is_contiguous()
            ):
                raise ValueError(
                    f"combine: values_out: got {describe(values_out)}; expected a contiguous float32 "
                    f"tensor of shape {want} on {self.device}"
                )
