"""Dispatch and combine across real MPI ranks, checked against the in-process reference.

Every rank draws every rank's inputs from one seed, so each can compute the
reference for itself. Run under `mpirun -n N python -m pytest --with-mpi tests/mpi`
with `MOE_A2A_TEST_PROVIDER` set to tcp or shm, and `MOE_A2A_TEST_DEVICE` set to
cpu (the default) or cuda: the same cases run on either backend (on one GPU,
several ranks share it, each its own process), plus CUDA graph capture on cuda.
"""

from __future__ import annotations

import time
import warnings
from typing import Any

import pytest
import torch
from ranks import COMM, DEVICE, PROVIDER, RANK, WORLD, device_pytestmark, layouts

from inputs import Inputs, Router, draw_inputs, expert_fn, random_ids
from moe_a2a import FabricError, PeerFailedError, _core
from moe_a2a.all_to_all import AllToAll, CapacityError, Config, RowRequest
from moe_a2a.reference import combine_reference, dequantize_fp8, dispatch_reference, quantize_fp8

pytestmark = device_pytestmark
HIDDEN = 200  # not a multiple of 128: the last fp8 block is short
EXPERTS_PER_RANK = 3 if WORLD > 1 else 8  # top-4 of 3 per rank: several picks land on one rank
# Waits for peers. These tests check results, not latency, and on the 2-vCPU
# CI machine a rank has been seen to stop for 30 to 65 s at a time (a CI run
# failed waiting 30 s for rank 0's routing row); test_silent_peer_times_out_with_clear_error
# checks the timeout itself, with 2 s.
TIMEOUT_S = 120.0


def make_params() -> dict[str, object]:
    """The Config arguments of make_a2a, before overrides."""
    return dict(
        max_tokens=24,
        hidden=HIDDEN,
        num_experts=EXPERTS_PER_RANK * WORLD,
        topk=4,
        dispatch_dtype="bf16",
        combine_dtype="bf16",
        expert_padding=1,
        timeout_s=TIMEOUT_S,
    )


def make_a2a(rpn: int | None, **overrides: object) -> AllToAll:
    params = make_params()
    params.update(overrides)
    graph_safe = bool(params.pop("graph_safe", False))
    return AllToAll(
        Config(**params),  # type: ignore[arg-type]
        device=DEVICE,
        provider=PROVIDER,
        ranks_per_node=rpn,
        graph_safe=graph_safe,
    )


