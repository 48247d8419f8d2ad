"""Probes of idle CPU and many instances (run under mpirun; figures in docs/reliability.md).

  mpirun -n 2 python tools/probes/idle_and_instances.py idle --provider shm [--rpn 1] [--open 32] \
      [--device cuda]
  mpirun -n 2 python tools/probes/idle_and_instances.py instances --provider tcp --count 32

idle: CPU seconds per second of this process (every thread: /proc/self/stat
utime+stime) while an open AllToAll, after one round, does nothing.
instances: RSS, fds, threads and seconds to create `count` instances.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from mpi4py import MPI

from moe_a2a.all_to_all import AllToAll, Config


def cpu_seconds() -> float:
    with open("/proc/self/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def thread_cpu() -> dict[int, float]:
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[int(tid)] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return out


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def one_round(a2a: AllToAll, cfg: Config) -> None:
    g = torch.Generator().manual_seed(a2a.rank)
    x = torch.randn(cfg.max_tokens, cfg.hidden, generator=g).to(torch.bfloat16)
    ids = torch.stack(
        [torch.randperm(cfg.num_experts, generator=g)[: cfg.topk] for _ in range(cfg.max_tokens)]
    )
    w = torch.rand(cfg.max_tokens, cfg.topk, generator=g)
    dev = a2a.device
    d = a2a.dispatch(x.to(dev), ids.to(torch.int32).to(dev), w.to(dev))
    a2a.combine(d.expert_x.to(torch.bfloat16), d)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("what", choices=["idle", "instances"])
    p.add_argument("--provider", default="tcp")
    p.add_argument("--rpn", type=int, default=None)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--count", type=int, default=32, help="instances: how many to create")
    p.add_argument("--open", type=int, default=1, help="idle: instances open while idling")
    a = p.parse_args()
    comm = MPI.COMM_WORLD
    world = comm.Get_size()
    cfg = Config(max_tokens=16, hidden=256, num_experts=2 * world, topk=2, timeout_s=30.0)
    if a.what == "idle":
        made = [
            AllToAll(cfg, provider=a.provider, ranks_per_node=a.rpn, device=a.device) for _ in range(a.open)
        ]
        for a2a in made:
            one_round(a2a, cfg)
        comm.Barrier()
        time.sleep(0.5)
        t0, c0, th0 = time.monotonic(), cpu_seconds(), thread_cpu()
        time.sleep(a.seconds)
        rate = (cpu_seconds() - c0) / (time.monotonic() - t0)
        th1 = thread_cpu()
        busiest = sorted(((th1[t] - th0.get(t, 0.0), t) for t in th1), reverse=True)[:3]
        rates = comm.gather((rate, busiest))
        if comm.rank == 0:
            print(
                f"idle {a.provider} rpn={a.rpn}, {a.open} open: CPU-s/s per rank",
                " ".join(f"{r:.3f}" for r, _ in rates),
            )
            for r, (_, b) in enumerate(rates):
                print(
                    f"  rank {r} busiest threads (CPU-s over {a.seconds} s):",
                    ", ".join(f"{c:.2f}" for c, _ in b),
                )
        for a2a in made:
            a2a.close()
        return
    comm.Barrier()
    rss0, fds0 = rss_mb(), len(os.listdir("/proc/self/fd"))
    tasks0 = len(os.listdir("/proc/self/task"))
    t0 = time.monotonic()
    made = [AllToAll(cfg, provider=a.provider, ranks_per_node=a.rpn) for _ in range(a.count)]
    dt = time.monotonic() - t0
    for x in made:
        one_round(x, cfg)
    out = (
        rss_mb() - rss0,
        len(os.listdir("/proc/self/fd")) - fds0,
        len(os.listdir("/proc/self/task")) - tasks0,
        dt,
    )
    res = comm.gather(out)
    if comm.rank == 0:
        for r, (m, f, t, s) in enumerate(res):
            where = f"{a.count} instances {a.provider} rpn={a.rpn} rank {r}"
            print(f"{where}: +{m:.0f} MB RSS, +{f} fds, +{t} threads, {s:.1f} s")
    for x in made:
        x.close()


if __name__ == "__main__":
    main()
