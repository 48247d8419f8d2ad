"""Rows per destination rank and node (issue 30) in the CUDA kernels, several ranks in one process.

Each case runs with `fabric_rows="rank"` (a token crosses to a rank of another node once,
combine reduced there), `"node"` (once to the node, forwarded there, combine reduced per node)
and `"expert"` (a row per copy), on virtual nodes of two ranks and of
one (every peer remote): dispatched rows, fp8 scales and counts bit for bit against
moe_a2a.reference, and combine within one unit in the last place of its mode's reference
(the same fp32 operations in the same order). Decode-sized calls route and pack in one
kernel; prefill-sized ones route in two and pack through the bulk copy engine.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from local_world import LocalWorld, Shape, cuda_unavailable_reason
from test_kernels import _run

_REASON = cuda_unavailable_reason()
pytestmark = pytest.mark.skipif(_REASON is not None, reason=_REASON or "")

# (world, ranks per node): nodes of two ranks (IPC and fabric peers) and of one.
LAYOUTS = [(2, 1), (4, 2), (4, 1), (8, 2), (8, 1)]
MODES = ["rank", "node", "expert"]


def _tokens(world: int, most: int) -> list[int]:
    """Uneven tokens, one rank with none."""
    return [0 if r == 1 else most - (r * 7) % max(1, most // 2) for r in range(world)]


# (id, Config arguments after world and ranks per node, extra _run arguments)
SHAPES = [
    # decode: 24 tokens, top-8 of 8 experts a rank: route_pack; several picks on one rank
    ("decode-bf16", (24, 512, 8, 8), {}),
    ("decode-fp8", (24, 512, 8, 8, "fp8"), {}),
    # prefill: more than 1024 copies, hidden whole fp8 blocks: the large routing and the bulk pack
    ("prefill-fp8", (320, 256, 8, 8, "fp8"), {}),
    ("prefill-bf16-fp32combine", (300, 256, 8, 6, "bf16", "fp32"), {"y_dtype": torch.float32}),
]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("world", "rpn"), LAYOUTS, ids=[f"w{w}-rpn{r}" for w, r in LAYOUTS])
@pytest.mark.parametrize(("args", "extra"), [s[1:] for s in SHAPES], ids=[s[0] for s in SHAPES])
def test_modes_match_the_reference(world: int, rpn: int, mode: str, args: tuple, extra: dict) -> None:
    max_tokens, hidden, per_rank, topk, *dtypes = args
    shape = Shape.of(world, rpn, max_tokens, hidden, per_rank * world, topk, *dtypes, fabric_rows=mode)
    _run(shape, _tokens(world, max_tokens), **extra)


# Hard routings with rows per rank, each on nodes of two ranks and of one.
HARD = [
    # every copy to rank 0's experts: all of a token's entries in one row (and its own rank's)
    ("one-rank", Shape.of(4, 1, 12, 128, 32, 4, fabric_rows="rank"), {"mode": "one_rank"}),
    # no private slots: every row through the shared section
    (
        "no-private",
        Shape.of(4, 2, 12, 128, 16, 4, max_private_tokens=0, fabric_rows="rank"),
        {"mode": "random"},
    ),
    # a private section of 3 rows, reused over 6 calls with other token counts
    (
        "reuse-private-3",
        Shape.of(8, 2, 20, 256, 32, 8, "fp8", max_private_tokens=3, fabric_rows="rank"),
        {"iterations": 6},
    ),
    # the unweighted combine (training's backward of dispatch): summed plainly where the experts are
    ("unweighted", Shape.of(4, 1, 16, 256, 16, 4, fabric_rows="rank"), {"weighted": False}),
    # eager receive: each sender's rows (and their entries) as they land, combine rows by DMA
    (
        "host-wait",
        Shape.of(4, 2, 16, 256, 16, 4, "fp8", max_private_tokens=5, fabric_rows="rank"),
        {"host_wait": True, "iterations": 3},
    ),
    ("host-wait-prefill", Shape.of(4, 1, 300, 256, 16, 8, fabric_rows="rank"), {"host_wait": True}),
    (
        "int32-ids-padding",
        Shape.of(4, 1, 10, 100, 8, 2, expert_padding=4, fabric_rows="rank"),
        {"ids_dtype": torch.int32},
    ),
    # top-1: a row per rank holds one entry, in token order (the output is expert-major)
    ("top1", Shape.of(4, 1, 16, 128, 8, 1, fabric_rows="rank"), {"host_wait": True}),
    ("top1-kernel-waits", Shape.of(4, 2, 16, 128, 8, 1, fabric_rows="rank"), {}),
    ("fp8-prequantised", Shape.of(2, 1, 8, 320, 4, 2, "fp8", fabric_rows="rank"), {"prequantised": True}),
]


def _per_node(shape: Shape) -> Shape:
    """The case with rows per node on nodes of two ranks."""
    return dataclasses.replace(
        shape, ranks_per_node=2, config=dataclasses.replace(shape.config, fabric_rows="node")
    )


NODE_HARD = [
    (f"node-{name}", _per_node(shape), extra)
    for name, shape, extra in HARD
    if name != "fp8-prequantised"  # world 2: one node
] + [
    # node 0's second rank forwards rows it holds no copy of (every copy to rank 0's experts)
    (
        "node-one-rank-8",
        Shape.of(8, 2, 12, 128, 32, 4, fabric_rows="node"),
        {"mode": "one_rank", "host_wait": True},
    ),
    (
        "node-reuse-fp8-8x4",
        Shape.of(8, 4, 20, 256, 32, 8, "fp8", max_private_tokens=3, fabric_rows="node"),
        {"iterations": 4},
    ),
]


@pytest.mark.parametrize(
    ("shape", "extra"), [c[1:] for c in HARD + NODE_HARD], ids=[c[0] for c in HARD + NODE_HARD]
)
def test_hard_cases_with_rows_per_rank(shape: Shape, extra: dict) -> None:
    _run(shape, _tokens(shape.world, shape.max_tokens), **extra)


def test_rows_per_rank_cross_once_per_token() -> None:
    """The routing row's wire rows: one per token towards a rank of another node (its
    copies to that rank share it), one per copy towards a rank of ours."""
    shape = Shape.of(4, 2, 16, 128, 16, 4, fabric_rows="rank")
    world = LocalWorld(shape)
    gen = torch.Generator().manual_seed(5)
    ids = [torch.randint(0, 16, (16, 4), generator=gen) for _ in range(4)]
    xs = [torch.randn(16, 128, generator=gen).to(torch.bfloat16).cuda() for _ in range(4)]
    world.dispatch(xs, [i.cuda() for i in ids])
    for s in range(4):
        ranks = ids[s] // shape.local_experts
        for r in range(4):
            picks = ranks == r
            want = int(picks.sum()) if world.same_node(s, r) else int(picks.any(dim=1).sum())
            assert world._rows(s, r) == want, (s, r)


def test_rows_per_node_cross_once_per_node() -> None:
    """With rows per node the routing row's wire rows go to one rank of each other node,
    the sender's forwarder there (the rank of its local index): one per token with a copy
    on that node; the node's other ranks get none."""
    shape = Shape.of(8, 2, 16, 128, 32, 4, fabric_rows="node")
    world = LocalWorld(shape, host_wait=True)
    gen = torch.Generator().manual_seed(6)
    ids = [torch.randint(0, 32, (16, 4), generator=gen) for _ in range(8)]
    xs = [torch.randn(16, 128, generator=gen).to(torch.bfloat16).cuda() for _ in range(8)]
    world.dispatch(xs, [i.cuda() for i in ids])
    for s in range(8):
        nodes = ids[s] // (shape.local_experts * 2)
        ranks = ids[s] // shape.local_experts
        for r in range(8):
            if world.same_node(s, r):
                want = int((ranks == r).sum())
            else:
                want = int((nodes == r // 2).any(dim=1).sum()) if r % 2 == s % 2 else 0
            assert world._rows(s, r) == want, (s, r)


@pytest.mark.parametrize("host_wait", [False, True], ids=["kernel-waits", "host-waits"])
def test_rows_per_rank_without_staging(host_wait: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """MOE_A2A_CUDA_OVERLAP=0: rows for remote peers packed straight into the fabric's host
    memory, received in one plan and copy (entries placed in between), no combine DMA."""
    monkeypatch.setenv("MOE_A2A_CUDA_OVERLAP", "0")
    shape = Shape.of(4, 2, 24, 256, 16, 8, "fp8", max_private_tokens=4, fabric_rows="rank")
    _run(shape, _tokens(4, 24), host_wait=host_wait, iterations=3)
    _run(Shape.of(4, 1, 300, 256, 16, 8, fabric_rows="rank"), _tokens(4, 300), host_wait=host_wait)
    if host_wait:  # rows per node: the host waits for every forward flag, then one plan and copy
        shape = Shape.of(8, 2, 24, 256, 32, 8, "fp8", max_private_tokens=4, fabric_rows="node")
        _run(shape, _tokens(8, 24), host_wait=True, iterations=3)
