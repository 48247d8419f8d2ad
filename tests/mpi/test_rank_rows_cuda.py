"""Rows per destination rank and node (issue 30) on the GPU across MPI ranks, against the reference.

Every mode, `fabric_rows="rank"` (a token crosses to a rank of another node once, its
combine summed there), `"node"` (once to each other node, forwarded inside it, its combine
summed per node) and `"expert"` (a row per copy), on every node layout: dispatched
rows, fp8 scales, counts and row weights bit for bit, combine within one unit in the last
place of its mode's reference (docs/cuda.md: the same fp32 operations in the same order).
Whole calls and halves, decode and prefill shapes, cached routing and a captured graph.
The CPU backend runs these cases in one process (tests/protocol/test_fabric_rows.py).
"""

from __future__ import annotations

import pytest
import torch
from ranks import DEVICE, PROVIDER, RANK, WORLD, device_pytestmark, layouts

from inputs import Inputs, draw_inputs, expert_fn
from moe_a2a.all_to_all import AllToAll, Config
from moe_a2a.reference import combine_reference, dispatch_reference

pytestmark = [
    device_pytestmark,
    pytest.mark.skipif(DEVICE != "cuda", reason="CPU: tests/protocol/test_fabric_rows.py runs these cases"),
]
MODES = ["rank", "node", "expert"]
EXPERTS_PER_RANK = 4  # top-8 of 4 a rank: most tokens pick several experts of one rank
ULP = {"bf16": 2.0**-7, "fp32": 2.0**-22}
# (max tokens, hidden, topk): decode routes and packs in one kernel; prefill (more than 1024
# copies, whole fp8 blocks) routes in two and packs through the bulk copy engine.
SHAPES = {"decode": (32, 512, 8), "prefill": (256, 256, 8)}


def make(
    rpn: int | None, mode: str, shape: str = "decode", graph_safe: bool = False, **kw: object
) -> AllToAll:
    tokens, hidden, topk = SHAPES[shape]
    cfg = Config(
        max_tokens=tokens,
        hidden=hidden,
        num_experts=EXPERTS_PER_RANK * WORLD,
        topk=min(topk, EXPERTS_PER_RANK * WORLD),
        fabric_rows=mode,
        timeout_s=120.0,
        **kw,  # type: ignore[arg-type]
    )
    return AllToAll(cfg, device=DEVICE, provider=PROVIDER, ranks_per_node=rpn, graph_safe=graph_safe)


def with_repeats(g: torch.Generator, tokens: int, experts: int, topk: int) -> torch.Tensor:
    """Experts with repeats: a token may pick one expert twice (two entries of one row)."""
    return torch.randint(0, experts, (tokens, topk), generator=g)


def inputs(seed: int, cfg: Config, none_on_one: bool = True) -> Inputs:
    """Uneven tokens, one rank with none (when there are several and `none_on_one`)."""
    tokens = [
        0 if none_on_one and WORLD > 1 and r == 1 else cfg.max_tokens - (r * 5) % 7 for r in range(WORLD)
    ]
    return draw_inputs(seed, cfg, WORLD, tokens, with_repeats)


def expected(a2a: AllToAll, rpn: int | None, inp: Inputs, weighted: bool = True) -> tuple[list, torch.Tensor]:
    """(every rank's reference dispatch, our combine's reference) in a2a's mode and layout."""
    cfg = a2a.cfg
    ref = dispatch_reference(inp.xs, inp.ids, cfg.num_experts, cfg.dispatch_dtype, cfg.expert_padding)
    ys = [expert_fn(r.expert_x, r.expert_x_scale) for r in ref]
    ws = inp.weights if weighted else [torch.ones_like(w) for w in inp.weights]
    nodes_of = rpn if rpn is not None else WORLD
    return ref, combine_reference(ys, ref, ws, cfg.combine_dtype, cfg.fabric_rows, nodes_of)[RANK]


def check_dispatch(d: object, ref: list) -> None:
    ours = ref[RANK]
    assert torch.equal(d.tokens_per_expert.cpu(), ours.tokens_per_expert)  # type: ignore[attr-defined]
    valid = ours.origin[:, 0] >= 0
    got = d.expert_x.cpu()[valid].view(torch.uint8)  # type: ignore[attr-defined]
    assert torch.equal(got, ours.expert_x[valid].view(torch.uint8)), "dispatched rows differ"
    if ours.expert_x_scale is not None:
        assert torch.equal(d.expert_x_scale.cpu()[valid], ours.expert_x_scale[valid])  # type: ignore[attr-defined]


