"""Run by test_abort_on_error.py under mpirun: rank 1 stops calling, rank 0 dispatches.

Rank 0's dispatch times out (timeout_s below); what happens next is the test's
subject: the job ends, or rank 0 waits for rank 1 in MPI_Finalize.
"""

import sys
import time

import torch
from mpi4py import MPI

from moe_a2a import AllToAll, Config

comm = MPI.COMM_WORLD
cfg = Config(max_tokens=8, hidden=64, num_experts=4, topk=2, timeout_s=1.0)
a2a = AllToAll(cfg, comm, provider=sys.argv[1], ranks_per_node=1)
if comm.Get_rank() == 1:
    time.sleep(float(sys.argv[2]))  # alive, but never calls: a stuck peer
    sys.exit(0)
x = torch.zeros(8, 64, dtype=torch.bfloat16)
ids = torch.tensor([[0, 1]] * 8, dtype=torch.int32)
a2a.dispatch(x, ids, torch.ones(8, 2))