def mine(inp: Inputs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This rank's (x, topk_ids, topk_weights) on the test device."""
    return inp.xs[RANK].to(DEVICE), inp.ids[RANK].to(DEVICE), inp.weights[RANK].to(DEVICE)


def other_work() -> None:
    """Something to compute between the halves of a call, on the test device."""
    a = torch.randn(128, 128, device=DEVICE)
    assert (a @ a).shape == (128, 128)


random_router = random_ids


def make_inputs(
    seed: int, cfg: Config, router: Router = random_router, tokens: list[int] | None = None
) -> Inputs:
    return draw_inputs(seed, cfg, WORLD, tokens, router)


def tail_value(origin: torch.Tensor) -> torch.Tensor:
    """A value per row, known to its sender from (rank, token, k) alone; 0 on padding rows."""
    s, t, k = origin.unbind(1)
    return torch.where(s >= 0, s * 1000.0 + t * 10.0 + k + 0.5, 0.0).float()


def check_round(
    a2a: AllToAll, inp: Inputs, split: bool = False, in_place: bool | None = None
) -> torch.Tensor:
    """One dispatch + combine on this rank, compared with the reference; returns the output (on the CPU).

    Split halves not `in_place` get their inputs overwritten between the halves: the receive
    half must not read them.
    """
    cfg = a2a.cfg
    x, ids, w = mine(inp)
    clobber = split and not in_place
    if split:
        x = x.clone()  # on the CPU, mine() hands out the reference's own tensor
        pending = a2a._dispatch_rows(RowRequest(in_place=in_place), x, ids, w, recv=False)
        if clobber:
            x.fill_(float("nan"))
        other_work()  # while bytes fly
        d = a2a._dispatch_rows(RowRequest(row_weights=True), handle=pending, send=False)
    else:
        d = a2a._dispatch_rows(RowRequest(row_weights=True), x, ids, w)
    ref = dispatch_reference(inp.xs, inp.ids, cfg.num_experts, cfg.dispatch_dtype, cfg.expert_padding)
    ours = ref[RANK]
    assert d.expert_x.device.type == d.tokens_per_expert.device.type == DEVICE
    assert torch.equal(d.tokens_per_expert.cpu(), ours.tokens_per_expert)
    assert d.expert_x.shape == ours.expert_x.shape
    valid = ours.origin[:, 0] >= 0  # padding rows hold no meaning
    assert torch.equal(d.expert_x.cpu()[valid].view(torch.uint8), ours.expert_x[valid].view(torch.uint8))
    if cfg.dispatch_dtype == "fp8":
        assert d.expert_x_scale is not None and ours.expert_x_scale is not None
        assert torch.equal(d.expert_x_scale.cpu()[valid], ours.expert_x_scale[valid])
    else:
        assert d.expert_x_scale is None
    # Row tails: each row carries its copy's weight (0 on padding rows) ...
    assert d.row_weights is not None and d.row_weights.shape == (d.expert_x.shape[0],)
    s, t, k = ours.origin[valid].unbind(1)
    want_w = torch.zeros(d.expert_x.shape[0])
    if valid.any():
        want_w[valid] = torch.stack([inp.weights[q][tt, kk] for q, tt, kk in zip(s, t, k, strict=True)])
    assert torch.equal(d.row_weights.cpu(), want_w), "a row's weight is not its copy's"
    # ... and takes one value back, unreduced, to the (t, k) it came from.
    values = tail_value(ours.origin).to(DEVICE)
    values_out = torch.full((x.shape[0], cfg.topk), float("nan"), device=DEVICE)

    y = expert_fn(d.expert_x, d.expert_x_scale)
    if split:
        pending_c = a2a._combine_rows(RowRequest(in_place=in_place, row_values=values), y, d, recv=False)
        if clobber:
            y.fill_(float("nan"))
            values.fill_(float("nan"))
        other_work()
        out = a2a._combine_rows(RowRequest(values_out=values_out), handle=pending_c, send=False)
    else:
        out = a2a._combine_rows(RowRequest(row_values=values, values_out=values_out), y, d)
    tokens = torch.arange(x.shape[0])[:, None].expand(-1, cfg.topk)
    mine_origin = torch.stack(
        [torch.full_like(tokens, RANK), tokens, torch.arange(cfg.topk).expand_as(tokens)], -1
    )
    assert torch.equal(values_out.cpu(), tail_value(mine_origin.reshape(-1, 3)).reshape(tokens.shape)), (
        "a copy's returned value is not its row's"
    )
    ys = [expert_fn(r.expert_x, r.expert_x_scale) for r in ref]
    expected = combine_reference(
        ys, ref, inp.weights, cfg.combine_dtype, cfg.fabric_rows, a2a._boot.topology.local_size
    )[RANK]
    assert out.device.type == DEVICE and out.dtype == expected.dtype and out.shape == expected.shape
    out = out.cpu()
    torch.testing.assert_close(out.float(), expected.float(), rtol=1.6e-2, atol=1e-2)
    check_traffic(a2a, inp)
    return out


def check_traffic(a2a: AllToAll, inp: Inputs) -> None:
    """traffic() after an uncached call: per peer the routing row, then the wire rows out at the
    dispatch row's size and back at the combine row's (docs/protocol.md, "Rows per destination rank")."""
    core = a2a._core_cfg

    def wire_rows(s: int, r: int) -> int:
        rpn = core.ranks_per_node
        on_r = inp.ids[s] // EXPERTS_PER_RANK == r
        far = s // rpn != r // rpn
        if far and a2a.cfg.fabric_rows == "node":  # to s's forwarder on r's node: a row per token there
            on_node = inp.ids[s] // EXPERTS_PER_RANK // rpn == r // rpn
            return int(on_node.any(dim=1).sum()) if r % rpn == s % rpn else 0
        return int(on_r.any(dim=1).sum() if far and a2a.cfg.fabric_rows == "rank" else on_r.sum())

    def forwarded(t: int) -> int:
        """Rows per node: what this rank, forwarding, passed node peer t and read of its outputs."""
        rpn = core.ranks_per_node
        if a2a.cfg.fabric_rows != "node" or t // rpn != RANK // rpn or t == RANK:
            return 0
        rows = entries = 0
        for s in range(WORLD):
            if s // rpn != RANK // rpn and s % rpn == RANK % rpn:  # we forward s's rows
                on_t = inp.ids[s] // EXPERTS_PER_RANK == t
                rows, entries = rows + int(on_t.any(dim=1).sum()), entries + int(on_t.sum())
        staged = 4 if DEVICE == "cuda" else 2  # CUDA stages fp32, the CPU y's dtype (expert_fn's bf16)
        return rows * core.dispatch_row_bytes + entries * (staged * a2a.cfg.hidden + 4)

    got = a2a.traffic().sum(axis=1)
    for p in range(WORLD):
        rows = wire_rows(RANK, p) * core.dispatch_row_bytes + wire_rows(p, RANK) * core.combine_row_bytes
        want = 0 if p == RANK else core.routing_width * 4 + rows + forwarded(p)
        assert got[p] == want, f"traffic to peer {p}: {got[p]} bytes, expected {want}"


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("rpn", layouts())
@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32], ids=["x-bf16", "x-fp32"])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32], ids=["out-bf16", "out-fp32"])
@pytest.mark.parametrize("split", [False, True], ids=["whole", "halves"])
def test_dequantized_receive(
    rpn: int | None, x_dtype: torch.dtype, out_dtype: torch.dtype, split: bool
) -> None:
    """fp8 rows delivered dequantised by the receive pass are the reference's rows dequantised,
    bit for bit (a whole call quantises this rank's own copies where they are, in x)."""
    with make_a2a(rpn, dispatch_dtype="fp8", expert_padding=4) as a2a:
        for it in range(2):
            inp = make_inputs(2000 + it, a2a.cfg)
            x, ids, w = mine(inp)
            x = x.to(x_dtype)
            rows = RowRequest(row_weights=True)
            if split:
                pending = a2a.dispatch(x, ids, w, recv=False)
                d = a2a._dispatch_rows(rows, handle=pending, send=False, dequantize=out_dtype)
            else:
                d = a2a._dispatch_rows(rows, x, ids, w, dequantize=out_dtype)
            ref = dispatch_reference(inp.xs, inp.ids, a2a.cfg.num_experts, "fp8", 4)[RANK]
            assert ref.expert_x_scale is not None
            want = dequantize_fp8(ref.expert_x, ref.expert_x_scale).to(out_dtype)
            valid = ref.origin[:, 0] >= 0
            assert d.expert_x_scale is None and d.expert_x.dtype == out_dtype
            assert torch.equal(d.expert_x.cpu()[valid], want[valid]), "dequantised rows differ"
            assert not bool(d.expert_x.cpu()[~valid].any()), "padding rows must hold zeros"
            assert d.row_weights is not None and not bool(d.row_weights.cpu()[~valid].any())
            a2a.combine(d.expert_x, d)


