"""The MoE layer's pieces without MPI: presets, router, grouped GEMM, weights, reference, layer.

The layer runs end to end here over a one-process all-to-all built on
`moe_a2a.reference` (dispatch and combine of every rank at once), and its output is
checked against `reference_forward` and against a per-token loop written out in
this file.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch.nn import functional

from moe_a2a import reference as a2a_reference
from moe_a2a.layers.experts import dequantize, grouped_mm, grouped_mm_loop, padded_offsets, swiglu_experts
from moe_a2a.layers.moe import MoELayer
from moe_a2a.layers.presets import PRESETS, MoEShape, get_preset
from moe_a2a.layers.reference import max_relative_error, reference_forward, tolerance
from moe_a2a.layers.router import Router, node_limited, route
from moe_a2a.layers.weights import (
    MoEWeights,
    full_layer_nbytes,
    local_experts,
    random_weights,
    shard_state_dict,
)

SMALL = MoEShape(
    hidden=160,
    num_experts=8,
    topk=3,
    expert_hidden=48,
    num_shared_experts=1,
    score_func="sigmoid",
    num_groups=4,
    topk_groups=2,
    route_scale=1.5,
)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def per_token_moe(x: torch.Tensor, w: MoEWeights, ids: torch.Tensor, wts: torch.Tensor) -> torch.Tensor:
    """The layer's definition, one token and one pick at a time, in fp64."""
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float64)
    xd = x.double()
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            h = functional.silu(w.w1[e].double() @ xd[t]) * (w.w3[e].double() @ xd[t])
            out[t] += float(wts[t, k]) * (w.w2[e].double() @ h)
        if w.has_shared:
            h = functional.silu(w.shared_w1.double() @ xd[t]) * (w.shared_w3.double() @ xd[t])
            out[t] += w.shared_w2.double() @ h
    return out


# --------------------------------------------------------------------------- presets


def test_presets_have_the_published_shapes() -> None:
    ds = get_preset("deepseek-v3")
    dims = (ds.hidden, ds.num_experts, ds.topk, ds.expert_hidden, ds.num_shared_experts)
    assert dims == (7168, 256, 8, 2048, 1)
    assert (ds.score_func, ds.num_groups, ds.topk_groups) == ("sigmoid", 8, 4)
    kimi = get_preset("kimi-k2")
    assert (kimi.hidden, kimi.num_experts, kimi.topk) == (7168, 384, 8)
    tiny = get_preset("tiny")
    assert tiny.num_experts % 4 == 0  # runs on 4 ranks
    assert full_layer_nbytes(tiny, torch.bfloat16) < 16 * 2**20


