"""The inputs of `moe-a2a run`: seeded generators, random and skewed routing.

Every draw comes from a generator named by the seed and what it is for, so every
rank (and rank 0's reference) can draw the same tensors without exchanging them.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def generator(seed: int, *parts: object) -> torch.Generator:
    """A torch generator seeded from `seed` and `parts` (e.g. "tokens", rank, step)."""
    import torch

    digest = hashlib.blake2b("/".join(map(str, (seed, *parts))).encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") & ((1 << 63) - 1))


def random_routing(
    tokens: int, num_experts: int, topk: int, gen: torch.Generator, popularity: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k distinct experts per token, drawn without replacement; weights sum to one.

    `popularity` (positive, [E]) makes expert e that much likelier; None is uniform.
    Gumbel top-k draws k experts without replacement in proportion to it in one pass.
    """
    import torch

    u = torch.rand(tokens, num_experts, generator=gen).clamp_(1e-12, 1 - 1e-7)
    keys = -torch.log(-torch.log(u))
    if popularity is not None:
        keys = keys + torch.log(popularity)
    ids = keys.topk(topk, dim=-1).indices
    weights = torch.softmax(torch.randn(tokens, topk, generator=gen), dim=-1)
    return ids, weights


def skewed_popularity(num_experts: int, skew: float, seed: int) -> torch.Tensor:
    """Zipf-like popularity: the i-th hottest expert weighs 1/i^skew; which experts are
    hot is a fixed random permutation of `seed`, the same on every rank and iteration."""
    import torch

    order = torch.randperm(num_experts, generator=generator(seed, "hot-experts"))
    weight = torch.arange(1, num_experts + 1, dtype=torch.float64).pow(-skew)
    popularity = torch.empty(num_experts, dtype=torch.float64)
    popularity[order] = weight
    return popularity.float()
