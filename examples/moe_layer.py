"""One MoE layer's expert-parallel step with moe-a2a, as a whole program.

Each rank routes its tokens, dispatches them (fp8 on the wire, dequantised to
bf16 by the receive pass), runs its own experts on the rows it received,
combines the results back and checks them against the same layer computed
on this rank alone. The shared expert runs while the dispatch is in flight.

    mpirun -n 2 python examples/moe_layer.py
    mpirun -n 2 python examples/moe_layer.py --ranks-per-node 1 --provider tcp   # across "nodes"

(Open MPI as root: add --allow-run-as-root.) The number of ranks must divide
NUM_EXPERTS (8).
"""

from __future__ import annotations

import argparse

import torch
from mpi4py import MPI

from moe_a2a import AllToAll, Config

HIDDEN, NUM_EXPERTS, TOPK = 512, 8, 2


def make_layer() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The same weights on every rank (one seed): router [H, E], experts [E, H, H], shared [H, H]."""
    g = torch.Generator().manual_seed(0)
    scale = HIDDEN**-0.5
    router = torch.randn(HIDDEN, NUM_EXPERTS, generator=g)
    experts = torch.randn(NUM_EXPERTS, HIDDEN, HIDDEN, generator=g) * scale
    shared = torch.randn(HIDDEN, HIDDEN, generator=g) * scale
    return router, experts, shared


def route(x: torch.Tensor, router: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k experts of each token and their softmax weights."""
    scores, ids = (x.float() @ router).topk(TOPK, dim=-1)
    return ids, scores.softmax(dim=-1)


def run_experts(
    expert_x: torch.Tensor, tokens_per_expert: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """This rank's experts on their rows: expert_x is expert-major, tokens_per_expert[i] rows each."""
    y = torch.empty_like(expert_x)
    start = 0
    for i, n in enumerate(tokens_per_expert.tolist()):
        y[start : start + n] = (expert_x[start : start + n].float() @ weights[i]).to(y.dtype)
        start += n
    return y


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--provider", default="auto", help="libfabric provider between nodes (default: auto)")
    parser.add_argument(
        "--ranks-per-node", type=int, help="virtual nodes of this many ranks (default: by host)"
    )
    args = parser.parse_args()

    comm = MPI.COMM_WORLD
    rank, world = comm.Get_rank(), comm.Get_size()
    router, experts, shared = make_layer()
    local = NUM_EXPERTS // world
    my_experts = experts[rank * local : (rank + 1) * local]  # the experts this rank hosts

    tokens = 32 + 16 * rank  # ranks may have different token counts
    x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(1 + rank)).to(torch.bfloat16)
    topk_ids, topk_weights = route(x, router)

    cfg = Config(max_tokens=64, hidden=HIDDEN, num_experts=NUM_EXPERTS, topk=TOPK, dispatch_dtype="fp8")
    with AllToAll(cfg, comm=comm, provider=args.provider, ranks_per_node=args.ranks_per_node) as a2a:
        # The send half returns while rows are in flight; the shared expert overlaps it.
        pending = a2a.dispatch(x, topk_ids, topk_weights, recv=False)
        shared_out = x.float() @ shared
        # fp8 rows arrive dequantised to bf16 (without dequantize=: fp8 rows and d.expert_x_scale).
        d = a2a.dispatch(handle=pending, send=False, dequantize=torch.bfloat16)
        y = run_experts(d.expert_x, d.tokens_per_expert, my_experts)
        out = a2a.combine(y, d).float() + shared_out  # [tokens, HIDDEN]: sum_k w[t,k] * expert(x[t]) + shared

    # The same layer on this rank alone, in fp32 and without fp8: the difference is fp8's rounding.
    want = shared_out.clone()
    for e in range(NUM_EXPERTS):
        t, k = (topk_ids == e).nonzero(as_tuple=True)
        want.index_add_(0, t, topk_weights[t, k, None] * (x[t].float() @ experts[e]))
    error = ((out - want).norm() / want.norm()).item()
    print(
        f"rank {rank}: {tokens} tokens out, {d.expert_x.shape[0]} rows in for experts "
        f"{rank * local}-{(rank + 1) * local - 1} ({d.expert_x.dtype}), relative error {error:.4f}",
        flush=True,
    )
    if error > 0.05:
        raise SystemExit(f"rank {rank}: relative error {error:.4f} above 0.05")


if __name__ == "__main__":
    main()
