"""A TorchTitan token dispatcher over moe-a2a: `MoeA2ATokenDispatcher`.

TorchTitan's `RoutedExperts` takes it in place of its own dispatchers (set
`routed_experts.token_dispatcher` to a `MoeA2ATokenDispatcher.Config`); see
docs/training.md. Dispatch returns rows in expert-major order (the order
TorchTitan's `AllToAllTokenDispatcher` produces), combine applies the routing
scores and sums each token's rows; both are differentiable through
`moe_a2a.autograd`. Importing this module imports TorchTitan (and triton).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from torchtitan.models.common.token_dispatcher import BaseEPTokenDispatcher, LocalTokenDispatcher

from moe_a2a.all_to_all import COMBINE_DTYPES, DISPATCH_DTYPES, Config
from moe_a2a.autograd import COMPILED_ROWS, GRAD_DTYPES, ExpertParallel
from moe_a2a.ep_types import Routed

# One ExpertParallel per (process group, shape, device): the layers of a model share it
# (each layer's forward and backward pairs stay in order, see moe_a2a.autograd).
_shared: dict[tuple[Any, ...], ExpertParallel] = {}
log = logging.getLogger(__name__)


def close_shared() -> None:
    """Close every ExpertParallel the dispatchers of this process opened (collective)."""
    for ep in _shared.values():
        ep.close()
    _shared.clear()


class MoeA2ATokenDispatcher(BaseEPTokenDispatcher):
    """Expert-parallel dispatch and combine through moe-a2a (shared memory, libfabric)."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseEPTokenDispatcher.Config):
        # The model's hidden size and the most tokens one rank dispatches per call: moe-a2a
        # sizes its buffers from them. TorchTitan's builder fills these only for its own
        # DeepEP-style configs; left None, both are taken from the first dispatch (the
        # largest batch of any rank), so CLI changes of batch size or seq_len need no edit.
        hidden_dim: int | None = None
        num_max_tokens_per_rank: int | None = None
        dispatch_dtype: str = "bf16"  # bf16, fp32 or fp8 (rows are dequantised for the experts)
        combine_dtype: str = "bf16"
        grad_dtype: str = "bf16"  # what gradients travel in, whatever dispatch_dtype is
        provider: str = "auto"
        ranks_per_node: int | None = None
        num_nics: int | None = None  # default: MOE_A2A_NUM_NICS (the job presets), else 1
        max_recv_tokens: int | None = None  # default: the worst case (every copy to one rank)
        timeout_s: float = 60.0
        # Under torch.compile: "exact" rows, or "capacity" (max_output_rows rows, zero past the
        # received ones; a static shape for the experts: set max_recv_tokens near the need)
        compiled_rows: str = "exact"

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        for name, allowed in (
            ("dispatch_dtype", DISPATCH_DTYPES),
            ("combine_dtype", COMBINE_DTYPES),
            ("grad_dtype", GRAD_DTYPES),
            ("compiled_rows", COMPILED_ROWS),
        ):
            value = getattr(config, name)
            if value not in allowed:
                raise ValueError(
                    f"MoeA2ATokenDispatcher.Config.{name}: got {value!r}; expected one of {list(allowed)}"
                )
        for name in ("hidden_dim", "num_max_tokens_per_rank"):
            value = getattr(config, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(
                    f"MoeA2ATokenDispatcher.Config.{name}: got {value!r}; expected a positive integer"
                )
        self.config = config
        self.ep: ExpertParallel | None = None

    def init_buffer(self) -> None:
        """Open (or join) the ExpertParallel of the EP mesh's process group: collective."""
        c = self.config
        if self.ep_mesh is None:
            return  # EP degree 1: local reordering only, as TorchTitan's own dispatchers do
        if c.hidden_dim is None or c.num_max_tokens_per_rank is None:
            return  # sized at the first dispatch (_open_from)
        self._open(c.hidden_dim, c.num_max_tokens_per_rank)

    def _open_from(self, x_TD: torch.Tensor) -> None:
        """Size from the first batch: the most tokens of any EP rank (collective, as dispatch is)."""
        import torch.distributed as dist

        assert self.ep_mesh is not None
        most = torch.tensor([x_TD.shape[0]], dtype=torch.int64, device=x_TD.device)
        dist.all_reduce(most, op=dist.ReduceOp.MAX, group=self.ep_mesh.get_group())
        c = self.config
        self._open(c.hidden_dim or x_TD.shape[-1], c.num_max_tokens_per_rank or max(1, int(most.item())))

    def _open(self, hidden_dim: int, max_tokens: int) -> None:
        c = self.config
        assert self.ep_mesh is not None
        cfg = Config(
            max_tokens=max_tokens,
            hidden=hidden_dim,
            num_experts=c.num_experts,
            topk=c.top_k,
            dispatch_dtype=c.dispatch_dtype,
            combine_dtype=c.combine_dtype,
            max_recv_tokens=c.max_recv_tokens,
            timeout_s=c.timeout_s,
        )
        group = self.ep_mesh.get_group()
        device = "cuda" if self.ep_mesh.device_type == "cuda" else "cpu"
        opts = (c.grad_dtype, c.provider, c.ranks_per_node, c.num_nics, c.compiled_rows)
        key = (id(group), cfg, device, *opts)
        if key not in _shared:
            _shared[key] = ExpertParallel(
                cfg,
                comm=group,
                device=device,
                provider=c.provider,
                ranks_per_node=c.ranks_per_node,
                num_nics=c.num_nics,
                grad_dtype=c.grad_dtype,
                compiled_rows=c.compiled_rows,
            )
            ep = _shared[key]
            log.info(
                "moe-a2a: expert parallelism over %d ranks on %s: %d experts here, up to %d tokens of "
                "hidden %d per rank, %s dispatch, %s gradients",
                ep.world_size,
                device,
                ep.num_local_experts,
                max_tokens,
                hidden_dim,
                c.dispatch_dtype,
                c.grad_dtype,
            )
        self.ep = _shared[key]

    def dispatch(
        self,
        x_TD: torch.Tensor,
        topk_scores_TK: torch.Tensor,
        topk_expert_ids_TK: torch.Tensor,
        num_local_tokens_per_expert_E: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """Rows for this rank's experts (expert-major), their counts, and the routing (an ExpertRouting)."""
        if self.ep is None:
            if self.ep_mesh is None:
                return LocalTokenDispatcher.dispatch(
                    self, x_TD, topk_scores_TK, topk_expert_ids_TK, num_local_tokens_per_expert_E
                )
            if torch.compiler.is_compiling():
                raise RuntimeError(
                    "MoeA2ATokenDispatcher under torch.compile: not open yet; call init_buffer() with "
                    "hidden_dim and num_max_tokens_per_rank set, or run one eager step first"
                )
            self._open_from(x_TD)
            assert self.ep is not None
        if x_TD.shape[0] > self.ep.cfg.max_tokens:
            raise ValueError(
                f"MoeA2ATokenDispatcher.dispatch: got {x_TD.shape[0]} tokens; expected at most "
                f"{self.ep.cfg.max_tokens} (num_max_tokens_per_rank, or the first batch's size where "
                "it is not set: set it to the largest local_batch_size * seq_len)"
            )
        routed = self.ep.dispatch(x_TD, topk_expert_ids_TK, topk_scores_TK)
        assert isinstance(routed, Routed)  # a whole call
        counts = routed.tokens_per_expert.to(x_TD.device)
        return routed.expert_x, counts, routed

    def combine(self, routed_output_RD: torch.Tensor, metadata: Any, x_TD: torch.Tensor) -> torch.Tensor:
        """`out[t] = sum_k score[t,k] * routed_output[row of (t,k)]`, in x's dtype."""
        if not isinstance(metadata, Routed):
            return LocalTokenDispatcher.combine(self, routed_output_RD, metadata, x_TD)
        assert self.ep is not None
        out = self.ep.combine(routed_output_RD, metadata)
        assert isinstance(out, torch.Tensor)  # a whole call
        return out.to(x_TD.dtype)
