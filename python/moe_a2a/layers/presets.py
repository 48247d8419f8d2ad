"""Model shapes of one MoE layer: presets and validated overrides."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

SCORE_FUNCS = ("softmax", "sigmoid")


@dataclass(frozen=True)
class MoEShape:
    """Dimensions and routing rules of one MoE layer.

    The shared expert is one SwiGLU FFN of width `expert_hidden * num_shared_experts`,
    as in TorchTitan. Routing: `score_func` over the router's logits, then top-`topk`
    among the best `topk_groups` of `num_groups` equal groups of experts (a group's
    score is the sum of its two best expert scores, as in DeepSeek-V3); the chosen
    weights are normalised to sum to one when `norm_topk`, then scaled by `route_scale`.
    """

    hidden: int
    num_experts: int
    topk: int
    expert_hidden: int
    num_shared_experts: int = 1
    score_func: str = "softmax"
    num_groups: int = 1
    topk_groups: int = 1
    route_scale: float = 1.0
    norm_topk: bool = True
    decode_tokens: int = 128  # tokens per rank in --mode decode
    prefill_tokens: int = 4096  # tokens per rank in --mode prefill

    def __post_init__(self) -> None:
        for name in (
            "hidden",
            "num_experts",
            "topk",
            "expert_hidden",
            "num_groups",
            "topk_groups",
            "decode_tokens",
            "prefill_tokens",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}: got {value!r}; expected a positive integer")
        if not isinstance(self.num_shared_experts, int) or self.num_shared_experts < 0:
            raise ValueError(
                f"num_shared_experts: got {self.num_shared_experts!r}; expected a non-negative integer"
            )
        if self.topk > self.num_experts:
            raise ValueError(f"topk: got {self.topk}; expected at most num_experts={self.num_experts}")
        if self.score_func not in SCORE_FUNCS:
            raise ValueError(f"score_func: got {self.score_func!r}; expected one of {SCORE_FUNCS}")
        if self.num_experts % self.num_groups != 0:
            raise ValueError(
                f"num_groups: got {self.num_groups}; expected a divisor of num_experts={self.num_experts}"
            )
        if self.topk_groups > self.num_groups:
            raise ValueError(
                f"topk_groups: got {self.topk_groups}; expected at most num_groups={self.num_groups}"
            )
        if self.topk > self.topk_groups * (self.num_experts // self.num_groups):
            raise ValueError(
                f"topk: got {self.topk}; the {self.topk_groups} chosen groups of "
                f"{self.num_experts // self.num_groups} experts hold fewer experts than that"
            )
        if not self.route_scale > 0:
            raise ValueError(f"route_scale: got {self.route_scale!r}; expected a positive number")

    @property
    def shared_hidden(self) -> int:
        """Width of the shared expert's FFN (0 when there is none)."""
        return self.expert_hidden * self.num_shared_experts

    def tokens(self, mode: str) -> int:
        """Default tokens per rank for a mode ("decode" or "prefill")."""
        if mode not in ("decode", "prefill"):
            raise ValueError(f"mode: got {mode!r}; expected 'decode' or 'prefill'")
        return self.decode_tokens if mode == "decode" else self.prefill_tokens

    def weight_elements(self) -> int:
        """Elements in the full (unsharded) layer: router, routed experts, shared expert."""
        routed = self.num_experts * 3 * self.expert_hidden * self.hidden
        return self.num_experts * self.hidden + routed + 3 * self.shared_hidden * self.hidden

    def replace(self, **changes: Any) -> MoEShape:
        """A copy with some fields changed (None values are ignored), validated again."""
        return dataclasses.replace(self, **{k: v for k, v in changes.items() if v is not None})


PRESETS: dict[str, MoEShape] = {
    # DeepSeek-V3: sigmoid scores, 8 groups of 32 experts, at most 4 groups per token,
    # chosen weights normalised then scaled by 2.5.
    "deepseek-v3": MoEShape(
        hidden=7168,
        num_experts=256,
        topk=8,
        expert_hidden=2048,
        num_shared_experts=1,
        score_func="sigmoid",
        num_groups=8,
        topk_groups=4,
        route_scale=2.5,
        norm_topk=True,
        decode_tokens=128,
        prefill_tokens=4096,
    ),
    # Kimi-K2: DeepSeek-V3's design with 384 experts and no group limit.
    "kimi-k2": MoEShape(
        hidden=7168,
        num_experts=384,
        topk=8,
        expert_hidden=2048,
        num_shared_experts=1,
        score_func="sigmoid",
        num_groups=1,
        topk_groups=1,
        route_scale=2.827,
        norm_topk=True,
        decode_tokens=128,
        prefill_tokens=4096,
    ),
    # Small enough for 4 ranks on two CPU cores; keeps two fp8 scale blocks per row
    # and group-limited routing so those paths run too.
    "tiny": MoEShape(
        hidden=256,
        num_experts=16,
        topk=4,
        expert_hidden=128,
        num_shared_experts=1,
        score_func="sigmoid",
        num_groups=4,
        topk_groups=2,
        route_scale=1.0,
        norm_topk=True,
        decode_tokens=16,
        prefill_tokens=256,
    ),
}


def get_preset(name: str) -> MoEShape:
    """The preset called `name`; a ValueError naming the valid ones otherwise."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(
            f"--model: unknown preset {name!r}; expected one of {', '.join(sorted(PRESETS))}"
        ) from None
