"""Run by test_peer_death.py, two processes over torch.distributed (gloo): rank 1 is killed
(SIGKILL) in the middle of a call, rank 0 prints how long its call took to fail and why.

With a third argument `finish`, rank 1 instead ends its last call and exits while rank 0 is
between that call's combine send and receive: rank 0's receive must still complete (rank 1 sent
its part before it left), and only rank 0's next call fails. With `drop`, rank 1 drops its
instance without closing it and rank 0 then writes into it: rank 1 must live on.

Not under mpirun: mpirun ends the whole job as soon as a rank dies, before the
survivor could report. Environment: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT.
"""

import gc
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

from moe_a2a import AllToAll, Config, fabric

provider, rpn = sys.argv[1], (None if sys.argv[2] == "none" else int(sys.argv[2]))
dist.init_process_group("gloo")
cfg = Config(max_tokens=8, hidden=64, num_experts=4, topk=2, timeout_s=30.0)
a2a = AllToAll(cfg, dist.group.WORLD, provider=provider, ranks_per_node=rpn)
x = torch.zeros(8, 64, dtype=torch.bfloat16)
ids = torch.tensor([[0, 3]] * 8, dtype=torch.int32)
d = a2a.dispatch(x, ids, torch.ones(8, 2))
a2a.combine(d.expert_x, d)
dist.barrier()
if len(sys.argv) > 3 and sys.argv[3] == "finish":
    pids = [0, 0]
    dist.all_gather_object(pids, os.getpid())
    mine = torch.randn(8, 64, generator=torch.Generator().manual_seed(dist.get_rank())).to(torch.bfloat16)
    d = a2a.dispatch(mine, ids, torch.ones(8, 2))
    if dist.get_rank() == 1:
        a2a.combine(d.expert_x, d)
        # Ends as a script does (the exit hook hands the engine's queued writes, its part of this
        # combine among them, to the network), without the teardown's collectives or a word.
        fabric._leave_at_exit()
        os._exit(0)
    pending = a2a.combine(d.expert_x, d, recv=False)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:  # until rank 1 is a zombie or gone: the pid check sees it
        try:
            with open(f"/proc/{pids[1]}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] in "ZX":
                    break
        except FileNotFoundError:
            break
        time.sleep(0.02)
    time.sleep(0.3)  # past the pid check's interval
    try:
        out = a2a.combine(handle=pending, send=False)
    except Exception as exc:
        print(f"kill_job: rank 0's last receive failed: {type(exc).__name__}: {exc}", flush=True)
        os._exit(4)
    print(f"kill_job: rank 0's last receive completed, equal: {torch.equal(out, 2 * mine)}", flush=True)
if len(sys.argv) > 3 and sys.argv[3] == "drop":
    if dist.get_rank() == 1:
        del a2a, d  # dropped without close(), as after a failure: its memory must outlive its registration
        gc.collect()
    dist.barrier()
    if dist.get_rank() == 0:
        a2a.dispatch(x, ids, torch.ones(8, 2), recv=False)  # our rows land in rank 1's memory
    time.sleep(1.5)
    print(f"kill_job: rank {dist.get_rank()} alive after the writes", flush=True)
    os._exit(0)
if dist.get_rank() == 1:
    a2a.dispatch(x, ids, torch.ones(8, 2), recv=False)  # mid-call: rows sent, nothing received
    os.kill(os.getpid(), signal.SIGKILL)
started = time.monotonic()
try:
    d = a2a.dispatch(x, ids, torch.ones(8, 2))
    a2a.combine(d.expert_x, d)
except Exception as exc:
    took = time.monotonic() - started
    print(f"kill_job: rank 0 failed after {took:.2f} s: {type(exc).__name__}: {exc}", flush=True)
    os._exit(3)  # no collective teardown with a dead peer
print("kill_job: rank 0 did not fail", flush=True)
os._exit(0)
