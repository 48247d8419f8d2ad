"""Run by test_cached_mismatch.py under mpirun: rank 0 runs a dispatch cached, the others do not.

Arguments: provider, ranks per node ("node": one node), and optionally the
device (cpu, the default, or cuda: on a GPU machine, by hand).

Every rank must end in a fabric error (the call must not pair silently); each
prints what it got, in one line, and exits 0 once it did.
"""

import sys

import torch
from mpi4py import MPI

from moe_a2a import AllToAll, Config, FabricError, PeerFailedError

comm = MPI.COMM_WORLD
rank = comm.Get_rank()
rpn = None if sys.argv[2] == "node" else int(sys.argv[2])
cfg = Config(max_tokens=8, hidden=64, num_experts=4, topk=2, timeout_s=1.0)
device = sys.argv[3] if len(sys.argv) > 3 else "cpu"
a2a = AllToAll(cfg, comm, device=device, provider=sys.argv[1], ranks_per_node=rpn, abort_on_error=False)
x = torch.ones(8, 64, dtype=torch.bfloat16, device=device)
ids = torch.tensor([[0, 3]] * 8, dtype=torch.int32, device=device)
w = torch.ones(8, 2, device=device)
d = a2a.dispatch(x, ids, w, keep_routing=True)
a2a.combine(d.expert_x, d)
try:
    again = a2a.dispatch(x, routing=d.routing) if rank == 0 else a2a.dispatch(x, ids, w)
    a2a.combine(again.expert_x, again)
except (FabricError, PeerFailedError) as e:  # its own error, or a peer's announced one
    print(f"rank {rank}: {type(e).__name__}: {e}", flush=True)
    a2a.close(wait_for_peers=False)
    sys.exit(0)
print(f"rank {rank}: no error", flush=True)
sys.exit(3)