@pytest.mark.mpi(min_size=1)
def test_prequantised_fp8_rows_come_as_a_pair() -> None:
    """x = (fp8 rows, their scales) travels as it is: the reference quantises the same rows to the
    same bits. A pair that is not one is named, and the instance stops on every rank."""
    a2a = make_a2a(None, dispatch_dtype="fp8", expert_padding=2)
    try:
        inp = make_inputs(2100, a2a.cfg)
        x, ids, w = mine(inp)
        q, scale = quantize_fp8(x.cpu())
        d = a2a.dispatch((q.to(DEVICE), scale.to(DEVICE)), ids, w)
        ref = dispatch_reference(inp.xs, inp.ids, a2a.cfg.num_experts, "fp8", 2)[RANK]
        valid = ref.origin[:, 0] >= 0
        assert d.expert_x_scale is not None and ref.expert_x_scale is not None
        assert torch.equal(d.expert_x.cpu()[valid].view(torch.uint8), ref.expert_x[valid].view(torch.uint8))
        assert torch.equal(d.expert_x_scale.cpu()[valid], ref.expert_x_scale[valid])
        a2a.combine(torch.zeros(d.expert_x.shape, dtype=torch.bfloat16, device=DEVICE), d)
        bad = [
            ("fp8 rows come as the pair", lambda: a2a.dispatch(q.to(DEVICE), ids, w)),
            ("only for already-quantised fp8 x", lambda: a2a.dispatch((x, scale.to(DEVICE)), ids, w)),
            ("a sequence of 3", lambda: a2a.dispatch((x, x, x), ids, w)),
        ]
        for match, call in bad:
            with pytest.raises(ValueError, match=match):
                call()
            a2a = a2a.reopen()
    finally:
        a2a.close()


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("rpn", layouts())
@pytest.mark.parametrize(
    ("dispatch_dtype", "combine_dtype", "padding"),
    [("bf16", "bf16", 1), ("fp8", "bf16", 4), ("fp32", "fp32", 3)],
)
def test_matches_reference(rpn: int | None, dispatch_dtype: str, combine_dtype: str, padding: int) -> None:
    with make_a2a(
        rpn, dispatch_dtype=dispatch_dtype, combine_dtype=combine_dtype, expert_padding=padding
    ) as a2a:
        for it in range(4):
            check_round(a2a, make_inputs(1000 + it, a2a.cfg))


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize(
    ("dispatch_dtype", "combine_dtype", "padding"),
    [("fp8", "bf16", 4), ("fp32", "fp32", 1)],  # bf16 and the rest: tests/protocol/test_fabric_rows.py
)
def test_rows_per_node_match_reference(dispatch_dtype: str, combine_dtype: str, padding: int) -> None:
    """fabric_rows="node" over virtual nodes of 2 (docs/protocol.md, "Rows per destination node"):
    a token crosses once per other node, to the rank with its sender's local index there, which
    passes its node peers their entries and sums their outputs; whole and split calls, zero tokens
    and overflowing private slots equal the reference, and traffic() counts the rows per node."""
    if WORLD < 4 or WORLD % 2:
        pytest.skip("rows per node: 2 or more nodes of 2 ranks")
    with make_a2a(
        2,
        fabric_rows="node",
        max_private_tokens=2,
        dispatch_dtype=dispatch_dtype,
        combine_dtype=combine_dtype,
        expert_padding=padding,
    ) as a2a:
        cfg = a2a.cfg
        for it in range(3):
            check_round(a2a, make_inputs(1100 + it, cfg), split=it == 1, in_place=False)
        check_round(a2a, make_inputs(1110, cfg, tokens=[0] + [cfg.max_tokens] * (WORLD - 1)))
        check_round(a2a, make_inputs(1111, cfg, tokens=[0] * WORLD))


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("rpn", layouts())
@pytest.mark.parametrize(
    ("dispatch_dtype", "combine_dtype"), [("bf16", "bf16"), ("fp32", "fp32"), ("fp8", "bf16")]
)
@pytest.mark.parametrize("in_place", [True, False], ids=["in place", "copied"])
def test_split_halves_in_place_or_copied(
    rpn: int | None, dispatch_dtype: str, combine_dtype: str, in_place: bool
) -> None:
    """Split halves with in_place=True read this rank's own rows from x and y (left as they
    are); with in_place=False x and y are overwritten between the halves and the result holds."""
    with make_a2a(rpn, dispatch_dtype=dispatch_dtype, combine_dtype=combine_dtype) as a2a:
        for it in range(3):
            check_round(a2a, make_inputs(600 + it, a2a.cfg), split=True, in_place=in_place)
        check_round(a2a, make_inputs(610, a2a.cfg, tokens=[0] * WORLD), split=True, in_place=in_place)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("rpn", layouts())
