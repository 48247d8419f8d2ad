"""What `ExpertParallel`'s calls hand back: each dispatch's routing (`ExpertRouting`), the rows
it delivers (`Routed`) and the pending halves of a split call."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from moe_a2a.a2a_types import Routing


@dataclass(eq=False)
class ExpertRouting:
    """One dispatch's routing, owned by this object: what its combine and its backward need.

    It keeps the gathered routing matrix (`gathered`, `world x (num_experts + world)`
    int32), so dispatching new rows along it (`ExpertParallel.dispatch(x,
    routing=r)`, and the backward of combine) exchanges no routing rows, long
    after later layers ran.
    """

    owner: int
    seq: int
    topk_ids: torch.Tensor  # [T, K], as the core takes them
    topk_weights: torch.Tensor  # [T, K] fp32, detached
    tokens_per_expert: torch.Tensor  # [local experts] int32
    num_rows: int  # R, padding rows included
    expert_padding: int = 1
    row_weights: torch.Tensor | None = None  # [R] fp32, each row's routing weight (0 on padding rows)
    x_dtype: torch.dtype = torch.bfloat16
    gathered: Routing | None = None  # the forward's gathered routing: later dispatches along it exchange none
    _finalizer: Any = field(default=None, repr=False)
    _weights_version: int | None = field(default=0, repr=False)  # row_weights' version counter when made

    @property
    def num_tokens(self) -> int:
        return int(self.topk_ids.shape[0])

    @property
    def real_rows(self) -> torch.Tensor | None:
        """[R] bool, False on padding rows; None when there are none (expert_padding 1)."""
        if self.expert_padding == 1:
            return None
        n = self.tokens_per_expert.to(torch.int64)
        pad = self.expert_padding
        padded = (n + pad - 1) // pad * pad
        start = torch.cumsum(padded, 0) - padded
        row = torch.arange(self.num_rows, device=n.device)
        seg = torch.repeat_interleave(
            torch.arange(n.numel(), device=n.device), padded, output_size=self.num_rows
        )
        return row - start[seg] < n[seg]

    def release(self) -> None:
        """Give the routing's slot back now instead of when it is garbage-collected."""
        if self._finalizer is not None:
            self._finalizer()


class CompiledRouting(NamedTuple):
    """A dispatch's routing inside a torch.compile region: the key of its `ExpertRouting` in
    `moe_a2a.compiled_ops` (a [] int64 tensor made at run time) and the dispatch's token count."""

    key: torch.Tensor
    num_tokens: Any  # int, or a SymInt while tracing


@dataclass
class Routed:
    """What `ExpertParallel.dispatch` delivers to this rank's experts."""

    expert_x: torch.Tensor  # [R, hidden] in the input's dtype (fp8 rows dequantised)
    tokens_per_expert: torch.Tensor  # [local experts] int32
    routing: ExpertRouting
    row_weights: torch.Tensor | None  # [R] fp32, differentiable w.r.t. topk_weights


@dataclass
class PendingRouted:
    """A dispatch whose send half is done: pass it to `ExpertParallel.dispatch(handle=...)`."""

    x: torch.Tensor
    topk_ids: torch.Tensor
    topk_weights: torch.Tensor
    cached: ExpertRouting | None
    track: bool  # gradients were enabled at the send half


@dataclass
class PendingCombined:
    """A combine whose send half is done: pass it to `ExpertParallel.combine(handle=...)`."""

    y: torch.Tensor
    routed: Routed
    weighted: bool
