"""Differentiable dispatch/combine (moe_a2a.autograd) against single-process torch autograd.

Every rank draws every rank's inputs and every expert's weights from one seed and
computes the whole computation in one process with plain torch autograd; its own
share of the output and of every gradient must match. fp32 runs match to
rounding; bf16 and an fp8 forward within the tolerances below (the reference
applies the same fp8 quantisation, with the straight-through gradient).
"""

from __future__ import annotations

import copy
import gc
import pickle
import weakref
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch
from ranks import COMM, DEVICE, PROVIDER, RANK, WORLD, device_pytestmark, layouts
from torch.utils.checkpoint import checkpoint

from moe_a2a.all_to_all import Config
from moe_a2a.autograd import ExpertParallel
from moe_a2a.reference import dequantize_fp8, quantize_fp8

pytestmark = device_pytestmark
HIDDEN = 48
EXPERTS = 24  # every world size of the CI matrix (1, 2, 3, 4, 8) divides it
TOPK = 3
MAX_TOKENS = 12
TIMEOUT_S = 120.0
# (forward dispatch dtype, gradient dtype, expert padding) and the tolerance it allows.
CASES = {"fp32": ("fp32", "fp32", 1), "bf16-pad4": ("bf16", "bf16", 4), "fp8": ("fp8", "bf16", 1)}
TOL = {"fp32": 1e-5, "bf16-pad4": 3e-2, "fp8": 5e-2}


