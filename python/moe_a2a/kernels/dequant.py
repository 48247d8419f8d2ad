"""fp8 rows back to bf16 or fp32 in one pass: `q * scale` per block of 128 columns.

The torch form (`reference.dequantize_fp8`, then a cast) writes two fp32 copies
of every row before the cast, which costs an fp8 training forward more than its
exchange (docs/benchmarks.md, "Training on the H200"). On CUDA one Triton kernel
reads each fp8 row once and writes the output dtype; it multiplies in fp32 and
rounds once, as the torch form does, so both give the same bits.
"""

from __future__ import annotations

import torch

from moe_a2a.reference import FP8_BLOCK, dequantize_fp8

try:
    import triton
    import triton.language as tl
except Exception:  # no Triton (or it cannot load here): the torch form serves
    triton = None


def dequantize_fp8_torch(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return dequantize_fp8(q, scale).to(dtype)


if triton is not None:

    @triton.jit
    def _dequant_kernel(q_ptr, s_ptr, out_ptr, H, NUM_SCALES, GROUP: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        for start in range(0, H, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < H
            s = tl.load(s_ptr + row * NUM_SCALES + cols // GROUP, mask=mask, other=0.0)
            q = tl.load(q_ptr + row * H + cols, mask=mask, other=0.0).to(tl.float32)
            tl.store(out_ptr + row * H + cols, (q * s).to(out_ptr.dtype.element_ty), mask=mask)


def dequantize_fp8_as(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`q` ([R, H] float8_e4m3fn) times `scale` ([R, ceil(H / 128)] fp32), as `dtype` (bf16 or fp32)."""
    if triton is None or not q.is_cuda or q.shape[0] == 0:
        return dequantize_fp8_torch(q, scale, dtype)
    q, scale = q.contiguous(), scale.contiguous()
    rows, hidden = q.shape
    out = torch.empty(rows, hidden, dtype=dtype, device=q.device)
    _dequant_kernel[(rows,)](q, scale, out, hidden, scale.shape[1], GROUP=FP8_BLOCK, BLOCK=1024)
    return out
