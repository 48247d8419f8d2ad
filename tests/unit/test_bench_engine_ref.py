"""The per-peer sizes `bench a2a` hands the engine-alone reference (moe_a2a.bench.engine_ref)."""

from __future__ import annotations

import numpy as np
import pytest

from moe_a2a.bench.engine_ref import rows_to, sent_by


def test_rows_to_counts_token_copies_or_tokens_per_owning_rank() -> None:
    ids = np.array([[0, 5], [7, 1], [4, 4]])  # 8 experts on 2 ranks: 0-3 on rank 0, 4-7 on rank 1
    assert rows_to(ids, 2, 8).tolist() == [2, 4]
    assert rows_to(ids, 2, 8, per_rank=True).tolist() == [2, 3]  # one row per token with a k there
    assert rows_to(np.zeros((0, 2), np.int64), 4, 8).tolist() == [0, 0, 0, 0]
    rng = np.random.default_rng(3)
    ids = rng.integers(0, 64, size=(100, 8))
    counts = rows_to(ids, 4, 64)
    assert counts.sum() == 800 and counts.tolist() == [int((ids // 16 == r).sum()) for r in range(4)]


def test_rows_to_refuses_experts_that_do_not_split_evenly() -> None:
    with pytest.raises(ValueError, match="num_experts: got 10; expected a multiple of the world size 4"):
        rows_to(np.zeros((1, 1), np.int64), 4, 10)


def test_sent_by_is_where_a_receivers_rows_start() -> None:
    counts = np.array([[0, 3, 5], [2, 0, 1], [4, 6, 0]])  # counts[s, r]: copies s sends to r
    assert [sent_by(counts, 0, r) for r in range(3)] == [0, 0, 3]
    assert [sent_by(counts, 2, r) for r in range(3)] == [0, 4, 10]