@pytest.fixture(scope="module", params=list(CASES))
def case(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module", params=layouts())
def ep(request: pytest.FixtureRequest, case: str) -> Iterator[ExpertParallel]:
    dispatch, grad, pad = CASES[case]
    cfg = Config(
        max_tokens=MAX_TOKENS,
        hidden=HIDDEN,
        num_experts=EXPERTS,
        topk=TOPK,
        dispatch_dtype=dispatch,
        combine_dtype="fp32" if grad == "fp32" else "bf16",
        expert_padding=pad,
        timeout_s=TIMEOUT_S,
    )
    e = ExpertParallel(cfg, device=DEVICE, provider=PROVIDER, ranks_per_node=request.param, grad_dtype=grad)
    yield e
    e.close()


@dataclass
class Problem:
    xs: list[torch.Tensor]
    ids: list[torch.Tensor]
    weights: list[torch.Tensor]
    w: torch.Tensor  # [EXPERTS, HIDDEN, HIDDEN] expert weights
    grad_out: list[torch.Tensor]


def problem(
    seed: int, tokens: list[int] | None = None, dtype: torch.dtype = torch.float32, repeat: bool = False
) -> Problem:
    """`repeat`: every other token picks its first expert twice."""
    g = torch.Generator().manual_seed(seed)
    if tokens is None:  # uneven, and one rank (of several) with none at all
        tokens = [int(torch.randint(1, MAX_TOKENS + 1, (1,), generator=g)) for _ in range(WORLD)]
        if WORLD > 1:
            tokens[1] = 0
    xs = [torch.randn(t, HIDDEN, generator=g).to(dtype) for t in tokens]
    ids = [
        torch.stack([torch.randperm(EXPERTS, generator=g)[:TOPK] for _ in range(t)])
        if t
        else torch.zeros(0, TOPK, dtype=torch.int64)
        for t in tokens
    ]
    if repeat:
        for i in ids:
            i[::2, 1] = i[::2, 0]
    weights = [torch.rand(t, TOPK, generator=g) for t in tokens]
    w = torch.randn(EXPERTS, HIDDEN, HIDDEN, generator=g) / HIDDEN**0.5
    grad_out = [torch.randn(t, HIDDEN, generator=g) for t in tokens]
    return Problem(xs, ids, weights, w, grad_out)


def local_slice() -> slice:
    per = EXPERTS // WORLD
    return slice(RANK * per, (RANK + 1) * per)


def experts(rows: torch.Tensor, counts: torch.Tensor, w: torch.Tensor, pad: int) -> torch.Tensor:
    """Each local expert's tanh(x @ W_e) over its (padded) segment of rows."""
    out, start = [], 0
    for i, n in enumerate(counts.tolist()):
        n = (n + pad - 1) // pad * pad
        out.append(torch.tanh(rows[start : start + n].float() @ w[i]))
        start += n
    return torch.cat(out).to(rows.dtype) if out else rows[:0]


def quantised(x: torch.Tensor, dispatch: str) -> torch.Tensor:
    """What the experts see of x, with the straight-through gradient."""
    if dispatch == "fp8":
        q, s = quantize_fp8(x.detach().float())
        return x + (dequantize_fp8(q, s).to(x.dtype) - x).detach()
    if dispatch == "bf16":
        return x + (x.detach().to(torch.bfloat16).to(x.dtype) - x).detach()
    return x


def reference_layer(xs, ids, weights, w, dispatch: str, combine: str) -> list[torch.Tensor]:
    """The MoE layer over every rank's tokens in one process; outputs rounded as combine's are."""
    outs = []
    for x, i, wt in zip(xs, ids, weights, strict=True):
        xq = quantised(x, dispatch)
        acc = torch.zeros(x.shape[0], HIDDEN)
        for k in range(TOPK):
            yk = torch.tanh(torch.einsum("th,thj->tj", xq.float(), w[i[:, k]]))
            acc = acc + wt[:, k : k + 1] * yk
        outs.append(quantised(acc, combine))
    return outs


def moe_a2a_layer(ep: ExpertParallel, x, ids, weights, w_local, weighted: bool) -> torch.Tensor:
    routed = ep.dispatch(x, ids, weights)
    y = experts(routed.expert_x, routed.tokens_per_expert, w_local, ep.cfg.expert_padding)
    if weighted:
        return ep.combine(y, routed)
    assert routed.row_weights is not None
    return ep.combine(y * routed.row_weights[:, None].to(y.dtype), routed, weighted=False)


def leaf(t: torch.Tensor) -> torch.Tensor:
    return t.clone().to(DEVICE).requires_grad_()


def assert_close(name: str, got: torch.Tensor | None, want: torch.Tensor | None, tol: float) -> None:
    if want is None or not bool(want.abs().gt(0).any()):
        return
    assert got is not None, f"{name}: no gradient, but the reference has one"
    got = got.detach().float().cpu()
    err = (got - want.float()).abs().max().item()
    scale = max(1.0, want.abs().max().item())
    assert err <= tol * scale, f"{name}: max abs error {err:.3g} > {tol * scale:.3g} (rank {RANK})"


def run_both(
    ep: ExpertParallel,
    case: str,
    seed: int,
    weighted: bool,
    layers: int = 1,
    ckpt: bool = False,
    repeat: bool = False,
):
    dispatch = CASES[case][0]
    pb = problem(seed, repeat=repeat)
    sl = local_slice()
    # ours: `layers` layers with one set of weights, all forwards first, then one backward
    x = leaf(pb.xs[RANK])
    wt = leaf(pb.weights[RANK])
    w_local = leaf(pb.w[sl])
    h = x
    ours = []  # every layer's output, as every rank computed it
    for _ in range(layers):
        args = (ep, h, pb.ids[RANK].to(DEVICE), wt, w_local, weighted)
        h = checkpoint(moe_a2a_layer, *args, use_reentrant=False) if ckpt else moe_a2a_layer(*args)
        ours.append(COMM.allgather(h.detach().cpu()))
    (h.float() * pb.grad_out[RANK].to(DEVICE)).sum().backward()
    # reference
    xr = [t.clone().requires_grad_() for t in pb.xs]
    wr = [t.clone().requires_grad_() for t in pb.weights]
    w_all = pb.w.clone().requires_grad_()
    hs = xr
    tol = TOL[case] * layers
    for layer in range(layers):
        hs = reference_layer(hs, pb.ids, wr, w_all, dispatch, ep.cfg.combine_dtype)
        assert_close(f"layer {layer}'s output", ours[layer][RANK], hs[RANK], TOL[case])
        # The next layer starts from our values (gradients pass straight through): the fp8 or bf16
        # rounding of a sum taken in another order would flip a quantisation step, and that
        # difference, not an error, would grow through the layers past any tolerance.
        hs = [r + (o.to(r.dtype) - r).detach() for r, o in zip(hs, ours[layer], strict=True)]
    sum((o * g).sum() for o, g in zip(hs, pb.grad_out, strict=True)).backward()
    assert_close("x.grad", x.grad, xr[RANK].grad, tol)
    assert_close("topk_weights.grad", wt.grad, wr[RANK].grad, tol)
    assert_close("expert weights' grad", w_local.grad, w_all.grad[sl], tol)


@pytest.mark.parametrize("weighted", [True, False], ids=["weighted", "unweighted"])
def test_gradients_match_reference(ep: ExpertParallel, case: str, seed: int, weighted: bool) -> None:
    run_both(ep, case, seed, weighted)
    assert ep.live_routings == 0, "every routing is released once its backward ran"


def test_layers_in_flight_between_forward_and_backward(ep: ExpertParallel, case: str, seed: int) -> None:
    """Three layers run forward on one instance before any backward: each keeps its own routing."""
    run_both(ep, case, seed + 1, weighted=True, layers=3)


def test_activation_recomputation(ep: ExpertParallel, case: str, seed: int) -> None:
    """Under torch.utils.checkpoint every layer's dispatch and combine run again in the backward."""
    run_both(ep, case, seed + 2, weighted=True, layers=2, ckpt=True)


def test_cached_routing_dispatches_new_rows(ep: ExpertParallel, case: str, seed: int) -> None:
    pb = problem(seed + 3)
    ids = pb.ids[RANK].to(DEVICE)
    first = ep.dispatch(pb.xs[RANK].to(DEVICE), ids, pb.weights[RANK].to(DEVICE))
    ep.combine(torch.zeros_like(first.expert_x), first)
    x2 = pb.grad_out[RANK].to(DEVICE)
    again = ep.dispatch(x2, routing=first.routing)
    fresh = ep.dispatch  # the same rows as a fresh dispatch of x2 along the same routing
    ep.combine(torch.zeros_like(again.expert_x), again)
    want = fresh(x2, ids, pb.weights[RANK].to(DEVICE))
    ep.combine(torch.zeros_like(want.expert_x), want)
    real = again.routing.real_rows
    got_rows, want_rows = again.expert_x, want.expert_x
    if real is not None:
        got_rows, want_rows = got_rows[real], want_rows[real]
    assert torch.equal(got_rows, want_rows)
    assert torch.equal(again.tokens_per_expert.cpu(), want.tokens_per_expert.cpu())


def test_padding_rows_are_zero(ep: ExpertParallel, case: str, seed: int) -> None:
    pb = problem(seed + 4)
    with torch.no_grad():
        r = ep.dispatch(pb.xs[RANK].to(DEVICE), pb.ids[RANK].to(DEVICE), pb.weights[RANK].to(DEVICE))
        ep.combine(torch.zeros_like(r.expert_x), r)
    if r.routing.real_rows is not None:
        assert not bool(r.expert_x[~r.routing.real_rows].any()), "padding rows must hold zeros"


def test_live_routings_are_bounded(case: str, seed: int) -> None:
    if case != "fp32":
        pytest.skip("one dtype is enough for the bound")
    dispatch, grad, pad = CASES[case]
    cfg = Config(
        max_tokens=MAX_TOKENS,
        hidden=HIDDEN,
        num_experts=EXPERTS,
        topk=TOPK,
        dispatch_dtype="fp32",
        combine_dtype="fp32",
        timeout_s=TIMEOUT_S,
    )
    with ExpertParallel(cfg, device=DEVICE, provider=PROVIDER, grad_dtype=grad, max_live_routings=2) as small:
        pb = problem(seed + 5)
        args = (pb.xs[RANK].to(DEVICE), pb.ids[RANK].to(DEVICE), pb.weights[RANK].to(DEVICE))
        kept = []
        for _ in range(2):
            r = small.dispatch(*args)
            small.combine(torch.zeros_like(r.expert_x), r)
            kept.append(r)
        with pytest.raises(RuntimeError, match="max_live_routings=2"):
            small.dispatch(*args)
        kept[0].routing.release()
        r = small.dispatch(*args)  # a released slot is usable again, and the instance still pairs
        small.combine(torch.zeros_like(r.expert_x), r)


def test_foreign_routing_is_refused(ep: ExpertParallel, case: str, seed: int) -> None:
    if case != "fp32":
        pytest.skip("one dtype is enough")
    cfg = ep.cfg
    with ExpertParallel(cfg, device=DEVICE, provider=PROVIDER, grad_dtype="fp32") as other:
        pb = problem(seed + 6)
        args = (pb.xs[RANK].to(DEVICE), pb.ids[RANK].to(DEVICE), pb.weights[RANK].to(DEVICE))
        mine = ep.dispatch(*args)
        theirs = other.dispatch(*args)
        with pytest.raises(RuntimeError, match="belongs to ExpertParallel"):
            ep.combine(torch.zeros_like(theirs.expert_x), theirs)
        ep.combine(torch.zeros_like(mine.expert_x), mine)
        other.combine(torch.zeros_like(theirs.expert_x), theirs)


def test_bad_input_names_the_argument(ep: ExpertParallel) -> None:
    x = torch.zeros(2, HIDDEN, device=DEVICE)
    ids = torch.tensor([[0, 4, 1], [1, 2, 3]], device=DEVICE)
    w = torch.ones(2, TOPK, device=DEVICE)
    with pytest.raises(ValueError, match="x: got a torch.int64"):
        ep.dispatch(x.long(), ids, w)


@pytest.mark.parametrize("weighted", [True, False], ids=["weighted", "unweighted"])
def test_a_token_may_pick_an_expert_twice(ep: ExpertParallel, case: str, seed: int, weighted: bool) -> None:
    """Each copy carries its own weight and returns its own gradient, so two copies of a token
    at one expert are two rows with their own weights, as in the reference."""
    run_both(ep, case, seed + 10, weighted, repeat=True)


def test_inference_mode_forward_equals_no_grad(ep: ExpertParallel, case: str, seed: int) -> None:
    """The forward under torch.inference_mode() (evaluation, serving), whose tensors have no
    version counter, gives no_grad's output bit for bit, along a cached routing too; it used to
    fail inside the dispatch and stop the instance."""
    p = problem(seed)
    x, ids, wt = (t[RANK].to(DEVICE) for t in (p.xs, p.ids, p.weights))
    w_local = p.w[local_slice()].to(DEVICE)
    outs = []
    for mode in (torch.no_grad, torch.inference_mode):
        with mode():
            routed = ep.dispatch(x.clone(), ids.clone(), wt.clone())
            y = experts(routed.expert_x, routed.tokens_per_expert, w_local, ep.cfg.expert_padding)
            outs.append(ep.combine(y, routed).cpu())
            again = ep.dispatch(x.clone(), routing=routed.routing)
            assert torch.equal(again.expert_x, routed.expert_x), "along the routing"
            outs.append(ep.combine(y, again).cpu())
            del routed, again  # the routings go
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[2], outs[3]), f"outputs differ (rank {RANK})"
    assert torch.equal(outs[0], outs[2]), f"inference mode changed the output (rank {RANK})"
    assert ep.live_routings == 0


