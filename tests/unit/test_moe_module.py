"""MoELayer as an nn.Module: TorchTitan 0.3.0's state dict, forward and gradients, bias updates.

One process. The differentiable path runs over `ExpertParallel` at world size 1
(bootstrapped from a one-rank gloo group, no MPI); the sharded inference path
over `moe_a2a.reference`'s all-to-all of several ranks at once. The ground truth
is TorchTitan's own `MoE` module (with its `LocalTokenDispatcher`) built here.
"""

from __future__ import annotations

import argparse
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from moe_a2a import reference as a2a_reference
from moe_a2a.layers import driver, run_args
from moe_a2a.layers.moe import MoELayer
from moe_a2a.layers.presets import MoEShape
from moe_a2a.layers.reference import max_relative_error
from moe_a2a.layers.weights import random_weights
from moe_a2a.usage import UsageError

moe = pytest.importorskip("torchtitan.models.common.moe", reason="TorchTitan 0.3.0 is a test dependency")

D, F, E, K = 64, 32, 8, 2
# TorchTitan computes the routed experts in bf16 whatever its weights' dtype: a few bf16 roundings.
TOL = 3e-2


def titan_moe(score_func: str, groups: int | None, shared: bool, bias: bool, seed: int) -> Any:
    """TorchTitan's MoE with random weights (and a random expert bias)."""
    from torchtitan.models.common.feed_forward import FeedForward
    from torchtitan.models.common.linear import Linear
    from torchtitan.models.common.token_dispatcher import LocalTokenDispatcher

    def linear(i: int, o: int) -> Any:
        return Linear.Config(in_features=i, out_features=o)

    cfg = moe.MoE.Config(
        num_experts=E,
        routed_experts=moe.RoutedExperts.Config(
            inner_experts=moe.GroupedExperts.Config(dim=D, hidden_dim=F, num_experts=E),
            token_dispatcher=LocalTokenDispatcher.Config(num_experts=E, top_k=K),
        ),
        router=moe.TokenChoiceTopKRouter.Config(
            num_experts=E,
            gate=linear(D, E),
            top_k=K,
            score_func=score_func,
            route_norm=score_func == "softmax",
            route_scale=1.5,
            num_expert_groups=groups,
            num_limited_groups=None if groups is None else 2,
        ),
        load_balance_coeff=1e-3 if bias else None,
        shared_experts=FeedForward.Config(w1=linear(D, F), w2=linear(F, D), w3=linear(D, F))
        if shared
        else None,
    )
    m = cfg.build()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
        if bias:
            m.expert_bias_E.copy_(torch.randn(E, generator=g) * 0.02)
    return m


def shape_of(score_func: str, groups: int | None, shared: bool) -> MoEShape:
    return MoEShape(
        hidden=D,
        num_experts=E,
        topk=K,
        expert_hidden=F,
        num_shared_experts=int(shared),
        score_func=score_func,
        num_groups=groups or 1,
        topk_groups=2 if groups else 1,
        route_scale=1.5,
        norm_topk=score_func == "softmax",
    )


def titan_forward(m: Any, x: torch.Tensor) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # CPU autocast to fp32 is a no-op, and says so
        return m(x)


