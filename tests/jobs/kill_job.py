"""Run by test_peer_death.py, two processes over torch.distributed (gloo): rank 1 is killed
(SIGKILL) in the middle of a call, rank 0 prints how long its call took to fail and why.

Not under mpirun: mpirun ends the whole job as soon as a rank dies, before the
survivor could report. Environment: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT.
"""

import os
import signal
import sys
import time

import torch
import torch.distributed as dist

from moe_a2a import AllToAll, Config

provider, rpn = sys.argv[1], (None if sys.argv[2] == "none" else int(sys.argv[2]))
dist.init_process_group("gloo")
cfg = Config(max_tokens=8, hidden=64, num_experts=4, topk=2, timeout_s=30.0)
a2a = AllToAll(cfg, dist.group.WORLD, provider=provider, ranks_per_node=rpn)
x = torch.zeros(8, 64, dtype=torch.bfloat16)
ids = torch.tensor([[0, 3]] * 8, dtype=torch.int32)
d = a2a.dispatch(x, ids, torch.ones(8, 2))
a2a.combine(d.expert_x, d)
dist.barrier()
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
