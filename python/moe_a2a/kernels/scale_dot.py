"""Weighted combine's backward over its rows, in one pass: `g * w[:, None]` and `<g, y>` per row.

Two torch calls read the rows twice and torch's broadcast multiply runs at
well under copy speed (docs/benchmarks.md, "Training on the H200"); on CUDA
one Triton kernel reads `g` and `y` once. Elsewhere, and where Triton cannot
run, the torch form gives the same values to rounding.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except Exception:  # no Triton (or it cannot load here): the torch form serves
    triton = None


def scale_dot_torch(
    g: torch.Tensor, w: torch.Tensor, y: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(g * w[:, None] in g's dtype, fp32 <g, y> per row or None)."""
    scaled = g * w.to(g.dtype)[:, None]
    dot = torch.linalg.vecdot(g, y.to(g.dtype)).to(torch.float32) if y is not None else None
    return scaled, dot


if triton is not None:

    @triton.jit
    def _scale_dot_kernel(
        g_ptr, y_ptr, w_ptr, out_ptr, dot_ptr, H, WITH_DOT: tl.constexpr, BLOCK: tl.constexpr
    ):
        row = tl.program_id(0).to(tl.int64)
        w = tl.load(w_ptr + row)
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, H, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < H
            g = tl.load(g_ptr + row * H + cols, mask=mask, other=0.0).to(tl.float32)
            tl.store(out_ptr + row * H + cols, (g * w).to(out_ptr.dtype.element_ty), mask=mask)
            if WITH_DOT:
                y = tl.load(y_ptr + row * H + cols, mask=mask, other=0.0).to(tl.float32)
                acc += g * y
        if WITH_DOT:
            tl.store(dot_ptr + row, tl.sum(acc, axis=0))


def scale_dot(
    g: torch.Tensor, w: torch.Tensor, y: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(g * w[:, None], <g, y> per row in fp32 or None when y is None); g, y: [R, H], w: [R] fp32."""
    if triton is None or not g.is_cuda or g.shape[0] == 0:
        return scale_dot_torch(g, w, y)
    g = g.contiguous()
    rows, hidden = g.shape
    out = torch.empty_like(g)
    dot = torch.empty(rows, dtype=torch.float32, device=g.device) if y is not None else None
    yy = y.to(g.dtype).contiguous() if y is not None else g
    _scale_dot_kernel[(rows,)](
        g,
        yy,
        w.to(torch.float32).contiguous(),
        out,
        dot if dot is not None else w,
        hidden,
        WITH_DOT=y is not None,
        BLOCK=1024,
    )
    return out, dot
