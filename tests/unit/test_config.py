"""Config validation: every bad argument is one clear ValueError, before any rank talks to another."""

from __future__ import annotations

import math

import pytest

from moe_a2a.all_to_all import Config

CORE_INT_MAX = 2**31 - 1  # the core's sizes are 32-bit ints
GOOD = dict(max_tokens=8, hidden=256, num_experts=8, topk=2)


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, 0, -1.0, True, "5"])
def test_timeout_must_be_positive_and_finite(value: object) -> None:
    with pytest.raises(ValueError, match=rf"timeout_s: got {value!r}; expected a positive, finite number"):
        Config(**GOOD, timeout_s=value)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "name",
    [
        "max_tokens",
        "hidden",
        "num_experts",
        "topk",
        "expert_padding",
        "max_private_tokens",
        "max_recv_tokens",
    ],
)
@pytest.mark.parametrize("value", [2**31, 2**40])
def test_sizes_beyond_the_core_are_rejected(name: str, value: int) -> None:
    params = {**GOOD, name: value}
    with pytest.raises(
        ValueError, match=rf"{name}: got {value}; expected an integer in \[\d, {CORE_INT_MAX}\]"
    ):
        Config(**params)  # type: ignore[arg-type]


def test_largest_core_sizes_are_accepted() -> None:
    Config(max_tokens=1, hidden=CORE_INT_MAX, num_experts=CORE_INT_MAX, topk=1, max_private_tokens=0)


def test_copies_per_call_must_fit_the_core() -> None:
    with pytest.raises(
        ValueError, match=r"max_tokens \* topk: got 1073741824 \* 4 = 4294967296; expected at most"
    ):
        Config(max_tokens=2**30, hidden=8, num_experts=8, topk=4)


def test_default_receive_capacity_must_fit_the_core() -> None:
    cfg = Config(max_tokens=2**28, hidden=8, num_experts=64, topk=4)
    with pytest.raises(ValueError, match=r"max_recv_tokens: the default for 8 ranks is 8589934592"):
        cfg.resolved(8)
    assert (
        Config(max_tokens=2**28, hidden=8, num_experts=64, topk=4, max_recv_tokens=2**30).resolved(8)[1]
        == 2**30
    )


def test_on_peer_loss_is_stop_or_mask() -> None:
    assert Config(max_tokens=4, hidden=8, num_experts=4, topk=2).on_peer_loss == "stop"  # training's
    assert Config(max_tokens=4, hidden=8, num_experts=4, topk=2, on_peer_loss="mask").on_peer_loss == "mask"
    with pytest.raises(ValueError, match=r"on_peer_loss: got 'drop'; expected one of \['stop', 'mask'\]"):
        Config(max_tokens=4, hidden=8, num_experts=4, topk=2, on_peer_loss="drop")
    with pytest.raises(ValueError, match="mask_renormalize: got 1; expected True or False"):
        Config(max_tokens=4, hidden=8, num_experts=4, topk=2, mask_renormalize=1)  # type: ignore[arg-type]
