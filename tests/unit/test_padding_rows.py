"""The CUDA backend's zeroing of rows that hold no token, run on CPU tensors (the ops are device-agnostic)."""

from __future__ import annotations

import pytest
import torch

from moe_a2a.backends.cuda import _zero_unfilled_rows


@pytest.mark.parametrize("padding", [2, 8])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("trailing", [0, 13])  # graph-safe buffers have rows past the last segment
def test_rows_without_tokens_become_zero(padding: int, dtype: torch.dtype, trailing: int) -> None:
    counts = torch.tensor([3, 0, padding, 1, 5], dtype=torch.int32)
    padded = [(int(n) + padding - 1) // padding * padding for n in counts]
    rows = sum(padded) + trailing
    nan = torch.full((rows, 40), float("nan"))
    x = nan.to(dtype) if dtype != torch.float8_e4m3fn else nan.to(torch.bfloat16).to(dtype)
    scale = torch.full((rows, 2), float("inf")) if dtype == torch.float8_e4m3fn else None
    _zero_unfilled_rows(x, scale, counts, padding)
    filled = torch.zeros(rows, dtype=torch.bool)
    start = 0
    for n, p in zip(counts.tolist(), padded, strict=True):
        filled[start : start + n] = True
        start += p
    raw = x.view(torch.uint8)
    assert torch.equal(raw[~filled], torch.zeros_like(raw[~filled]))
    assert torch.equal(raw[filled], nan.to(torch.bfloat16).to(dtype).view(torch.uint8)[filled])  # untouched
    if scale is not None:
        assert torch.equal(scale[~filled], torch.zeros_like(scale[~filled]))
        assert torch.isinf(scale[filled]).all()