@pytest.fixture(scope="module")
def world_of_one(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A one-rank gloo group to bootstrap ExpertParallel from, without MPI."""
    import torch.distributed as dist

    store = f"file://{tmp_path_factory.mktemp('store')}/store"
    dist.init_process_group("gloo", init_method=store, rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def expert_parallel(group: Any, provider: str, dispatch: str, combine: str, grad: str, tokens: int) -> Any:
    from moe_a2a.all_to_all import Config
    from moe_a2a.autograd import ExpertParallel

    cfg = Config(
        max_tokens=tokens, hidden=D, num_experts=E, topk=K, dispatch_dtype=dispatch, combine_dtype=combine
    )
    return ExpertParallel(cfg, comm=group, provider=provider, grad_dtype=grad)


# --------------------------------------------------------------------------- state dict


def test_torchtitan_state_dict_loads_whole_and_sharded() -> None:
    m = titan_moe("softmax", None, shared=True, bias=True, seed=1)
    sd = m.state_dict()
    shape = shape_of("softmax", None, True)
    whole = MoELayer.from_state_dict(shape, sd, 0, 1)
    # The module speaks TorchTitan's keys: its state dict round-trips into TorchTitan's MoE.
    assert whole.state_dict().keys() == sd.keys()
    for key, value in whole.state_dict().items():
        torch.testing.assert_close(value, sd[key], rtol=0, atol=0)
    whole.load_state_dict(sd)
    # Sharded: rank r keeps experts [2r, 2r + 2) of 8, the router, bias and shared expert whole.
    for r in range(4):
        part = MoELayer.from_state_dict(shape, sd, r, 4, dtype=torch.bfloat16)
        assert part.local_experts == range(2 * r, 2 * r + 2)
        got = part.state_dict()
        for name in ("w1_EFD", "w2_EDF", "w3_EFD"):
            key = f"routed_experts.inner_experts.{name}"
            assert got[key].dtype == torch.bfloat16
            torch.testing.assert_close(got[key], sd[key][2 * r : 2 * r + 2].bfloat16(), rtol=0, atol=0)
        torch.testing.assert_close(got["router.gate.weight"], sd["router.gate.weight"], rtol=0, atol=0)
        torch.testing.assert_close(got["expert_bias_E"], sd["expert_bias_E"], rtol=0, atol=0)
    # This library's own keys load too, and give the same layer.
    own = MoELayer.from_state_dict(shape, whole.weights.state_dict(), 0, 1)
    for key, value in own.state_dict().items():
        torch.testing.assert_close(value, sd[key], rtol=0, atol=0)


def test_unknown_or_doubled_keys_are_named() -> None:
    sd = titan_moe("sigmoid", None, shared=False, bias=False, seed=2).state_dict()
    shape = shape_of("sigmoid", None, False)
    bad = {**sd, "routed_experts.inner_experts.w4_EFD": sd["routed_experts.inner_experts.w1_EFD"]}
    with pytest.raises(
        ValueError, match=r"unexpected keys \['layers.0.routed_experts.inner_experts.w4_EFD'\]"
    ):
        MoELayer.from_state_dict(
            shape, {f"layers.0.{k}": v for k, v in bad.items()}, 0, 1, prefix="layers.0."
        )
    both = {**sd, "experts.w1": sd["routed_experts.inner_experts.w1_EFD"]}
    with pytest.raises(ValueError, match="got both 'routed_experts.inner_experts.w1_EFD' and 'experts.w1'"):
        MoELayer.from_state_dict(shape, both, 0, 1)
    short = {**sd, "routed_experts.inner_experts.w2_EDF": sd["routed_experts.inner_experts.w2_EDF"][:, :, :5]}
    with pytest.raises(ValueError, match=r"state_dict\['routed_experts.inner_experts.w2_EDF'\]: got shape"):
        MoELayer.from_state_dict(shape, short, 0, 1)


# --------------------------------------------------------------------------- against TorchTitan


@pytest.mark.parametrize(
    ("score_func", "groups", "shared", "bias"),
    [("softmax", None, True, False), ("sigmoid", 4, False, True), ("sigmoid", None, True, True)],
    ids=["softmax-shared", "sigmoid-node-limited-bias", "sigmoid-shared-bias"],
)
def test_forward_and_gradients_match_torchtitan(
    score_func: str, groups: int | None, shared: bool, bias: bool, world_of_one: Any, provider: str
) -> None:
    """[B, L, D] in, ExpertParallel at world 1: output and every gradient as TorchTitan's MoE."""
    m = titan_moe(score_func, groups, shared, bias, seed=3)
    layer = MoELayer.from_state_dict(shape_of(score_func, groups, shared), m.state_dict(), 0, 1)
    x = torch.randn(3, 7, D, generator=torch.Generator().manual_seed(4))
    xt, xl = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    ref = titan_forward(m, xt)
    probe = torch.randn(ref.shape, generator=torch.Generator().manual_seed(5))
    (ref * probe).sum().backward()
    with expert_parallel(world_of_one, provider, "fp32", "fp32", "fp32", 21) as ep:
        out = layer(xl, ep)
        assert out.shape == x.shape and out.grad_fn is not None
        assert max_relative_error(out, ref) < TOL
        (out * probe).sum().backward()
    titan_params = dict(m.named_parameters())
    assert set(titan_params) == {n for n, _ in layer.named_parameters()}
    for name, p in layer.named_parameters():
        want = titan_params[name].grad
        assert want is not None and want.abs().max() > 0, name
        # A parameter TorchTitan trains must train here too: no None, no all-zero gradient.
        assert p.grad is not None and p.grad.abs().max() > 0, f"{name}: no gradient"
        assert max_relative_error(p.grad, want) < TOL, name
    assert max_relative_error(xl.grad, xt.grad) < TOL
    # TorchTitan counts the tokens per expert in training forwards; so does the layer.
    torch.testing.assert_close(layer.tokens_per_expert_E, m.tokens_per_expert_E)


def test_sharded_layers_match_torchtitan_over_the_reference_all_to_all() -> None:
    """Four ranks' layers from one TorchTitan state dict, inference path: TorchTitan's output per rank."""
    world = 4
    m = titan_moe("sigmoid", 4, shared=True, bias=True, seed=6)
    shape = shape_of("sigmoid", 4, True)
    layers = [MoELayer.from_state_dict(shape, m.state_dict(), r, world).eval() for r in range(world)]
    g = torch.Generator().manual_seed(7)
    xs = [torch.randn(n, D, generator=g) for n in (6, 0, 3, 9)]  # rank 1 has no tokens
    ref = titan_forward(m, torch.cat(xs)[None]).detach()[0].split([x.shape[0] for x in xs])
    with torch.no_grad():
        routed = [layer.route(x) for layer, x in zip(layers, xs, strict=True)]
        ids, wts = [r[0] for r in routed], [r[1] for r in routed]
        ds = a2a_reference.dispatch_reference(xs, ids, E, "bf16", 1)
        ys = [layer.experts(d) for layer, d in zip(layers, ds, strict=True)]
        outs = a2a_reference.combine_reference(ys, ds, wts, "fp32")
        for r, layer in enumerate(layers):
            got = outs[r] + layer.shared_expert(xs[r])
            assert got.shape == ref[r].shape
            assert max_relative_error(got, ref[r]) < TOL, r


def test_two_and_three_dimensional_input_give_the_same_output(world_of_one: Any, provider: str) -> None:
    shape = shape_of("softmax", None, True)
    layer = MoELayer(shape, random_weights(shape, seed=8, dtype=torch.float32)).eval()
    x = torch.randn(2, 5, D, generator=torch.Generator().manual_seed(9))
    with expert_parallel(world_of_one, provider, "fp32", "fp32", "fp32", 10) as ep:
        out3 = layer(x, ep)
        out2 = layer(x.reshape(10, D), ep)
        ids, wts = layer.route(x.reshape(10, D))
        given = layer(x, ep, ids.view(2, 5, K), wts.view(2, 5, K))
    assert out3.shape == (2, 5, D) and out2.shape == (10, D)
    torch.testing.assert_close(out3.reshape(10, D), out2, rtol=0, atol=0)
    torch.testing.assert_close(given, out3, rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"x: got \(10, 3\); expected \[tokens, 64\] or \[batch, seq, 64\]"):
        layer(torch.zeros(10, 3), ep)


def test_inference_path_refuses_to_train_silently() -> None:
    """Over a plain all-to-all a training layer would get no gradient: refused, not silently wrong."""
    from tests.unit.test_layers import OneRankAllToAll

    shape = shape_of("softmax", None, True)
    layer = MoELayer(shape, random_weights(shape, seed=10, dtype=torch.float32))
    x = torch.randn(6, D)
    with pytest.raises(RuntimeError, match="has no backward, while the layer is training"):
        layer(x, OneRankAllToAll(E, "fp32", "fp32", 1))
    out = layer.eval()(x, OneRankAllToAll(E, "fp32", "fp32", 1))
    assert out.grad_fn is None
    with torch.no_grad():
        layer.train()(x, OneRankAllToAll(E, "fp32", "fp32", 1))


def test_backward_phases_are_timed(world_of_one: Any, provider: str) -> None:
    shape = shape_of("softmax", None, True)
    layer = MoELayer(shape, random_weights(shape, seed=11, dtype=torch.bfloat16))
    events: list[str] = []

    class Phase:
        def __init__(self, name: str) -> None:
            self.name = name

        def __enter__(self) -> None:
            events.append(f"{self.name}+")

        def __exit__(self, *exc: object) -> None:
            events.append(f"{self.name}-")

    x = torch.randn(8, D, dtype=torch.bfloat16, requires_grad=True)
    with expert_parallel(world_of_one, provider, "bf16", "bf16", "bf16", 8) as ep:
        out = layer(x, ep, timer=Phase)
        forward = ["dispatch", "shared_expert", "experts", "combine"]
        assert events == [f"{p}{s}" for p in forward for s in "+-"]
        out.float().sum().backward()
    assert events[8:] == ["combine_bwd+", "combine_bwd-", "dispatch_bwd+", "dispatch_bwd-"]


# --------------------------------------------------------------------------- load balancing


def test_expert_bias_update_follows_torchtitan() -> None:
    shape = shape_of("sigmoid", None, False)
    weights = random_weights(shape, seed=12, dtype=torch.float32)
    with pytest.raises(RuntimeError, match="update_expert_bias: load_balance_coeff is None"):
        MoELayer(shape, weights).update_expert_bias()
    with pytest.raises(ValueError, match="load_balance_coeff: got -1"):
        MoELayer(shape, weights, load_balance_coeff=-1)
    layer = MoELayer(shape, weights, load_balance_coeff=0.01)
    assert layer.expert_bias_E is not None and not layer.expert_bias_E.any()
    ids = torch.tensor([[0, 1], [0, 2], [0, 1]])
    layer._routing(torch.zeros(3, D), ids, torch.ones(3, 2))
    torch.testing.assert_close(layer.tokens_per_expert_E, torch.tensor([3.0, 2, 1, 0, 0, 0, 0, 0]))
    counts = layer.update_expert_bias(all_reduce=lambda t: 2 * t)  # a second rank with the same load
    torch.testing.assert_close(counts, torch.tensor([6.0, 4, 2, 0, 0, 0, 0, 0]))
    # sign(mean - load) = [-1, -1, -1, +1, ...] (mean 1.5), then centred: mean(delta) = 0.25 * 0.01.
    want = 0.01 * torch.tensor([-1.0, -1, -1, 1, 1, 1, 1, 1]) - 0.0025
    torch.testing.assert_close(layer.expert_bias_E, want)
    assert not layer.tokens_per_expert_E.any()
    # Eval forwards do not count.
    with torch.no_grad():
        layer.eval()._routing(torch.zeros(3, D), ids, torch.ones(3, 2))
    assert not layer.tokens_per_expert_E.any()


# --------------------------------------------------------------------------- driver flags


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="moe-a2a")
    driver.add_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["run", *argv])


