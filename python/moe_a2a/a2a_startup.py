"""An AllToAll's start-up: its arguments checked, the core's config, the workspace mapped on
every rank of the node, the engine leased and the backend started (collective steps).

Each step that can fail on one rank runs inside `Bootstrap.together`, so it fails on all.
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from moe_a2a import _core, gpu_direct, switches
from moe_a2a.a2a_types import COMBINE_DTYPES, DEVICES, DISPATCH_DTYPES, Config
from moe_a2a.backends.common import CORE_DTYPE, Backend, Setup
from moe_a2a.bootstrap import Bootstrap
from moe_a2a.fabric import EngineLease, lease_engine
from moe_a2a.nics import current_gpu_address


def check_arguments(cfg: Config, device: str, graph_safe: bool, abort_on_error: bool | None) -> None:
    """This rank's checks of the constructor's arguments (and of the switches)."""
    if abort_on_error is not None and not isinstance(abort_on_error, bool):
        raise ValueError(f"abort_on_error: got {abort_on_error!r}; expected True, False or None")
    if not isinstance(cfg, Config):
        raise TypeError(f"cfg: got {type(cfg).__name__}; expected moe_a2a.Config")
    if device not in DEVICES:
        raise ValueError(f"device: got {device!r}; expected one of {list(DEVICES)}")
    if graph_safe and device != "cuda":
        raise ValueError("graph_safe: only device='cuda' has CUDA graphs to capture")
    if device == "cuda":
        from moe_a2a.backends.cuda import MAX_TOPK as CUDA_MAX_TOPK
        from moe_a2a.backends.cuda import cuda_available

        reason = cuda_available()
        if reason is not None:
            raise RuntimeError(f"device='cuda': {reason}")
        if cfg.topk > CUDA_MAX_TOPK:
            raise ValueError(f"topk: got {cfg.topk}; device='cuda' takes at most {CUDA_MAX_TOPK}")
    switches.check_all()  # a mistyped switch is an error, not a silent default


def core_config(cfg: Config, rank: int, world_size: int, ranks_per_node: int, slice_bytes: int = 0) -> Any:
    """The core's `A2AConfig` of one rank, `max_private_tokens` and `max_recv_tokens` resolved
    (its `instance` is set once the engine is leased). The memory plan sizes the same one."""
    c = _core.A2AConfig()
    c.rank, c.world, c.ranks_per_node = rank, world_size, ranks_per_node
    c.max_tokens, c.hidden, c.num_experts, c.topk = cfg.max_tokens, cfg.hidden, cfg.num_experts, cfg.topk
    c.dispatch_dtype = CORE_DTYPE[DISPATCH_DTYPES[cfg.dispatch_dtype]]
    c.combine_dtype = CORE_DTYPE[COMBINE_DTYPES[cfg.combine_dtype]]
    c.expert_padding = cfg.expert_padding
    c.max_private_tokens, c.max_recv_tokens = cfg.resolved(world_size)
    c.timeout_s = float(cfg.timeout_s)
    c.slice_bytes = slice_bytes
    if cfg.fabric_rows == "auto":  # the mode is the instance's: Config.fabric_rows_for
        raise ValueError("fabric_rows: got 'auto'; expected the mode resolved by Config.fabric_rows_for")
    c.fabric_rows = getattr(_core.FabricRows, cfg.fabric_rows)
    return c


def open_workspace(boot: Bootstrap, core_cfg: Any, node: set[int], share_rows: bool) -> Any:
    """This rank's workspace, with every same-node peer's mapped (collective). In a rejoin
    (moe_a2a.rejoin) every rank offers its segment's reopen path, which outlives the name: the
    replacement maps the survivors' here, the survivors map the replacement's later (`reuse_workspace`)."""
    name = f"/moe-a2a-{os.getpid()}-{uuid.uuid4().hex[:12]}-r{boot.rank}"
    with boot.together("allocating the workspace"):
        workspace = _core.Workspace(core_cfg, name, share_rows)
    offered = workspace.reopen_path() if getattr(boot, "joining", None) else name
    names = boot.allgather(offered.encode())
    with boot.together("mapping the node's workspaces"):
        workspace.map_node([n.decode() if r in node else "" for r, n in enumerate(names)])
    boot.barrier()  # everyone has mapped everyone: the names can go
    workspace.unlink()
    return workspace


def reuse_workspace(boot: Bootstrap, reuse: Any) -> None:
    """`open_workspace`'s collectives on a survivor of a rejoin: its own workspace stays; the
    replacements' paths are kept for the backend's step, which maps them once nothing reads
    the old ones."""
    with boot.together("allocating the workspace"):
        pass
    names = boot.allgather(reuse.setup.workspace.reopen_path().encode())
    reuse.paths = {r: names[r].decode() for r in reuse.joining if r in reuse.setup.node}
    with boot.together("mapping the node's workspaces"):
        pass
    boot.barrier()


@dataclass(frozen=True)
class Opened:
    """What `open_backend` started: the engine lease (None with no remote peer), the session and
    the backend that drives it."""

    lease: EngineLease | None
    setup: Setup
    backend: Backend


def open_backend(
    boot: Bootstrap,
    cfg: Config,
    core_cfg: Any,
    device: str,
    provider: str,
    num_nics: int,
    nics: Sequence[str] | str | None,
    graph_safe: bool,
) -> Opened:
    """Lease the engine, open and register the workspace, start the backend (collective). A step
    that fails fails on every rank, before anyone wrote: what was made so far is released."""
    topo = boot.topology
    node = set(topo.node_ranks)
    remote_peers = [r for r in range(topo.world_size) if r not in node]
    reuse = getattr(boot, "reuse", None)
    if reuse is not None:
        return _reopen_backend(boot, reuse, device, provider, num_nics, nics, graph_safe, remote_peers)
    lease: EngineLease | None = None
    setup: Setup | None = None
    try:
        # No engine (no endpoint, thread or /dev/shm file) where every peer shares our node.
        gpu = current_gpu_address() if device == "cuda" else None
        forced = switches.get("MOE_A2A_GPU_DIRECT")
        ask = device == "cuda" and forced is not False
        lease = None
        if remote_peers:
            lease = lease_engine(boot, provider, num_nics, nics=nics, gpu=gpu, gpu_memory=ask)
        core_cfg.instance = lease.slot if lease else 0
        engine = lease.engine if lease else None
        setup = Setup(
            cfg=cfg,
            core_cfg=core_cfg,
            workspace=None,
            engine=engine,
            region=None,  # no engine: nothing registered
            group=None,
            remote_peers=remote_peers,
            node=node,
            bootstrap=boot,
            pids=[],
        )
        # Same-node peers read our rows only on the CPU backend; elsewhere the rows
        # are private memory (huge pages where the kernel gives them, which the
        # fabric moves faster than shared memory's 4 KB pages).
        setup.workspace = open_workspace(boot, core_cfg, node, share_rows=device == "cpu" and len(node) > 1)
        if engine is not None:
            with boot.together("registering the workspace"):
                setup.region = engine.core.register_region(setup.workspace.ptr, setup.workspace.size)
            setup.remotes = engine.exchange_region(setup.region, bootstrap=boot)
            with boot.together("creating the peer group"):
                setup.group = engine.group(remote_peers, setup.remotes, setup.rails)
        setup.pids = boot.local_pids()
        setup.transfer = choose_transfer(boot, setup, device, provider, forced, graph_safe)
        return Opened(lease, setup, _start_backend(boot, setup, device, graph_safe))
    except BaseException:
        if lease is not None:  # every rank failed at the same step: nobody wrote yet
            if setup is not None:
                lease.close(setup.region, setup.group, setup.workspace, 0.0)
            else:
                lease.close(None, None, None, 0.0)
        raise


def _reopen_backend(
    boot: Bootstrap,
    reuse: Any,
    device: str,
    provider: str,
    num_nics: int,
    nics: Sequence[str] | str | None,
    graph_safe: bool,
    remote_peers: list[int],
) -> Opened:
    """`open_backend`'s collectives on a survivor of a rejoin (moe_a2a.rejoin), step for step as
    the replacement runs them: the engine, workspace and registration stay; only the replacements
    are connected, their regions added and their segments mapped. Releases nothing on failure:
    the survivor's masked instance serves on."""
    setup, lease = reuse.setup, reuse.lease
    setup.bootstrap = boot
    gpu = current_gpu_address() if device == "cuda" else None
    forced = switches.get("MOE_A2A_GPU_DIRECT")
    ask = device == "cuda" and forced is not False
    if remote_peers:
        lease_engine(boot, provider, num_nics, nics=nics, gpu=gpu, gpu_memory=ask, rejoining=lease)
    reuse_workspace(boot, reuse)
    engine = setup.engine
    if engine is not None:
        with boot.together("registering the workspace"):
            pass
        setup.remotes = engine.exchange_region(setup.region, reuse.joining, setup.remotes, boot)
        with boot.together("creating the peer group"):
            setup.remote_peers = remote_peers
            setup.group = engine.group(remote_peers, setup.remotes, setup.rails)
    setup.pids = boot.local_pids()
    was = setup.transfer
    setup.transfer = choose_transfer(boot, setup, device, provider, forced, graph_safe)
    if setup.transfer.path != was.path:  # every rank sees the same agreed path
        raise RuntimeError(
            f"the rows' path is {setup.transfer.path!r} with the replacement(s) {list(reuse.joining)}, "
            f"but the survivors use {was.path!r} ({setup.transfer.why}); start the replacement as the "
            "survivors were"
        )
    return Opened(lease, setup, _start_backend(boot, setup, device, graph_safe, reuse))


