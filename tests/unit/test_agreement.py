"""The start-up comparison of every rank's settings, over a stand-in for the bootstrap."""

from __future__ import annotations

import json
from typing import Any

import pytest

from moe_a2a.agreement import all_to_all_settings, check_agreement
from moe_a2a.all_to_all import Config


class FakeBootstrap:
    """allgather returns what the other ranks would have sent; our own blob goes in at `rank`."""

    def __init__(self, rank: int, others: list[dict[str, Any]]) -> None:
        self.rank, self.others = rank, others

    def allgather(self, blob: bytes) -> list[bytes]:
        out = [json.dumps(s).encode() for s in self.others]
        out.insert(self.rank, blob)
        return out


def settings(**cfg_overrides: Any) -> dict[str, Any]:
    cfg = Config(**{"max_tokens": 8, "hidden": 256, "num_experts": 8, "topk": 2, **cfg_overrides})
    return all_to_all_settings(cfg, "cpu", "tcp", 2, 1, False)


def test_equal_settings_pass() -> None:
    check_agreement(FakeBootstrap(1, [settings()] * 3), settings())


def test_each_difference_names_the_field_and_the_ranks() -> None:
    world = [settings(), settings(hidden=128, dispatch_dtype="fp8")] + [settings()] * 4
    message = (
        r"AllToAll: the ranks were given different settings \(every rank must pass the same\): "
        r"hidden: 256 on ranks 0, 2-5, 128 on rank 1; "
        r"dispatch_dtype: 'bf16' on ranks 0, 2-5, 'fp8' on rank 1$"
    )
    for rank in (0, 3):  # the same error wherever it is raised
        with pytest.raises(ValueError, match=message):
            check_agreement(FakeBootstrap(rank, world[:rank] + world[rank + 1 :]), world[rank])


def test_layout_provider_and_version_are_compared() -> None:
    theirs = {**settings(), "ranks_per_node": 1, "provider": "shm", "version": "0.0.1"}
    with pytest.raises(
        ValueError, match=r"provider: 'tcp' on rank 0, 'shm' on rank 1; ranks_per_node: 2 on "
    ):
        check_agreement(FakeBootstrap(0, [theirs]), settings())
    with pytest.raises(ValueError, match=r"version: '\d+\.\d+\.\d+' on rank 0, '0.0.1' on rank 1"):
        check_agreement(FakeBootstrap(0, [theirs]), settings())


def test_a_setting_only_some_ranks_have() -> None:
    with pytest.raises(ValueError, match=r"extra: \(none\) on rank 0, 1 on rank 1$"):
        check_agreement(FakeBootstrap(0, [{**settings(), "extra": 1}]), settings())
