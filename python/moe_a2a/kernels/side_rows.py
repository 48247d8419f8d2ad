"""The training side channel's rows, each built in one launch.

`moe_a2a.autograd` sends each token's `(weights | expert ids)` along the main
exchange's routing, and each rank then finds, for every row it received, which
of its token's `k` it is and its weight. In torch each of these is a handful of
small calls, and on a slow host each call costs more than its kernel: the
forward's GPU waited about 0.8 ms a step behind them (docs/benchmarks.md,
"Training on the H200"). On CUDA one Triton kernel does each; elsewhere, and
where Triton cannot run, the torch forms give the same values (bit for bit:
nothing is rounded but the ids' conversion to fp32, exact below 2**24).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl
except Exception:  # no Triton (or it cannot load here): the torch form serves
    triton = None


@dataclass
class RowRoute:
    """Where each output row of a dispatch belongs, and what the side channel says of it."""

    expert: torch.Tensor  # [R] int64 local expert of each row
    real: torch.Tensor | None  # [R] bool, False on padding rows; None without padding
    k: torch.Tensor | None = None  # [R] int64 which k of its token the row is (0 on padding rows)
    weight: torch.Tensor | None = None  # [R] fp32 its routing weight (0 on padding rows)


def _use_triton(t: torch.Tensor) -> bool:
    return triton is not None and t.is_cuda


# -- the sender's rows: (weights | ids as floats), and whether a token repeats an expert ----------


def pack_side_rows_torch(
    ids: torch.Tensor, weights: torch.Tensor, flag: torch.Tensor, call: int
) -> torch.Tensor:
    """[T, 2K] fp32 rows; sets `flag` ([1] int64) to `call` when a token picks one expert twice."""
    tokens, k = ids.shape
    if tokens > 0 and k > 1:
        if k <= 16:  # every pair: fewer torch calls than a sort
            repeats = bool((ids[:, :, None] == ids[:, None, :]).sum() != tokens * k)
        else:
            s = torch.sort(ids, dim=1).values
            repeats = bool((s[:, 1:] == s[:, :-1]).any())
        if repeats:
            flag.fill_(call)
    return torch.cat([weights.detach().to(torch.float32), ids.to(torch.float32)], dim=1)


if triton is not None:

    # Arguments that change from call to call are not specialised on: a new value's
    # divisibility would compile the kernel again, mid-run.
    @triton.jit(do_not_specialize=["call", "T"])
    def _pack_kernel(ids_ptr, w_ptr, out_ptr, flag_ptr, call, T, K, BLOCK_T: tl.constexpr, KP: tl.constexpr):
        t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
        k = tl.arange(0, KP)
        mask = (t[:, None] < T) & (k[None, :] < K)
        at = t[:, None] * K + k[None, :]
        ids = tl.load(ids_ptr + at, mask=mask, other=-1).to(tl.int64)
        w = tl.load(w_ptr + at, mask=mask, other=0.0).to(tl.float32)
        row = t[:, None] * (2 * K) + k[None, :]
        tl.store(out_ptr + row, w, mask=mask)
        tl.store(out_ptr + row + K, ids.to(tl.float32), mask=mask)
        # Pairs (i, j), i != j, of one token's real lanes with the same id. Every program
        # that finds one stores the same value, so the races between them are benign.
        both = mask[:, :, None] & mask[:, None, :]
        same = (ids[:, :, None] == ids[:, None, :]) & both & (k[:, None] != k[None, :])[None, :, :]
        if tl.sum(tl.sum(tl.sum(same.to(tl.int32), axis=2), axis=1), axis=0) > 0:
            tl.store(flag_ptr, call)


def _launch_pack(ids: torch.Tensor, weights: torch.Tensor, flag: torch.Tensor, call: int) -> torch.Tensor:
    tokens, k = ids.shape
    out = torch.empty(tokens, 2 * k, dtype=torch.float32, device=ids.device)
    if tokens == 0:
        return out
    kp = triton.next_power_of_2(k)
    block_t = max(1, min(64, 4096 // (kp * kp)))
    _pack_kernel[(triton.cdiv(tokens, block_t),)](
        ids.contiguous(), weights.detach().contiguous(), out, flag, call, tokens, k, BLOCK_T=block_t, KP=kp
    )
    return out


def pack_side_rows(ids: torch.Tensor, weights: torch.Tensor, flag: torch.Tensor, call: int) -> torch.Tensor:
    """Each token's side-channel row `(weights | ids as fp32)`, [T, 2K]; sets `flag` ([1] int64,
    on the ids' device) to `call` when some token picks one expert twice, and leaves it
    otherwise (on CUDA without a synchronisation: read it once the stream is past this)."""
    if _use_triton(ids):
        return _launch_pack(ids, weights, flag, call)
    return pack_side_rows_torch(ids, weights, flag, call)


# -- the receiver's rows: each row's local expert, and its k and weight ---------------------------


def route_rows_torch(
    counts: torch.Tensor, padding: int, rows: int, first: int, side: torch.Tensor | None
) -> RowRoute:
    """`counts`: [L] int32 rows per local expert (unpadded); `first`: the global id of local
    expert 0; `side`: the received side rows [rows, 2K] fp32, or None."""
    local = torch.arange(counts.shape[0], device=counts.device)
    real = None
    if padding > 1:
        n = counts.to(torch.int64)
        padded = (n + padding - 1) // padding * padding
        expert = torch.repeat_interleave(local, padded, output_size=rows)
        start = torch.cumsum(padded, 0) - padded
        real = torch.arange(rows, device=counts.device) - start[expert] < n[expert]
    else:
        expert = torch.repeat_interleave(local, counts, output_size=rows)
    route = RowRoute(expert=expert, real=real)
    if side is not None:
        k = side.shape[1] // 2
        # A row's k is where its token's ids name the row's expert (the only match where
        # no token repeats an expert). Padding rows hold leftover bytes, which can be an
        # earlier call's ids: only the plan says which rows are real.
        match = side[:, k:] == (expert + first if first else expert)[:, None]
        if real is not None:
            match &= real[:, None]
        route.k = torch.argmax(match.to(torch.int8), dim=1)  # 0 where nothing matches
        route.weight = torch.where(match, side[:, :k], 0.0).sum(dim=1)
    return route


if triton is not None:

    @triton.jit(do_not_specialize=["R", "FIRST"])
    def _route_kernel(
        counts_ptr, side_ptr, expert_ptr, real_ptr, k_ptr, w_ptr, R, L, PAD, FIRST, K,
        BLOCK: tl.constexpr, LP: tl.constexpr, KP: tl.constexpr, SIDE: tl.constexpr, PADDED: tl.constexpr,
    ):  # fmt: skip
        r = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = r < R
        e = tl.arange(0, LP)
        n = tl.load(counts_ptr + e, mask=e < L, other=0).to(tl.int64)
        padded = (n + PAD - 1) // PAD * PAD
        end = tl.cumsum(padded, axis=0)
        # A row's expert: how many experts end at or before it.
        before = (end[None, :] <= r[:, None]) & (e[None, :] < L)
        expert = tl.sum(before.to(tl.int64), axis=1)
        tl.store(expert_ptr + r, expert, mask=inside)
        real = inside
        if PADDED:
            mine = e[None, :] == expert[:, None]
            start = tl.sum(tl.where(mine, (end - padded)[None, :], 0), axis=1)
            count = tl.sum(tl.where(mine, n[None, :], 0), axis=1)
            real = inside & (r - start < count)
            tl.store(real_ptr + r, real.to(tl.int8), mask=inside)
        if SIDE:
            k = tl.arange(0, KP)
            lanes = inside[:, None] & (k[None, :] < K)
            at = r[:, None] * (2 * K) + k[None, :]
            ids = tl.load(side_ptr + at + K, mask=lanes, other=-1.0)
            w = tl.load(side_ptr + at, mask=lanes, other=0.0)
            match = lanes & real[:, None] & (ids == (expert + FIRST).to(tl.float32)[:, None])
            tl.store(k_ptr + r, tl.sum(tl.where(match, k[None, :], 0), axis=1).to(tl.int64), mask=inside)
            tl.store(w_ptr + r, tl.sum(tl.where(match, w, 0.0), axis=1), mask=inside)


def _launch_route(
    counts: torch.Tensor, padding: int, rows: int, first: int, side: torch.Tensor | None
) -> RowRoute:
    dev = counts.device
    expert = torch.empty(rows, dtype=torch.int64, device=dev)
    real = torch.empty(rows, dtype=torch.bool, device=dev) if padding > 1 else None
    route = RowRoute(expert=expert, real=real)
    if side is not None:
        route.k = torch.empty(rows, dtype=torch.int64, device=dev)
        route.weight = torch.empty(rows, dtype=torch.float32, device=dev)
    if rows == 0:
        return route
    local = counts.shape[0]
    topk = side.shape[1] // 2 if side is not None else 1
    lp = triton.next_power_of_2(max(local, 1))
    block = max(16, min(128, 16384 // lp))  # a [block, lp] comparison in registers
    _route_kernel[(triton.cdiv(rows, block),)](
        counts,
        side if side is not None else expert,
        expert,
        real.view(torch.int8) if real is not None else expert,
        route.k if route.k is not None else expert,
        route.weight if route.weight is not None else expert,
        rows,
        local,
        padding,
        first,
        topk,
        BLOCK=block,
        LP=lp,
        KP=triton.next_power_of_2(topk),
        SIDE=side is not None,
        PADDED=padding > 1,
    )
    return route


def route_rows(
    counts: torch.Tensor, padding: int, rows: int, first: int, side: torch.Tensor | None
) -> RowRoute:
    """Each of a dispatch's `rows` output rows: its local expert and whether it is real (from
    `counts`, [L] int32 per local expert, padded to `padding`), and with `side` (the received
    side rows, [rows, 2K] fp32) its k and weight; `first` is local expert 0's global id."""
    if _use_triton(counts):
        return _launch_route(counts, padding, rows, first, side.contiguous() if side is not None else None)
    return route_rows_torch(counts, padding, rows, first, side)
