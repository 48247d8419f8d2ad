"""The training path's fused row kernel (moe_a2a.kernels.scale_dot) against its torch form."""

from __future__ import annotations

import pytest
import torch
from local_world import cuda_unavailable_reason

from moe_a2a.kernels.scale_dot import scale_dot, scale_dot_torch, triton

_REASON = cuda_unavailable_reason() or (None if triton is not None else "Triton is not installed")
pytestmark = pytest.mark.skipif(_REASON is not None, reason=f"{_REASON}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 1), (7, 1000), (300, 7168), (0, 64)])
def test_matches_torch(dtype: torch.dtype, shape: tuple[int, int]) -> None:
    g = torch.Generator(device="cuda").manual_seed(1)
    a = torch.randn(shape, generator=g, device="cuda").to(dtype)
    y = torch.randn(shape, generator=g, device="cuda").to(dtype)
    w = torch.rand(shape[0], generator=g, device="cuda")
    got_s, got_d = scale_dot(a, w, y)
    want_d = (a.float() * y.float()).sum(-1)
    want_s = (a.float() * w[:, None]).to(dtype)
    ref_s, _ = scale_dot_torch(a, w, y)
    assert got_s.dtype == dtype and got_d is not None and got_d.dtype == torch.float32
    # one rounding of the product in the row dtype; the dot accumulates in fp32
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-6
    assert torch.allclose(got_s.float(), want_s.float(), rtol=tol, atol=tol)
    assert torch.allclose(got_s.float(), ref_s.float(), rtol=tol, atol=tol)
    assert torch.allclose(got_d, want_d, rtol=1e-4, atol=1e-3 * max(1, shape[1]) ** 0.5)
    only_scale, none = scale_dot(a, w, None)
    assert none is None and torch.equal(only_scale, got_s)