def test_a_deep_copy_shares_the_instance_and_pickling_is_refused(ep: ExpertParallel) -> None:
    """copy.deepcopy of a model that holds an ExpertParallel (an EMA or reference model)
    shares the instance, as a copied DeviceMesh shares its process groups: it could not be
    built again without every rank. Pickling one is refused, naming the class."""
    layer = torch.nn.Linear(2, 2)
    layer.ep = ep  # type: ignore[assignment]
    twin = copy.deepcopy(layer)
    assert twin.ep is ep and twin.weight is not layer.weight
    assert copy.copy(ep) is ep and copy.deepcopy(ep.forward_a2a) is ep.forward_a2a
    for obj, name in ((ep, "ExpertParallel"), (ep.forward_a2a, "AllToAll")):
        with pytest.raises(TypeError, match=f"^{name} cannot be pickled"):
            pickle.dumps(obj)


def test_a_double_backward_raises_instead_of_dropping_terms(ep: ExpertParallel, case: str, seed: int) -> None:
    """A gradient penalty (create_graph=True, then a backward through the gradient) over a
    layer with a residual path: the exchange has no second derivative, so the second backward
    raises on every rank. It used to run, with the MoE's second-order terms silently missing
    (the experts' weights got no gradient at all)."""
    p = problem(seed)
    x = leaf(p.xs[RANK])
    w_local = p.w[local_slice()].to(DEVICE).requires_grad_()
    out = moe_a2a_layer(ep, x, p.ids[RANK].to(DEVICE), p.weights[RANK].to(DEVICE), w_local, True)
    (gx,) = torch.autograd.grad((out.float() + x * x).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="differentiate twice"):
        (gx.float() ** 2).sum().backward()


