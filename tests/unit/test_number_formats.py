"""The CPU core's fp8 and bf16 conversions against torch, bit for bit."""

from __future__ import annotations

import torch

from moe_a2a import _core


def _edge_values() -> torch.Tensor:
    """Every e4m3 code's value and the midpoints between neighbours, both signs, plus specials."""
    codes = torch.arange(0, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    mids = (codes[1:] + codes[:-1]) / 2
    nudged = torch.cat([mids * (1 + 2**-20), mids * (1 - 2**-20)])
    special = torch.tensor([0.0, 448.0, 449.0, 463.9, 464.0, 500.0, 1e30, 2**-9, 2**-10, 3 * 2**-11, 1e-40])
    values = torch.cat([codes, mids, nudged, special])
    return torch.cat([values, -values])


def _random_values(n: int = 1 << 20) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    scale = torch.exp2(torch.randint(-14, 10, (n,), generator=g).float())
    return torch.randn(n, generator=g) * scale


def test_fp8_matches_torch() -> None:
    for values in (_edge_values(), _random_values()):
        clamped = values.clamp(-448.0, 448.0)  # torch saturates only through the clamp
        expected = clamped.to(torch.float8_e4m3fn).view(torch.uint8)
        got = torch.frombuffer(bytearray(_core.f32_to_e4m3(values.numpy().tobytes())), dtype=torch.uint8)
        mismatch = (got != expected).nonzero().flatten()
        assert mismatch.numel() == 0, (
            f"{mismatch.numel()} mismatches, first: {values[mismatch[:5]].tolist()} -> "
            f"{got[mismatch[:5]].tolist()} vs torch {expected[mismatch[:5]].tolist()}"
        )


def test_nan_maps_to_nan() -> None:
    got = _core.f32_to_e4m3(torch.tensor([float("nan")]).numpy().tobytes())
    assert torch.frombuffer(bytearray(got), dtype=torch.float8_e4m3fn).isnan().all()


def test_bf16_matches_torch() -> None:
    values = torch.cat([_random_values(), _edge_values(), torch.tensor([3.4e38, -3.4e38, 1e-45])])
    expected = values.to(torch.bfloat16).view(torch.int16)
    got = torch.frombuffer(bytearray(_core.f32_to_bf16(values.numpy().tobytes())), dtype=torch.int16)
    assert torch.equal(got, expected)
