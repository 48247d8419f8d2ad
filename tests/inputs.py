"""Every rank's inputs drawn from one seed, and a stand-in for the experts: shared by the
multi-rank suites (tests/mpi) and the protocol's ranks in one process (tests/protocol)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from moe_a2a import Config


@dataclass
class Inputs:
    """Every rank's (x, topk_ids, topk_weights), drawn from one seed."""

    xs: list[torch.Tensor]
    ids: list[torch.Tensor]
    weights: list[torch.Tensor]


Router = Callable[[torch.Generator, int, int, int], torch.Tensor]


def random_ids(g: torch.Generator, tokens: int, experts: int, topk: int) -> torch.Tensor:
    """Distinct experts per token, uniformly at random."""
    if tokens == 0:
        return torch.empty(0, topk, dtype=torch.int64)
    return torch.stack([torch.randperm(experts, generator=g)[:topk] for _ in range(tokens)])


def draw_inputs(
    seed: int, cfg: Config, world: int, tokens: list[int] | None = None, router: Router = random_ids
) -> Inputs:
    """`world` ranks' inputs; `tokens` per rank, else a random count up to max_tokens each."""
    g = torch.Generator().manual_seed(seed)
    if tokens is None:
        tokens = [int(torch.randint(0, cfg.max_tokens + 1, (1,), generator=g)) for _ in range(world)]
    xs = [(torch.randn(t, cfg.hidden, generator=g) * 4).to(torch.bfloat16) for t in tokens]
    ids = [router(g, t, cfg.num_experts, cfg.topk) for t in tokens]
    weights = [torch.rand(t, cfg.topk, generator=g) for t in tokens]
    return Inputs(xs, ids, weights)


def expert_fn(x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """A cheap stand-in for the experts that depends on every element."""
    xf = x.float()
    if scale is not None:
        xf = xf * scale.repeat_interleave(128, dim=1)[:, : x.shape[1]]
    return (xf * 0.75 + 0.5).to(torch.bfloat16)
