"""Dispatch along a cached routing: the same rows as a full dispatch, and no routing exchange.

Layers 1..L dispatch forward, each keeping its routing; then L..1 dispatch new
rows along their kept routing (as the backward of combine does), each checked
bitwise against a full dispatch of the same rows. Before every cached call a
rank fills the routing rows of its workspace with garbage: the call must not
read them (its plan is the kept matrix) and nobody may write them (no peer
publishes a row), while the full dispatch after it must still work.
"""

from __future__ import annotations

import ctypes
import dataclasses
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from ranks import DEVICE, PROVIDER, RANK, WORLD, device_pytestmark, layouts

from moe_a2a import AllToAll, CapacityError, Config, Routing
from moe_a2a.all_to_all import RowRequest
from moe_a2a.autograd import ExpertParallel
from moe_a2a.backends.common import RowMath, apply_row_math

pytestmark = device_pytestmark
HIDDEN = 160  # two fp8 scale blocks, the second short
EXPERTS = 24  # every world size of the CI matrix (1, 2, 3, 4, 8) divides it
TOPK = 3
MAX_TOKENS = 12
LAYERS = 3
POISON = 0xA5A5A5A5
CASES = {"bf16-pad2": ("bf16", 2), "fp8": ("fp8", 1)}


@pytest.fixture(scope="module", params=layouts())
def rpn(request: pytest.FixtureRequest) -> int | None:
    return request.param


@pytest.fixture(scope="module", params=list(CASES))
def a2a(request: pytest.FixtureRequest, rpn: int | None) -> Iterator[AllToAll]:
    dtype, pad = CASES[request.param]
    cfg = Config(MAX_TOKENS, HIDDEN, EXPERTS, TOPK, dispatch_dtype=dtype, expert_padding=pad)
    with AllToAll(cfg, device=DEVICE, provider=PROVIDER, ranks_per_node=rpn) as a:
        yield a


def layer_inputs(seed: int, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x, ids, weights, new rows) of this rank for one layer: uneven tokens, one rank with none."""
    g = torch.Generator().manual_seed(seed * 1000 + RANK)
    tokens = 0 if WORLD > 1 and RANK == 1 else int(torch.randint(1, MAX_TOKENS + 1, (1,), generator=g))
    g.manual_seed(seed * 1000 + 100 * (layer + 1) + RANK)
    ids = torch.stack(
        [torch.randperm(EXPERTS, generator=g)[:TOPK] for _ in range(tokens)] or [torch.zeros(0)]
    )
    ids = ids.reshape(tokens, TOPK).to(torch.int64)
    x = torch.randn(tokens, HIDDEN, generator=g).to(torch.bfloat16)
    rows = torch.randn(tokens, HIDDEN, generator=g).to(torch.bfloat16)
    return x.to(DEVICE), ids.to(DEVICE), torch.rand(tokens, TOPK, generator=g).to(DEVICE), rows.to(DEVICE)


def routing_words(a: AllToAll) -> ctypes.Array:
    """The routing section of this rank's host workspace (where peers and the proxy write rows)."""
    ws = a._setup.workspace
    return (ctypes.c_uint32 * (WORLD * (EXPERTS + WORLD))).from_address(ws.ptr + ws.routing_offset)


def round_trip(a: AllToAll, x: torch.Tensor, between: Any = None, **kw: Any) -> tuple[Any, ...]:
    """dispatch then combine; `between()` runs after the dispatch, before our combine lets peers go on."""
    d = a.dispatch(x, **kw)
    if between is not None:
        between()
    a.combine(torch.zeros(d.expert_x.shape, dtype=torch.bfloat16, device=a.device), d)
    scale = d.expert_x_scale if d.expert_x_scale is not None else torch.empty(0)
    return d.expert_x.view(torch.uint8).cpu(), scale.cpu(), d.tokens_per_expert.cpu(), d