def test_hard_routings(rpn: int | None) -> None:
    """Zero tokens, one hot expert, one hot rank, several picks per rank, overflowing private slots."""
    with make_a2a(rpn, max_private_tokens=2, dispatch_dtype="fp8") as a2a:
        cfg = a2a.cfg
        full = [cfg.max_tokens] * WORLD

        def one_expert(g: torch.Generator, t: int, e: int, k: int) -> torch.Tensor:
            # Every token's first pick is expert 0; the rest are random and distinct.
            ids = random_router(g, t, e, k)
            for row in ids:
                if 0 in row.tolist():
                    row[row.tolist().index(0)] = row[0].item()
                row[0] = 0
            return ids

        def one_rank(g: torch.Generator, t: int, e: int, k: int) -> torch.Tensor:
            # As many picks as fit (distinct) on the last rank's experts, the rest elsewhere.
            last = list(range((WORLD - 1) * EXPERTS_PER_RANK, e))
            rows = []
            for _ in range(t):
                mine = [last[i] for i in torch.randperm(len(last), generator=g)[: min(k, len(last))]]
                others = [x for x in torch.randperm(e, generator=g).tolist() if x not in last]
                rows.append(mine + others[: k - len(mine)])
            return torch.tensor(rows, dtype=torch.int64).reshape(t, k)

        zero_on_rank0 = [0] + [cfg.max_tokens] * (WORLD - 1)
        check_round(a2a, make_inputs(7, cfg, tokens=zero_on_rank0))
        check_round(a2a, make_inputs(8, cfg, tokens=[0] * WORLD))
        check_round(a2a, make_inputs(9, cfg, router=one_expert, tokens=full))
        check_round(a2a, make_inputs(10, cfg, router=one_rank, tokens=full))


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("rpn", layouts())
def test_no_private_slots(rpn: int | None) -> None:
    """max_private_tokens=0: every copy goes to the shared section, one fabric write per peer, not two."""
    with make_a2a(rpn, max_private_tokens=0) as a2a:
        cfg = a2a.cfg
        check_round(a2a, make_inputs(20, cfg))
        check_round(a2a, make_inputs(21, cfg, tokens=[0] + [cfg.max_tokens] * (WORLD - 1)), split=True)
        check_round(a2a, make_inputs(22, cfg, tokens=[0] * WORLD))


