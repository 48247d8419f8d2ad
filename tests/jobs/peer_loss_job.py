"""Run by test_peer_loss.py: WORLD_SIZE ranks over torch.distributed (gloo) on one host, an AllToAll
with on_peer_loss="mask"; rank KILL SIGKILLs itself in the middle of call KILL_AT of a loop of
decode-sized calls. Every survivor checks each call's output against the reference with the
lost rank's experts masked, and prints one line per event.

Over torch.distributed where RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT are set; else under
mpirun, which ends the whole job as soon as a rank dies unless told not to (docs/peer-loss.md).
Arguments: provider, calls, kills ("rank:call,..."),
then "renormalize" or nothing. RANKS_PER_NODE=2 lays the ranks out as virtual nodes of 2, so that
peers on the other node are reached over the fabric and masked across nodes.
MOE_A2A_TEST_DEVICE=cuda runs the calls on the GPU (every rank on device 0, as on the H200);
PEER_LOSS_GRAPH=1 there runs each call as a CUDA graph replay (graph_safe=True): the survivors learn
of the loss at `check()`, a replay of the graph captured before it is refused (StaleGraphError),
and they capture the step again.

Rejoins (docs/peer-loss.md, "Rejoin"): with REJOIN_AT="step:key,...", the survivors call
`a2a.rejoin(key)` before the call of each such step where a rank is masked; a process started
with REPLACEMENT_KEY=key and RANK=r (test_peer_loss.py starts it once rank r has died) replaces
rank r through `moe_a2a.rejoin.replacement` and joins the loop at the survivors' epoch.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

from moe_a2a import AllToAll, Config, PeerLostError, StaleGraphError, rejoin

# A job the test finds hung gets SIGUSR1 before it is killed: every thread's stack, to say where.
faulthandler.register(signal.SIGUSR1, all_threads=True)

provider, calls = sys.argv[1], int(sys.argv[2])
DEVICE = os.environ.get("MOE_A2A_TEST_DEVICE", "cpu")
if DEVICE == "cuda":
    torch.cuda.set_device(0)
kills = {int(r): int(c) for r, c in (kill.split(":") for kill in sys.argv[3].split(","))}
renormalize = len(sys.argv) > 4 and sys.argv[4] == "renormalize"
started = time.time()
rejoin_at = {int(a): k for a, k in (r.split(":") for r in os.environ.get("REJOIN_AT", "").split(",") if r)}
if "REPLACEMENT_KEY" in os.environ:  # the launcher's group lost this rank: meet the survivors
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    comm = rejoin.replacement(os.environ["REPLACEMENT_KEY"], rank, world, timeout_s=60.0)
    PIDS = [os.getpid()]
elif "RANK" in os.environ:  # torch.distributed's variables (torchrun sets them too)
    dist.init_process_group("gloo")
    comm = dist.group.WORLD
    rank, world = dist.get_rank(), dist.get_world_size()
    PIDS = [0] * world
    dist.all_gather_object(PIDS, os.getpid())
else:  # mpirun, with a launcher option that keeps the survivors (docs/peer-loss.md)
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, world = comm.Get_rank(), comm.Get_size()
    PIDS = comm.allgather(os.getpid())
E, K, T, H = 4 * world, 2, 4, 64
H += 8 * int(os.environ.get("REPLACEMENT_BAD", "0"))  # a replacement with another hidden size
cfg = Config(
    max_tokens=T,
    hidden=H,
    num_experts=E,
    topk=K,
    timeout_s=2.0 if os.environ.get("PEER_LOSS_GRAPH") == "1" else 30.0,  # a graph's kernels wait 2x+1 s
    on_peer_loss="mask",
    mask_renormalize=renormalize,
    # Across nodes, rows per expert: the origin sums every row in k order, as the reference does
    # (rows per rank would sum a node's part at the experts first, in other roundings).
    fabric_rows="expert" if os.environ.get("RANKS_PER_NODE") else "rank",
)
RPN = int(os.environ.get("RANKS_PER_NODE", "0")) or None  # 2: two virtual nodes of 2 ranks each
GRAPH = os.environ.get("PEER_LOSS_GRAPH") == "1"
a2a = AllToAll(cfg, comm, device=DEVICE, provider=provider, ranks_per_node=RPN, graph_safe=GRAPH)
# LAYERS > 1: more instances on the same engine (a model's layers), each losing the rank in its
# own call and rejoining with its own key ("{key}-l{i}") right after the first.
layers: list[AllToAll] = []
for i in range(1, int(os.environ.get("LAYERS", "1"))):
    layer_comm = comm
    if "REPLACEMENT_KEY" in os.environ:
        layer_comm = rejoin.replacement(f"{os.environ['REPLACEMENT_KEY']}-l{i}", rank, world, timeout_s=60.0)
    layers.append(AllToAll(cfg, layer_comm, device=DEVICE, provider=provider, ranks_per_node=RPN))
L = E // world
if rank == 0:
    print(f"peer_loss_job: rows path {a2a.rows_path['path']}", flush=True)
if "REPLACEMENT_KEY" in os.environ:
    print(
        f"peer_loss_job: rank {rank} replacement joined at epoch {a2a.epoch} "
        f"{time.time() - started:.3f} s after it started",
        flush=True,
    )


def inputs(step: int, r: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + r)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(torch.int32)
    w = torch.rand(T, K, generator=g)
    return x, ids, w


def expert(x: torch.Tensor, e: int) -> torch.Tensor:
    return (x.float() * (1.0 + 0.25 * e)).to(torch.bfloat16)


def reference(step: int, masked: tuple[int, ...]) -> torch.Tensor:
    """out[t] = sum over k not on a masked rank of w[t,k] * expert(x[t], e), fp32 in k order."""
    x, ids, w = inputs(step, rank)
    keep = torch.tensor([[int(e) // L not in masked for e in row] for row in ids])
    kept = w * keep
    if renormalize:
        left = kept.sum(1, keepdim=True)
        kept = torch.where(
            left != 0, kept * (w.sum(1, keepdim=True) / torch.where(left != 0, left, 1.0)), kept
        )
    out = torch.zeros(T, H)
    for t in range(T):
        for k in range(K):
            if keep[t, k]:
                out[t] += kept[t, k] * expert(x[t], int(ids[t, k])).float()
    return out.to(torch.bfloat16), ~keep


def step_of(inst: AllToAll, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> tuple[Any, torch.Tensor]:
    """One eager decode step of `inst`: dispatch, expert() on each local expert's rows, combine."""
    d = inst.dispatch(x, ids, w)
    counts = d.tokens_per_expert.cpu()
    start = counts.cumsum(0) - counts
    y = torch.empty_like(d.expert_x)
    for i in range(L):
        a, n = int(start[i]), int(counts[i])
        y[a : a + n] = expert(d.expert_x[a : a + n], rank * L + i)
    return d, inst.combine(y, d).cpu()


def fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def mapped() -> int:
    """Mappings of the node's workspaces (ours and our peers'): a rejoin must unmap the old ones."""
    with open("/proc/self/maps") as f:
        return sum("/dev/shm/moe-a2a-" in line for line in f)


def shm_files() -> int:
    """/dev/shm files of this job's processes (others' jobs may share the host)."""
    ours = tuple(p for pid in PIDS for p in (f"moe-a2a-{pid}-", f"{pid}:"))  # workspaces, libfabric shm
    return sum(name.startswith(ours) for name in os.listdir("/dev/shm"))


def graph_expert(d: object) -> torch.Tensor:
    """expert() of every filled row without the host: each row's expert from tokens_per_expert."""
    counts = d.tokens_per_expert.to(torch.int64)  # type: ignore[attr-defined]
    ends = counts.cumsum(0)
    rows = torch.arange(d.expert_x.shape[0], device=counts.device)  # type: ignore[attr-defined]
    local = torch.searchsorted(ends, rows, right=True).clamp(max=L - 1)
    factor = 1.0 + 0.25 * (rank * L + local).float()
    return (d.expert_x.float() * factor[:, None]).to(torch.bfloat16)  # type: ignore[attr-defined]


def graph_loop() -> None:
    """Every call a replay of one captured step; inputs copied into its static buffers first."""
    xs = torch.zeros(T, H, dtype=torch.bfloat16, device="cuda")
    idss = torch.zeros(T, K, dtype=torch.int32, device="cuda")
    ws = torch.zeros(T, K, device="cuda")

    def step_fn() -> tuple[torch.Tensor, object]:
        d = a2a.dispatch(xs, idss, ws)
        return a2a.combine(graph_expert(d), d), d

    def load(step: int) -> None:
        x, ids, w = inputs(step, rank)
        xs.copy_(x)
        idss.copy_(ids)
        ws.copy_(w)

    def check_out(step: int, out: torch.Tensor, d: object) -> None:
        ref, dropped = reference(step, a2a.masked_ranks)
        if a2a.masked_ranks:
            assert torch.equal(d.dropped.cpu(), dropped), step  # type: ignore[attr-defined]
        assert torch.equal(out.cpu(), ref), (
            f"rank {rank} step {step}: {(out.float().cpu() - ref.float()).abs().max()}"
        )

    done = 0  # calls started: the device's epoch
    checked = masked_checked = 0
    graph = None
    seen = 0
    while done < calls:
        try:
            if graph is None:  # warm up eagerly (a call of its own), then capture
                load(done)
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    out, d = step_fn()
                torch.cuda.current_stream().wait_stream(side)
                torch.cuda.synchronize()
                done += 1
                a2a.check()
                check_out(done - 1, out, d)
                checked += 1
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    out, d = step_fn()
                continue
            if kills.get(rank) == done:
                print(f"peer_loss_job: rank {rank} killed at {time.time():.6f}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            load(done)
            graph.replay()
            torch.cuda.synchronize()
            done += 1
            a2a.check()
        except PeerLostError as exc:
            print(f"peer_loss_job: rank {rank} masked {exc.lost} resume {exc.epoch}: {exc}", flush=True)
            done = exc.epoch
            assert graph is not None
            graph.replay()  # captured before the loss: refused, having done nothing
            torch.cuda.synchronize()
            try:
                a2a.check()
            except StaleGraphError as stale:
                print(f"peer_loss_job: rank {rank} stale replay refused: {stale}", flush=True)
            graph = None
            continue
        check_out(done - 1, out, d)
        checked += 1
        if a2a.masked_ranks:
            masked_checked += 1
            if len(a2a.masked_ranks) > seen:
                seen = len(a2a.masked_ranks)
                now = time.time()
                print(
                    f"peer_loss_job: rank {rank} first call with {a2a.masked_ranks} masked done at {now:.6f}",
                    flush=True,
                )
    print(
        f"peer_loss_job: rank {rank} done: {checked} calls checked, {masked_checked} masked, "
        f"masked {a2a.masked_ranks}, masked_calls {a2a.masked_calls}, fds +0, /dev/shm +0 (graph mode)",
        flush=True,
    )
    a2a.close()
    os._exit(0)


if GRAPH:
    graph_loop()

killed_at = None
rejoined = "REPLACEMENT_KEY" in os.environ  # the next full call is the first after a rejoin
seen_masked = 0
checked = masked_checked = layers_checked = 0
fds_before = shm_before = maps_before = 0
while a2a.epoch < calls:
    step = a2a.epoch  # every survivor resumes at the same epoch after a loss
    if fds_before == 0 and step >= 2:  # a replacement starts later
        fds_before, shm_before, maps_before = fds(), shm_files(), mapped()
    if step in rejoin_at and a2a.masked_ranks:
        t0 = time.time()
        # A survivor keeps what it registered and connected: only the replacements are new.
        ours = (a2a._setup.workspace.ptr, a2a._setup.engine, a2a._setup.region)
        try:
            key = rejoin_at.pop(step)
            back = a2a.rejoin(key)
            for i, layer in enumerate(layers, 1):
                layer.rejoin(f"{key}-l{i}")
            print(f"peer_loss_job: rank {rank} rejoined {back} in {time.time() - t0:.3f} s", flush=True)
            kept = ours == (a2a._setup.workspace.ptr, a2a._setup.engine, a2a._setup.region)
            print(f"peer_loss_job: rank {rank} kept its workspace, engine and region: {kept}", flush=True)
            met, joined = a2a.rejoin_times
            print(f"peer_loss_job: rank {rank} met in {met:.3f} s, joined in {joined:.3f} s", flush=True)
            rejoined = True
        except rejoin.RejoinError as exc:  # the masked instance serves on
            print(f"peer_loss_job: rank {rank} rejoin refused: {exc}", flush=True)
    x, ids, w = inputs(step, rank)
    try:
        xd, idsd, wd = x.to(DEVICE), ids.to(DEVICE), w.to(DEVICE)
        if kills.get(rank) == step and "REPLACEMENT_KEY" not in os.environ:
            a2a.dispatch(xd, idsd, wd, recv=False)  # mid-call: rows sent, nothing received
            if DEVICE == "cuda":
                torch.cuda.synchronize()  # the send kernels ran: the rows are out
            print(f"peer_loss_job: rank {rank} killed at {time.time():.6f}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        d, out = step_of(a2a, xd, idsd, wd)
    except PeerLostError as exc:
        print(
            f"peer_loss_job: rank {rank} masked {exc.lost} at {time.time():.6f} resume {exc.epoch}: {exc}",
            flush=True,
        )
        continue
    masked = a2a.masked_ranks
    ref, dropped = reference(step, masked)
    if masked:
        if killed_at is None or len(masked) > seen_masked:
            seen_masked = len(masked)
            killed_at = time.time()
            print(
                f"peer_loss_job: rank {rank} first call with {masked} masked done at {killed_at:.6f}",
                flush=True,
            )
        assert d.dropped is not None and torch.equal(d.dropped.cpu(), dropped), (step, d.dropped, dropped)
        masked_checked += 1
    else:
        assert d.dropped is None
        if rejoined:
            print(
                f"peer_loss_job: rank {rank} first full call after the rejoin done at {time.time():.6f}",
                flush=True,
            )
            rejoined = False
    assert torch.equal(out, ref), f"rank {rank} step {step}: {(out.float() - ref.float()).abs().max()}"
    checked += 1
    for i, layer in enumerate(layers, 1):
        try:
            _, out = step_of(layer, xd, idsd, wd)
        except PeerLostError as exc:  # this layer's own call saw the loss
            print(f"peer_loss_job: rank {rank} layer {i} masked {exc.lost}", flush=True)
            continue
        ref, _ = reference(step, layer.masked_ranks)
        assert torch.equal(out, ref), f"rank {rank} layer {i} step {step}"
        layers_checked += 1
if isinstance(a2a._args["comm"], rejoin.NodeRendezvous):  # built by a rejoin: no reopen()
    try:
        a2a.reopen()
    except ValueError as exc:
        print(f"peer_loss_job: rank {rank} reopen refused: {exc}", flush=True)
grew = (fds() - fds_before, shm_files() - shm_before)
print(
    f"peer_loss_job: rank {rank} done: {checked} calls checked, {masked_checked} masked, "
    f"masked {a2a.masked_ranks}, masked_calls {a2a.masked_calls}, fds +{grew[0]}, /dev/shm +{grew[1]}, "
    f"workspace mappings +{mapped() - maps_before}, layers: {layers_checked} calls checked, masked "
    f"{[layer.masked_ranks for layer in layers]}",
    flush=True,
)
t0 = time.time()
for layer in layers:
    layer.close()
a2a.close()
print(f"peer_loss_job: rank {rank} closed in {time.time() - t0:.3f} s", flush=True)
os._exit(0)  # no collective teardown with a dead peer
