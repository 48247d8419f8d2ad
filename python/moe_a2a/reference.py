"""Dispatch and combine for every rank at once, in one process, with torch.

The ground truth for the tests: it follows the contract of docs/design.md section 6 and
the numerics of docs/protocol.md (fp8 block quantisation, expert-major padded
layout, fp32 accumulation of the combine in k order), but none of the buffer
mechanics.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_a2a._core import FP8_BLOCK, FP8_MAX

DTYPES = {
    "bf16": torch.bfloat16,
    "fp32": torch.float32,
    "fp8": torch.float8_e4m3fn,
}


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-quantise rows of `x` to e4m3: one fp32 scale per 128 elements."""
    tokens, hidden = x.shape
    blocks = (hidden + FP8_BLOCK - 1) // FP8_BLOCK
    xf = x.float()
    padded = torch.zeros(tokens, blocks * FP8_BLOCK, dtype=torch.float32, device=x.device)
    padded[:, :hidden] = xf
    amax = padded.view(tokens, blocks, FP8_BLOCK).abs().amax(dim=2)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    scaled = padded.view(tokens, blocks, FP8_BLOCK) / scale.unsqueeze(2)
    clamped = scaled.clamp(-FP8_MAX, FP8_MAX).reshape(tokens, blocks * FP8_BLOCK)
    q = clamped[:, :hidden].to(torch.float8_e4m3fn)
    return q, scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Inverse of `quantize_fp8` (up to rounding), in fp32."""
    hidden = q.shape[1]
    expanded = scale.repeat_interleave(FP8_BLOCK, dim=1)[:, :hidden]
    return q.float() * expanded


@dataclass
class ReferenceDispatch:
    """One rank's dispatch result, as `AllToAll.dispatch` returns it."""

    expert_x: torch.Tensor
    expert_x_scale: torch.Tensor | None
    tokens_per_expert: torch.Tensor
    # For each output row: (source rank, token, k), or (-1, -1, -1) for padding.
    origin: torch.Tensor


def _round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


def dispatch_reference(
    xs: list[torch.Tensor],
    topk_ids: list[torch.Tensor],
    num_experts: int,
    dispatch_dtype: str = "bf16",
    expert_padding: int = 1,
) -> list[ReferenceDispatch]:
    """Dispatch of every rank's tokens; `xs[r]` is rank r's `[T_r, hidden]` input."""
    world = len(xs)
    local = num_experts // world
    hidden = xs[0].shape[1]
    payload: list[torch.Tensor] = []
    scales: list[torch.Tensor | None] = []
    for x in xs:
        if dispatch_dtype == "fp8":
            q, q_scale = quantize_fp8(x)
            payload.append(q)
            scales.append(q_scale)
        else:
            payload.append(x.to(DTYPES[dispatch_dtype]))
            scales.append(None)

    results = []
    for r in range(world):
        rows: list[torch.Tensor] = []
        scale_rows: list[torch.Tensor] = []
        origin: list[tuple[int, int, int]] = []
        counts = []
        for i in range(local):
            expert = r * local + i
            n = 0
            for s in range(world):
                # nonzero walks (t, k) in row-major order: the send order.
                hits = (topk_ids[s] == expert).nonzero()
                for t, k in hits.tolist():
                    rows.append(payload[s][t])
                    scale = scales[s]
                    if scale is not None:
                        scale_rows.append(scale[t])
                    origin.append((s, t, k))
                n += hits.shape[0]
            counts.append(n)
            pad = _round_up(n, expert_padding) - n
            for _ in range(pad):
                rows.append(torch.zeros(hidden, dtype=payload[0].dtype))
                if scales[0] is not None:
                    scale_rows.append(torch.zeros(scales[0].shape[1], dtype=torch.float32))
                origin.append((-1, -1, -1))
        dtype = DTYPES[dispatch_dtype]
        expert_x = torch.stack(rows) if rows else torch.empty(0, hidden, dtype=dtype)
        expert_scale = None
        if dispatch_dtype == "fp8":
            blocks = (hidden + FP8_BLOCK - 1) // FP8_BLOCK
            expert_scale = torch.stack(scale_rows) if scale_rows else torch.empty(0, blocks)
        results.append(
            ReferenceDispatch(
                expert_x=expert_x,
                expert_x_scale=expert_scale,
                tokens_per_expert=torch.tensor(counts, dtype=torch.int32),
                origin=torch.tensor(origin, dtype=torch.int64).reshape(-1, 3),
            )
        )
    return results


