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
  titan TorchTitan's own MoE with MoeA2ATokenDispatcher, one rank per emulated host,
        against the whole module with its LocalTokenDispatcher in this process:
        the output, the input's gradient and every parameter's gradient, then
        `steps` SGD steps whose global losses must follow the reference's.
  node  the ranks' node layout as the bootstrap finds it from host names (several ranks
        per emulated host), then dispatch and combine across those nodes, exactly equal
        to moe_a2a.reference (fp32 combine).
  death one rank per emulated host; rank `victim` writes its report and SIGKILLs itself in
        call `at`, before its dispatch, while the others wait for it with nothing in flight
        to it: each survivor reports the error and when it came (the kill is noticed by the
        engine's control connection, not by a write or the timeout).
  mask  one rank per emulated host, on_peer_loss="mask": rank `victim` SIGKILLs itself in
        call `at`, after sending its rows; the survivors, each on another host, agree over
        their control connections, mask it and go on to call `calls`, each call's output
        equal to the reference with the lost rank's experts masked. With `rejoin_at`, the
        survivors call rejoin(`key`) there, meeting a replacement started with REPLACEMENT_KEY
        in rank 0's TCPStore (MOE_A2A_REJOIN_STORE), and the full reference holds again.
  finish
        rank 1's script ends right after its last call (no close, no collective), that call's
        combine rows to rank 0 still queued for its rate-limited NIC: rank 0's tokens all pick
        rank 1's experts, so the whole combine flows from rank 1 to rank 0. The other ranks
        report how their last call ended, and whether its output equals their input.
        `teardown=0`: rank 1 runs the exit hook and ends at once (os._exit), without the
        interpreter's teardown, in which the rows have time to drain before its end.
  a2a_rate
        timed dispatch + combine steps (after one untimed step) with one rank per
        emulated host; each rank reports its seconds and the payload bytes it sent
        to remote peers (AllToAll.traffic), to compare with its NICs' rate.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

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


def node(group: object, rank: int, world: int, args: dict[str, str]) -> dict[str, object]:
    import socket

    from moe_a2a.all_to_all import AllToAll, Config
    from moe_a2a.reference import combine_reference, dispatch_reference

    topo = Bootstrap(group).topology  # ranks per node from host names, as a job would
    cfg = Config(max_tokens=24, hidden=160, num_experts=2 * world, topk=3, combine_dtype="fp32",
                 timeout_s=TIMEOUT_S)  # fmt: skip
    a2a = AllToAll(cfg, comm=group, device="cpu", provider="tcp", num_nics=2)
    g = torch.Generator().manual_seed(17)
    tokens = [int(torch.randint(0, cfg.max_tokens + 1, (1,), generator=g)) for _ in range(world)]
    xs = [(torch.randn(t, cfg.hidden, generator=g) * 3).to(torch.bfloat16) for t in tokens]
    ids = [torch.stack([torch.randperm(cfg.num_experts, generator=g)[: cfg.topk] for _ in range(t)])
           .reshape(t, cfg.topk) for t in tokens]  # fmt: skip
    ws = [torch.rand(t, cfg.topk, generator=g) for t in tokens]
    ref = dispatch_reference(xs, ids, cfg.num_experts)
    d = a2a.dispatch(xs[rank], ids[rank], ws[rank])
    ours = ref[rank]
    assert torch.equal(d.tokens_per_expert.cpu(), ours.tokens_per_expert)
    valid = ours.origin[:, 0] >= 0
    assert torch.equal(d.expert_x[valid].view(torch.uint8), ours.expert_x[valid].view(torch.uint8))
    y = (d.expert_x.float() * 0.5 - 1.0).to(torch.bfloat16)
    out = a2a.combine(y, d)
    ys = [(r.expert_x.float() * 0.5 - 1.0).to(torch.bfloat16) for r in ref]
    expected = combine_reference(ys, ref, ws, "fp32", a2a.cfg.fabric_rows, topo.local_size)[rank]
    assert torch.equal(out, expected), f"combine differs by up to {(out - expected).abs().max()}"
    traffic = a2a.traffic()  # [peer, path]: path 0 within the node, 1 across the fabric
    a2a.close()
    return {
        "host": socket.gethostname(),
        "node_ranks": list(topo.node_ranks),
        "local_size": topo.local_size,
        "tokens": tokens[rank],
        "node_bytes": traffic[:, 0].tolist(),
        "fabric_bytes": traffic[:, 1].tolist(),
    }


def titan(group: object, rank: int, world: int, args: dict[str, str]) -> dict[str, object]:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from torch.distributed.device_mesh import init_device_mesh

    import titan_case as tc

    seed, steps = int(args["seed"]), int(args["steps"])
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    mine = tc.ours(
        args["router"], seed, mesh, rank, world, provider="tcp", ranks_per_node=1, num_nics=int(args["nics"])
    )
    ref = tc.reference(args["router"], seed)
    xs, gs = tc.batch(seed, world)
    total = sum(x.shape[1] for x in xs)
    lo = sum(x.shape[1] for x in xs[:rank])
    opt_m = torch.optim.SGD(mine.parameters(), lr=0.001)
    opt_r = torch.optim.SGD(ref.parameters(), lr=0.001)
    losses_m, losses_r = [], []
    for step in range(steps + 1):
        opt_m.zero_grad()
        x = xs[rank].clone().requires_grad_()
        loss = tc.loss_of(mine(x), gs[rank], total)
        loss.backward()
        for name, p in mine.named_parameters():  # data parallelism's sum of the replicated ones
            if "inner_experts" not in name and p.grad is not None:
                dist.all_reduce(p.grad, group=group)
        opt_r.zero_grad()
        ref_x = torch.cat(xs, dim=1).requires_grad_()
        ref_loss = tc.loss_of(ref(ref_x), torch.cat(gs, dim=1), total)
        ref_loss.backward()
        if step == 0:  # every gradient, before any step changes the weights
            assert x.grad is not None and ref_x.grad is not None
            want = ref_x.grad[:, lo : lo + x.shape[1]]
            assert tc.max_err(x.grad, want) <= 2e-2 * tc.scale(want), "the input's gradient differs"
            tc.compare_grads(mine, ref, rank, world, 2e-2)
        opt_m.step()
        opt_r.step()
        total_loss = loss.detach().clone()
        dist.all_reduce(total_loss, group=group)
        losses_m.append(float(total_loss))
        losses_r.append(float(ref_loss))
    err = max(abs(a - b) for a, b in zip(losses_m, losses_r, strict=True))
    assert err <= 0.02 * max(1.0, max(abs(r) for r in losses_r)), f"{losses_m} vs {losses_r}"
    assert losses_r[-1] < losses_r[0], f"the reference did not train: {losses_r}"
    return {"losses": losses_m, "reference": losses_r, "tokens": xs[rank].shape[1]}


def a2a_rate(group: object, rank: int, world: int, args: dict[str, str]) -> dict[str, object]:
    from moe_a2a.all_to_all import AllToAll, Config

    tokens, hidden, steps = int(args["tokens"]), int(args["hidden"]), int(args["steps"])
    private = int(args["private"]) if "private" in args else None
    cfg = Config(
        max_tokens=tokens,
        hidden=hidden,
        num_experts=2 * world,
        topk=2,
        timeout_s=TIMEOUT_S,
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


def death(group: object, rank: int, world: int, args: dict[str, str], out: str) -> dict[str, object]:
    from moe_a2a.all_to_all import AllToAll, Config

    victim, at = int(args["victim"]), int(args["at"])
    cfg = Config(max_tokens=8, hidden=64, num_experts=2 * world, topk=2, timeout_s=TIMEOUT_S)
    a2a = AllToAll(cfg, comm=group, device="cpu", provider="tcp", ranks_per_node=1, num_nics=1)
    g = torch.Generator().manual_seed(11 + rank)
    x = torch.randn(cfg.max_tokens, cfg.hidden, generator=g).to(torch.bfloat16)
    picks = [torch.randperm(cfg.num_experts, generator=g)[: cfg.topk] for _ in range(cfg.max_tokens)]
    ids = torch.stack(picks)
    w = torch.rand(cfg.max_tokens, cfg.topk, generator=g)
    for call in range(at + 1):
        if rank == victim and call == at:
            time.sleep(0.5)  # the survivors' rows to us have landed; they wait for ours
            with open(out, "w") as f:
                json.dump({"rank": rank, "killed_at": time.time()}, f)
            os.kill(os.getpid(), signal.SIGKILL)
        t0 = time.monotonic()
        try:
            d = a2a.dispatch(x, ids, w)
            a2a.combine(d.expert_x, d)
        except Exception as e:  # the call that saw the loss
            seconds = time.monotonic() - t0
            return {"call": call, "noticed_at": time.time(), "seconds": seconds, "error": str(e)}
    return {"call": None}


def mask(group: object, rank: int, world: int, args: dict[str, str], out: str) -> dict[str, object]:
    from moe_a2a import PeerLostError, rejoin
    from moe_a2a.all_to_all import AllToAll, Config

    victim, at, calls = int(args["victim"]), int(args["at"]), int(args["calls"])
    rejoin_at = int(args.get("rejoin_at", -1))
    replacing = "REPLACEMENT_KEY" in os.environ
    meeting = time.time()
    if replacing:  # the lost rank's replacement: it meets the survivors in the store
        group = rejoin.replacement(os.environ["REPLACEMENT_KEY"], rank, world, timeout_s=60.0)
    T, H, E, K = 8, 64, 4 * world, 2
    # Rows per expert: the origin sums each token's rows in k order, as the reference below does.
    cfg = Config(
        max_tokens=T,
        hidden=H,
        num_experts=E,
        topk=K,
        timeout_s=TIMEOUT_S,
        on_peer_loss="mask",
        fabric_rows="expert",
    )
    a2a = AllToAll(cfg, comm=group, device="cpu", provider="tcp", ranks_per_node=1, num_nics=1)
    L = E // world

    def inputs(step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randn(T, H, generator=g).to(torch.bfloat16)
        ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(torch.int32)
        return x, ids, torch.rand(T, K, generator=g)

    def expert(x: torch.Tensor, e: int) -> torch.Tensor:
        return (x.float() * (1.0 + 0.25 * e)).to(torch.bfloat16)

    checked = masked_calls = 0
    noticed_at = first_masked_at = rejoined_at = rejoin_s = None
    joined_at = a2a.epoch if replacing else None
    join_s = time.time() - meeting if replacing else None  # from the meeting to the instance built
    while a2a.epoch < calls:
        step = a2a.epoch  # every survivor resumes at the same epoch after the loss
        if step == rejoin_at and a2a.masked_ranks:
            t0 = time.time()
            a2a.rejoin(args["key"])
            rejoined_at, rejoin_s = time.time(), time.time() - t0
        x, ids, w = inputs(step)
        if rank == victim and step == at and not replacing:
            a2a.dispatch(x, ids, w, recv=False)  # mid-call: our rows sent, nothing received
            with open(out, "w") as f:
                json.dump({"rank": rank, "killed_at": time.time()}, f)
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            d = a2a.dispatch(x, ids, w)
            start = d.tokens_per_expert.cumsum(0) - d.tokens_per_expert
            y = torch.empty_like(d.expert_x)
            for i in range(L):
                a, n = int(start[i]), int(d.tokens_per_expert[i])
                y[a : a + n] = expert(d.expert_x[a : a + n], rank * L + i)
            got = a2a.combine(y, d)
        except PeerLostError:
            noticed_at = time.time()
            continue
        masked = a2a.masked_ranks
        ref = torch.zeros(T, H)
        for t in range(T):
            for k in range(K):
                if int(ids[t, k]) // L not in masked:
                    ref[t] += w[t, k] * expert(x[t], int(ids[t, k])).float()
        assert torch.equal(got, ref.to(torch.bfloat16)), f"rank {rank} call {step} differs from the reference"
        checked += 1
        if masked:
            masked_calls += 1
            first_masked_at = first_masked_at or time.time()
    # Leave together: a rank that exits while another still waits for its last rows is a loss.
    import datetime

    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
        timeout=datetime.timedelta(seconds=TIMEOUT_S),
    )  # fmt: skip
    live = world - len(a2a.masked_ranks)
    deadline = time.monotonic() + TIMEOUT_S
    for step in ("mask-done", "mask-left"):  # rank 0 hosts the store: it leaves last
        store.add(step, 1)
        while (
            (step == "mask-done" or rank == 0) and store.add(step, 0) < live and time.monotonic() < deadline
        ):
            time.sleep(0.02)
    return {
        "checked": checked,
        "masked": list(a2a.masked_ranks),
        "masked_calls": masked_calls,
        "noticed_at": noticed_at,
        "first_masked_at": first_masked_at,
        "rejoined_at": rejoined_at,
        "rejoin_s": rejoin_s,
        "join_s": join_s,
        "joined_at": joined_at,
    }


def finish(group: object, rank: int, world: int, args: dict[str, str], out: str) -> dict[str, object]:
    from moe_a2a.all_to_all import AllToAll, Config

    T, H, E = int(args["tokens"]), int(args["hidden"]), 2 * world
    cfg = Config(max_tokens=T, hidden=H, num_experts=E, topk=1, timeout_s=TIMEOUT_S)
    a2a = AllToAll(cfg, comm=group, device="cpu", provider="tcp", ranks_per_node=1, num_nics=1)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(rank)).to(torch.bfloat16)
    # Rank 0's tokens go to rank 1's first expert; every other rank's stay at home.
    ids = torch.full((T, 1), 2 if rank == 0 else 2 * rank, dtype=torch.int32)
    w = torch.ones(T, 1)
    d = a2a.dispatch(x, ids, w)  # a first call: every connection is up before the one that counts
    a2a.combine(d.expert_x, d)
    dist.barrier(group)
    t0 = time.monotonic()
    d = a2a.dispatch(x, ids, w)
    try:
        y = a2a.combine(d.expert_x, d)
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}", "seconds": time.monotonic() - t0}
    if rank == 1:
        with open(out, "w") as f:
            json.dump({"rank": rank, "left_at": time.time()}, f)
        if args.get("teardown") == "0":  # the interpreter's exit without the time its teardown takes
            from moe_a2a import fabric

            fabric._leave_at_exit()  # what atexit runs first
            os._exit(0)
        sys.exit(0)  # the script ends: no close, no collective
    return {"error": None, "seconds": time.monotonic() - t0, "equal": bool(torch.equal(y, x))}


def main() -> int:
    scenario, out = sys.argv[1], sys.argv[2]
    args = dict(a.split("=", 1) for a in sys.argv[3:])
    if "REPLACEMENT_KEY" in os.environ:  # not a member of the launcher's group: it meets the survivors
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        with open(out, "w") as f:
            json.dump({"rank": rank, **mask(None, rank, world, args, out)}, f)
        os._exit(0)
    dist.init_process_group("gloo", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(list(range(world)), backend="gloo")
    lossy = {"death": death, "mask": mask, "finish": finish}.get(scenario)
    if lossy is not None:  # a peer is gone: no collective may follow, nor a close that waits
        with open(out, "w") as f:
            json.dump({"rank": rank, **lossy(group, rank, world, args, out)}, f)
        os._exit(0)
    scenarios = {"send": send, "a2a": a2a, "a2a_rate": a2a_rate, "titan": titan, "node": node}
    result = scenarios[scenario](group, rank, world, args)
    with open(out, "w") as f:
        json.dump({"rank": rank, **result}, f)
    dist.barrier(group)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
