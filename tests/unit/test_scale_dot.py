"""The torch form of the training path's row kernel, on the CPU."""

from __future__ import annotations

import torch

from moe_a2a.kernels.scale_dot import scale_dot


def test_scales_rows_and_dots_them() -> None:
    g = torch.Generator().manual_seed(0)
    a = torch.randn(9, 33, generator=g)
    y = torch.randn(9, 33, generator=g)
    w = torch.rand(9, generator=g)
    s, d = scale_dot(a, w, y)
    assert torch.allclose(s, a * w[:, None])
    assert d is not None and torch.allclose(d, (a * y).sum(-1), rtol=1e-5, atol=1e-5)
    s2, none = scale_dot(a.bfloat16(), w, None)
    assert none is None and s2.dtype == torch.bfloat16