def test_train_flags_and_their_defaults() -> None:
    args = parse("--model", "tiny", "--mode", "train")
    shape = run_args.validate_args(args)
    assert (args.routing, args.optimizer, args.lr, args.grad_dtype) == ("router", "adamw", 1e-3, "bf16")
    assert shape.tokens(run_args.token_mode("train")) == shape.prefill_tokens
    args = parse("--model", "tiny")
    run_args.validate_args(args)
    assert args.routing == "random"
    for flags, message in [
        (["--optimizer", "sgd"], "--optimizer: applies to --mode train, got --mode decode"),
        (
            ["--mode", "prefill", "--load-balance-coeff", "0.1"],
            "--load-balance-coeff: applies to --mode train",
        ),
        (["--mode", "train", "--lr", "0"], "--lr: got 0.0; expected a positive number"),
        (["--mode", "train", "--load-balance-coeff", "-1"], "--load-balance-coeff: got -1.0"),
    ]:
        with pytest.raises(UsageError, match=message):
            run_args.validate_args(parse("--model", "tiny", *flags))
    args = parse("--model", "tiny", "--mode", "train", "--tokens", "40")
    assert run_args.validate_args(args).prefill_tokens == 40


def test_train_reference_has_no_gradient_for_a_gate_with_given_weights(tmp_path: Path) -> None:
    """With fixed routing weights the gate gets no gradient in the reference, so none is demanded."""
    from moe_a2a.layers.reference import reference_train_step

    shape = shape_of("softmax", None, True)
    w = random_weights(shape, seed=13, dtype=torch.float32)
    x = torch.randn(5, D)
    ids = torch.tensor([[0, 1], [2, 3], [4, 5], [6, 7], [0, 7]])
    _, routed = reference_train_step(x, w, ids, torch.zeros(5, D), score_func="softmax")
    _, fixed = reference_train_step(x, w, ids, torch.zeros(5, D), topk_weights=torch.full((5, 2), 0.5))
    assert "router.gate.weight" in routed and "router.gate.weight" not in fixed
    assert {"x", "routed_experts.inner_experts.w1_EFD", "shared_experts.w2.weight"} <= set(fixed)