def check_combine(out: torch.Tensor, want: torch.Tensor, dtype: str) -> None:
    assert not torch.isnan(out).any(), "combine left rows unwritten"
    torch.testing.assert_close(out.cpu().float(), want.float(), rtol=ULP[dtype], atol=1e-6)


def mine(inp: Inputs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return inp.xs[RANK].to(DEVICE), inp.ids[RANK].to(DEVICE), inp.weights[RANK].to(DEVICE)


@pytest.mark.parametrize("rpn", layouts())
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("split", [False, True], ids=["whole", "halves"])
def test_modes_match_the_reference(rpn: int | None, mode: str, dtype: str, shape: str, split: bool) -> None:
    with make(rpn, mode, shape, dispatch_dtype=dtype) as a2a:
        for it in range(2):  # the second call reuses every buffer
            inp = inputs(10 * it + len(shape), a2a.cfg)
            x, ids, w = mine(inp)
            ref, want = expected(a2a, rpn, inp)
            if split:
                pending = a2a.dispatch(x.clone(), ids, w, recv=False)
                d = a2a.dispatch(handle=pending, send=False)
            else:
                d = a2a.dispatch(x, ids, w)
            check_dispatch(d, ref)
            y = expert_fn(d.expert_x, d.expert_x_scale)
            if split:
                out = a2a.combine(y, d, recv=False)
                out = a2a.combine(handle=out, send=False)
            else:
                out = a2a.combine(y, d)
            check_combine(out, want, a2a.cfg.combine_dtype)


@pytest.mark.parametrize("rpn", layouts())
@pytest.mark.parametrize("mode", MODES)
def test_unweighted_and_fp32_combine(rpn: int | None, mode: str) -> None:
    with make(rpn, mode, combine_dtype="fp32") as a2a:
        inp = inputs(7, a2a.cfg)
        x, ids, w = mine(inp)
        ref, want = expected(a2a, rpn, inp, weighted=False)
        d = a2a.dispatch(x, ids, w)
        check_dispatch(d, ref)
        check_combine(a2a.combine(expert_fn(d.expert_x, d.expert_x_scale), d, weighted=False), want, "fp32")


@pytest.mark.parametrize("rpn", layouts())
@pytest.mark.parametrize("mode", MODES)
def test_cached_routing(rpn: int | None, mode: str) -> None:
    """A dispatch along a kept routing (as the backward runs) sends new rows the same way."""
    with make(rpn, mode) as a2a:
        inp = inputs(21, a2a.cfg)
        x, ids, w = mine(inp)
        d = a2a.dispatch(x, ids, w, keep_routing=True)
        a2a.combine(expert_fn(d.expert_x, d.expert_x_scale), d)
        kept = d.routing
        again = inputs(22, a2a.cfg)  # new rows, the same routing
        new = Inputs(again.xs, inp.ids, inp.weights)
        ref, want = expected(a2a, rpn, new)
        d2 = a2a.dispatch(new.xs[RANK].to(DEVICE), routing=kept)
        check_dispatch(d2, ref)
        check_combine(a2a.combine(expert_fn(d2.expert_x, d2.expert_x_scale), d2), want, a2a.cfg.combine_dtype)


def replay_checked(
    a2a: AllToAll,
    rpn: int | None,
    graph: torch.cuda.CUDAGraph,
    out: torch.Tensor,
    inputs_in: tuple[torch.Tensor, ...],
    inp: Inputs,
) -> None:
    """New inputs into the captured step's tensors, one replay, its combine against the reference."""
    for dst, src in zip(inputs_in, mine(inp), strict=True):
        dst.copy_(src)
    graph.replay()
    torch.cuda.synchronize()
    a2a.check()
    check_combine(out, expected(a2a, rpn, inp)[1], a2a.cfg.combine_dtype)


@pytest.mark.parametrize("rpn", layouts())
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_graph_capture_replays(rpn: int | None, mode: str, dtype: str) -> None:
    """A whole step captured once and replayed with new inputs: wire rows, entries and
    reduced rows all computed on the GPU (shapes fixed: every rank has tokens)."""
    with make(rpn, mode, dispatch_dtype=dtype, graph_safe=True) as a2a:
        held = mine(inputs(300, a2a.cfg, none_on_one=False))

        def step() -> torch.Tensor:
            d = a2a.dispatch(*held)
            return a2a.combine(expert_fn(d.expert_x, d.expert_x_scale), d)

        step()  # eager warm-up (maps peers, sets kernel attributes), then the capture
        torch.cuda.synchronize()
        a2a.check()  # a kernel that timed out in the warm-up fails here, not silently
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = step()
        for it in range(3):
            replay_checked(a2a, rpn, graph, out, held, inputs(400 + it, a2a.cfg, none_on_one=False))
