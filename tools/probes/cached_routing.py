"""Probe of cached routing (run under mpirun; figures in docs/benchmarks.md, "Cached routing").

  mpirun -n 4 python tools/probes/cached_routing.py --provider tcp --rpn 1 --pairs 300

Times one dispatch + combine along a kept routing (`dispatch(x, routing=r)`,
no routing exchange) against a full one of the same rows, alternating which
goes first, each from a barrier to the slowest rank's end. Prints both
medians and the median of the paired differences (full minus cached).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from mpi4py import MPI

from moe_a2a.all_to_all import AllToAll, Config

WARMUP = 5


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--provider", default="tcp")
    p.add_argument("--rpn", type=int, default=None, help="ranks per node (default: one node)")
    p.add_argument("--pairs", type=int, default=300)
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--num-experts", type=int, default=32)
    p.add_argument("--topk", type=int, default=4)
    args = p.parse_args()
    if args.pairs < 1:
        p.error(f"--pairs: got {args.pairs}; expected at least 1")
    comm = MPI.COMM_WORLD
    T, E, K = args.tokens, args.num_experts, args.topk
    g = torch.Generator().manual_seed(comm.Get_rank())
    ids = torch.argsort(torch.rand(T, E, generator=g), dim=1)[:, :K].contiguous()
    w = torch.rand(T, K, generator=g)
    x = torch.randn(T, args.hidden, generator=g).to(torch.bfloat16)
    cfg = Config(T, args.hidden, E, K, max_recv_tokens=T * K * comm.Get_size())
    times: dict[str, list[int]] = {"full": [], "cached": []}
    with AllToAll(cfg, comm, provider=args.provider, ranks_per_node=args.rpn) as a2a:
        kept = a2a.dispatch(x, ids, w, keep_routing=True)
        a2a.combine(kept.expert_x, kept)
        for i in range(WARMUP + args.pairs):
            for kind in ("full", "cached") if i % 2 else ("cached", "full"):
                comm.Barrier()
                start = time.perf_counter_ns()
                d = a2a.dispatch(x, routing=kept.routing) if kind == "cached" else a2a.dispatch(x, ids, w)
                a2a.combine(d.expert_x, d)
                took = comm.allreduce(time.perf_counter_ns() - start, op=MPI.MAX)
                if i >= WARMUP:
                    times[kind].append(took)
    if comm.Get_rank() == 0:
        full, cached = np.array(times["full"]) / 1e3, np.array(times["cached"]) / 1e3
        print(
            f"{comm.Get_size()} ranks, {args.provider}, ranks per node {args.rpn or comm.Get_size()}: "
            f"full p50 {np.median(full):.0f} us, cached p50 {np.median(cached):.0f} us, "
            f"median of paired differences {np.median(full - cached):.0f} us over {args.pairs} pairs"
        )


if __name__ == "__main__":
    main()
