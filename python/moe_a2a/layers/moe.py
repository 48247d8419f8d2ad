"""One expert-parallel MoE layer as a torch.nn.Module: router, dispatch, shared expert, experts, combine.

Submodules, parameters and buffers carry TorchTitan 0.3.0's names
(`torchtitan.models.common.moe.MoE`), so the layer's `state_dict()` and
`load_state_dict()` speak TorchTitan's keys; the routed experts hold only this
rank's block:

  router.gate.weight                    [E, D]
  routed_experts.inner_experts.w1_EFD   [E_local, F, D]   (and w3_EFD)
  routed_experts.inner_experts.w2_EDF   [E_local, D, F]
  shared_experts.w{1,2,3}.weight        [Fs, D], [D, Fs], [Fs, D]
  expert_bias_E                         [E]   (buffer, when the layer has a bias)
  tokens_per_expert_E                   [E]   (buffer, not saved: load counted in training)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch
from torch import nn

from moe_a2a.layers.experts import dequantize, swiglu, swiglu_experts
from moe_a2a.layers.presets import MoEShape
from moe_a2a.layers.router import TopKRouter, Weight
from moe_a2a.layers.weights import MoEWeights, shard_state_dict

# Called with a phase name (see moe_a2a.trace.PHASES); returns a context manager that
# times the phase.
PhaseTimer = Callable[[str], AbstractContextManager[Any]]


class Dispatched(Protocol):
    """What dispatch hands the experts (moe_a2a.all_to_all's result, or autograd's Routed)."""

    expert_x: torch.Tensor
    tokens_per_expert: torch.Tensor


def _untimed(name: str) -> AbstractContextManager[Any]:
    return contextlib.nullcontext()


class GroupedExperts(nn.Module):
    """This rank's routed experts, stacked in TorchTitan's layout."""

    def __init__(self, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor) -> None:
        super().__init__()
        self.w1_EFD = nn.Parameter(w1)
        self.w2_EDF = nn.Parameter(w2)
        self.w3_EFD = nn.Parameter(w3)


class RoutedExperts(nn.Module):
    """Holds `inner_experts`, so the keys nest as TorchTitan's do."""

    def __init__(self, inner: GroupedExperts) -> None:
        super().__init__()
        self.inner_experts = inner