def choose_transfer(
    boot: Bootstrap, setup: Setup, device: str, provider: str, forced: bool | None, graph_safe: bool
) -> Any:
    """The rows' path over the fabric, agreed by every rank (collective; moe_a2a.gpu_direct)."""
    engine = setup.engine
    caps = [engine.capabilities(i) for i in range(engine.core.num_nics)] if engine is not None else None
    cfg = setup.cfg
    width = max(DISPATCH_DTYPES[cfg.dispatch_dtype].itemsize, COMBINE_DTYPES[cfg.combine_dtype].itemsize)
    largest = gpu_direct.largest_write(setup.core_cfg, cfg.hidden * width)
    with boot.together("choosing the rows' path (GPU-direct or staged)"):
        mine = gpu_direct.choose_path(device, provider, caps, forced, largest, graph_safe)
    blobs = boot.allgather(json.dumps(mine.as_dict()).encode())
    everyone = [gpu_direct.PathChoice(**json.loads(b)) for b in blobs]
    with boot.together("agreeing on the rows' path"):
        return gpu_direct.agree(everyone, forced)


def _start_backend(
    boot: Bootstrap, setup: Setup, device: str, graph_safe: bool, reuse: Any = None
) -> Backend:
    first_epoch = getattr(boot, "first_epoch", 0)  # after a rejoin the calls go on from the survivors'
    if device == "cuda":
        from moe_a2a.backends.cuda import CudaBackend

        if reuse is not None:
            reuse.backend.rejoin(setup, reuse, first_epoch)
            return reuse.backend
        return CudaBackend(setup, graph_safe, first_epoch)
    from moe_a2a.backends.cpu import CpuBackend

    with boot.together("starting the cpu backend"):
        if reuse is not None:
            reuse.forget_old_peers()
            for r, path in reuse.paths.items():
                setup.workspace.remap_peer(r, path)
        backend = CpuBackend(setup, None, first_epoch)
        if reuse is not None:
            reuse.built = backend  # a rejoin that fails after this stops it
    return backend
