"""One expert-parallel MoE layer: router, dispatch, shared expert, grouped experts, combine."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch

from moe_a2a.layers.experts import dequantize, swiglu, swiglu_experts
from moe_a2a.layers.presets import MoEShape
from moe_a2a.layers.router import Router
from moe_a2a.layers.weights import MoEWeights, shard_state_dict

# Called with a phase name (see moe_a2a.trace.PHASES); returns a context manager that
# times the phase.
PhaseTimer = Callable[[str], AbstractContextManager[Any]]


class Dispatched(Protocol):
    """What dispatch hands the experts (moe_a2a.all_to_all's result)."""

    expert_x: torch.Tensor
    expert_x_scale: torch.Tensor | None
    tokens_per_expert: torch.Tensor


def _untimed(name: str) -> AbstractContextManager[Any]:
    return contextlib.nullcontext()


class MoELayer:
    """This rank's part of an MoE layer; its `forward` runs the layer over an all-to-all.

    The all-to-all is passed in (anything with moe_a2a.AllToAll's `dispatch` and
    `combine`), so the layer runs over MPI, in one process over a reference
    all-to-all, or in a test double.
    """

    def __init__(self, shape: MoEShape, weights: MoEWeights, *, expert_padding: int = 1) -> None:
        if weights.hidden != shape.hidden or weights.num_experts != shape.num_experts:
            raise ValueError(
                f"weights: got hidden {weights.hidden}, {weights.num_experts} experts; the shape expects "
                f"hidden {shape.hidden}, {shape.num_experts} experts"
            )
        if weights.expert_hidden != shape.expert_hidden:
            raise ValueError(
                f"weights: got expert_hidden {weights.expert_hidden}; the shape expects {shape.expert_hidden}"
            )
        if weights.has_shared != (shape.num_shared_experts > 0) or (
            weights.has_shared and weights.shared_w1.shape[0] != shape.shared_hidden
        ):
            got = weights.shared_w1.shape[0] if weights.has_shared else 0
            raise ValueError(f"weights: shared expert width {got}; the shape expects {shape.shared_hidden}")
        if not isinstance(expert_padding, int) or expert_padding < 1:
            raise ValueError(f"expert_padding: got {expert_padding!r}; expected a positive integer")
        self.shape = shape
        self.weights = weights
        self.expert_padding = expert_padding
        self.router = Router.from_shape(shape, weights.gate, weights.expert_bias)
        self.last_tokens_per_expert: torch.Tensor | None = None  # of the latest forward, for traces

    @classmethod
    def from_state_dict(
        cls,
        shape: MoEShape,
        state_dict: Mapping[str, torch.Tensor],
        rank: int,
        world_size: int,
        *,
        prefix: str = "",
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        expert_padding: int = 1,
    ) -> MoELayer:
        """A layer from a full (unsharded) TorchTitan state dict, keeping this rank's experts."""
        weights = shard_state_dict(
            state_dict, rank, world_size, prefix=prefix, shape=shape, dtype=dtype, device=device
        )
        return cls(shape, weights, expert_padding=expert_padding)

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.weights.w1.dtype

    @property
    def local_experts(self) -> range:
        start = self.weights.expert_offset
        return range(start, start + self.weights.num_local_experts)

    def shared_expert(self, x: torch.Tensor) -> torch.Tensor | None:
        """The shared expert over this rank's tokens (None without one)."""
        w = self.weights
        if not w.has_shared:
            return None
        return swiglu(x.to(self.compute_dtype), w.shared_w1, w.shared_w2, w.shared_w3)

    def experts(self, d: Dispatched) -> torch.Tensor:
        """Routed experts over dispatched rows, one grouped GEMM per weight."""
        counts = d.tokens_per_expert
        if counts.shape != (self.weights.num_local_experts,):
            raise ValueError(
                f"tokens_per_expert: got shape {tuple(counts.shape)}; this rank hosts "
                f"{self.weights.num_local_experts} experts (does the all-to-all have the same num_experts?)"
            )
        x = dequantize(d.expert_x, d.expert_x_scale, self.compute_dtype)
        w = self.weights
        return swiglu_experts(x, counts, w.w1, w.w2, w.w3, self.expert_padding)

    @torch.no_grad()
    def forward(
        self,
        x: torch.Tensor,
        a2a: Any,
        topk_ids: torch.Tensor | None = None,
        topk_weights: torch.Tensor | None = None,
        timer: PhaseTimer | None = None,
    ) -> torch.Tensor:
        """The layer's output `[T, D]` for this rank's tokens `x [T, D]`, in the combine dtype.

        Routing comes from the router unless `topk_ids`/`topk_weights` are given (to feed
        this layer and another implementation the same routing). The shared expert runs
        while dispatched tokens are in flight, between the send and receive halves.
        """
        if x.dim() != 2 or x.shape[1] != self.shape.hidden:
            raise ValueError(f"x: got shape {tuple(x.shape)}; expected [tokens, {self.shape.hidden}]")
        if (topk_ids is None) != (topk_weights is None):
            raise ValueError("topk_ids/topk_weights: got one without the other; pass both or neither")
        if topk_ids is None:
            topk_ids, topk_weights = self.router(x)
        elif topk_ids.shape != (x.shape[0], self.shape.topk) or topk_weights.shape != topk_ids.shape:
            raise ValueError(
                f"topk_ids/topk_weights: got shapes {tuple(topk_ids.shape)} and "
                f"{tuple(topk_weights.shape)}; expected [{x.shape[0]}, {self.shape.topk}]"
            )
        cfg = getattr(a2a, "cfg", None)
        if cfg is not None and getattr(cfg, "expert_padding", self.expert_padding) != self.expert_padding:
            raise ValueError(
                f"a2a: pads expert segments to {cfg.expert_padding}; this layer expects {self.expert_padding}"
            )
        phase = timer or _untimed
        with phase("dispatch_send"):
            handle = a2a.dispatch(x, topk_ids, topk_weights, send=True, recv=False)
        with phase("shared_expert"):
            shared = self.shared_expert(x)
        with phase("dispatch_recv"):
            d = a2a.dispatch(handle=handle, send=False, recv=True)
        with phase("experts"):
            y = self.experts(d)
        with phase("combine_send"):
            combine_handle = a2a.combine(y, d, send=True, recv=False)
        with phase("combine_recv"):
            out = a2a.combine(handle=combine_handle, send=False, recv=True)
        self.last_tokens_per_expert = d.tokens_per_expert
        if shared is None:
            return out
        return (out.float() + shared.float()).to(out.dtype)
