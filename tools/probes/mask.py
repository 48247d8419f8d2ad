"""Probes of mask and continue (issue 32; figures in docs/reliability.md, "Mask and continue").

  python tools/probes/mask.py loss --provider tcp --runs 5
  mpirun -n 4 python tools/probes/mask.py cost --blocks 20 --calls 200 [--device cuda]
  python tools/probes/mask.py rejoin --provider tcp --runs 5

loss: starts tests/jobs/peer_loss_job.py on 4 ranks over torch.distributed (one host), SIGKILLs
rank 3 mid-dispatch, and prints each survivor's time from the kill to its first call with
rank 3 masked completing (the agreement included). The job's environment passes through:
RANKS_PER_NODE=2 for virtual nodes, MOE_A2A_TEST_DEVICE=cuda for the GPU.
rejoin: the same job, rank 3 SIGKILLed at call 6; a launcher loop starts its replacement as soon
as it is gone, and the survivors call rejoin at call 8 (so they wait there for it). Prints the
time from the kill to each rank's first call with every rank back, the survivors' time in
rejoin(), and the replacement's from its first line (Python and torch imported) to joined.
cost: decode-sized calls (8 tokens, hidden 256, 8 experts per rank, top-2) on one node with
on_peer_loss "stop" and "mask" (nobody lost), in alternating blocks so that the machine's
load hits both alike; prints the median per-call time of each.
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

JOB = Path(__file__).resolve().parents[2] / "tests" / "jobs" / "peer_loss_job.py"


def loss(provider: str, runs: int) -> None:
    for run in range(runs):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_"))}
        env |= {"WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        env["MOE_A2A_ABORT_ON_ERROR"] = "0"
        args = [sys.executable, str(JOB), provider, "30", "3:10"]
        procs = [
            subprocess.Popen(args, env=env | {"RANK": str(r)}, stdout=subprocess.PIPE, text=True)
            for r in range(4)
        ]
        outs = [p.communicate(timeout=200)[0] for p in procs]
        # Each survivor exits 0 only if every call it completed equalled the masked reference.
        codes = [p.returncode for p in procs[:3]]
        found = re.search(r"rows path (\S+)", outs[0])
        path = found[1] if found else "?"
        if codes != [0, 0, 0]:
            print(f"{provider} run {run}: survivors exited {codes}\n" + "\n".join(outs))
            continue
        killed = float(re.search(r"killed at ([0-9.]+)", outs[3])[1])  # type: ignore[index]
        took = [float(re.search(r"masked done at ([0-9.]+)", o)[1]) - killed for o in outs[:3]]  # type: ignore[index]
        rows = path[1] if path else "?"
        print(
            f"{provider} run {run} (rows {rows}): kill -> first masked call done, ranks 0-2: "
            + ", ".join(f"{t:.3f} s" for t in took)
            + "; every call equal to the reference"
        )


def rejoin(provider: str, runs: int) -> None:
    for run in range(runs):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        key = f"probe{os.getpid()}-{run}"
        env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_"))}
        env |= {"WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        env |= {"MOE_A2A_ABORT_ON_ERROR": "0", "REJOIN_AT": f"8:{key}"}
        if "RANKS_PER_NODE" in env:  # virtual nodes share no /dev/shm meeting: rank 0's TCPStore
            env["MOE_A2A_REJOIN_STORE"] = f"127.0.0.1:{port}"
        args = [sys.executable, str(JOB), provider, "30", "3:6"]
        procs = [
            subprocess.Popen(args, env=env | {"RANK": str(r)}, stdout=subprocess.PIPE, text=True)
            for r in range(4)
        ]
        while procs[3].poll() is None:  # the launcher: restart rank 3 once it is gone
            time.sleep(0.01)
        extra = {"RANK": "3", "REPLACEMENT_KEY": key}
        procs.append(subprocess.Popen(args, env=env | extra, stdout=subprocess.PIPE, text=True))
        outs = [p.communicate(timeout=200)[0] for p in procs]
        killed = float(re.search(r"killed at ([0-9.]+)", outs[3])[1])  # type: ignore[index]
        full = [
            float(re.search(r"first full call after the rejoin done at ([0-9.]+)", o)[1])
            for o in outs[:3] + outs[4:]
        ]  # type: ignore[index]
        inside = [float(re.search(r"rejoined \(3,\) in ([0-9.]+) s", o)[1]) for o in outs[:3]]  # type: ignore[index]
        joined = float(re.search(r"joined at epoch \d+ ([0-9.]+) s", outs[4])[1])  # type: ignore[index]
        after = [float(re.search(r"joined in ([0-9.]+) s", o)[1]) for o in outs[:3]]  # type: ignore[index]
        found = re.search(r"rows path (\S+)", outs[0])
        path = found[1] if found else "?"
        print(
            f"{provider} run {run} (rows {path}): kill -> first full call, ranks 0-2 and 3': "
            + ", ".join(f"{t - killed:.3f} s" for t in full)
            + f"; survivors in rejoin(): {min(inside):.3f}-{max(inside):.3f} s; "
            f"replacement from its first line to joined: {joined:.3f} s; survivors from the meeting "
            f"to joined: {min(after):.3f}-{max(after):.3f} s"
        )


def cost(blocks: int, calls: int, ranks_per_node: int | None, provider: str, device: str) -> None:
    import torch
    from mpi4py import MPI

    from moe_a2a.all_to_all import AllToAll, Config

    comm = MPI.COMM_WORLD
    world, rank = comm.Get_size(), comm.Get_rank()
    T, H, E, K = 8, 256, 8 * world, 2
    if device == "cuda":
        torch.cuda.set_device(0)
    made = {
        mode: AllToAll(
            Config(max_tokens=T, hidden=H, num_experts=E, topk=K, on_peer_loss=mode),
            comm,
            device=device,
            provider=provider,
            ranks_per_node=ranks_per_node,
        )
        for mode in ("stop", "mask")
    }
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).int()
    w = torch.rand(T, K, generator=g)
    x, ids, w = x.to(device), ids.to(device), w.to(device)
    times: dict[str, list[float]] = {mode: [] for mode in made}
    for block in range(blocks):
        for mode in ("stop", "mask") if block % 2 == 0 else ("mask", "stop"):
            a2a = made[mode]
            for _ in range(calls):
                started = time.perf_counter()
                d = a2a.dispatch(x, ids, w)
                a2a.combine(d.expert_x, d)
                if device == "cuda":
                    torch.cuda.synchronize()
                times[mode].append(time.perf_counter() - started)
    p50 = {mode: statistics.median(t) * 1e6 for mode, t in times.items()}
    everyone = comm.gather(p50)
    if rank == 0:
        for r, got in enumerate(everyone):
            print(f"rank {r}: p50 per call: stop {got['stop']:.1f} us, mask {got['mask']:.1f} us")
    for a2a in made.values():
        a2a.close()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="what", required=True)
    p = sub.add_parser("loss")
    p.add_argument("--provider", default="tcp")
    p.add_argument("--runs", type=int, default=5)
    p = sub.add_parser("rejoin")
    p.add_argument("--provider", default="tcp")
    p.add_argument("--runs", type=int, default=5)
    p = sub.add_parser("cost")
    p.add_argument("--blocks", type=int, default=20)
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--ranks-per-node", type=int, default=None, help="virtual nodes (default: one node)")
    p.add_argument("--provider", default="tcp", help="for peers on other nodes")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    args = parser.parse_args()
    if args.what == "loss":
        loss(args.provider, args.runs)
    elif args.what == "rejoin":
        rejoin(args.provider, args.runs)
    else:
        cost(args.blocks, args.calls, args.ranks_per_node, args.provider, args.device)


if __name__ == "__main__":
    main()