def test_row_weights_changed_in_place_are_refused(ep: ExpertParallel, case: str, seed: int) -> None:
    """The weighted combine's backward scales by the routing's row weights, which routed.row_weights
    shares: a change in place is an error on every rank (each made it), before anything is sent."""
    pb = problem(seed + 11)
    x, wt = leaf(pb.xs[RANK]), leaf(pb.weights[RANK])
    routed = ep.dispatch(x, pb.ids[RANK].to(DEVICE), wt)
    out = ep.combine(routed.expert_x * 1.0, routed)
    assert routed.row_weights is not None
    with torch.no_grad():
        routed.row_weights.mul_(2.0)
    with pytest.raises(RuntimeError, match="row_weights was changed in place"):
        out.float().sum().backward()
    del out, routed
    run_both(ep, case, seed + 12, weighted=True)  # the instance goes on as before


def test_split_halves_match_whole_calls(ep: ExpertParallel, case: str, seed: int) -> None:
    """dispatch/combine in halves, with other work between them, give the same values and gradients."""
    pb = problem(seed + 7)
    sl = local_slice()

    def run(split: bool) -> tuple[torch.Tensor, ...]:
        x, wt, w_local = leaf(pb.xs[RANK]), leaf(pb.weights[RANK]), leaf(pb.w[sl])
        ids = pb.ids[RANK].to(DEVICE)
        if split:
            pending = ep.dispatch(x, ids, wt, recv=False)
            shared = torch.tanh(x)  # other work while rows travel
            routed = ep.dispatch(handle=pending)
        else:
            routed, shared = ep.dispatch(x, ids, wt), torch.tanh(x)
        y = experts(routed.expert_x, routed.tokens_per_expert, w_local, ep.cfg.expert_padding)
        if split:
            pc = ep.combine(y, routed, recv=False)
            out = ep.combine(handle=pc)
        else:
            out = ep.combine(y, routed)
        ((out.float() + shared) * pb.grad_out[RANK].to(DEVICE)).sum().backward()
        return out.detach(), x.grad, wt.grad, w_local.grad

    whole, halves = run(False), run(True)
    for name, a, b in zip(
        ("out", "x.grad", "topk_weights.grad", "weights' grad"), whole, halves, strict=True
    ):
        assert torch.equal(a, b), f"{name} differs between whole and split calls"


