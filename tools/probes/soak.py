"""Soak probe (issue 17, item 8): resident memory over many dispatch+combine rounds.

  mpirun -n 2 python tools/probes/soak.py --calls 1000000 --every 100000 --provider tcp --rpn 1

Prints, per rank, RSS (MB) after every `--every` rounds and the growth per
10,000 rounds after the warm-up (the first `--warmup` rounds). Inputs vary
every round (token count and routing), as a model's do.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from mpi4py import MPI

from moe_a2a.all_to_all import AllToAll, Config


def rss_kb() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--calls", type=int, default=100_000)
    p.add_argument("--every", type=int, default=10_000)
    p.add_argument("--warmup", type=int, default=20_000)
    p.add_argument("--provider", default="tcp")
    p.add_argument("--rpn", type=int, default=None, help="ranks per node; 1: every peer over the fabric")
    a = p.parse_args()
    comm = MPI.COMM_WORLD
    world = comm.Get_size()
    cfg = Config(max_tokens=16, hidden=128, num_experts=4 * world, topk=2, timeout_s=30.0)
    g = torch.Generator().manual_seed(comm.rank)
    # A pool of varied inputs, so the loop allocates nothing of its own.
    pool = []
    for i in range(64):
        t = 1 + (i * 7) % cfg.max_tokens
        x = torch.randn(t, cfg.hidden, generator=g).to(torch.bfloat16)
        ids = torch.stack([torch.randperm(cfg.num_experts, generator=g)[: cfg.topk] for _ in range(t)])
        pool.append((x, ids.to(torch.int32), torch.rand(t, cfg.topk, generator=g)))
    samples: list[tuple[int, int]] = []
    with AllToAll(cfg, provider=a.provider, ranks_per_node=a.rpn) as a2a:
        t0 = time.monotonic()
        for n in range(1, a.calls + 1):
            x, ids, w = pool[n % len(pool)]
            d = a2a.dispatch(x, ids, w)
            a2a.combine(d.expert_x, d)
            if n % a.every == 0:
                samples.append((n, rss_kb()))
        took = time.monotonic() - t0
    every = comm.gather(samples)
    if comm.rank == 0:
        print(f"{a.calls} rounds, {a.provider} rpn={a.rpn}, {world} ranks, {took:.0f} s")
        for r, s in enumerate(every):
            after = [(n, kb) for n, kb in s if n >= a.warmup]
            line = " ".join(f"{kb / 1024:.1f}" for _, kb in s)
            slope = ""
            if len(after) >= 2:
                (n0, k0), (n1, k1) = after[0], after[-1]
                slope = f"; after warm-up {(k1 - k0) / (n1 - n0) * 10_000:+.1f} kB per 10k rounds"
            print(f"  rank {r} RSS MB: {line}{slope}")


if __name__ == "__main__":
    main()