@pytest.mark.mpi(min_size=1)
@pytest.mark.timeout(240)
def test_many_iterations_reuse_buffers() -> None:
    """200 rounds with new routing each time, alternating whole and split calls."""
    rpn = layouts()[-1]
    with make_a2a(rpn, max_private_tokens=3) as a2a:
        for it in range(200):
            check_round(a2a, make_inputs(5000 + it, a2a.cfg), split=it % 2 == 1)


@pytest.mark.mpi(min_size=1)
def test_deterministic() -> None:
    with make_a2a(layouts()[-1], dispatch_dtype="fp8") as a2a:
        inp = make_inputs(42, a2a.cfg)
        first = check_round(a2a, inp)
        second = check_round(a2a, inp)
    assert torch.equal(first.view(torch.int16), second.view(torch.int16))


@pytest.mark.mpi(min_size=1)
def test_capacity_error_then_next_call_works() -> None:
    rpn = layouts()[-1]
    # Room for 4 copies per rank: a full round needs far more.
    with make_a2a(rpn, max_recv_tokens=4, max_private_tokens=1) as a2a:
        cfg = a2a.cfg
        big = make_inputs(77, cfg, tokens=[cfg.max_tokens] * WORLD)
        with pytest.raises(CapacityError, match="max_recv_tokens=4"):
            a2a.dispatch(*mine(big))
        # One token in the whole world: 4 copies, which fit anywhere.
        check_round(a2a, make_inputs(78, cfg, tokens=[1] + [0] * (WORLD - 1)))