def test_unknown_preset_names_it_and_the_valid_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown preset 'gpt-5'") as info:
        get_preset("gpt-5")
    for name in PRESETS:
        assert name in str(info.value)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"topk": 9}, "topk: got 9"),
        ({"num_groups": 3}, "num_groups: got 3"),
        ({"topk_groups": 5}, "topk_groups: got 5"),
        ({"topk_groups": 1}, "topk: got 3"),  # one group of 2 experts cannot hold top-3
        ({"hidden": 0}, "hidden: got 0"),
        ({"score_func": "relu"}, "score_func: got 'relu'"),
    ],
)
def test_shape_validation_names_the_field(changes: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SMALL.replace(**changes)


# --------------------------------------------------------------------------- router


def brute_force_route(
    x: torch.Tensor,
    gate: torch.Tensor,
    topk: int,
    score_func: str,
    num_groups: int,
    topk_groups: int,
    route_scale: float,
    norm_topk: bool,
    bias: torch.Tensor | None,
) -> tuple[list[set[int]], torch.Tensor]:
    """Per-token routing written out with sorted() over Python lists."""
    logits = x.double() @ gate.double().t()
    scores = torch.softmax(logits, -1) if score_func == "softmax" else torch.sigmoid(logits)
    choice = scores + (bias.double() if bias is not None else 0)
    E = gate.shape[0]
    size = E // num_groups
    chosen, weights = [], []
    for t in range(x.shape[0]):
        c = choice[t].tolist()
        groups = sorted(
            range(num_groups), key=lambda g: -sum(sorted(c[g * size : (g + 1) * size], reverse=True)[:2])
        )
        allowed = [e for g in groups[:topk_groups] for e in range(g * size, (g + 1) * size)]
        experts = sorted(allowed, key=lambda e: -c[e])[:topk]
        w = torch.tensor([float(scores[t, e]) for e in experts], dtype=torch.float64)
        if norm_topk:
            w = w / w.sum()
        chosen.append(set(experts))
        weights.append(sorted((w * route_scale).tolist()))
    return chosen, torch.tensor(weights, dtype=torch.float64)


@pytest.mark.parametrize(
    ("score_func", "num_groups", "topk_groups", "norm_topk", "with_bias"),
    [
        ("softmax", 1, 1, False, False),
        ("softmax", 1, 1, True, False),
        ("sigmoid", 4, 2, True, False),
        ("sigmoid", 8, 3, True, True),
        ("sigmoid", 2, 1, False, True),
    ],
)
def test_route_matches_a_per_token_brute_force(
    score_func: str, num_groups: int, topk_groups: int, norm_topk: bool, with_bias: bool
) -> None:
    g = gen(1)
    x, gate = torch.randn(40, 64, generator=g), torch.randn(16, 64, generator=g) / 8
    bias = torch.randn(16, generator=g) * 0.05 if with_bias else None
    ids, w = route(
        x,
        gate,
        3,
        score_func=score_func,
        num_groups=num_groups,
        topk_groups=topk_groups,
        route_scale=2.5,
        norm_topk=norm_topk,
        expert_bias=bias,
    )
    assert ids.dtype == torch.int64 and w.dtype == torch.float32 and ids.shape == w.shape == (40, 3)
    chosen, weights = brute_force_route(x, gate, 3, score_func, num_groups, topk_groups, 2.5, norm_topk, bias)
    assert [set(row) for row in ids.tolist()] == chosen
    torch.testing.assert_close(w.double().sort(-1).values, weights, rtol=1e-5, atol=1e-6)
    if norm_topk:
        torch.testing.assert_close(w.sum(-1), torch.full((40,), 2.5), rtol=1e-5, atol=1e-5)


def test_group_limited_routing_stays_within_the_chosen_groups() -> None:
    g = gen(2)
    x, gate = torch.randn(200, 32, generator=g), torch.randn(32, 32, generator=g)
    ids, _ = route(x, gate, 6, score_func="sigmoid", num_groups=8, topk_groups=3)
    groups_used = (ids // 4).tolist()
    assert max(len(set(row)) for row in groups_used) <= 3
    # Without the limit the same tokens spread over more groups: the limit did something.
    free, _ = route(x, gate, 6, score_func="sigmoid")
    assert max(len(set(row)) for row in (free // 4).tolist()) > 3


def test_node_limited_routing_uses_at_most_m_nodes() -> None:
    shape = MoEShape(hidden=32, num_experts=32, topk=8, expert_hidden=16, score_func="softmax")
    limited = node_limited(shape, num_nodes=4, max_nodes=2)
    assert (limited.num_groups, limited.topk_groups) == (4, 2)
    g = gen(3)
    router = Router.from_shape(limited, torch.randn(32, 32, generator=g))
    ids, _ = router(torch.randn(100, 32, generator=g))
    assert max(len(set(row)) for row in (ids // 8).tolist()) <= 2  # 8 experts per node
    with pytest.raises(ValueError, match="num_nodes: got 3"):
        node_limited(shape, num_nodes=3, max_nodes=1)
    with pytest.raises(ValueError, match="topk: got 8"):
        node_limited(shape, num_nodes=8, max_nodes=1)  # one node of 4 experts cannot give 8


def test_route_validates_its_arguments() -> None:
    x, gate = torch.randn(4, 8), torch.randn(6, 8)
    with pytest.raises(ValueError, match=r"gate: got shape \(6, 9\)"):
        route(x, torch.randn(6, 9), 2)
    with pytest.raises(ValueError, match="topk: got 7"):
        route(x, gate, 7)
    with pytest.raises(ValueError, match="num_groups: got 4"):
        route(x, gate, 2, num_groups=4)
    with pytest.raises(ValueError, match=r"expert_bias: got shape \(5,\)"):
        route(x, gate, 2, expert_bias=torch.randn(5))


# --------------------------------------------------------------------------- grouped GEMM


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_mm_matches_a_loop_with_empty_groups_and_trailing_rows(dtype: torch.dtype) -> None:
    g = gen(4)
    x = torch.randn(30, 24, generator=g).to(dtype)
    w = torch.randn(5, 40, 24, generator=g).to(dtype).transpose(-2, -1)  # [G, K, N], not contiguous
    offs = torch.tensor([4, 4, 17, 17, 26], dtype=torch.int32)  # groups 1 and 3 empty; rows 26.. unused
    out = grouped_mm(x, w, offs)
    expected = torch.zeros(30, 40, dtype=torch.float64)
    for gi, (a, b) in enumerate([(0, 4), (4, 4), (4, 17), (17, 17), (17, 26)]):
        expected[a:b] = x[a:b].double() @ w[gi].double()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), expected, rtol=tol, atol=tol * 8)
    assert out[26:].eq(0).all()
    torch.testing.assert_close(grouped_mm_loop(x, w, offs).double(), expected, rtol=tol, atol=tol * 8)


def test_grouped_mm_falls_back_to_the_loop_when_torch_refuses(monkeypatch: pytest.MonkeyPatch) -> None:
    from moe_a2a.layers import experts

    def refuse(*args: object, **kwargs: object) -> torch.Tensor:
        raise RuntimeError("grouped_mm: unsupported here")

    monkeypatch.setattr(torch, "_grouped_mm", refuse, raising=False)
    monkeypatch.setattr(experts, "_grouped_mm_broken", set())
    g = gen(5)
    x, w = torch.randn(12, 16, generator=g), torch.randn(3, 16, 8, generator=g)
    offs = torch.tensor([5, 9, 12], dtype=torch.int32)
    torch.testing.assert_close(grouped_mm(x, w, offs), grouped_mm_loop(x, w, offs))
    assert ("cpu", torch.float32) in experts._grouped_mm_broken


def test_swiglu_experts_per_segment_with_padding() -> None:
    g = gen(6)
    E, D, F = 4, 32, 24
    w1, w3 = torch.randn(E, F, D, generator=g) / 6, torch.randn(E, F, D, generator=g) / 6
    w2 = torch.randn(E, D, F, generator=g) / 5
    counts = torch.tensor([3, 0, 5, 1], dtype=torch.int32)
    offs = padded_offsets(counts, 4)
    assert offs.tolist() == [4, 4, 12, 16]
    x = torch.randn(20, D, generator=g)  # 4 spare rows after the last segment
    x[3] = float("nan")  # a padding row holding garbage must not leak anywhere
    y = swiglu_experts(x, counts, w1, w2, w3, expert_padding=4)
    starts = [0, 4, 4, 12]
    for e in range(E):
        rows = x[starts[e] : starts[e] + int(counts[e])]
        want = (functional.silu(rows @ w1[e].t()) * (rows @ w3[e].t())) @ w2[e].t()
        torch.testing.assert_close(y[starts[e] : starts[e] + int(counts[e])], want, rtol=1e-5, atol=1e-5)
    padding = [3, 9, 10, 11, 13, 14, 15, 16, 17, 18, 19]
    assert y[padding].eq(0).all()
    with pytest.raises(ValueError, match="expert_x: got 20 rows"):
        swiglu_experts(x, torch.tensor([9, 0, 9, 1], dtype=torch.int32), w1, w2, w3, expert_padding=4)


def test_dequantize_undoes_the_dispatch_fp8_blocks() -> None:
    x = torch.randn(6, 300, generator=gen(7)) * 3  # 3 blocks, the last one short
    q, scale = a2a_reference.quantize_fp8(x)
    back = dequantize(q, scale, torch.float32)
    torch.testing.assert_close(back, a2a_reference.dequantize_fp8(q, scale))
    assert ((back - x).abs() <= x.abs() / 16 + scale.repeat_interleave(128, 1)[:, :300] * 2**-9).all()
    with pytest.raises(ValueError, match="expert_x_scale: got None"):
        dequantize(q, None, torch.float32)
    with pytest.raises(ValueError, match=r"expert_x_scale: got shape \(6, 2\)"):
        dequantize(q, scale[:, :2], torch.float32)


# --------------------------------------------------------------------------- weights


def test_random_weights_are_made_per_expert_and_agree_across_ranks() -> None:
    full = random_weights(SMALL, seed=11, dtype=torch.float32, expert_bias=True)
    assert full.w1.shape == (8, 48, 160) and full.w2.shape == (8, 160, 48) and full.gate.shape == (8, 160)
    assert full.shared_w1.shape == (48, 160) and full.shared_w2.shape == (160, 48)
    for rank in range(4):
        part = random_weights(
            SMALL, seed=11, experts=local_experts(8, rank, 4), dtype=torch.float32, expert_bias=True
        )
        assert part.expert_offset == 2 * rank and part.num_local_experts == 2
        for name in ("w1", "w2", "w3"):
            torch.testing.assert_close(
                getattr(part, name), getattr(full, name)[2 * rank : 2 * rank + 2], rtol=0, atol=0
            )
        torch.testing.assert_close(part.gate, full.gate, rtol=0, atol=0)
        torch.testing.assert_close(part.expert_bias, full.expert_bias, rtol=0, atol=0)
    other = random_weights(SMALL, seed=12, dtype=torch.float32)
    assert not torch.equal(other.w1, full.w1)
    assert not torch.equal(full.w1[0], full.w1[1])  # experts differ from each other
    assert full.nbytes() == full_layer_nbytes(SMALL, torch.float32) + 8 * 4  # plus the bias
    bf16 = random_weights(SMALL, seed=11)
    assert bf16.w1.dtype == torch.bfloat16 and bf16.gate.dtype == torch.float32


def test_state_dict_uses_torchtitan_names_and_shards_by_rank() -> None:
    full = random_weights(SMALL, seed=13, dtype=torch.float32, expert_bias=True)
    sd = {f"layers.2.moe.{k}": v for k, v in full.state_dict().items()}
    assert set(full.state_dict()) == {
        "router.gate.weight",
        "experts.w1",
        "experts.w2",
        "experts.w3",
        "shared_experts.w1.weight",
        "shared_experts.w2.weight",
        "shared_experts.w3.weight",
        "expert_bias",
    }
    sd["layers.2.moe.tokens_per_expert"] = torch.zeros(8)  # a TorchTitan buffer the layer ignores
    sd["layers.3.moe.experts.w1"] = torch.randn(2)  # another layer: not ours
    parts = [
        shard_state_dict(sd, r, 4, prefix="layers.2.moe.", shape=SMALL, dtype=torch.bfloat16)
        for r in range(4)
    ]
    torch.testing.assert_close(torch.cat([p.w2 for p in parts]), full.w2.bfloat16(), rtol=0, atol=0)
    assert parts[3].expert_offset == 6 and parts[3].w1.dtype == torch.bfloat16
    assert parts[1].gate.dtype == torch.float32  # the router keeps its precision
    # Copies, not views: the unsharded tensors can be freed.
    assert parts[1].w1.untyped_storage().nbytes() == parts[1].w1.numel() * 2


def test_state_dict_errors_name_the_key() -> None:
    sd = random_weights(SMALL, seed=14, dtype=torch.float32).state_dict()
    with pytest.raises(ValueError, match=r"missing \['experts.w3'\]"):
        shard_state_dict({k: v for k, v in sd.items() if k != "experts.w3"})
    bad = dict(sd, **{"experts.w2": sd["experts.w2"].transpose(1, 2)})
    with pytest.raises(ValueError, match=r"state_dict\['experts.w2'\]: got shape \(8, 48, 160\)"):
        shard_state_dict(bad)
    with pytest.raises(ValueError, match=r"unexpected keys \['experts.w4'\]"):
        shard_state_dict(dict(sd, **{"experts.w4": sd["experts.w1"]}))
    with pytest.raises(ValueError, match="num_experts: got 8, not divisible by the world size 3"):
        shard_state_dict(sd, 0, 3)
    with pytest.raises(ValueError, match="expected all of"):
        shard_state_dict({k: v for k, v in sd.items() if k != "shared_experts.w2.weight"})
    with pytest.raises(ValueError, match="expert_hidden is 48; the model shape expects 64"):
        shard_state_dict(sd, shape=SMALL.replace(expert_hidden=64))


# --------------------------------------------------------------------------- reference and layer


@dataclass
class _Handle:
    x: torch.Tensor
    ids: torch.Tensor
    weights: torch.Tensor


class OneRankAllToAll:
    """AllToAll's contract for a world of one rank, computed by moe_a2a.reference."""

    def __init__(
        self, num_experts: int, dispatch_dtype: str, combine_dtype: str, expert_padding: int
    ) -> None:
        self.num_experts, self.expert_padding = num_experts, expert_padding
        self.dispatch_dtype, self.combine_dtype = dispatch_dtype, combine_dtype
        self.calls: list[str] = []

    def dispatch(
        self,
        x: torch.Tensor | None = None,
        topk_ids: torch.Tensor | None = None,
        topk_weights: torch.Tensor | None = None,
        *,
        handle: _Handle | None = None,
        send: bool = True,
        recv: bool = True,
    ) -> Any:
        self.calls.append(f"dispatch send={send} recv={recv}")
        if send:
            handle = _Handle(x, topk_ids, topk_weights)
        if not recv:
            return handle
        d = a2a_reference.dispatch_reference(
            [handle.x], [handle.ids], self.num_experts, self.dispatch_dtype, self.expert_padding
        )[0]
        d.topk_weights = handle.weights
        return d

    def combine(
        self,
        y: torch.Tensor | None = None,
        d: Any = None,
        *,
        handle: Any = None,
        send: bool = True,
        recv: bool = True,
    ) -> Any:
        self.calls.append(f"combine send={send} recv={recv}")
        if send:
            handle = (y, d)
        if not recv:
            return handle
        y, d = handle
        return a2a_reference.combine_reference([y], [d], [d.topk_weights], self.combine_dtype)[0]


def test_reference_forward_matches_the_per_token_definition() -> None:
    w = random_weights(SMALL, seed=15, dtype=torch.float32)
    g = gen(16)
    x = torch.randn(12, 160, generator=g)
    ids, wts = Router.from_shape(SMALL, w.gate)(x)
    ref = reference_forward(x, w, ids, wts, "fp32")
    torch.testing.assert_close(ref.double(), per_token_moe(x, w, ids, wts), rtol=1e-4, atol=1e-4)
    # fp8 dispatch: the experts see quantised input (so the result differs), the shared expert does not.
    ref8 = reference_forward(x, w, ids, wts, "fp8")
    assert 1e-4 < max_relative_error(ref8, ref) < 0.1
    with pytest.raises(ValueError, match="hold 2 of 8 experts"):
        reference_forward(x, random_weights(SMALL, 15, range(0, 2)), ids, wts)


@pytest.mark.parametrize(
    ("dispatch_dtype", "combine_dtype", "weight_dtype", "padding"),
    [
        ("fp32", "fp32", torch.float32, 1),
        ("bf16", "bf16", torch.bfloat16, 4),
        ("fp8", "bf16", torch.bfloat16, 8),
        ("fp8", "fp32", torch.float32, 1),
    ],
)
def test_layer_over_one_rank_matches_the_reference(
    dispatch_dtype: str, combine_dtype: str, weight_dtype: torch.dtype, padding: int
) -> None:
    full = random_weights(SMALL, seed=17, dtype=weight_dtype)
    layer = MoELayer(SMALL, full, expert_padding=padding).eval()
    a2a = OneRankAllToAll(8, dispatch_dtype, combine_dtype, padding)
    x = torch.randn(24, 160, generator=gen(18)).to(weight_dtype)
    out = layer.forward(x, a2a)  # the router's routing
    assert out.dtype == {"bf16": torch.bfloat16, "fp32": torch.float32}[combine_dtype]
    assert a2a.calls == [
        "dispatch send=True recv=False",
        "dispatch send=False recv=True",
        "combine send=True recv=False",
        "combine send=False recv=True",
    ]
    ids, wts = layer.route(x)
    ref = reference_forward(x, full, ids, wts, dispatch_dtype)
    err = max_relative_error(out, ref)
    assert err <= tolerance(dispatch_dtype, combine_dtype, weight_dtype), err
    assert int(layer.last_tokens_per_expert.sum()) == 24 * 3


def test_layer_takes_given_routing_instead_of_its_router() -> None:
    full = random_weights(SMALL, seed=19, dtype=torch.float32)
    layer = MoELayer(SMALL, full).eval()
    g = gen(20)
    x = torch.randn(10, 160, generator=g)
    ids = torch.stack([torch.randperm(8, generator=g)[:3] for _ in range(10)])
    wts = torch.rand(10, 3, generator=g) + 0.1
    out = layer.forward(x, OneRankAllToAll(8, "fp32", "fp32", 1), ids, wts)
    torch.testing.assert_close(out.double(), per_token_moe(x, full, ids, wts), rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match=r"topk_ids/topk_weights: got shapes \(10, 2\)"):
        layer.forward(x, OneRankAllToAll(8, "fp32", "fp32", 1), ids[:, :2], wts[:, :2])
    with pytest.raises(ValueError, match="got one without the other"):
        layer.forward(x, OneRankAllToAll(8, "fp32", "fp32", 1), ids, None)


def test_sharded_layers_over_four_ranks_match_the_whole_layer() -> None:
    """Four ranks' layers loaded from one state dict, dispatch/combine by the reference all-to-all."""
    world, padding = 4, 2
    full = random_weights(SMALL, seed=21, dtype=torch.float32, expert_bias=True)
    sd = full.state_dict()
    layers = [MoELayer.from_state_dict(SMALL, sd, r, world, expert_padding=padding) for r in range(world)]
    g = gen(22)
    xs = [torch.randn(n, 160, generator=g) for n in (9, 0, 5, 13)]  # rank 1 has no tokens
    routed = [layer.route(x) for layer, x in zip(layers, xs, strict=True)]
    ids, wts = [r[0] for r in routed], [r[1] for r in routed]
    ds = a2a_reference.dispatch_reference(xs, ids, 8, "bf16", padding)
    ys = [layer.experts(d) for layer, d in zip(layers, ds, strict=True)]
    outs = a2a_reference.combine_reference(ys, ds, wts, "fp32")
    for r, layer in enumerate(layers):
        shared = layer.shared_expert(xs[r])
        got = outs[r] + shared
        ref = reference_forward(xs[r], full, ids[r], wts[r], "bf16")
        assert got.shape == (xs[r].shape[0], 160)
        assert max_relative_error(got, ref) <= tolerance("bf16", "fp32", torch.float32), r


def test_layer_rejects_weights_of_another_shape() -> None:
    w = random_weights(SMALL, seed=23, dtype=torch.float32)
    with pytest.raises(ValueError, match="expert_hidden 48; the shape expects 64"):
        MoELayer(SMALL.replace(expert_hidden=64), w)
    with pytest.raises(ValueError, match="shared expert width 48; the shape expects 0"):
        MoELayer(SMALL.replace(num_shared_experts=0), w)
    with pytest.raises(ValueError, match="expert_padding: got 0"):
        MoELayer(SMALL, w, expert_padding=0)
