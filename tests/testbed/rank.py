"""One rank of a testbed test, started inside an emulated host by tests/testbed/test_testbed.py.

    python rank.py SCENARIO OUT.json [key=value ...]

Rendezvous: torch.distributed (gloo) from RANK, WORLD_SIZE, MASTER_ADDR over the
management veth. Scenarios:
  send  rank 0 writes `bytes` to every other rank (one tagged write each, split
        across NICs above `split`), or to ranks 1 to `to` only; receivers check
        every byte; rank 0 reports the time from the first write until every
        receiver has checked.
  a2a   dispatch and combine with one rank per emulated host, compared with
        moe_a2a.reference on every rank.
  a2a_rate
        timed dispatch + combine steps (after one untimed step) with one rank per
        emulated host; each rank reports its seconds and the payload bytes it sent
        to remote peers (AllToAll.traffic), to compare with its NICs' rate.
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np
import torch
import torch.distributed as dist

from moe_a2a.bootstrap import Bootstrap
from moe_a2a.fabric import Engine

TIMEOUT_S = 120.0
TAG = 7


def send(group: object, rank: int, world: int, args: dict[str, str]) -> dict[str, object]:
    size = int(args["bytes"])
    targets = range(1, int(args.get("to", world - 1)) + 1)
    engine = Engine(Bootstrap(group), "tcp", num_nics=int(args["nics"]), split_threshold=int(args["split"]))
    payload = np.random.default_rng(1).integers(0, 256, size, dtype=np.uint8)
    buf = payload.copy() if rank == 0 else np.zeros(size, np.uint8)
    region = engine.register(buf)
    remotes = engine.exchange_region(region)
    dist.barrier(group)
    t0 = time.monotonic()
    if rank == 0:
        for peer in targets:
            engine.core.write(region, 0, size, remotes[peer], 0, TAG)
        engine.core.wait_tx(TIMEOUT_S)
    elif rank in targets:
        engine.core.wait_imm(TAG, 0, 1, TIMEOUT_S)
        assert np.array_equal(buf, payload), f"rank {rank}: the {size} bytes from rank 0 differ"
    dist.barrier(group)
    seconds = time.monotonic() - t0
    return {
        "nics": engine.nics.names,
        "how": engine.nics.how,
        "seconds": seconds,
        "bytes": size * len(targets),
    }


def a2a(group: object, rank: int, world: int, args: dict[str, str]) -> dict[str, object]:
    from moe_a2a.all_to_all import AllToAll, Config
    from moe_a2a.reference import combine_reference, dispatch_reference

    cfg = Config(max_tokens=16, hidden=96, num_experts=2 * world, topk=2, timeout_s=TIMEOUT_S)
    a2a = AllToAll(
        cfg, comm=group, device="cpu", provider="tcp", ranks_per_node=1, num_nics=int(args["nics"])
    )
    g = torch.Generator().manual_seed(5)
    tokens = [int(torch.randint(1, cfg.max_tokens + 1, (1,), generator=g)) for _ in range(world)]
    xs = [(torch.randn(t, cfg.hidden, generator=g) * 4).to(torch.bfloat16) for t in tokens]
    ids = [
        torch.stack([torch.randperm(cfg.num_experts, generator=g)[: cfg.topk] for _ in range(t)])
        for t in tokens
    ]
    ws = [torch.rand(t, cfg.topk, generator=g) for t in tokens]
    ref = dispatch_reference(xs, ids, cfg.num_experts)
    rounds = int(args.get("rounds", "2"))
    for _ in range(rounds):
        d = a2a.dispatch(xs[rank], ids[rank], ws[rank])
        ours = ref[rank]
        assert torch.equal(d.tokens_per_expert.cpu(), ours.tokens_per_expert)
        valid = ours.origin[:, 0] >= 0
        assert torch.equal(d.expert_x[valid].view(torch.uint8), ours.expert_x[valid].view(torch.uint8))
        y = (d.expert_x.float() * 0.75 + 0.5).to(torch.bfloat16)
        out = a2a.combine(y, d)
        ys = [(r.expert_x.float() * 0.75 + 0.5).to(torch.bfloat16) for r in ref]
        expected = combine_reference(ys, ref, ws)[rank]
        torch.testing.assert_close(out.float(), expected.float(), rtol=1.6e-2, atol=1e-2)
    return {"rounds": rounds, "tokens": tokens[rank]}


def a2a_rate(group: object, rank: int, world: int, args: dict[str, str]) -> dict[str, object]:
    from moe_a2a.all_to_all import AllToAll, Config

    tokens, hidden, steps = int(args["tokens"]), int(args["hidden"]), int(args["steps"])
    private = int(args["private"]) if "private" in args else None
    cfg = Config(
        max_tokens=tokens, hidden=hidden, num_experts=2 * world, topk=2, timeout_s=TIMEOUT_S,
        max_private_tokens=private,
    )
    a2a = AllToAll(
        cfg, comm=group, device="cpu", provider="tcp", ranks_per_node=1, num_nics=int(args["nics"])
    )
    g = torch.Generator().manual_seed(11 + rank)
    x = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16)
    # every token's two copies go to the two experts of one other rank: all traffic crosses a NIC
    peer = (rank + 1 + torch.randint(0, world - 1, (tokens,), generator=g)) % world
    ids = torch.stack([2 * peer, 2 * peer + 1], dim=1)
    w = torch.rand(tokens, 2, generator=g)
    seconds, sent = [], 0
    for step in range(steps + 1):
        dist.barrier(group)
        t0 = time.monotonic()
        d = a2a.dispatch(x, ids, w)
        a2a.combine(d.expert_x, d)
        if step == 0:
            continue  # connections and first-touch pages
        seconds.append(time.monotonic() - t0)
        sent += int(a2a.traffic().sum())
    a2a.close()
    return {"seconds": sum(seconds), "bytes": sent}


def main() -> int:
    scenario, out = sys.argv[1], sys.argv[2]
    args = dict(a.split("=", 1) for a in sys.argv[3:])
    dist.init_process_group("gloo", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(list(range(world)), backend="gloo")
    result = {"send": send, "a2a": a2a, "a2a_rate": a2a_rate}[scenario](group, rank, world, args)
    with open(out, "w") as f:
        json.dump({"rank": rank, **result}, f)
    dist.barrier(group)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