@pytest.mark.mpi(min_size=1)
def test_row_tail_arguments_are_checked() -> None:
    """combine's row_values and values_out are named when wrong; the instance stops on every rank."""
    a2a = make_a2a(None)
    cfg = a2a.cfg
    x = torch.randn(3, cfg.hidden, device=DEVICE).to(torch.bfloat16)
    ids = torch.arange(3 * cfg.topk, device=DEVICE).reshape(3, cfg.topk) % cfg.num_experts
    w = torch.rand(3, cfg.topk, device=DEVICE)
    wrong = torch.zeros(999, device=DEVICE)
    bad = [
        ("row_values: got .* expected float32 of shape", dict(row_values=wrong)),
        (
            "row_values: got .* expected float32",
            dict(row_values=torch.zeros(0, dtype=torch.int32, device=DEVICE)),
        ),
        ("values_out: got .* expected a contiguous float32 tensor of shape", dict(values_out=wrong)),
    ]
    try:
        for match, kwargs in bad:
            d = a2a.dispatch(x, ids, w)
            with pytest.raises(ValueError, match=match):
                a2a._combine_rows(RowRequest(**kwargs), d.expert_x, d)
            a2a = a2a.reopen()
        with pytest.raises(ValueError, match="row_values= belongs to the send half"):
            a2a._combine_rows(RowRequest(row_values=wrong), send=False)
        a2a = a2a.reopen()
        check_round(a2a, make_inputs(4, cfg))
    finally:
        a2a.close()


@pytest.mark.mpi(min_size=1)
def test_validation_errors() -> None:
    """Each bad argument is named; the instance then stops on every rank until reopened."""
    a2a = make_a2a(None)
    cfg = a2a.cfg
    x = torch.randn(3, cfg.hidden, device=DEVICE).to(torch.bfloat16)
    ids = torch.zeros(3, cfg.topk, dtype=torch.int64, device=DEVICE)
    w = torch.rand(3, cfg.topk, device=DEVICE)
    many = cfg.max_tokens + 1
    bad: list[tuple[type[Exception], str, Any]] = [
        (ValueError, "x: got .* expected", lambda: a2a.dispatch(x[:, :-1], ids, w)),
        (
            ValueError,
            "max_tokens",
            lambda: a2a.dispatch(
                torch.randn(many, cfg.hidden, device=DEVICE),
                torch.zeros(many, cfg.topk, dtype=torch.long, device=DEVICE),
                torch.rand(many, cfg.topk, device=DEVICE),
            ),
        ),
        (ValueError, "dtype", lambda: a2a.dispatch(x.to(torch.float16), ids, w)),
        (ValueError, "topk_weights", lambda: a2a.dispatch(x, ids, w[:, :1])),
        (
            ValueError,
            "in_place: got 'yes'; expected True, False or None",
            lambda: a2a._dispatch_rows(RowRequest(in_place="yes"), x, ids, w),  # type: ignore[arg-type]
        ),
        (
            ValueError,
            "in_place= belongs to the send half",
            lambda: a2a._dispatch_rows(RowRequest(in_place=True), send=False),
        ),
        (
            RuntimeError,
            "latest dispatch|not the latest",
            lambda: a2a.combine(torch.zeros(0, cfg.hidden, device=DEVICE), make_fake_dispatched()),
        ),
        (
            ValueError,
            "row_weights: got 1; expected True or False",
            lambda: a2a._dispatch_rows(RowRequest(row_weights=1), x, ids, w),  # type: ignore[arg-type]
        ),
        (
            ValueError,
            "dequantize: got torch.bfloat16 with dispatch_dtype 'bf16'; expected .* dispatch_dtype 'fp8'",
            lambda: a2a.dispatch(x, ids, w, dequantize=torch.bfloat16),
        ),
        (
            ValueError,
            "dequantize= belong to the receive half",
            lambda: a2a.dispatch(x, ids, w, recv=False, dequantize=torch.bfloat16),
        ),
        (
            ValueError,
            "dispatch: values_out belong to the other call kind",
            lambda: a2a._dispatch_rows(RowRequest(values_out=w), x, ids, w),
        ),
    ]
    if DEVICE == "cpu":
        bad.append(
            (
                ValueError,
                r"topk_ids: found expert id .*expected ids in \[0, ",
                lambda: a2a.dispatch(x, ids + cfg.num_experts, w),
            )
        )
    else:  # the kernels check ids (a host check would synchronise)
        bad.append(
            (
                ValueError,
                r"topk_ids held an expert id outside \[0, ",
                lambda: a2a.dispatch(x, ids + cfg.num_experts, w),
            )
        )
        # The id that drops a masked rank's copy is an error where no rank is masked.
        masked_id = torch.full_like(ids, _core.MASKED_EXPERT)
        bad.append(
            (ValueError, r"topk_ids held an expert id outside \[0, ", lambda: a2a.dispatch(x, masked_id, w))
        )
        bad.append((ValueError, "x is on cpu; expected cuda", lambda: a2a.dispatch(x.cpu(), ids, w)))
        bad.append((ValueError, "topk_ids is on cpu", lambda: a2a.dispatch(x, ids.cpu(), w)))
    try:
        for kind, match, call in bad:
            with pytest.raises(kind, match=match):
                call()
            # Every rank got the same bad call here; one alone would have stopped the others too.
            stopped = r"unusable after an earlier failure: call \d+ .*a2a.reopen\(\)"
            with pytest.raises(RuntimeError, match=stopped):
                a2a.dispatch(x, ids, w)
            a2a = a2a.reopen()
        check_round(a2a, make_inputs(3, cfg))
    finally:
        a2a.close()
    if WORLD > 1:  # every count divides a world of one
        with pytest.raises(ValueError, match="num_experts.*not divisible by the world size"):
            AllToAll(
                Config(max_tokens=4, hidden=8, num_experts=WORLD + 1, topk=1),
                device=DEVICE,
                provider=PROVIDER,
            )
    with pytest.raises(ValueError, match="topk: got 9; expected at most num_experts=8"):
        Config(max_tokens=4, hidden=8, num_experts=8, topk=9)


