"""TorchTitan's MoE with MoeA2ATokenDispatcher compiled as TorchTitan's apply_compile does it
(the block, fullgraph=True, capture_scalar_outputs=True), against the same module eager:
the output, the input's gradient and every parameter's gradient; no graph break in the block;
bad input gives eager's named error. Tiny shapes and few cases: compiling is slow on 2 cores."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from ranks import DEVICE, PROVIDER, RANK, WORLD, device_pytestmark

pytestmark = device_pytestmark
pytest.importorskip("torchtitan.models.common.moe", reason="TorchTitan 0.3.0 is not installed")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from test_torchtitan import ep_mesh, ours, step  # noqa: E402, F401  (ep_mesh: the fixture)

# Inductor fuses the router's and experts' arithmetic differently from eager; the
# exchanges themselves are the same operators' results bit for bit.
TOL = 1e-6
# The loss is a sum over every element, which Inductor's GPU reduction adds in another order:
# 1.7e-6 of the scale on the H200 (some seeds), against TOL's 1e-6.
LOSS_TOL = 1e-5


def assert_close_but_bf16_flips(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Within TOL of the scale (the largest magnitude), except where the fp32 difference
    Inductor makes flips a bf16 rounding (eager's bf16 casts are emulated): a flip moves one
    value by one bf16 ulp, which sums and products downstream carry into a few elements; those
    may differ by up to 4 bf16 ulps of the scale (2^-6 of it), and must be few: at most 1 in 10
    of the elements, or all within 1 in 10 of the rows (last dimension; one row always may):
    one flip in a token's bf16 row reaches every element of that token's gradient, which on a
    rank of 3 tokens is a third of x.grad."""
    import titan_case as tc

    g, w = got.detach().float().cpu(), want.detach().float().cpu()
    diff = (g - w).abs()
    off = diff > TOL * tc.scale(want)
    if not bool(off.any()):
        return
    assert float(diff.max()) <= 2.0**-6 * tc.scale(want), f"{what}: max err {float(diff.max())}"
    rows_off = off.reshape(-1, off.shape[-1]).any(dim=1)
    few = int(off.sum()) <= max(1, off.numel() // 10) or int(rows_off.sum()) <= max(1, rows_off.numel() // 10)
    assert few, (
        f"{what}: {int(off.sum())} of {off.numel()} elements differ, in {int(rows_off.sum())} of "
        f"{rows_off.numel()} rows"
    )


@pytest.fixture(autouse=True)
def _compile_settings() -> Iterator[None]:
    """apply_compile's setting, and bf16 rounded where eager rounds it; both undone after
    (the other tests of this process run eager), with the compiled code dropped."""
    with (
        torch._dynamo.config.patch(capture_scalar_outputs=True),
        torch._inductor.config.patch(emulate_precision_casts=True),
    ):
        yield
    torch._dynamo.reset()


def _skip_unless_run_here() -> None:
    if WORLD not in (1, 2, 4) or (DEVICE == "cpu" and PROVIDER != "tcp"):
        pytest.skip("compile cases run at 1, 2 and 4 ranks, on the CPU over tcp only (compiling is slow)")


def _compiled(mesh: object, seed: int, rows: str) -> torch.nn.Module:
    moe = ours("softmax", seed, mesh, compiled_rows=rows)
    moe.routed_experts.token_dispatcher.init_buffer()
    moe.compile(fullgraph=True)
    return moe


@pytest.mark.parametrize("rows", ["exact", "capacity"])
def test_compiled_block_matches_eager(ep_mesh: object, seed: int, rows: str) -> None:  # noqa: F811
    """compiled_rows="capacity": TorchTitan's experts take the zero rows past the received
    ones (its own dispatchers pad too) and the results are the same."""
    _skip_unless_run_here()
    import titan_case as tc

    eager, comp = ours("softmax", seed, ep_mesh), _compiled(ep_mesh, seed, rows)
    xs, gs = tc.batch(seed, WORLD)
    x, g = xs[RANK], gs[RANK]
    for _ in range(2):  # the second step reuses the compiled graphs
        for m in (eager, comp):
            m.zero_grad()
        loss_e, xe = step(eager, x, g)
        loss_c, xc = step(comp, x, g)
        assert tc.max_err(loss_c, loss_e) <= LOSS_TOL * tc.scale(loss_e)
        assert xe.grad is not None and xc.grad is not None
        assert_close_but_bf16_flips(xc.grad, xe.grad, "x.grad")
        pe = dict(eager.named_parameters())
        for name, p in comp.named_parameters():
            name = name.replace("_orig_mod.", "")
            want = pe[name].grad
            assert (p.grad is None) == (want is None), name
            if want is not None:
                assert_close_but_bf16_flips(p.grad, want, f"{name}.grad")


def test_no_graph_break_and_bad_input_named(ep_mesh: object, seed: int) -> None:  # noqa: F811
    _skip_unless_run_here()
    moe = ours("softmax", seed, ep_mesh)
    moe.routed_experts.token_dispatcher.init_buffer()
    x = torch.randn(1, 3, tc_dim(), device=DEVICE)
    with torch.no_grad():  # explain runs the block: no backward follows
        explain = torch._dynamo.explain(moe)(x)
    assert explain.graph_break_count == 0, explain.break_reasons
    assert explain.graph_count == 1
    # fp16 is neither of the dtypes dispatch takes: eager's error, named, at trace time
    bad = torch.compile(moe, fullgraph=True)
    with pytest.raises(Exception, match="dispatch: x: got"):
        bad(x.half())


def tc_dim() -> int:
    import titan_case as tc

    return tc.DIM


def test_expert_parallel_compiled_matches_eager(seed: int) -> None:
    """docs/training.md's ExpertParallel example (dispatch, experts, weighted combine,
    backward) compiled fullgraph: the output and the gradients of x, topk_weights and the
    expert weights are eager's within TOL (fp32; Inductor's tanh and its backward round
    differently in the last bit, the exchanges are the same)."""
    _skip_unless_run_here()
    from moe_a2a import compiled_ops
    from moe_a2a.all_to_all import Config
    from moe_a2a.autograd import ExpertParallel

    hidden, experts, topk, tokens = 16, 4 * WORLD, 2, 6
    cfg = Config(max_tokens=8, hidden=hidden, num_experts=experts, topk=topk, combine_dtype="fp32")
    g = torch.Generator().manual_seed(seed + RANK)
    x0 = torch.randn(tokens, hidden, generator=g)
    ids = torch.stack([torch.randperm(experts, generator=g)[:topk] for _ in range(tokens)])
    w0 = torch.rand(tokens, topk, generator=g)
    grad = torch.randn(tokens, hidden, generator=g)
    weight0 = torch.randn(hidden, hidden, generator=g) * 0.1
    with ExpertParallel(cfg, device=DEVICE, provider=PROVIDER, grad_dtype="fp32") as ep:

        def layer(x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
            routed = ep.dispatch(x, ids, w)
            y = torch.tanh(routed.expert_x @ weight)
            return ep.combine(y, routed)

        results = []
        for fn in (layer, torch.compile(layer, fullgraph=True)):
            x, w, weight = (t.clone().to(DEVICE).requires_grad_() for t in (x0, w0, weight0))
            out = fn(x, ids.to(DEVICE), w, weight)
            out.backward(grad.to(DEVICE))
            results.append((out.detach(), x.grad, w.grad, weight.grad))
        # compiled_rows="capacity": the experts see max_output_rows rows, zero past the
        # received ones; the results are the same
        with ExpertParallel(
            cfg, device=DEVICE, provider=PROVIDER, grad_dtype="fp32", compiled_rows="capacity"
        ) as cap:

            def cap_layer(
                x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, weight: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
                routed = cap.dispatch(x, ids, w)
                y = torch.tanh(routed.expert_x @ weight)
                return cap.combine(y, routed), routed.expert_x, routed.tokens_per_expert

            x, w, weight = (t.clone().to(DEVICE).requires_grad_() for t in (x0, w0, weight0))
            out, rows, counts = torch.compile(cap_layer, fullgraph=True)(x, ids.to(DEVICE), w, weight)
            out.backward(grad.to(DEVICE))
            results.append((out.detach(), x.grad, w.grad, weight.grad))
            assert rows.shape[0] == cap.forward_a2a.max_output_rows
            assert not bool(rows[int(counts.sum()) :].any()), "the rows past the received ones are zero"
            assert cap.live_routings == 0
        names = ("out", "x.grad", "w.grad", "weight.grad")
        for compiled in results[1:]:
            for name, got, want in zip(names, compiled, results[0], strict=True):
                assert got is not None and want is not None, name
                err = float((got - want).abs().max())
                assert err <= TOL * max(1.0, float(want.abs().max())), f"{name}: max abs error {err:.3g}"
        assert ep.live_routings == 0  # the compiled backward released its routing
        # Only the expert weight trains (no dispatch backward): the combine's backward is the
        # routing's last use, and releases it.
        grads = []
        for fn in (layer, torch.compile(layer, fullgraph=True)):
            weight = weight0.clone().to(DEVICE).requires_grad_()
            fn(x0.to(DEVICE), ids.to(DEVICE), w0.to(DEVICE), weight).backward(grad.to(DEVICE))
            grads.append(weight.grad)
        assert grads[0] is not None and grads[1] is not None
        assert float((grads[1] - grads[0]).abs().max()) <= TOL * max(1.0, float(grads[0].abs().max()))
        # (the channel keeps the backward's dispatch open until the next one closes it, as in eager)
        assert not [k for k in compiled_ops._routings if k[0] == ep.id]
        compiled = torch.compile(layer, fullgraph=True)
        with pytest.raises(Exception, match="dispatch: x: got"):  # at trace time
            compiled(x0.half().to(DEVICE), ids.to(DEVICE), w0.to(DEVICE), weight0.to(DEVICE))
        bad = ids.clone()
        bad[0, 0] = experts  # every rank alike: the ranks agree on the error
        # (the CPU checks before sending; the CUDA kernels drop the copies and the receive half raises)
        with pytest.raises(ValueError, match="topk_ids: found expert id|topk_ids held an expert id outside"):
            compiled(x0.to(DEVICE), bad.to(DEVICE), w0.to(DEVICE), weight0.to(DEVICE))


def test_one_compiled_function_serves_many_instances(seed: int) -> None:
    """A function compiled once (fullgraph) and called with each of many ExpertParallel
    instances, as layers that hold their own instance share their code: one graph serves
    every instance of a shape (twelve here, past Dynamo's recompile limit of 8, which
    fullgraph turns into an error), other shapes compile their own, and each instance's
    results and gradients are eager's. One rank: all of it happens inside one process."""
    _skip_unless_run_here()
    if WORLD != 1:
        pytest.skip("one rank: what it checks happens inside one process")
    from moe_a2a.all_to_all import Config
    from moe_a2a.autograd import ExpertParallel

    def layer(ep: ExpertParallel, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        routed = ep.dispatch(x, ids, w)
        return ep.combine(torch.tanh(routed.expert_x), routed)

    compiled = torch.compile(layer, fullgraph=True)
    g = torch.Generator().manual_seed(seed)
    shapes = [(16, 4, "exact")] * 12 + [(24, 6, "exact"), (8, 4, "capacity")]
    for n, (hidden, experts, rows) in enumerate(shapes):
        cfg = Config(max_tokens=8, hidden=hidden, num_experts=experts, topk=2, combine_dtype="fp32")
        x0 = torch.randn(5, hidden, generator=g)
        ids = torch.stack([torch.randperm(experts, generator=g)[:2] for _ in range(5)]).to(DEVICE)
        w0 = torch.rand(5, 2, generator=g)
        with ExpertParallel(
            cfg, device=DEVICE, provider=PROVIDER, grad_dtype="fp32", compiled_rows=rows
        ) as ep:
            results = []
            for fn in (layer, compiled):
                x, w = (t.clone().to(DEVICE).requires_grad_() for t in (x0, w0))
                out = fn(ep, x, ids, w)
                out.backward(torch.ones_like(out))
                results.append((out.detach(), x.grad, w.grad))
            for name, got, want in zip(("out", "x.grad", "w.grad"), results[1], results[0], strict=True):
                assert got is not None and want is not None, name
                err = float((got - want).abs().max())
                assert err <= TOL * max(1.0, float(want.abs().max())), f"instance {n}: {name}: {err:.3g}"
            assert ep.live_routings == 0
