"""Group-limited routing for the benchmarks, and the bound it puts on copies per token.

DeepSeek-V3 routes each token among the best `topk_groups` of `num_groups`
equal groups of experts (`moe_a2a.layers.router.route`, the drivers' rule);
node-limited routing is the same rule with one group per node. Experts live
on ranks in contiguous blocks of E / world, so a token's experts lie on the
ranks (and nodes) its chosen groups span, and that caps how many distinct
ranks or nodes it can reach: the "copies per token" a protocol that sends
one row per destination rank (fabric_rows="rank") or node has to hold.

`Routing(num_groups=1, topk_groups=1)` is plain top-k over all experts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Routing:
    """Top-k among the best `topk_groups` of `num_groups` contiguous expert groups."""

    num_experts: int
    topk: int
    num_groups: int = 1
    topk_groups: int = 1

    def __post_init__(self) -> None:
        e, k, g, tg = self.num_experts, self.topk, self.num_groups, self.topk_groups
        if g < 1 or e % g:
            raise ValueError(f"num_groups: got {g}; expected a divisor of num_experts={e}")
        if not 1 <= tg <= g:
            raise ValueError(f"topk_groups: got {tg}; expected 1..num_groups={g}")
        if not 1 <= k <= tg * (e // g):
            raise ValueError(f"topk: got {k}; expected 1..{tg * (e // g)} ({tg} groups of {e // g} experts)")

    @classmethod
    def of_args(cls, shape: dict[str, int], args: Any, num_nodes: int) -> Routing:
        """`bench a2a`'s: plain top-k, --num-groups/--topk-groups, or --max-nodes (a group per node)."""
        from moe_a2a.usage import UsageError

        groups, topk_groups = args.num_groups or 1, args.topk_groups or 1
        if args.max_nodes is not None:
            groups, topk_groups = num_nodes, min(args.max_nodes, num_nodes)
        try:
            return cls(shape["num_experts"], shape["topk"], groups, topk_groups)
        except ValueError as err:
            raise UsageError(f"--num-groups/--topk-groups/--max-nodes: {err}") from None

    @property
    def limited(self) -> bool:
        return 1 < self.num_groups and self.topk_groups < self.num_groups

    def text(self) -> str:
        if not self.limited:
            return f"top-{self.topk} of {self.num_experts} experts"
        return f"top-{self.topk} within {self.topk_groups} of {self.num_groups} groups (DeepSeek-V3)"

    def ids_weights(self, seed: int, rank: int, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`(topk_ids int64 [T, K], topk_weights fp32 [T, K])` for one rank's tokens.

        Random scores (a sigmoid router's), seeded by (seed, rank), through the drivers'
        group rule; the weights are the chosen scores, not normalised."""
        import torch

        from moe_a2a.layers.router import route

        g = torch.Generator().manual_seed(seed * 65537 + rank + 1)
        logits = torch.randn(tokens, self.num_experts, generator=g)
        # route() scores x @ gate.T: the identity gate makes x the logits themselves.
        ids, w = route(
            logits,
            torch.eye(self.num_experts),
            self.topk,
            score_func="sigmoid",
            num_groups=self.num_groups,
            topk_groups=self.topk_groups,
            norm_topk=False,
        )
        return ids.contiguous(), w.contiguous()

    def bound(self, world: int, ranks_per_node: int) -> dict[str, int]:
        """Most distinct ranks and nodes one token's experts can be on (`world` ranks,
        `ranks_per_node` to a node, experts in contiguous blocks per rank)."""
        if world < 1 or self.num_experts % world:
            raise ValueError(f"world: got {world}; expected a divisor of num_experts={self.num_experts}")
        if ranks_per_node < 1 or world % ranks_per_node:
            raise ValueError(f"ranks_per_node: got {ranks_per_node}; expected a divisor of world={world}")
        per_rank, size = self.num_experts // world, self.num_experts // self.num_groups
        out = {}
        for name, unit in (("ranks", per_rank), ("nodes", per_rank * ranks_per_node)):
            # Units (ranks or nodes) each group touches; a token's lie in its topk_groups groups.
            spans = sorted(
                ((g + 1) * size - 1) // unit - g * size // unit + 1 for g in range(self.num_groups)
            )
            out[name] = min(self.topk, sum(spans[-self.topk_groups :]), self.num_experts // unit)
        return out


def destinations(
    ids: np.ndarray, num_experts: int, world: int, ranks_per_node: int, rank: int
) -> dict[str, np.ndarray]:
    """Per token of `rank`: copies to ranks of other nodes, distinct such ranks, distinct other nodes.

    Copies are the fabric rows of fabric_rows="expert", distinct ranks those of
    fabric_rows="rank", distinct nodes those of a per-node protocol."""
    owner = np.asarray(ids, dtype=np.int64).reshape(len(ids), -1) // (num_experts // world)
    node = owner // ranks_per_node
    remote = node != rank // ranks_per_node
    return {"copies": remote.sum(axis=1), "ranks": _distinct(owner, remote), "nodes": _distinct(node, remote)}


def _distinct(values: np.ndarray, keep: np.ndarray) -> np.ndarray:
    """Each row's number of distinct values where `keep`."""
    s = np.sort(np.where(keep, values, -1), axis=1)
    if s.shape[1] == 0:
        return np.zeros(len(s), dtype=np.int64)
    return (s[:, 0] >= 0) + ((s[:, 1:] != s[:, :-1]) & (s[:, 1:] >= 0)).sum(axis=1)