@pytest.mark.mpi(min_size=1)
def test_inputs_that_require_grad_are_warned_once() -> None:
    """AllToAll has no backward: an input that requires grad, with gradients on, would get none
    back, so the first such call warns (naming the argument and ExpertParallel), once per
    instance; under no_grad nothing is said, and the results are the same either way."""
    with make_a2a(layouts()[-1]) as a2a:
        inp = make_inputs(77, a2a.cfg)
        x, ids, w = mine(inp)
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("error")
            d = a2a.dispatch(x.requires_grad_(), ids, w)
            want = a2a.combine(d.expert_x, d)
        with pytest.warns(UserWarning, match=r"^AllToAll.dispatch: x requires grad, but AllToAll has no"):
            d = a2a.dispatch(x, ids, w)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # once per instance
            got = a2a.combine(d.expert_x.requires_grad_(), d)
        assert torch.equal(got, want) and not got.requires_grad


def test_closed_instance_says_so() -> None:
    a2a = make_a2a(None)
    check_round(a2a, make_inputs(4, a2a.cfg))
    a2a.close()
    a2a.close()  # a second close does nothing
    x, ids, w = mine(make_inputs(4, a2a.cfg))
    for use in (lambda: a2a.epoch, a2a.traffic, a2a.check, lambda: a2a.dispatch(x, ids, w)):
        with pytest.raises(RuntimeError, match="AllToAll is closed"):
            use()


def make_fake_dispatched():  # type: ignore[no-untyped-def]
    from moe_a2a.all_to_all import Dispatched

    return Dispatched(torch.zeros(0, HIDDEN), None, torch.zeros(EXPERTS_PER_RANK, dtype=torch.int32))


