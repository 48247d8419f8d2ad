"""Run by test_peer_loss.py: the decode layer (`MoELayer`, preset tiny, fp32) on 4 ranks over
torch.distributed with on_peer_loss="mask"; rank 3 is SIGKILLed mid-dispatch at step 4. Each
survivor compares every step's output with the whole layer computed here: before the loss with
the full model, after it with the lost rank's experts weighted 0; and checks that after the loss
only tokens routed to a lost expert differ from the full model.

Environment: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT. Prints one line per survivor.
"""

from __future__ import annotations

import os
import signal

import torch
import torch.distributed as dist

from moe_a2a import AllToAll, Config, PeerLostError
from moe_a2a.layers.moe import MoELayer
from moe_a2a.layers.presets import get_preset
from moe_a2a.layers.reference import max_relative_error, reference_forward
from moe_a2a.layers.weights import local_experts, random_weights

STEPS, KILL_RANK, KILL_AT, SEED, LIMIT = 12, 3, 4, 7, 1e-4
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.set_num_threads(1)
shape = get_preset("tiny")
T, E = shape.decode_tokens, shape.num_experts
mine = random_weights(shape, SEED, local_experts(E, rank, world), dtype=torch.float32)
full = random_weights(shape, SEED, dtype=torch.float32)
layer = MoELayer(shape, mine).eval().requires_grad_(False)
cfg = Config(
    max_tokens=T,
    hidden=shape.hidden,
    num_experts=E,
    topk=shape.topk,
    dispatch_dtype="fp32",
    combine_dtype="fp32",
    timeout_s=30.0,
    on_peer_loss="mask",
)
a2a = AllToAll(cfg, dist.group.WORLD)
L = E // world
worst, masked_steps, changed, kept_equal = 0.0, 0, 0, True
while a2a.epoch < STEPS:
    step = a2a.epoch
    x = torch.randn(T, shape.hidden, generator=torch.Generator().manual_seed(100 * step + rank))
    ids, w = layer.route(x)
    if rank == KILL_RANK and step == KILL_AT:
        a2a.dispatch(x, ids, w, recv=False)
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        out = layer.forward(x, a2a, ids, w)
    except PeerLostError:
        continue
    on_lost = torch.zeros_like(ids, dtype=torch.bool)
    for r in a2a.masked_ranks:
        on_lost |= ids // L == r
    ref = reference_forward(x, full, ids, w.masked_fill(on_lost, 0.0), "fp32")
    worst = max(worst, max_relative_error(out, ref))
    if a2a.masked_ranks:
        masked_steps += 1
        whole = reference_forward(x, full, ids, w, "fp32")
        hit = on_lost.any(dim=1)
        # Tokens with no expert on a lost rank are the full model's; the others are not.
        kept_equal &= max_relative_error(out[~hit], whole[~hit]) <= LIMIT if (~hit).any() else True
        changed += int(((out[hit] - whole[hit]).abs().amax(dim=1) > 1e-3).sum())
print(
    f"peer_loss_layer_job: rank {rank}: worst {worst:.2e} masked steps {masked_steps} "
    f"untouched tokens equal {kept_equal} changed tokens {changed} masked {a2a.masked_ranks}",
    flush=True,
)
a2a.close()
os._exit(0 if worst <= LIMIT and kept_equal else 1)