@pytest.mark.parametrize("weighted", [True, False], ids=["weighted", "unweighted"])
def test_an_earlier_calls_bytes_never_count(ep: ExpertParallel, case: str, seed: int, weighted: bool) -> None:
    """A step whose inputs and weights are all NaN leaves NaN in the workspace's rows and tails
    and in freed buffers; the next step's values and gradients must not see any of it (padding
    rows' weights, tails no copy wrote)."""
    pb = problem(seed + 8)
    sl = local_slice()
    x = leaf(torch.full_like(pb.xs[RANK], float("nan")))
    wt = leaf(torch.full_like(pb.weights[RANK], float("nan")))
    w_local = leaf(pb.w[sl])
    out = moe_a2a_layer(ep, x, pb.ids[RANK].to(DEVICE), wt, w_local, weighted)
    (out.float() * pb.grad_out[RANK].to(DEVICE)).sum().backward()
    run_both(ep, case, seed + 8, weighted)


def test_a_step_leaves_nothing_alive(case: str, seed: int) -> None:
    """After a training step and close, the ExpertParallel, its AllToAlls and the rows are freed.

    Before, each AllToAll kept its latest Dispatched and autograd set grad_fn on that
    very rows tensor: rows -> grad_fn -> ctx -> ExpertParallel -> AllToAll -> rows, a
    cycle through C++ that gc never collects (the step's rows and graph, until exit).
    """
    if case != "fp32":
        pytest.skip("one dtype is enough")
    cfg = Config(MAX_TOKENS, HIDDEN, EXPERTS, TOPK, timeout_s=TIMEOUT_S)  # bf16 rows, fp32 input
    e = ExpertParallel(cfg, device=DEVICE, provider=PROVIDER, grad_dtype="fp32")
    pb = problem(seed + 9)
    x, wt = leaf(pb.xs[RANK]), leaf(pb.weights[RANK])
    h, rows = x, []
    for _ in range(3):  # layers
        routed = e.dispatch(h, pb.ids[RANK].to(DEVICE), wt)
        rows.append(weakref.ref(routed.expert_x))
        h = e.combine(routed.expert_x * 2.0, routed)
    h.sum().backward()
    refs = [weakref.ref(o) for o in (e, e.forward_a2a, e.backward_a2a)]
    e.close()
    del e, routed, x, wt, h
    gc.collect()
    alive = [type(r()).__name__ for r in refs + rows if r() is not None]
    assert not alive, f"still alive after the step and close: {alive}"
