"""TorchTitan's own MoE, one rank's share of it, and the whole module as the reference.

Shared by the MPI tests (tests/mpi/test_torchtitan.py) and the testbed's ranks on
emulated hosts (tests/testbed/rank.py): each rank holds its tokens and its local
experts' weights; the reference runs every rank's tokens through the full module
in one process with TorchTitan's LocalTokenDispatcher.
"""

from __future__ import annotations

import torch
from torchtitan.models.common import moe as titan_moe
from torchtitan.models.common.feed_forward import FeedForward
from torchtitan.models.common.linear import Linear
from torchtitan.models.common.token_dispatcher import LocalTokenDispatcher

from moe_a2a.integrations.torchtitan import MoeA2ATokenDispatcher

DIM, FFN, EXPERTS, TOPK = 64, 32, 24, 4  # 24 experts: every CI world size (1, 2, 3, 4, 8) divides it
MAX_TOKENS = 16
ROUTERS = {
    "softmax": dict(score_func="softmax"),
    "sigmoid": dict(score_func="sigmoid", route_norm=True),
    "node-limited": dict(score_func="sigmoid", num_expert_groups=4, num_limited_groups=2),
}
EXPERT_WEIGHTS = ("w1_EFD", "w2_EDF", "w3_EFD")


def build(router: str, dispatcher: object, seed: int, device: str = "cpu") -> torch.nn.Module:
    """TorchTitan's MoE with a shared expert, its weights drawn from `seed`."""
    lin = Linear.Config
    cfg = titan_moe.MoE.Config(
        num_experts=EXPERTS,
        routed_experts=titan_moe.RoutedExperts.Config(
            inner_experts=titan_moe.GroupedExperts.Config(dim=DIM, hidden_dim=FFN, num_experts=EXPERTS),
            token_dispatcher=dispatcher,
        ),
        router=titan_moe.TokenChoiceTopKRouter.Config(
            num_experts=EXPERTS,
            gate=lin(in_features=DIM, out_features=EXPERTS),
            top_k=TOPK,
            **ROUTERS[router],
        ),
        shared_experts=FeedForward.Config(
            w1=lin(in_features=DIM, out_features=FFN),
            w2=lin(in_features=FFN, out_features=DIM),
            w3=lin(in_features=DIM, out_features=FFN),
        ),
        load_balance_coeff=1e-3,
    )
    moe = cfg.build()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
        # a bias that changes the routing, to check it is applied alike
        moe.expert_bias_E.copy_(torch.randn(EXPERTS, generator=g) * 0.05)
    return moe.to(device)


def local_experts(rank: int, world: int) -> slice:
    per = EXPERTS // world
    return slice(rank * per, (rank + 1) * per)


# moe-a2a's dispatcher as the tests build it, unless a test says otherwise.
DISPATCHER_DEFAULTS: dict[str, object] = {
    "hidden_dim": DIM,
    "num_max_tokens_per_rank": MAX_TOKENS,
    "combine_dtype": "fp32",
    "grad_dtype": "fp32",
    "timeout_s": 120.0,
}


def ours(
    router: str,
    seed: int,
    mesh: object,
    rank: int,
    world: int,
    device: str = "cpu",
    **dispatcher: object,
) -> torch.nn.Module:
    """The same module on this rank: moe-a2a's dispatcher (`dispatcher`: its Config's
    fields), only the local experts' weights."""
    fields = {**DISPATCHER_DEFAULTS, **dispatcher}
    disp = MoeA2ATokenDispatcher.Config(num_experts=EXPERTS, top_k=TOPK, **fields)
    moe = build(router, disp, seed, device)
    inner = moe.routed_experts.inner_experts
    sl = local_experts(rank, world)
    for name in EXPERT_WEIGHTS:
        setattr(inner, name, torch.nn.Parameter(getattr(inner, name).detach()[sl].clone()))
    moe.routed_experts.token_dispatcher.wire_meshes(ep_mesh=mesh)
    return moe


def reference(router: str, seed: int, device: str = "cpu") -> torch.nn.Module:
    return build(router, LocalTokenDispatcher.Config(num_experts=EXPERTS, top_k=TOPK), seed, device)


def tokens_per_rank(g: torch.Generator, world: int) -> list[int]:
    """Uneven, and one rank (of several) with no tokens at all."""
    t = [int(torch.randint(1, MAX_TOKENS + 1, (1,), generator=g)) for _ in range(world)]
    if world > 1:
        t[-1] = 0
    return t


def batch(seed: int, world: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Every rank's input and target, [1, tokens, DIM] each."""
    g = torch.Generator().manual_seed(seed)
    tokens = tokens_per_rank(g, world)
    xs = [torch.randn(1, t, DIM, generator=g) for t in tokens]
    gs = [torch.randn(1, t, DIM, generator=g) for t in tokens]
    return xs, gs


def loss_of(out: torch.Tensor, g: torch.Tensor, mse_over: int | None) -> torch.Tensor:
    """A linear loss (every output element's gradient is g), or squared error over the global batch."""
    if mse_over is None:
        return (out * g).sum()
    return ((out - g) ** 2).sum() / max(1, mse_over)


def max_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.detach().float().cpu() - want.float().cpu()).abs().max()) if want.numel() else 0.0


def scale(t: torch.Tensor) -> float:
    """What errors are measured against: the largest magnitude, and at least 1."""
    return max(1.0, float(t.abs().amax()) if t.numel() else 0.0)


def compare_grads(mine: torch.nn.Module, ref: torch.nn.Module, rank: int, world: int, tol: float) -> None:
    """Every parameter's gradient against the reference's (replicated ones already summed
    over ranks); one that the reference has and we lack fails."""
    ref_params = dict(ref.named_parameters())
    sl = local_experts(rank, world)
    for name, p in mine.named_parameters():
        want = ref_params[name].grad
        if "inner_experts" in name and want is not None:
            want = want[sl]
        if want is not None and bool(want.abs().gt(0).any()):
            assert p.grad is not None, f"{name}: no gradient, but the reference has one"
        if want is None:
            continue
        got = p.grad.float().cpu() if p.grad is not None else torch.zeros_like(want)
        err = max_err(got, want)
        assert err <= tol * scale(want), f"{name}.grad: max abs error {err:.3g}"
