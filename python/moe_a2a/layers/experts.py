"""Routed experts as a grouped GEMM, the shared expert, and fp8 block dequantisation."""

from __future__ import annotations

import logging

import torch
from torch.nn import functional

from moe_a2a._core import FP8_BLOCK  # elements per fp32 scale in fp8 dispatch (docs/protocol.md)

log = logging.getLogger(__name__)

# (device type, dtype) pairs on which torch._grouped_mm raised: use the loop from then on.
_grouped_mm_broken: set[tuple[str, torch.dtype]] = set()


def grouped_mm_loop(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """`out[rows of group g] = x[rows of group g] @ w[g]`; groups end at `offs` (cumulative).

    The plain loop that torch._grouped_mm is checked against and falls back to.
    Rows after `offs[-1]` are zero.
    """
    out = x.new_zeros(x.shape[0], w.shape[-1])
    ends = offs.tolist()
    start = 0
    for g, end in enumerate(ends):
        if end > start:
            out[start:end] = x[start:end] @ w[g]
        start = end
    return out


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Grouped GEMM: `x [R, K]`, `w [G, K, N]`, `offs [G]` int32 cumulative row ends.

    Uses torch._grouped_mm where this torch build runs it for the device and dtype
    (CUDA sm90+ with bf16, and the CPU in recent releases); elsewhere, or if it raises,
    a loop of matmuls. Rows after `offs[-1]` are zero in both paths (_grouped_mm leaves
    them unwritten).
    """
    if x.dim() != 2 or w.dim() != 3 or x.shape[1] != w.shape[1]:
        raise ValueError(
            f"grouped_mm: got x {tuple(x.shape)} and w {tuple(w.shape)}; expected [R, K] and [G, K, N]"
        )
    if offs.dim() != 1 or offs.shape[0] != w.shape[0]:
        raise ValueError(f"offs: got shape {tuple(offs.shape)}; expected [{w.shape[0]}] (one end per group)")
    key = (x.device.type, x.dtype)
    fn = getattr(torch, "_grouped_mm", None)
    if fn is not None and key not in _grouped_mm_broken and x.dtype == w.dtype:
        try:
            out = fn(x, w, offs=offs.to(device=x.device, dtype=torch.int32))
        except (RuntimeError, NotImplementedError) as err:
            # Unsupported device, dtype or alignment: remember and use the loop, loudly once.
            _grouped_mm_broken.add(key)
            log.warning("torch._grouped_mm unavailable for %s/%s (%s); using a loop", *key, err)
        else:
            total = int(offs[-1]) if offs.numel() else 0
            if total < out.shape[0]:
                out[total:] = 0
            return out
    return grouped_mm_loop(x, w, offs)


def padded_offsets(tokens_per_expert: torch.Tensor, expert_padding: int) -> torch.Tensor:
    """Cumulative row ends of each expert's segment, each count rounded up to `expert_padding`."""
    if expert_padding < 1:
        raise ValueError(f"expert_padding: got {expert_padding}; expected a positive integer")
    counts = tokens_per_expert.to(device="cpu", dtype=torch.int64)
    padded = (counts + expert_padding - 1) // expert_padding * expert_padding
    return torch.cumsum(padded, 0).to(torch.int32)


def dequantize(
    x: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype, block: int = FP8_BLOCK
) -> torch.Tensor:
    """Dispatched rows in the compute dtype: fp8 rows times their block scales, else a cast."""
    if scale is None:
        if x.dtype == torch.float8_e4m3fn:
            raise ValueError("expert_x_scale: got None; fp8 expert_x needs its block scales")
        return x.to(dtype)
    hidden = x.shape[1]
    if scale.dim() != 2 or scale.shape[0] != x.shape[0] or scale.shape[1] != -(-hidden // block):
        raise ValueError(
            f"expert_x_scale: got shape {tuple(scale.shape)}; expected [{x.shape[0]}, {-(-hidden // block)}]"
        )
    full = scale.float().repeat_interleave(block, dim=1)[:, :hidden]
    return (x.float() * full).to(dtype)


def swiglu_experts(
    x: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
    expert_padding: int = 1,
) -> torch.Tensor:
    """SwiGLU of each local expert over its segment of rows (TorchTitan layout).

    `x [R, D]` holds rows grouped by local expert, each segment padded to
    `expert_padding`; `w1, w3 [E, F, D]`, `w2 [E, D, F]`. Per expert e:
    `y = (silu(x @ w1[e].T) * (x @ w3[e].T)) @ w2[e].T`. Returns `[R, D]` in x's dtype;
    padding rows and rows past the last segment hold zeros.
    """
    num_local = w1.shape[0]
    if tokens_per_expert.shape != (num_local,):
        raise ValueError(
            f"tokens_per_expert: got shape {tuple(tokens_per_expert.shape)}; expected [{num_local}]"
        )
    offs = padded_offsets(tokens_per_expert, expert_padding)
    total = int(offs[-1]) if num_local else 0
    if total > x.shape[0]:
        raise ValueError(
            f"expert_x: got {x.shape[0]} rows; tokens_per_expert with padding {expert_padding} needs {total}"
        )
    rows = x[:total]
    gate = functional.silu(grouped_mm(rows, w1.transpose(-2, -1), offs))
    h = gate * grouped_mm(rows, w3.transpose(-2, -1), offs)
    y = x.new_zeros(x.shape[0], w2.shape[1])
    y[:total] = grouped_mm(h, w2.transpose(-2, -1), offs)
    if expert_padding > 1 and total:
        # Padding rows went through the GEMMs with meaningless (possibly non-finite)
        # input; zero them so nothing downstream can trip on them.
        counts = tokens_per_expert.to(device="cpu", dtype=torch.int64)
        padded = offs.to(torch.int64).diff(prepend=offs.new_zeros(1, dtype=torch.int64))
        segment = torch.repeat_interleave(torch.arange(num_local), padded)
        position = torch.arange(total) - (offs.to(torch.int64) - padded)[segment]
        is_padding = (position >= counts[segment]).to(y.device)
        y[:total][is_padding] = 0
    return y


def swiglu(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor) -> torch.Tensor:
    """Dense SwiGLU FFN with linear weights: `w1, w3 [F, D]`, `w2 [D, F]` (the shared expert)."""
    return (functional.silu(x @ w1.t()) * (x @ w3.t())) @ w2.t()