class SharedExpert(nn.Module):
    """The dense SwiGLU FFN that every token goes through (linear weights)."""

    def __init__(self, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor) -> None:
        super().__init__()
        self.w1, self.w2, self.w3 = Weight(w1), Weight(w2), Weight(w3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return swiglu(x.to(self.w1.weight.dtype), self.w1.weight, self.w2.weight, self.w3.weight)


class MoELayer(nn.Module):
    """This rank's part of an MoE layer; `forward` runs the layer over an all-to-all.

    The all-to-all is passed in. An `moe_a2a.autograd.ExpertParallel` makes the
    forward differentiable (training); anything with moe_a2a.AllToAll's split
    `dispatch` and `combine` (over MPI, a one-process reference, a test double)
    runs the inference path under `torch.no_grad()`, with the shared expert between
    the send and receive halves of dispatch. That path refuses a layer in training
    mode with gradients enabled, because its output could never train anything:
    call `.eval()` or use `torch.no_grad()` for inference.

    `load_balance_coeff` turns on the auxiliary-loss-free load balancing of
    DeepSeek-V3 as TorchTitan implements it: training forwards count tokens per
    expert, and `update_expert_bias` (after the optimizer step) moves the bias.
    """

    expert_bias_E: torch.Tensor | None  # noqa: N815 (buffers, typed for the checker; shapes in names)
    tokens_per_expert_E: torch.Tensor  # noqa: N815

    def __init__(
        self,
        shape: MoEShape,
        weights: MoEWeights,
        *,
        expert_padding: int = 1,
        load_balance_coeff: float | None = None,
    ) -> None:
        super().__init__()
        if weights.hidden != shape.hidden or weights.num_experts != shape.num_experts:
            raise ValueError(
                f"weights: got hidden {weights.hidden}, {weights.num_experts} experts; the shape expects "
                f"hidden {shape.hidden}, {shape.num_experts} experts"
            )
        if weights.expert_hidden != shape.expert_hidden:
            raise ValueError(
                f"weights: got expert_hidden {weights.expert_hidden}; the shape expects {shape.expert_hidden}"
            )
        shared = weights.shared
        got = shared[0].shape[0] if shared is not None else 0
        if (shared is not None) != (shape.num_shared_experts > 0) or (
            shared is not None and got != shape.shared_hidden
        ):
            raise ValueError(f"weights: shared expert width {got}; the shape expects {shape.shared_hidden}")
        if not isinstance(expert_padding, int) or expert_padding < 1:
            raise ValueError(f"expert_padding: got {expert_padding!r}; expected a positive integer")
        if load_balance_coeff is not None and not (
            isinstance(load_balance_coeff, (int, float)) and load_balance_coeff > 0
        ):
            raise ValueError(
                f"load_balance_coeff: got {load_balance_coeff!r}; expected a positive number or None"
            )
        self.shape = shape
        self.expert_padding = expert_padding
        self.expert_offset = weights.expert_offset
        self.load_balance_coeff = load_balance_coeff
        self.router = TopKRouter(shape, weights.gate)
        self.routed_experts = RoutedExperts(GroupedExperts(weights.w1, weights.w2, weights.w3))
        self.shared_experts = SharedExpert(*shared) if shared is not None else None
        bias = weights.expert_bias
        if bias is None and load_balance_coeff is not None:
            bias = torch.zeros(shape.num_experts, dtype=torch.float32, device=weights.gate.device)
        self.register_buffer("expert_bias_E", bias, persistent=True)
        self.register_buffer(
            "tokens_per_expert_E",
            torch.zeros(shape.num_experts, dtype=torch.float32, device=weights.gate.device),
            persistent=False,
        )
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
        load_balance_coeff: float | None = None,
    ) -> MoELayer:
        """A layer from a full (unsharded) state dict, keeping this rank's experts.

        Takes this library's keys (`MoEWeights.state_dict`) and TorchTitan 0.3.0's
        (`MoE.state_dict()`, the same as this module's own at world size 1).
        """
        weights = shard_state_dict(
            state_dict, rank, world_size, prefix=prefix, shape=shape, dtype=dtype, device=device
        )
        return cls(shape, weights, expert_padding=expert_padding, load_balance_coeff=load_balance_coeff)

    @property
    def weights(self) -> MoEWeights:
        """The layer's tensors (the parameters themselves) as MoEWeights."""
        inner = self.routed_experts.inner_experts
        shared = self.shared_experts
        return MoEWeights(
            gate=self.router.gate.weight,
            w1=inner.w1_EFD,
            w2=inner.w2_EDF,
            w3=inner.w3_EFD,
            expert_offset=self.expert_offset,
            shared_w1=None if shared is None else shared.w1.weight,
            shared_w2=None if shared is None else shared.w2.weight,
            shared_w3=None if shared is None else shared.w3.weight,
            expert_bias=self.expert_bias_E,
        )

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.routed_experts.inner_experts.w1_EFD.dtype

    @property
    def num_local_experts(self) -> int:
        return self.routed_experts.inner_experts.w1_EFD.shape[0]

    @property
    def local_experts(self) -> range:
        return range(self.expert_offset, self.expert_offset + self.num_local_experts)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The router's `(topk_ids, topk_weights)` for `[T, D]` tokens, with the layer's expert bias."""
        return self.router(x, self.expert_bias_E)

    def shared_expert(self, x: torch.Tensor) -> torch.Tensor | None:
        """The shared expert over this rank's tokens (None without one)."""
        return None if self.shared_experts is None else self.shared_experts(x)

    def experts(self, d: Dispatched) -> torch.Tensor:
        """Routed experts over dispatched rows, one grouped GEMM per weight."""
        counts = d.tokens_per_expert
        if counts.shape != (self.num_local_experts,):
            raise ValueError(
                f"tokens_per_expert: got shape {tuple(counts.shape)}; this rank hosts "
                f"{self.num_local_experts} experts (does the all-to-all have the same num_experts?)"
            )
        x = dequantize(d.expert_x, getattr(d, "expert_x_scale", None), self.compute_dtype)
        w = self.routed_experts.inner_experts
        return swiglu_experts(x, counts, w.w1_EFD, w.w2_EDF, w.w3_EFD, self.expert_padding)

    def forward(
        self,
        x: torch.Tensor,
        a2a: Any,
        topk_ids: torch.Tensor | None = None,
        topk_weights: torch.Tensor | None = None,
        timer: PhaseTimer | None = None,
    ) -> torch.Tensor:
        """The layer's output for this rank's tokens `x`, `[T, D]` or `[B, L, D]` (same shape back).

        Routing comes from the router unless `topk_ids`/`topk_weights` are given (to feed
        this layer and another implementation the same routing), `[T, topk]` or
        `[B, L, topk]`. The output is in the combine dtype. With an ExpertParallel, the
        timer also times the backward of combine and of dispatch (`combine_bwd`,
        `dispatch_bwd`) when autograd runs them.
        """
        D = self.shape.hidden
        if not isinstance(x, torch.Tensor) or x.dim() not in (2, 3) or x.shape[-1] != D:
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"x: got {got}; expected [tokens, {D}] or [batch, seq, {D}]")
        lead = x.shape[:-1]
        x2 = x.reshape(-1, D)
        T, K = x2.shape[0], self.shape.topk
        if (topk_ids is None) != (topk_weights is None):
            raise ValueError("topk_ids/topk_weights: got one without the other; pass both or neither")
        if topk_ids is not None:
            assert topk_weights is not None
            if topk_ids.shape not in ((*lead, K), (T, K)) or topk_weights.shape != topk_ids.shape:
                raise ValueError(
                    f"topk_ids/topk_weights: got shapes {tuple(topk_ids.shape)} and "
                    f"{tuple(topk_weights.shape)}; expected {[*lead, K]}"
                    + (f" or {[T, K]}" if len(lead) > 1 else "")
                )
            topk_ids, topk_weights = topk_ids.reshape(T, K), topk_weights.reshape(T, K)
        cfg = getattr(a2a, "cfg", None)
        if cfg is not None and getattr(cfg, "expert_padding", self.expert_padding) != self.expert_padding:
            raise ValueError(
                f"a2a: pads expert segments to {cfg.expert_padding}; this layer expects {self.expert_padding}"
            )
        from moe_a2a.autograd import ExpertParallel

        if isinstance(a2a, ExpertParallel):
            topk_ids, topk_weights = self._routing(x2, topk_ids, topk_weights)
            out = self._forward_differentiable(x2, a2a, topk_ids, topk_weights, timer)
        else:
            if torch.is_grad_enabled() and self.training:
                raise RuntimeError(
                    f"forward: a2a is a {type(a2a).__name__}, which has no backward, while the layer is "
                    "training with gradients enabled; pass an moe_a2a.autograd.ExpertParallel to train, "
                    "or call .eval() (or use torch.no_grad()) for inference"
                )
            with torch.no_grad():
                topk_ids, topk_weights = self._routing(x2, topk_ids, topk_weights)
                out = self._forward_inference(x2, a2a, topk_ids, topk_weights, timer)
        return out.reshape(*lead, D)

    def _routing(
        self, x: torch.Tensor, topk_ids: torch.Tensor | None, topk_weights: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if topk_ids is None:
            topk_ids, topk_weights = self.route(x)
        assert topk_weights is not None
        if self.training:
            # The load of this rank's tokens, for update_expert_bias (as TorchTitan counts it).
            with torch.no_grad():
                counts = torch.bincount(topk_ids.reshape(-1), minlength=self.shape.num_experts)
                self.tokens_per_expert_E.add_(counts.to(self.tokens_per_expert_E))
        return topk_ids, topk_weights

    def _forward_inference(
        self, x: torch.Tensor, a2a: Any, topk_ids: torch.Tensor, topk_weights: torch.Tensor, timer: Any
    ) -> torch.Tensor:
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
        return _add_shared(out, shared)

    def _forward_differentiable(
        self, x: torch.Tensor, ep: Any, topk_ids: torch.Tensor, topk_weights: torch.Tensor, timer: Any
    ) -> torch.Tensor:
        phase = timer or _untimed
        with phase("dispatch"):
            routed = ep.dispatch(x, topk_ids, topk_weights)
        with phase("shared_expert"):
            shared = self.shared_expert(x)
        with phase("experts"):
            y = self.experts(routed)
        with phase("combine"):
            out = ep.combine(y, routed, weighted=True)
        if timer is not None:
            _time_node(out.grad_fn, "combine_bwd", timer)
            _time_node(routed.expert_x.grad_fn, "dispatch_bwd", timer)
        self.last_tokens_per_expert = routed.tokens_per_expert
        return _add_shared(out, shared)

    @torch.no_grad()
    def update_expert_bias(
        self, all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
    ) -> torch.Tensor:
        """Move the expert bias towards balanced load; call it after the optimizer step.

        `expert_bias += coeff * sign(mean load - load)`, centred to zero mean, as
        TorchTitan's optimizer hook does; the load is what training forwards counted
        since the last update, summed over ranks by `all_reduce` (tensor in, sum over
        ranks out; None in one process). The counts are then reset. Returns the
        global counts used.
        """
        if self.load_balance_coeff is None or self.expert_bias_E is None:
            raise RuntimeError(
                "update_expert_bias: load_balance_coeff is None; construct the layer with "
                "load_balance_coeff=<positive number> to balance the load"
            )
        counts = self.tokens_per_expert_E.clone()
        if all_reduce is not None:
            counts = all_reduce(counts).to(self.tokens_per_expert_E)
        delta = self.load_balance_coeff * torch.sign(counts.mean() - counts)
        self.expert_bias_E.add_(delta - delta.mean())
        self.tokens_per_expert_E.zero_()
        return counts


def _add_shared(out: torch.Tensor, shared: torch.Tensor | None) -> torch.Tensor:
    """Routed plus shared output, summed in fp32, in the combine dtype."""
    return out if shared is None else (out.float() + shared.float()).to(out.dtype)


def _time_node(node: Any, name: str, timer: PhaseTimer) -> None:
    """Time an autograd node's backward as phase `name`: its pre-hook opens the phase, its hook closes it."""
    if node is None:  # nothing upstream wants a gradient: autograd will not run it
        return
    box: dict[str, Any] = {}

    def start(grad_outputs: Any) -> None:
        box["phase"] = timer(name)
        box["phase"].__enter__()

    def end(grad_inputs: Any, grad_outputs: Any) -> None:
        phase = box.pop("phase", None)
        if phase is not None:
            phase.__exit__(None, None, None)

    node.register_prehook(start)
    node.register_hook(end)
