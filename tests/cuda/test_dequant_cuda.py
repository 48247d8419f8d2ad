"""The fp8 training forward's dequantisation kernel (moe_a2a.kernels.dequant) against its torch form."""

from __future__ import annotations

import pytest
import torch
from local_world import cuda_unavailable_reason

from moe_a2a.kernels.dequant import dequantize_fp8_as, dequantize_fp8_torch, triton
from moe_a2a.reference import quantize_fp8

_REASON = cuda_unavailable_reason() or (None if triton is not None else "Triton is not installed")
pytestmark = pytest.mark.skipif(_REASON is not None, reason=f"{_REASON}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 1), (7, 1000), (300, 7168), (5, 129), (0, 256)])
def test_same_bits_as_torch(dtype: torch.dtype, shape: tuple[int, int]) -> None:
    g = torch.Generator(device="cuda").manual_seed(2)
    x = torch.randn(shape, generator=g, device="cuda") * 30
    q, scale = quantize_fp8(x)
    got = dequantize_fp8_as(q, scale, dtype)
    want = dequantize_fp8_torch(q, scale, dtype)
    assert got.dtype == dtype and got.shape == x.shape
    assert torch.equal(got, want)
