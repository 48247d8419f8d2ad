"""Token-choice top-k routing: softmax or sigmoid scores, group- or node-limited."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from moe_a2a.layers.presets import SCORE_FUNCS, MoEShape


def route(
    x: torch.Tensor,
    gate: torch.Tensor,
    topk: int,
    *,
    score_func: str = "softmax",
    num_groups: int = 1,
    topk_groups: int = 1,
    route_scale: float = 1.0,
    norm_topk: bool = True,
    expert_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k experts and their weights for every token.

    `x` is `[T, D]`, `gate` the router weight `[E, D]`. Scores are computed in fp32 so
    that the discrete choice does not depend on the input dtype's rounding.
    With `num_groups > 1`, experts form equal contiguous groups; each token keeps the
    `topk_groups` groups whose two best scores sum highest (DeepSeek-V3) and picks its
    experts among those only. Node-limited routing is the same rule with one group per
    node, since experts live on ranks in contiguous blocks and nodes are contiguous ranks.
    `expert_bias` (DeepSeek-V3's load-balancing correction) shifts the choice but not
    the weights. Returns `(topk_ids int64 [T, topk], topk_weights fp32 [T, topk])`.
    """
    if x.dim() != 2:
        raise ValueError(f"x: got shape {tuple(x.shape)}; expected [tokens, hidden]")
    if gate.dim() != 2 or gate.shape[1] != x.shape[1]:
        raise ValueError(
            f"gate: got shape {tuple(gate.shape)}; expected [num_experts, {x.shape[1]}] (hidden of x)"
        )
    num_experts = gate.shape[0]
    if score_func not in SCORE_FUNCS:
        raise ValueError(f"score_func: got {score_func!r}; expected one of {SCORE_FUNCS}")
    if not 1 <= topk <= num_experts:
        raise ValueError(f"topk: got {topk}; expected 1..{num_experts}")
    if num_groups < 1 or num_experts % num_groups != 0:
        raise ValueError(f"num_groups: got {num_groups}; expected a divisor of num_experts={num_experts}")
    if not 1 <= topk_groups <= num_groups:
        raise ValueError(f"topk_groups: got {topk_groups}; expected 1..num_groups={num_groups}")
    group_size = num_experts // num_groups
    if topk > topk_groups * group_size:
        raise ValueError(
            f"topk: got {topk}; {topk_groups} groups of {group_size} experts cannot hold that many"
        )
    if expert_bias is not None and tuple(expert_bias.shape) != (num_experts,):
        raise ValueError(f"expert_bias: got shape {tuple(expert_bias.shape)}; expected [{num_experts}]")

    logits = x.float() @ gate.float().t()
    scores = torch.softmax(logits, dim=-1) if score_func == "softmax" else torch.sigmoid(logits)
    choice = scores if expert_bias is None else scores + expert_bias.float()
    if num_groups > 1 and topk_groups < num_groups:
        grouped = choice.view(-1, num_groups, group_size)
        group_score = grouped.topk(min(2, group_size), dim=-1).values.sum(dim=-1)
        keep = group_score.topk(topk_groups, dim=-1).indices
        dropped = torch.ones_like(group_score, dtype=torch.bool).scatter_(1, keep, False)
        choice = grouped.masked_fill(dropped.unsqueeze(-1), float("-inf")).view(-1, num_experts)
    topk_ids = choice.topk(topk, dim=-1).indices
    topk_weights = scores.gather(1, topk_ids)
    if norm_topk:
        # Guard against a zero sum only; sigmoid and softmax scores are positive.
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True).clamp_min(1e-20)
    return topk_ids, topk_weights * route_scale


@dataclass
class Router:
    """A router's weights and rules; calling it routes `[T, D]` tokens."""

    gate: torch.Tensor  # [E, D]
    topk: int
    score_func: str = "softmax"
    num_groups: int = 1
    topk_groups: int = 1
    route_scale: float = 1.0
    norm_topk: bool = True
    expert_bias: torch.Tensor | None = None

    @classmethod
    def from_shape(
        cls, shape: MoEShape, gate: torch.Tensor, expert_bias: torch.Tensor | None = None
    ) -> Router:
        return cls(
            gate=gate,
            topk=shape.topk,
            score_func=shape.score_func,
            num_groups=shape.num_groups,
            topk_groups=shape.topk_groups,
            route_scale=shape.route_scale,
            norm_topk=shape.norm_topk,
            expert_bias=expert_bias,
        )

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return route(
            x,
            self.gate,
            self.topk,
            score_func=self.score_func,
            num_groups=self.num_groups,
            topk_groups=self.topk_groups,
            route_scale=self.route_scale,
            norm_topk=self.norm_topk,
            expert_bias=self.expert_bias,
        )


class Weight(nn.Module):
    """A bare weight under the key `weight`, as nn.Linear (bias-free) names it, without its init."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight)


class TopKRouter(nn.Module):
    """The router as a module: `gate.weight [E, D]` (TorchTitan's key `router.gate.weight`).

    Calling it routes `[T, D]` tokens like `route`, differentiably w.r.t. the gate
    (through the chosen weights; the choice itself is discrete). `expert_bias` is
    an argument, not a buffer here, because the layer holds it (as TorchTitan's MoE
    does) and updates it outside autograd; it is required so that no caller drops
    it by accident.
    """

    def __init__(self, shape: MoEShape, gate: torch.Tensor) -> None:
        super().__init__()
        self.gate = Weight(gate)
        self.shape = shape

    def forward(self, x: torch.Tensor, expert_bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        return Router.from_shape(self.shape, self.gate.weight, expert_bias)(x)


def node_limited(shape: MoEShape, num_nodes: int, max_nodes: int) -> MoEShape:
    """`shape` with routing limited to `max_nodes` of `num_nodes` nodes (groups = nodes)."""
    if num_nodes < 1 or shape.num_experts % num_nodes != 0:
        raise ValueError(f"num_nodes: got {num_nodes}; expected a divisor of num_experts={shape.num_experts}")
    if max_nodes < 1:
        raise ValueError(f"max_nodes: got {max_nodes}; expected a positive integer")
    return shape.replace(num_groups=num_nodes, topk_groups=min(max_nodes, num_nodes))
