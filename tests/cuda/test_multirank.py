"""The CUDA path across real MPI ranks (processes), against the in-process reference.

The cases of the CPU suite (tests/mpi/test_a2a.py) on CUDA tensors, plus CUDA
graph capture. Several ranks may share one GPU, each its own process: that is
how it runs on one H200. Node layouts: one node (CUDA IPC only), every rank its
own node (fabric only), and nodes of two (both). Run with

    mpirun -n N tools/rank0_console.sh python -m pytest --with-mpi tests/cuda/test_multirank.py

and MOE_A2A_TEST_PROVIDER=shm (or tcp).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import pytest
import torch
from local_world import cuda_unavailable_reason

from moe_a2a import FabricError
from moe_a2a.all_to_all import CapacityError, Config
from moe_a2a.reference import combine_reference, dispatch_reference

_REASON = cuda_unavailable_reason()
pytestmark = pytest.mark.skipif(_REASON is not None, reason=_REASON or "")

if _REASON is None:
    from mpi4py import MPI

    from moe_a2a.all_to_all import AllToAll

    COMM = MPI.COMM_WORLD
    RANK, WORLD = COMM.Get_rank(), COMM.Get_size()
    torch.cuda.set_device(RANK % torch.cuda.device_count())
else:  # collected but skipped
    RANK, WORLD = 0, 1

PROVIDER = os.environ.get("MOE_A2A_TEST_PROVIDER", "shm")
HIDDEN = 200  # not a multiple of 128: the last fp8 block is short
EXPERTS_PER_RANK = 3 if WORLD > 1 else 8  # top-4 of 3 per rank: several picks land on one rank
TIMEOUT_S = 30.0


def layouts() -> list[int | None]:
    out: list[int | None] = [None]  # one node: CUDA IPC only
    if WORLD > 1:
        out.append(1)  # every rank its own node: fabric only
    if WORLD > 2 and WORLD % 2 == 0:
        out.append(2)  # both at once
    return out


def make_a2a(rpn: int | None, graph_safe: bool = False, **overrides: object) -> AllToAll:
    params: dict[str, object] = dict(
        max_tokens=24,
        hidden=HIDDEN,
        num_experts=EXPERTS_PER_RANK * WORLD,
        topk=4,
        timeout_s=TIMEOUT_S,
    )
    params.update(overrides)
    return AllToAll(
        Config(**params), device="cuda", provider=PROVIDER, ranks_per_node=rpn, graph_safe=graph_safe
    )  # type: ignore[arg-type]


@dataclass
class Inputs:
    xs: list[torch.Tensor]
    ids: list[torch.Tensor]
    weights: list[torch.Tensor]


def random_router(g: torch.Generator, tokens: int, experts: int, topk: int) -> torch.Tensor:
    if tokens == 0:
        return torch.empty(0, topk, dtype=torch.int64)
    return torch.rand(tokens, experts, generator=g).argsort(dim=1)[:, :topk]


def one_expert(g: torch.Generator, tokens: int, experts: int, topk: int) -> torch.Tensor:
    """Every token picks expert 0, and topk-1 distinct others."""
    score = torch.rand(tokens, experts, generator=g)
    score[:, 0] = -1.0
    return score.argsort(dim=1)[:, :topk]


def one_rank(g: torch.Generator, tokens: int, experts: int, topk: int) -> torch.Tensor:
    """As many distinct picks as fit on the last rank's experts, the rest elsewhere."""
    score = torch.rand(tokens, experts, generator=g)
    score[:, (WORLD - 1) * EXPERTS_PER_RANK :] -= 2.0
    return score.argsort(dim=1)[:, :topk]


def make_inputs(seed: int, cfg: Config, router=random_router, tokens: list[int] | None = None) -> Inputs:  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(seed)
    if tokens is None:
        tokens = [int(torch.randint(0, cfg.max_tokens + 1, (1,), generator=g)) for _ in range(WORLD)]
    xs = [(torch.randn(t, cfg.hidden, generator=g) * 4).to(torch.bfloat16) for t in tokens]
    ids = [router(g, t, cfg.num_experts, cfg.topk) for t in tokens]
    weights = [torch.rand(t, cfg.topk, generator=g) for t in tokens]
    return Inputs(xs, ids, weights)