def combine_reference(
    ys: list[torch.Tensor],
    dispatched: list[ReferenceDispatch],
    topk_weights: list[torch.Tensor],
    combine_dtype: str = "bf16",
    fabric_rows: str = "rank",
    ranks_per_node: int = 1,
) -> list[torch.Tensor]:
    """Weighted sum of expert outputs per token, back on the rank that sent it.

    `ys[r]` has the shape of `dispatched[r].expert_x`. A copy that travels in a row
    of its own (same node, or `fabric_rows="expert"`) is converted to
    `combine_dtype` first (the wire format), then accumulated in fp32 in k order
    with its weight. With `fabric_rows="rank"`, the copies of a token on a rank of
    another node (ranks r // ranks_per_node apart) are first summed there, weighted,
    in fp32 in k order, and converted once; the origin adds that row at the token's
    first k on the rank (docs/protocol.md, "Rows per destination rank"). With
    `fabric_rows="node"` the same holds per node: the copies on all ranks of that
    node are summed by its forwarder ("Rows per destination node"). The result
    is stored as `combine_dtype`. An unweighted combine is this with weights of one.
    """
    if fabric_rows not in ("rank", "node", "expert"):  # "auto": the instance's mode (a2a.cfg)
        raise ValueError(f"fabric_rows: got {fabric_rows!r}; expected 'rank', 'node' or 'expert'")
    wire = DTYPES[combine_dtype]
    hidden = ys[0].shape[1] if ys else 0
    wide = fabric_rows in ("rank", "node")

    def group(r: int) -> int:  # what one reduced row covers: a rank, or a node
        return r // ranks_per_node if fabric_rows == "node" else r

    # Every copy's rank and output row, for sums that span a node's ranks.
    where = {
        (s, t, k): (r, row)
        for r, d in enumerate(dispatched)
        for row, (s, t, k) in enumerate(d.origin.tolist())
        if s >= 0
    }
    y_all = [y.float() for y in ys]
    per_copy = [torch.zeros(w.shape[0], w.shape[1], hidden, dtype=torch.float32) for w in topk_weights]
    # Rows per rank: partial sums [T, K, hidden] at each (t, the first k on r), and where each (t, k) went.
    reduced = [torch.zeros(w.shape[0], w.shape[1], hidden, dtype=torch.float32) for w in topk_weights]
    target = [torch.full(w.shape, -1, dtype=torch.int64) for w in topk_weights]
    for r, d in enumerate(dispatched):
        for s, t, k in d.origin.tolist():
            if s >= 0:
                target[s][t, k] = r
    for r, d in enumerate(dispatched):
        y_wire = ys[r].to(wire).float()
        by_copy = {(s, t, k): row for row, (s, t, k) in enumerate(d.origin.tolist()) if s >= 0}
        for (s, t, k), row in by_copy.items():
            if not (wide and r // ranks_per_node != s // ranks_per_node):
                per_copy[s][t, k] = y_wire[row]
                continue
            ks = [q for q in range(target[s].shape[1]) if group(int(target[s][t, q])) == group(r)]
            if k != ks[0]:
                continue  # summed into the first k's row
            acc = torch.zeros(hidden, dtype=torch.float32)
            for q in ks:
                at, at_row = where[(s, t, q)]
                acc = acc + topk_weights[s][t, q].float() * y_all[at][at_row]
            reduced[s][t, k] = acc.to(wire).float()
    outs = []
    for s, w in enumerate(topk_weights):
        acc = torch.zeros(w.shape[0], hidden, dtype=torch.float32)
        for k in range(w.shape[1]):
            far = target[s][:, k] // ranks_per_node != s // ranks_per_node
            rank_row = far & wide
            grouped = target[s] // ranks_per_node if fabric_rows == "node" else target[s]
            first = torch.tensor([_first_on_rank(grouped, t, k) for t in range(w.shape[0])], dtype=torch.bool)
            own = w[:, k : k + 1].float() * per_copy[s][:, k]
            term = torch.where(rank_row[:, None], reduced[s][:, k], own)
            # A later k of a row per rank adds nothing (not even +0, which would turn a -0 sum into +0).
            acc = torch.where((rank_row & ~first)[:, None], acc, acc + term)
        outs.append(acc.to(wire))
    return outs


def _first_on_rank(target: torch.Tensor, t: int, k: int) -> bool:
    """Whether k is token t's first k on rank (or node) target[t, k]."""
    return all(int(target[t, q]) != int(target[t, k]) for q in range(k))
