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


def test_block_quantisation_matches_reference() -> None:
    """The dispatch packer's vectorised quantiser against moe_a2a.reference.quantize_fp8."""
    from moe_a2a.reference import quantize_fp8

    hidden = 300  # a short last block
    g = torch.Generator().manual_seed(2)
    rows = [
        torch.randn(16, hidden, generator=g)
        * torch.exp2(torch.randint(-20, 20, (16, 1), generator=g).float())
    ]
    # Blocks whose elements sit on e4m3 rounding midpoints after scaling.
    mids = _edge_values()[: hidden // 2]
    tricky = torch.zeros(2, hidden)
    tricky[0, : mids.numel()] = mids
    tricky[0, 0] = 448.0  # amax 448: scale exactly 1
    tricky[1] = torch.linspace(-3, 3, hidden)
    rows.append(tricky)
    rows.append(torch.zeros(1, hidden))  # amax 0: scale 1
    x = torch.cat(rows)
    q_bytes, s_bytes = _core.quantize_fp8_rows(x.numpy().tobytes(), hidden)
    q = torch.frombuffer(bytearray(q_bytes), dtype=torch.uint8).view(x.shape[0], hidden)
    s = torch.frombuffer(bytearray(s_bytes), dtype=torch.float32).view(x.shape[0], -1)
    ref_q, ref_s = quantize_fp8(x)
    assert torch.equal(s, ref_s)
    assert torch.equal(q, ref_q.view(torch.uint8))