@pytest.mark.mpi(min_size=1)
@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("field", "rank1_value"),
    [
        ("num_experts", (EXPERTS_PER_RANK + 1) * WORLD),
        ("hidden", HIDDEN + 8),
        ("dispatch_dtype", "fp8"),
        ("fabric_rows", "expert"),
        ("ranks_per_node", 1),
        ("ranks_per_node", WORLD + 1),  # not even valid: rank 1 alone used to fail, the others to wait
    ],
)
def test_mismatched_config_fails_on_every_rank(field: str, rank1_value: object) -> None:
    """Rank 1 builds with another value: every rank raises the same error, naming the field and ranks."""
    if WORLD < 2:
        pytest.skip("needs 2+ ranks")
    if field == "ranks_per_node":
        rpn, overrides, ours = (rank1_value if RANK == 1 else None), {}, None
    else:
        rpn, overrides = None, ({field: rank1_value} if RANK == 1 else {})
        params = make_params()
        ours = params[field] if field in params else getattr(Config, field)  # else Config's default
    started = time.monotonic()
    with pytest.raises(ValueError) as err:
        make_a2a(rpn, **overrides)
    message = str(err.value)
    assert f"{field}: {ours!r} on rank" in message, message
    assert f"{rank1_value!r} on rank 1" in message, message
    assert time.monotonic() - started < 30  # no timeout: it fails at construction
    # Everyone failed alike, before any engine was made: the next instance works.
    mismatched = COMM.allgather(message)
    assert mismatched == [message] * WORLD
    with make_a2a(None) as a2a:
        check_round(a2a, make_inputs(11, a2a.cfg))


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
def test_silent_peer_times_out_with_clear_error() -> None:
    """A peer that never takes part: the others fail within the timeout, naming it, and do not hang."""
    silent = WORLD - 1
    a2a = make_a2a(1, timeout_s=2.0)
    started = time.monotonic()
    if RANK != silent:
        inp = make_inputs(5, a2a.cfg, tokens=[4] * WORLD)
        # Its own timeout, or another rank's announcement of one: both name the silent peer.
        with pytest.raises((FabricError, PeerFailedError), match=f"peer {silent}"):
            a2a.dispatch(*mine(inp))
        assert time.monotonic() - started < 30
        with pytest.raises(RuntimeError, match="unusable after an earlier failure"):
            a2a.dispatch(*mine(inp))
    COMM.Barrier()
    a2a.close(wait_for_peers=False)


@pytest.mark.mpi(min_size=1)
@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graph capture needs MOE_A2A_TEST_DEVICE=cuda")
@pytest.mark.parametrize("rpn", layouts())
@pytest.mark.parametrize("dispatch_dtype", ["fp8", "bf16"])
def test_graph_capture_replays(rpn: int | None, dispatch_dtype: str) -> None:
    """A whole step (dispatch, experts, combine) captured once and replayed with new inputs
    (bf16: this rank's own rows read in place, in the graph too)."""
    with make_a2a(rpn, graph_safe=True, dispatch_dtype=dispatch_dtype) as a2a:
        cfg = a2a.cfg
        tokens = [cfg.max_tokens - r % 3 for r in range(WORLD)]
        x, ids, w = mine(make_inputs(300, cfg, tokens=tokens))

        def step() -> torch.Tensor:
            d = a2a.dispatch(x, ids, w)
            return a2a.combine(expert_fn(d.expert_x, d.expert_x_scale), d)

        step()  # eager warm-up: maps peers, sets kernel attributes
        torch.cuda.synchronize()
        a2a.check()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = step()
        for it in range(5):
            inp = make_inputs(400 + it, cfg, tokens=tokens)
            for dst, src in zip((x, ids, w), mine(inp), strict=True):
                dst.copy_(src)
            graph.replay()
            torch.cuda.synchronize()
            a2a.check()
            ref = dispatch_reference(inp.xs, inp.ids, cfg.num_experts, cfg.dispatch_dtype, cfg.expert_padding)
            ys = [expert_fn(r.expert_x, r.expert_x_scale) for r in ref]
            expected = combine_reference(
                ys, ref, inp.weights, cfg.combine_dtype, cfg.fabric_rows, a2a._boot.topology.local_size
            )[RANK]
            torch.testing.assert_close(out.cpu().float(), expected.float(), rtol=1.6e-2, atol=1e-2)


@pytest.mark.skipif(DEVICE != "cuda", reason="the CUDA kernels' top-k limit")
def test_cuda_topk_limit_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="topk: got 65; device='cuda' takes at most 64"):
        make_a2a(None, topk=65, num_experts=65 * WORLD)