def test_cached_dispatch_equals_a_full_one_with_layers_between(a2a: AllToAll, seed: int) -> None:
    inputs = [layer_inputs(seed, layer) for layer in range(LAYERS)]
    kept: list[Routing] = []
    for x, ids, w, _ in inputs:  # layers 1..L forward
        *_, d = round_trip(a2a, x, topk_ids=ids, topk_weights=w, keep_routing=True)
        assert isinstance(d.routing, Routing) and tuple(d.routing.matrix.shape) == (WORLD, EXPERTS + WORLD)
        kept.append(d.routing)
    matrices = [r.matrix.clone() for r in kept]
    for layer in reversed(range(LAYERS)):  # then L..1, each with the previous layer's calls between
        _, ids, w, rows = inputs[layer]
        words = routing_words(a2a)
        ctypes.memset(words, 0xA5, ctypes.sizeof(words))
        before = a2a.routing_rows()
        written: list[int] = []  # a peer may start its next call (and publish) once we combine

        def look(words: ctypes.Array = words, written: list[int] = written) -> None:
            written.extend(i for i, v in enumerate(words) if v != POISON)

        got = round_trip(a2a, rows, look, routing=kept[layer])
        assert a2a.routing_rows() == before, "a cached call exchanged routing rows"
        assert not written, f"routing words {written} were written during a cached call (rank {RANK})"
        want = round_trip(a2a, rows, topk_ids=ids, topk_weights=w)
        sent, received = a2a.routing_rows()
        assert (sent - before[0], received - before[1]) == (WORLD - 1, WORLD - 1)
        for name, g, e in zip(
            ("expert_x", "expert_x_scale", "tokens_per_expert"), got[:3], want[:3], strict=True
        ):
            assert torch.equal(g, e), f"layer {layer + 1}: {name} differs from a full dispatch (rank {RANK})"
        assert torch.equal(kept[layer].matrix, matrices[layer]), "a call changed a kept routing"


def test_a_gone_routings_matrix_serves_a_later_dispatch(a2a: AllToAll, seed: int) -> None:
    """A kept routing's matrix (pinned on CUDA) is reused once its Routing is gone, never while it lives
    or while the last call, cached along it, may still be asked for its traffic."""
    x, ids, w, rows = layer_inputs(seed, 0)
    *_, d1 = round_trip(a2a, x, topk_ids=ids, topk_weights=w, keep_routing=True)
    *_, d2 = round_trip(a2a, x, topk_ids=ids, topk_weights=w, keep_routing=True)
    first, second = d1.routing.matrix.data_ptr(), d2.routing.matrix.data_ptr()
    assert first != second, "a live routing's matrix was handed to the next dispatch"
    want = d1.routing.matrix.clone()
    del d1  # its Routing goes with it: the next kept routing takes its matrix
    *_, d3 = round_trip(a2a, x, topk_ids=ids, topk_weights=w, keep_routing=True)
    assert d3.routing.matrix.data_ptr() == first
    assert torch.equal(d3.routing.matrix, want), "the reused matrix does not hold the new call's routing"
    expect = round_trip(a2a, rows, topk_ids=ids, topk_weights=w)
    got = round_trip(a2a, rows, routing=d3.routing)
    for g, e in zip(got[:3], expect[:3], strict=True):
        assert torch.equal(g, e), f"a dispatch along a reused matrix differs from a full one (rank {RANK})"
    third = d3.routing.matrix.data_ptr()
    del d3, got  # the last call went along it: held until the next call
    *_, d4 = round_trip(a2a, x, topk_ids=ids, topk_weights=w, keep_routing=True)
    assert d4.routing.matrix.data_ptr() != third, "the last cached call's matrix was taken over"


def test_a_routing_travels_to_an_instance_of_the_same_shape(
    a2a: AllToAll, rpn: int | None, seed: int
) -> None:
    """As the backward does: a routing kept on one instance drives a dispatch of another (other dtype)."""
    x, ids, w, rows = layer_inputs(seed, 7)
    *_, d = round_trip(a2a, x, topk_ids=ids, topk_weights=w, keep_routing=True)
    cfg = Config(MAX_TOKENS, HIDDEN, EXPERTS, TOPK, dispatch_dtype="fp32")
    with AllToAll(cfg, device=DEVICE, provider=PROVIDER, ranks_per_node=rpn) as other:
        got = round_trip(other, rows.float(), routing=d.routing)
        want = round_trip(other, rows.float(), topk_ids=ids, topk_weights=w)
        assert other.routing_rows() == (WORLD - 1, WORLD - 1), "only the full dispatch exchanged rows"
    assert torch.equal(got[0], want[0]) and torch.equal(got[2], want[2])