def expert_fn(x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """A cheap stand-in for the experts that depends on every element."""
    xf = x.float()
    if scale is not None:
        xf = xf * scale.repeat_interleave(128, dim=1)[:, : x.shape[1]]
    return (xf * 0.75 + 0.5).to(torch.bfloat16)


def check_round(a2a: AllToAll, inp: Inputs, split: bool = False) -> torch.Tensor:
    """One dispatch + combine on this rank, compared with the reference; returns the output."""
    cfg = a2a.cfg
    x, ids, w = inp.xs[RANK].cuda(), inp.ids[RANK].cuda(), inp.weights[RANK].cuda()
    if split:
        pending = a2a.dispatch(x, ids, w, recv=False)
        busy = torch.randn(256, 256, device="cuda") @ torch.randn(256, 256, device="cuda")  # work in between
        d = a2a.dispatch(handle=pending, send=False)
        assert busy.shape == (256, 256)
    else:
        d = a2a.dispatch(x, ids, w)
    ref = dispatch_reference(inp.xs, inp.ids, cfg.num_experts, cfg.dispatch_dtype, cfg.expert_padding)
    mine = ref[RANK]
    assert d.expert_x.is_cuda and d.tokens_per_expert.is_cuda
    assert torch.equal(d.tokens_per_expert.cpu(), mine.tokens_per_expert)
    assert d.expert_x.shape == mine.expert_x.shape
    valid = mine.origin[:, 0] >= 0  # padding rows hold no meaning
    assert torch.equal(d.expert_x.cpu()[valid].view(torch.uint8), mine.expert_x[valid].view(torch.uint8))
    if cfg.dispatch_dtype == "fp8":
        assert d.expert_x_scale is not None and mine.expert_x_scale is not None
        assert torch.equal(d.expert_x_scale.cpu()[valid], mine.expert_x_scale[valid])
    else:
        assert d.expert_x_scale is None

    y = expert_fn(d.expert_x, d.expert_x_scale)
    if split:
        pending_c = a2a.combine(y, d, recv=False)
        torch.cuda.current_stream().synchronize()  # the caller computes something else here
        out = a2a.combine(handle=pending_c, send=False)
    else:
        out = a2a.combine(y, d)
    ys = [expert_fn(r.expert_x, r.expert_x_scale) for r in ref]
    expected = combine_reference(ys, ref, inp.weights, cfg.combine_dtype)[RANK]
    assert out.is_cuda and out.dtype == expected.dtype and out.shape == expected.shape
    torch.testing.assert_close(out.cpu().float(), expected.float(), rtol=1.6e-2, atol=1e-2)
    return out


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
@pytest.mark.parametrize("rpn", layouts())
def test_hard_routings(rpn: int | None) -> None:
    """Zero tokens, one hot expert, one hot rank, several picks per rank, overflowing private slots."""
    with make_a2a(rpn, max_private_tokens=2, dispatch_dtype="fp8") as a2a:
        cfg = a2a.cfg
        full = [cfg.max_tokens] * WORLD
        check_round(a2a, make_inputs(7, cfg, tokens=[0] + [cfg.max_tokens] * (WORLD - 1)))
        check_round(a2a, make_inputs(8, cfg, tokens=[0] * WORLD))
        check_round(a2a, make_inputs(9, cfg, router=one_expert, tokens=full))
        check_round(a2a, make_inputs(10, cfg, router=one_rank, tokens=full))


@pytest.mark.mpi(min_size=1)
@pytest.mark.timeout(300)
def test_many_iterations_reuse_buffers() -> None:
    """200 rounds with new routing each time, alternating whole and split calls."""
    with make_a2a(layouts()[-1], max_private_tokens=3) as a2a:
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
    with make_a2a(layouts()[-1], max_recv_tokens=4, max_private_tokens=1) as a2a:
        cfg = a2a.cfg
        big = make_inputs(77, cfg, tokens=[cfg.max_tokens] * WORLD)
        with pytest.raises(CapacityError, match="max_recv_tokens=4"):
            a2a.dispatch(big.xs[RANK].cuda(), big.ids[RANK].cuda(), big.weights[RANK].cuda())
        check_round(a2a, make_inputs(78, cfg, tokens=[1] + [0] * (WORLD - 1)))


@pytest.mark.mpi(min_size=1)
def test_validation_errors() -> None:
    with make_a2a(None) as a2a:
        cfg = a2a.cfg
        x = torch.randn(3, cfg.hidden, device="cuda").to(torch.bfloat16)
        ids = torch.zeros(3, cfg.topk, dtype=torch.int64, device="cuda")
        w = torch.rand(3, cfg.topk, device="cuda")
        with pytest.raises(ValueError, match=r"topk_ids: found expert id .*expected ids in \[0, "):
            a2a.dispatch(x, ids + cfg.num_experts, w)
        with pytest.raises(ValueError, match="x: got .* expected"):
            a2a.dispatch(x[:, :-1], ids, w)
        with pytest.raises(ValueError, match="x is on cpu; expected cuda"):
            a2a.dispatch(x.cpu(), ids, w)
        with pytest.raises(ValueError, match="topk_ids is on cpu"):
            a2a.dispatch(x, ids.cpu(), w)
        with pytest.raises(ValueError, match="dtype"):
            a2a.dispatch(x.to(torch.float16), ids, w)
        with pytest.raises(ValueError, match="topk_weights"):
            a2a.dispatch(x, ids, w[:, :1])
        check_round(a2a, make_inputs(3, cfg))  # a bad call leaves the instance working


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("rpn", layouts())
def test_graph_capture_replays(rpn: int | None) -> None:
    """A whole step (dispatch, experts, combine) captured once and replayed with new inputs."""
    with make_a2a(rpn, graph_safe=True, dispatch_dtype="fp8") as a2a:
        cfg = a2a.cfg
        tokens = [cfg.max_tokens - r % 3 for r in range(WORLD)]
        first = make_inputs(300, cfg, tokens=tokens)
        x, ids, w = first.xs[RANK].cuda(), first.ids[RANK].cuda(), first.weights[RANK].cuda()

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
            x.copy_(inp.xs[RANK])
            ids.copy_(inp.ids[RANK])
            w.copy_(inp.weights[RANK])
            graph.replay()
            torch.cuda.synchronize()
            a2a.check()
            ref = dispatch_reference(inp.xs, inp.ids, cfg.num_experts, cfg.dispatch_dtype, cfg.expert_padding)
            ys = [expert_fn(r.expert_x, r.expert_x_scale) for r in ref]
            expected = combine_reference(ys, ref, inp.weights, cfg.combine_dtype)[RANK]
            torch.testing.assert_close(out.cpu().float(), expected.float(), rtol=1.6e-2, atol=1e-2)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
def test_silent_peer_times_out_with_clear_error() -> None:
    """A peer that never takes part: the others fail within the timeout, naming it, and do not hang."""
    silent = WORLD - 1
    a2a = make_a2a(1, timeout_s=2.0)
    started = time.monotonic()
    if RANK != silent:
        inp = make_inputs(5, a2a.cfg, tokens=[4] * WORLD)
        x, ids, w = inp.xs[RANK].cuda(), inp.ids[RANK].cuda(), inp.weights[RANK].cuda()
        with pytest.raises(FabricError, match=f"peer {silent}"):
            a2a.dispatch(x, ids, w)
        assert time.monotonic() - started < 30
        with pytest.raises(RuntimeError, match="unusable after an earlier failure"):
            a2a.dispatch(x, ids, w)
    COMM.Barrier()
    a2a.close(wait_for_peers=False)
