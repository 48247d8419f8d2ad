"""The CUDA backend: kernels on the caller's stream, CUDA IPC within a node, the proxy for the fabric.

Ranks of one node map each other's device workspaces through CUDA IPC and
write rows directly; rows for other nodes go through the host workspace
(pinned shared memory), which the host proxy moves over the fabric.

By default dispatch's receive half waits on the host until its plan kernel has
run, to learn how many rows arrived (the output's shape) and to raise what the
kernels reported (an expert id out of range: those copies were dropped, and the
instance is unusable afterwards, as after any failure but a capacity error);
it does not synchronise the stream, so the rows are still being copied when it
returns, in stream order before anything the caller enqueues next. A call
along a cached routing waits for nothing: its rows follow from the matrix on
the host, and its ids were checked by the call that made the routing.
Combine's receive half waits for its peers on the host, where timeouts and
proxy failures are raised, and returns without synchronising: the result is
ready in stream order. With `graph_safe=True` nothing synchronises: dispatch
returns buffers of `max_output_rows` rows (`tokens_per_expert` says which are
filled; with `expert_padding > 1` padding rows and the rows past the last
segment are zeros),
`combine` takes `y` of that shape, and a whole step can be captured in a CUDA
graph; errors are then raised by `AllToAll.check()`.
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np
import torch

from moe_a2a import FabricError, _core, gpu_direct, switches
from moe_a2a.backends.common import CORE_DTYPE, RecvRequest, Setup, num_scales

# The current stream's raw handle by device index (torch's private binding; None where it lacks it).
_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def cuda_available() -> str | None:
    """None when the CUDA path can run here, else why not."""
    if not getattr(_core, "HAVE_CUDA", False):
        return "moe_a2a._core was built without the CUDA kernels (no nvcc at build time)"
    if not torch.cuda.is_available():
        return "no CUDA GPU on this machine"
    return None


# The kernels keep a token's top-k rows in shared arrays of this size (kMaxTopk, rows.cuh).
MAX_TOPK = 64


def _zero_unfilled_rows(
    expert_x: torch.Tensor, scale: torch.Tensor | None, counts: torch.Tensor, padding: int
) -> None:
    """Zero every row that holds no token (padding, and in graph-safe mode the rows past the last segment).

    Torch ops on the current stream, after the receive kernels: the mask comes
    from `counts` on the device, so there is no host synchronisation and the ops
    can be captured in a CUDA graph. Filled on a byte view, since fp8 has no
    masked_fill and a multiply would keep NaN.
    """
    rows = expert_x.shape[0]
    n = counts.to(torch.int64)
    padded = (n + padding - 1) // padding * padding
    ends = torch.cumsum(padded, 0)
    row = torch.arange(rows, device=expert_x.device)
    seg = torch.searchsorted(ends, row, right=True)  # the expert segment of each row
    inside = seg < n.numel()
    seg = seg.clamp(max=n.numel() - 1)
    empty = ~(inside & (row - (ends[seg] - padded[seg]) < n[seg]))
    expert_x.view(torch.uint8).masked_fill_(empty[:, None], 0)
    if scale is not None:
        scale.masked_fill_(empty[:, None], 0.0)


def _register_device_rows(setup: Setup, impl: Any, device: int) -> tuple[Any, Any] | None:
    """GPU-direct (collective): the device workspace registered with every NIC and a group bound
    to every peer's, the proxy told to write rows from and into it. Where registration fails on
    any rank (a provider that reports FI_HMEM but whose libfabric has no CUDA, as Debian's shm),
    every rank stages instead (`setup.transfer` says why), or, with MOE_A2A_GPU_DIRECT=1,
    raises the same error; nothing of it is left registered either way."""
    boot, engine = setup.bootstrap, setup.engine
    region = group = None
    try:
        error = ""
        try:
            if switches.get("MOE_A2A_TEST_FAIL_GPU_REGISTRATION"):
                raise FabricError("registering the device workspace: MOE_A2A_TEST_FAIL_GPU_REGISTRATION")
            size = int(impl.layout["total"])
            region = engine.core.register_region(
                impl.device_workspace, size, "cuda", device, "the device workspace"
            )
        except FabricError as e:
            error = str(e)
        failed = [(r, b.decode()) for r, b in enumerate(boot.allgather(error.encode())) if b]
        if failed:
            if region is not None:
                engine.core.release(region, None)
                region = None
            rank, why = failed[0]
            if switches.get("MOE_A2A_GPU_DIRECT"):
                raise RuntimeError(f"MOE_A2A_GPU_DIRECT=1: rank {rank} could not register GPU memory: {why}")
            setup.transfer = gpu_direct.PathChoice(
                gpu_direct.STAGED,
                f"registering GPU memory failed on rank {rank}, so every rank stages: {why}",
            )
            return None
        remotes = engine.exchange_region(region, bootstrap=boot)
        setup.device_remotes = remotes  # a mask after a loss binds the live ones again
        with boot.together("binding the peers' device workspaces (GPU-direct)"):
            group = engine.group(setup.remote_peers, remotes)
            impl.rows_on_device(region, group, setup.engine.capabilities(0)["provider"] != "shm")
    except BaseException:
        if region is not None:
            engine.core.release(region, group)
        raise
    return region, group


class CudaBackend:
    """Drives `_core.CudaAllToAll` on the current CUDA device and stream."""

    ids_dtypes: tuple[torch.dtype, ...] = (torch.int32, torch.int64)
    checks_ids = True  # the routing kernel drops out-of-range ids; the receive half raises

    def __init__(self, setup: Setup, graph_safe: bool, first_epoch: int = 0) -> None:
        """`first_epoch`: dispatches already started (a rejoin's instance goes on from the
        survivors' epoch: its next call is first_epoch + 1)."""
        self.cfg = setup.cfg
        self.graph_safe = graph_safe
        self.device = torch.device("cuda", torch.cuda.current_device())
        self._device_index = self.device.index
        self._setup = setup
        engine = setup.engine.core if setup.engine is not None else None  # None: no remote peer
        boot = setup.bootstrap
        with boot.together("allocating the cuda backend"):  # GPU memory runs out on one rank
            reason = cuda_available()
            if reason is not None:
                raise RuntimeError(f"device='cuda': {reason}")
            self._impl = _core.CudaAllToAll(
                setup.workspace, engine, setup.region, setup.group, setup.remote_peers, setup.pids
            )
            handle = self._impl.ipc_handle()
        if setup.cfg.on_peer_loss == "mask":  # kernels check for a graph captured before a mask
            self._impl.maskable()
        handles = boot.allgather(handle)
        with boot.together("opening the node's GPU memory"):
            self._impl.open_node([h if r in setup.node else b"" for r, h in enumerate(handles)])
        if graph_safe:  # every receive waits in kernels: rows per node forwarded in the stream
            self._impl.kernel_waits()
        # GPU-direct: (region, group) of the registered device workspace; at close, the memory too.
        self.device_rows: tuple[Any, ...] | None = None
        if setup.transfer is not None and setup.transfer.path == gpu_direct.GPU_DIRECT:
            self.device_rows = _register_device_rows(setup, self._impl, self.device.index)
        if first_epoch > 0:  # re-armed at that epoch with nobody masked, before any call
            rows_group = self.device_rows[1] if self.device_rows is not None else None
            flags = [0] * boot.world_size
            self._impl.mask(flags, first_epoch, setup.group, rows_group, setup.remote_peers)
        self.max_output_rows = int(self._impl.max_output_rows)
        self._local_experts = setup.cfg.num_experts // setup.bootstrap.world_size
        self._alive: tuple[Any, ...] = ()  # tensors (and RowMath) the kernels read
        self._last_matrix: torch.Tensor | None = None  # the last call's, when it was cached
        self._last_rows: tuple[int, int] | None = None  # and its routing_rows
        # The copy kernel skips padding rows (and, graph-safe, rows past the last): theirs are 0.
        self._per_row = torch.zeros if setup.cfg.expert_padding > 1 or graph_safe else torch.empty

    def rejoin(self, setup: Setup, reuse: Any, first_epoch: int) -> None:
        """The constructor's collectives on a survivor of a rejoin (moe_a2a.rejoin), halted: the
        replacements' GPU memory opened and their device workspaces bound (GPU-direct), nothing
        of ours made anew; then re-armed with nobody masked at `first_epoch`."""
        boot, impl = setup.bootstrap, self._impl
        with boot.together("allocating the cuda backend"):
            pass
        handles = boot.allgather(impl.ipc_handle())
        with boot.together("opening the node's GPU memory"):
            reuse.forget_old_peers()
            for r in reuse.joining:
                if r in setup.node:
                    impl.release_peer(r)  # before the workspace unmaps its old host workspace
                    setup.workspace.remap_peer(r, reuse.paths[r])
                impl.replace_peer(r, handles[r] if r in setup.node else b"", setup.workspace, setup.pids[r])
        rows_group = None
        if self.device_rows is not None:
            region, group = self.device_rows[:2]
            failed = [(r, b.decode()) for r, b in enumerate(boot.allgather(b"")) if b]
            if failed:
                raise RuntimeError(
                    f"rank {failed[0][0]} could not register GPU memory ({failed[0][1]}), but the "
                    "survivors' rows go GPU-direct"
                )
            setup.device_remotes = setup.engine.exchange_region(
                region, reuse.joining, setup.device_remotes, boot
            )
            with boot.together("binding the peers' device workspaces (GPU-direct)"):
                rows_group = setup.engine.group(setup.remote_peers, setup.device_remotes)
                self.device_rows = (region, rows_group, *self.device_rows[2:])
        self._impl.mask([0] * boot.world_size, first_epoch, setup.group, rows_group, setup.remote_peers)
        self._alive, self._last_matrix, self._last_rows = (), None, None
        self._setup = setup

    @property
    def epoch(self) -> int:
        return int(self._impl.epoch)

    def _stream(self) -> int:
        # The raw handle without building a torch.cuda.Stream (a few us per call on
        # a slow host, four calls a step); the public route where torch lacks it.
        if _RAW_STREAM is not None:
            return int(_RAW_STREAM(self._device_index))
        return torch.cuda.current_stream(self.device).cuda_stream

    def dispatch_send(
        self,
        x: torch.Tensor,
        scale: torch.Tensor | None,
        ids: torch.Tensor,
        routing: torch.Tensor | None,
        in_place: bool = False,
        weights: torch.Tensor | None = None,
        rows: tuple[int, int] | None = None,
        then_recv: RecvRequest | None = None,
    ) -> None:
        """`routing`: a cached call's matrix, pinned host memory that the plan kernel reads.
        `in_place`: this rank's copies to itself are read from `x` by the receive half.
        `weights` ([T, topk] float32) go with the copies' rows. `rows`: a cached call's
        (output rows, most copies any rank receives), from its matrix on the host.
        `then_recv`: its buffers and arguments are made first and its kernel launched right
        after the send half's, so the GPU does not wait for the host between the two."""
        stream = self._stream()
        # Until the kernels that read them have run; detached, so no autograd graph
        # (and no routing handle behind it) outlives its step.
        self._alive = (x.detach(), ids, scale, routing, weights)
        recv_args = None
        if then_recv is not None:  # every argument ready: no Python between the two launches
            self._recv_buffers(then_recv)
            recv_args = self._recv_args(then_recv, stream)
            self._alive = (*self._alive, then_recv.routing_out, then_recv.math)
        dequant_recv = then_recv is not None and then_recv.dequant is not None
        self._impl.dispatch_send(
            x.data_ptr(),
            CORE_DTYPE[x.dtype],
            scale.data_ptr() if scale is not None else 0,
            ids.data_ptr(),
            ids.dtype == torch.int64,
            x.shape[0],
            0,
            stream,
            routing.data_ptr() if routing is not None else 0,
            in_place,
            weights.data_ptr() if weights is not None else 0,
            dequant_recv,
        )
        if recv_args is not None:
            assert then_recv is not None
            self._impl.dispatch_recv(*recv_args)
            then_recv.launched = True
        self._last_matrix = routing
        self._last_rows = rows

    def dispatch_recv(
        self, req: RecvRequest
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """`req.routing_out`: pinned [world, num_experts + world] int32, the call's matrix once this
        returns. `req.math`: applied by the receive kernel itself, in the pass that delivers the
        rows. Returns (rows, fp8 scales, tokens per expert, row_dot, row weights)."""
        if not req.launched:
            self._recv_buffers(req)
            self._launch_recv(req, self._stream())
        expert_x, scale, counts, dot, weights = req.out
        if self.cfg.expert_padding > 1:
            _zero_unfilled_rows(expert_x, scale, counts, self.cfg.expert_padding)
        if not self.graph_safe:
            filled = self._known_rows(self._last_rows) if self._last_rows is not None else None
            if filled is None:
                # Not a stream synchronisation: the plan kernel raises a host word once the
                # output rows and the status are final, and the copy kernel goes on meanwhile.
                self._impl.wait_planned()
                filled = int(self._impl.output_rows)
            expert_x = expert_x[:filled]
            scale = scale[:filled] if scale is not None else None
            dot = dot[:filled] if dot is not None else None
            weights = weights[:filled] if weights is not None else None
        return expert_x, scale, counts, dot, weights

    def _recv_buffers(self, req: RecvRequest) -> None:
        """The receive half's outputs, at their most rows (a view of the filled ones is returned).
        `req.routing_out` is pinned (AllToAll makes it so): the plan kernel writes it."""
        rows, hidden = self.max_output_rows, self.cfg.hidden
        dtype = req.dequant if req.dequant is not None else req.dtype
        expert_x = torch.empty(rows, hidden, dtype=dtype, device=self.device)
        scale = None
        if dtype == torch.float8_e4m3fn:
            scale = torch.empty(rows, num_scales(hidden), dtype=torch.float32, device=self.device)
        counts = torch.empty(self._local_experts, dtype=torch.int32, device=self.device)
        per_row = self._per_row
        dot = None
        if req.math is not None and req.math.dot_y is not None:
            dot = per_row(rows, dtype=torch.float32, device=self.device)
        weights = per_row(rows, dtype=torch.float32, device=self.device) if req.row_weights else None
        req.out = (expert_x, scale, counts, dot, weights)

    def _launch_recv(self, req: RecvRequest, stream: int) -> None:
        self._impl.dispatch_recv(*self._recv_args(req, stream))
        self._alive = (*self._alive, req.routing_out, req.math)
        req.launched = True

    def _recv_args(self, req: RecvRequest, stream: int) -> tuple[Any, ...]:
        """The receive kernel's arguments (`_impl.dispatch_recv`'s), from `req`'s buffers."""
        expert_x, scale, counts, dot, weights = req.out
        math, routing_out = req.math, req.routing_out
        dot_y = math.dot_y if math is not None else None
        return (
            expert_x.data_ptr(),
            scale.data_ptr() if scale is not None else 0,
            counts.data_ptr(),
            not self.graph_safe,
            stream,
            routing_out.data_ptr() if routing_out is not None else 0,
            math.scale.data_ptr() if math is not None else 0,
            dot_y.data_ptr() if dot_y is not None else 0,
            CORE_DTYPE[dot_y.dtype] if dot_y is not None else _core.DType.bf16,
            dot.data_ptr() if dot is not None else 0,
            weights.data_ptr() if weights is not None else 0,
            req.dequant is not None,
            CORE_DTYPE[req.dequant] if req.dequant is not None else _core.DType.bf16,
        )

    def _known_rows(self, rows_most: tuple[int, int]) -> int | None:
        """A cached call's output rows, from its matrix on the host: its receive half then waits
        for nothing, and the host runs ahead of the GPU (the backward's dispatches are cached).

        None where some rank would be over capacity: the plan kernel says so, and every rank
        waits for it to raise the CapacityError. `Routing.received_rows` computes them again
        whenever the matrix changed in place (its version counter), as the plan kernel reads it.
        """
        rows, most = rows_most
        return None if most > self._setup.core_cfg.max_recv_tokens else rows

    def combine_send(
        self,
        y: torch.Tensor,
        in_place: bool = False,
        row_values: torch.Tensor | None = None,
        weighted: bool = True,
    ) -> None:
        # `weighted`: rows per rank are summed where the experts are, with or without the
        # dispatch's weights (docs/protocol.md, "Rows per destination rank").
        values = row_values.data_ptr() if row_values is not None else 0
        self._impl.combine_send(
            y.data_ptr(), CORE_DTYPE[y.dtype], y.shape[0], self._stream(), in_place, values, weighted
        )
        self._alive = (*self._alive, y.detach(), row_values)

    def combine_recv(
        self, weights: torch.Tensor, out: torch.Tensor, values_out: torch.Tensor | None = None
    ) -> None:
        # Eager: the host saw every flag up before the launch, so the kernel has
        # nothing to report; inputs stay referenced until the next dispatch.
        values = values_out.data_ptr() if values_out is not None else 0
        self._impl.combine_recv(
            weights.data_ptr(), out.data_ptr(), not self.graph_safe, self._stream(), values
        )
        self._alive = (*self._alive, weights)

    def announce_failure(self, text: str) -> None:
        """Tell every peer that this rank failed, so their waits end at once."""
        self._impl.announce_failure(text)

    def check(self) -> None:
        """Raise the outcome of the last call (graph-safe mode; synchronise the stream first)."""
        self._impl.check()

    def wire_rows(self) -> tuple[np.ndarray, np.ndarray]:
        """Wire rows this rank sent to / received from each rank in the last dispatch."""
        torch.cuda.current_stream(self.device).synchronize()
        world, experts = self._setup.bootstrap.world_size, self.cfg.num_experts
        rank = self._setup.bootstrap.rank
        # Row s: count[s][0..E), then u[s][0..N) (docs/protocol.md, "Rows per destination rank").
        if self._last_matrix is not None:  # a cached call: the workspace holds an earlier call's rows
            per_rank = self._last_matrix.numpy().astype(np.int64)[:, experts:]
            return per_rank[rank], per_rank[:, rank]
        # Our own row only we write; a peer's row there may already be its next call's (a peer
        # passes our combine and starts again), so what we received comes from our plan.
        start = self._setup.workspace.ptr + self._impl.layout["routing"] + rank * (experts + world) * 4
        own = np.frombuffer((ctypes.c_uint32 * (experts + world)).from_address(start), dtype=np.uint32)
        return own[experts:].astype(np.int64), np.array(self._impl.wire_received(), dtype=np.int64)

    def forwarded(self) -> tuple[np.ndarray, np.ndarray]:
        """Rows per node (fabric_rows="node") in the last call, per node peer: the rows we forwarded
        that it read its entries from, and the bytes of its outputs (staged in fp32) and row values
        that our combine read."""
        torch.cuda.current_stream(self.device).synchronize()
        rows, output_bytes = self._impl.forwarded_traffic()
        return np.array(rows, dtype=np.int64), np.array(output_bytes, dtype=np.int64)

    def routing_rows(self) -> tuple[int, int]:
        return int(self._impl.routing_rows_sent), int(self._impl.routing_rows_received)

    def halt(self) -> int:
        """After a failed call, before the survivors agree (moe_a2a.masking): our kernels ended
        (eager kernels never wait for a peer; a graph's at their deadline) and the proxy joined.
        Returns the dispatches started, graph replays included (they count on the device only)."""
        torch.cuda.synchronize(self.device)
        self._impl.stop_proxy()
        return max(int(self._impl.epoch), int(self._impl.device_epoch))

    def remask(self, setup: Setup, masked: list[int], first_epoch: int, gone_remote: list[int]) -> None:
        """Re-arm after `halt` with the agreed masked ranks (1 per masked rank) and epoch: the same
        memory and node mappings, the proxy serving the live remote peers (`setup` already holds
        them and their group). GPU-direct binds the live peers' device workspaces anew."""
        rows_group = None
        if self.device_rows is not None:
            region, group = self.device_rows[:2]
            if gone_remote:
                group = setup.engine.group(setup.remote_peers, setup.device_remotes)
                self.device_rows = (region, group, *self.device_rows[2:])
            rows_group = group
        self._impl.mask(masked, first_epoch, setup.group, rows_group, setup.remote_peers)
        self._alive, self._last_matrix, self._last_rows = (), None, None

    def take_device_rows(self) -> tuple[Any, ...] | None:
        """After close: GPU-direct's (region, group, memory), handed over (AllToAll.close releases
        them); this backend keeps no reference."""
        rows, self.device_rows = self.device_rows, None
        return rows

    def close(self) -> None:
        torch.cuda.synchronize(self.device)
        if self.device_rows is not None:
            # The registered device workspace goes only after its region (AllToAll.close).
            self._impl.stop_proxy()
            self.device_rows = (*self.device_rows[:2], self._impl)
        self._impl = None  # type: ignore[assignment]
        self._alive = ()
        self._setup = None  # type: ignore[assignment]