def test_a_routing_over_another_instances_capacity(a2a: AllToAll, rpn: int | None, seed: int) -> None:
    """Along a routing that overfills this instance's receive buffers: a CapacityError on every
    rank (on CUDA the receive half then waits for the plan kernel, which finds it), and the
    instance stays usable."""
    x, ids, w, rows = layer_inputs(seed, 8)
    ids = torch.arange(TOPK, device=DEVICE).repeat(x.shape[0], 1)  # every copy to rank 0's experts
    *_, d = round_trip(a2a, x, topk_ids=ids, topk_weights=w, keep_routing=True)
    copies = int(d.routing.matrix[:, : EXPERTS // WORLD].sum())
    if copies < 2:
        pytest.skip("the world's tokens make fewer than two copies")
    cfg = Config(MAX_TOKENS, HIDDEN, EXPERTS, TOPK, max_recv_tokens=copies - 1, max_private_tokens=1)
    with AllToAll(cfg, device=DEVICE, provider=PROVIDER, ranks_per_node=rpn) as small:
        with pytest.raises(CapacityError, match=f"max_recv_tokens={copies - 1}"):
            small.dispatch(rows, routing=d.routing)
        got = round_trip(small, rows[:0], topk_ids=ids[:0], topk_weights=w[:0])  # usable: an empty call
        assert got[0].shape[0] == 0


@pytest.mark.parametrize(("dtype", "pad"), [("bf16", 2), ("fp32", 1)])
def test_a_weighted_receive_scales_rows_and_takes_dots(
    rpn: int | None, seed: int, dtype: str, pad: int
) -> None:
    """row_scale/row_dot on a cached receive: the rows of a plain call times their scale (the
    torch form's values: a padding row may be -0 there) and each row's dot product with row_dot
    (fp32, to summation order)."""
    x, ids, w, rows = layer_inputs(seed, 11)
    gd = torch.float32 if dtype == "fp32" else torch.bfloat16
    cfg = Config(MAX_TOKENS, HIDDEN, EXPERTS, TOPK, dispatch_dtype=dtype, expert_padding=pad)
    with AllToAll(cfg, device=DEVICE, provider=PROVIDER, ranks_per_node=rpn) as a:
        *_, d = round_trip(a, x, topk_ids=ids, topk_weights=w, keep_routing=True)
        plain = a.dispatch(rows.to(gd), routing=d.routing)
        n = plain.expert_x.shape[0]
        g = torch.Generator().manual_seed(seed * 10 + RANK)
        scale = torch.randn(n, generator=g).to(DEVICE)
        ys = torch.randn(n, HIDDEN, generator=g).to(torch.bfloat16).to(DEVICE)
        want_rows, want_dot = apply_row_math(plain.expert_x, RowMath(scale, ys))
        assert plain.row_dot is None
        a.combine(torch.zeros_like(plain.expert_x), plain)
        got = a._dispatch_rows(RowRequest(row_scale=scale, row_dot=ys), rows.to(gd), routing=d.routing)
        a.combine(torch.zeros_like(got.expert_x), got)
        only = a._dispatch_rows(RowRequest(row_scale=scale), rows.to(gd), routing=d.routing)  # rows only
        a.combine(torch.zeros_like(only.expert_x), only)
    assert got.expert_x.dtype == gd and torch.equal(
        got.tokens_per_expert.cpu(), plain.tokens_per_expert.cpu()
    )
    for r in (got.expert_x, only.expert_x):
        assert torch.equal(r.cpu(), want_rows.cpu()), f"rank {RANK}"
    assert got.row_dot is not None and got.row_dot.dtype == torch.float32 and only.row_dot is None
    assert want_dot is not None
    torch.testing.assert_close(got.row_dot.cpu(), want_dot.cpu(), rtol=1e-5, atol=1e-4)


def test_inference_mode_keeps_and_follows_a_routing(a2a: AllToAll, seed: int) -> None:
    """Under torch.inference_mode() (serving, evaluation), whose tensors have no version
    counter: a kept routing and a call along it give the rows of full calls, and the instance
    stays usable. It used to fail inside the call, reading the ids' counter, and stop."""
    x, ids, w, rows = layer_inputs(seed, 20)
    want = round_trip(a2a, x, topk_ids=ids, topk_weights=w)
    want_cached = round_trip(a2a, rows, topk_ids=ids, topk_weights=w)
    with torch.inference_mode():
        x_i, ids_i, w_i, rows_i = (t.clone() for t in (x, ids, w, rows))
        *got, d = round_trip(a2a, x_i, topk_ids=ids_i, topk_weights=w_i, keep_routing=True)
        assert d.routing is not None and d.routing.ids_version is None  # nothing to compare a change by
        got_cached = round_trip(a2a, rows_i, routing=d.routing)
    names = ("expert_x", "expert_x_scale", "tokens_per_expert") * 2  # full, then along the routing
    for name, g, e in zip(names, [*got, *got_cached[:3]], [*want[:3], *want_cached[:3]], strict=True):
        assert torch.equal(g, e), f"{name} differs under inference mode (rank {RANK})"
    round_trip(a2a, x, topk_ids=ids, topk_weights=w)  # and the instance goes on


def test_a_changed_routing_is_refused(a2a: AllToAll, seed: int) -> None:
    """topk_ids changed in place after dispatch returned the routing: refused, on every rank alike."""
    x, ids, w, rows = layer_inputs(seed, 10)
    *_, d = round_trip(a2a, x, topk_ids=ids.clone(), topk_weights=w, keep_routing=True)
    d.routing.topk_ids.add_(0)
    with pytest.raises(ValueError, match="topk_ids were changed in place"):
        a2a.dispatch(rows, routing=d.routing)


def test_bad_routing_names_the_argument(rpn: int | None, seed: int) -> None:
    """Each bad argument is named; the instance then stops on every rank until reopened."""
    x, ids, w, rows = layer_inputs(seed, 9)
    cfg = Config(MAX_TOKENS, HIDDEN, EXPERTS, TOPK)
    a2a = AllToAll(cfg, device=DEVICE, provider=PROVIDER, ranks_per_node=rpn)
    try:
        *_, d = round_trip(a2a, x, topk_ids=ids, topk_weights=w, keep_routing=True)
        assert d.routing is not None
        wrong = torch.zeros(rows.shape[0] + 1, HIDDEN, dtype=rows.dtype, device=DEVICE)
        ones3 = torch.ones(3, device=DEVICE)
        ones999, dot1 = torch.ones(999, device=DEVICE), torch.ones(1, HIDDEN, device=DEVICE)
        bad: list[tuple[type[Exception], str, Any]] = [
            (TypeError, "routing: got Tensor", lambda a: a.dispatch(rows, routing=d.routing.matrix)),
            (ValueError, "leave topk_ids out", lambda a: a.dispatch(rows, ids, routing=d.routing)),
            (ValueError, "x: got", lambda a: a.dispatch(wrong, routing=d.routing)),
            (ValueError, "keep_routing: got", lambda a: a.dispatch(x, ids, w, keep_routing=1)),
            (ValueError, r"row_scale: got .* expected float32 of shape \(",
             lambda a: a._dispatch_rows(RowRequest(row_scale=ones999), rows, routing=d.routing)),
            (ValueError, "row_dot= needs row_scale=",
             lambda a: a._dispatch_rows(RowRequest(row_dot=dot1), rows, routing=d.routing)),
            (ValueError, "row_scale= needs a call along routing=",
             lambda a: a._dispatch_rows(RowRequest(row_scale=ones3), x, ids, w)),
            (ValueError, "row_scale=, row_dot=, row_weights= and dequantize= belong to the receive half",
             lambda a: a._dispatch_rows(RowRequest(row_scale=ones3), rows, routing=d.routing, recv=False)),
        ]  # fmt: skip
        if DEVICE == "cpu":  # where checking costs no stream synchronisation: a changed row of ours
            changed = d.routing.matrix.clone()
            changed[RANK, 0] += 1
            routing = dataclasses.replace(d.routing, matrix=changed)
            bad.append((ValueError, f"routing: row {RANK} of its matrix does not count",
                        lambda a: a.dispatch(rows, routing=routing)))  # fmt: skip
        for exc, match, call in bad:  # every rank passes the same bad argument
            with pytest.raises(exc, match=match):
                call(a2a)
            a2a = a2a.reopen()
        round_trip(a2a, rows, routing=d.routing)  # a routing outlives the instance that made it
    finally:
        a2a.close()


@pytest.fixture(scope="module")
def ep(rpn: int | None) -> Iterator[ExpertParallel]:
    cfg = Config(MAX_TOKENS, HIDDEN, EXPERTS, TOPK)
    with ExpertParallel(cfg, device=DEVICE, provider=PROVIDER, ranks_per_node=rpn, grad_dtype="fp32") as e:
        yield e


def test_backward_exchanges_no_routing(ep: ExpertParallel, seed: int) -> None:
    """Layers 1..L forward, then one backward: every dispatch of the backward goes along a kept routing."""
    instances = {id(a): a for a in (ep.forward_a2a, ep.backward_a2a)}.values()
    x = layer_inputs(seed, 0)[0].float().requires_grad_()
    h = x
    for layer in range(LAYERS):
        _, ids, w, _ = layer_inputs(seed, layer)
        routed = ep.dispatch(h, ids, w.requires_grad_())
        h = ep.combine(routed.expert_x * 2.0, routed)
    before = [a.routing_rows() for a in instances]
    h.sum().backward()
    assert [a.routing_rows() for a in instances] == before, "the backward exchanged routing rows"
    assert x.grad is not None and bool(torch.isfinite(x.grad).all())
