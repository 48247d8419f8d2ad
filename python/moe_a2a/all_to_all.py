"""AllToAll: expert-parallel dispatch and combine on torch tensors.

The contract is docs/design.md section 6; positions and numerics are in
docs/protocol.md. This module validates inputs, owns the tensors and drives
the C++ core, which does the work with the GIL released.
"""

from __future__ import annotations

import functools
import itertools
import math
import os
import sys
import uuid
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
import torch

from moe_a2a import _core, memory_plan, switches
from moe_a2a.agreement import all_to_all_settings, check_agreement
from moe_a2a.backends.common import (
    Backend,
    RecvRequest,
    RowMath,
    Setup,
    num_scales,
    routing_rows,
)
from moe_a2a.bootstrap import Bootstrap
from moe_a2a.fabric import EngineLease, hint_universe_size, lease_engine
from moe_a2a.nics import current_gpu_address, num_nics_default

DISPATCH_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp8": torch.float8_e4m3fn}
COMBINE_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
DEVICES = ("cpu", "cuda")
PATHS = ("same_node", "fabric")

CapacityError = _core.CapacityError
FabricError = _core.FabricError
PeerFailedError = _core.PeerFailedError

# Identity of each AllToAll in this process: handles carry it, so one instance
# never reads buffers sized from another instance's handle.
_instance_ids = itertools.count(1)


F = TypeVar("F", bound=Callable[..., Any])

# The core holds sizes and row indices as 32-bit ints.
CORE_INT_MAX = 2**31 - 1


def _positive_int(name: str, value: Any, minimum: int = 1) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not minimum <= value <= CORE_INT_MAX:
        raise ValueError(f"{name}: got {value!r}; expected an integer in [{minimum}, {CORE_INT_MAX}]")


@dataclass(frozen=True)
class Config:
    """Shape and policy of an AllToAll; fixed for its lifetime (buffers are sized from it)."""

    max_tokens: int
    hidden: int
    num_experts: int
    topk: int
    dispatch_dtype: str = "bf16"
    combine_dtype: str = "bf16"
    expert_padding: int = 1
    max_private_tokens: int | None = None
    max_recv_tokens: int | None = None
    timeout_s: float = 60.0

    def __post_init__(self) -> None:
        for name in ("max_tokens", "hidden", "num_experts", "topk", "expert_padding"):
            _positive_int(name, getattr(self, name))
        if self.topk > self.num_experts:
            raise ValueError(f"topk: got {self.topk}; expected at most num_experts={self.num_experts}")
        if self.dispatch_dtype not in DISPATCH_DTYPES:
            raise ValueError(
                f"dispatch_dtype: got {self.dispatch_dtype!r}; expected one of {list(DISPATCH_DTYPES)}"
            )
        if self.combine_dtype not in COMBINE_DTYPES:
            raise ValueError(
                f"combine_dtype: got {self.combine_dtype!r}; expected one of {list(COMBINE_DTYPES)}"
            )
        if self.max_private_tokens is not None:
            _positive_int("max_private_tokens", self.max_private_tokens, minimum=0)
        if self.max_recv_tokens is not None:
            _positive_int("max_recv_tokens", self.max_recv_tokens)
        t = self.timeout_s
        if not isinstance(t, (int, float)) or isinstance(t, bool) or not (0 < t < math.inf):
            raise ValueError(f"timeout_s: got {t!r}; expected a positive, finite number of seconds")
        if self.max_tokens * self.topk > CORE_INT_MAX:  # a call's copies are numbered in 32 bits
            raise ValueError(
                f"max_tokens * topk: got {self.max_tokens} * {self.topk} = {self.max_tokens * self.topk}; "
                f"expected at most {CORE_INT_MAX}"
            )

    def resolved(self, world_size: int) -> tuple[int, int]:
        """(max_private_tokens, max_recv_tokens) for a world size, defaults filled in."""
        if self.num_experts % world_size != 0:
            raise ValueError(
                f"num_experts: got {self.num_experts}, which is not divisible by the world size "
                f"{world_size}; every rank must host the same number of experts"
            )
        local = self.num_experts // world_size
        per_peer_worst = self.max_tokens * min(self.topk, local)
        private = self.max_private_tokens
        if private is None:
            private = min(per_peer_worst, math.ceil(self.max_tokens * self.topk / world_size))
        recv = self.max_recv_tokens if self.max_recv_tokens is not None else world_size * per_peer_worst
        if recv > CORE_INT_MAX:
            raise ValueError(
                f"max_recv_tokens: the default for {world_size} ranks is {recv}; expected at most "
                f"{CORE_INT_MAX}: pass a smaller max_recv_tokens"
            )
        return private, recv


@dataclass(frozen=True, eq=False)
class Routing:
    """The gathered routing of one dispatch, kept to dispatch new rows along it with no routing exchange.

    `dispatch(..., keep_routing=True)` returns it as `Dispatched.routing`;
    `dispatch(x, routing=r)` on any instance of the same ranks and shape then
    publishes no routing row and waits for none (docs/protocol.md, "Cached
    calls"). Every rank must make the same call cached. Leave the tensors as
    they are: the positions of every rank's rows follow from them.
    """

    matrix: torch.Tensor  # [world, num_experts] int32: count[s][e], on the host (pinned for CUDA)
    topk_ids: torch.Tensor  # [T, topk], as the core took them
    topk_weights: torch.Tensor  # [T, topk] fp32
    rank: int = field(repr=False)
    world_size: int = field(repr=False)
    max_tokens: int = field(repr=False)
    # topk_ids' version counter when dispatch returned it: a call along the routing does not
    # check its ids again (on CUDA that would cost a wait), so an in-place change is refused.
    ids_version: int | None = field(repr=False, default=None)
    _rows: Any = field(init=False, repr=False, default=None, compare=False)  # received_rows' memo

    def received_rows(self, padding: int) -> tuple[int, int]:
        """(output rows this rank receives along the matrix, each expert's padded to `padding`;
        the most copies any rank receives), computed again only if the matrix changed."""
        key = (self.matrix._version, padding)
        if self._rows is None or self._rows[0] != key:
            object.__setattr__(self, "_rows", (key, routing_rows(self.matrix, self.rank, padding)))  # frozen
        return self._rows[1]


@dataclass
class PendingDispatch:
    """A dispatch whose send half is done; pass it to `dispatch(handle=..., send=False)`."""

    epoch: int
    num_tokens: int
    topk_weights: torch.Tensor
    owner: int = field(repr=False, default=0)
    routing: Routing | None = field(repr=False, default=None)  # the call's, when cached
    keep_routing: bool = field(repr=False, default=False)
    topk_ids: torch.Tensor | None = field(repr=False, default=None)


@dataclass
class Dispatched:
    """What dispatch delivers to this rank's experts."""

    expert_x: torch.Tensor
    expert_x_scale: torch.Tensor | None
    tokens_per_expert: torch.Tensor
    epoch: int = field(repr=False, default=0)
    num_tokens: int = field(repr=False, default=0)
    topk_weights: torch.Tensor | None = field(repr=False, default=None)
    owner: int = field(repr=False, default=0)
    routing: Routing | None = None  # with keep_routing=True, or the cached call's
    row_dot: torch.Tensor | None = None  # [rows] float32, with dispatch(row_dot=...)
    row_weights: torch.Tensor | None = None  # [rows] float32, with dispatch(row_weights=True)


@dataclass
class PendingCombine:
    """A combine whose send half is done; pass it to `combine(handle=..., send=False)`."""

    epoch: int
    num_tokens: int
    topk_weights: torch.Tensor
    owner: int = field(repr=False, default=0)


def _counted(what: str) -> Callable[[F], F]:
    """An API call: counted, and any failure but a capacity error stops the instance on every rank."""

    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def call(self: AllToAll, *args: Any, **kwargs: Any) -> Any:
            self._check_usable()
            self._calls += 1
            try:
                return fn(self, *args, **kwargs)
            except CapacityError:
                raise  # every rank raised it for the same call: the next one starts clean
            except Exception as exc:
                self._fail(what, exc)
                raise

        return call  # type: ignore[return-value]

    return wrap


def _resolve_in_place(what: str, in_place: Any, send: bool, recv: bool) -> bool:
    """A whole call reads its input in place unless told otherwise; a send half only when asked."""
    if in_place is None:
        return send and recv
    if not isinstance(in_place, bool):
        raise ValueError(f"{what}: in_place: got {in_place!r}; expected True, False or None")
    if not send:
        raise ValueError(f"{what}: in_place= belongs to the send half (send=True)")
    return in_place


def _describe(t: Any) -> str:
    """How an argument looks, for error messages."""
    if not isinstance(t, torch.Tensor):
        return f"a {type(t).__name__}"
    return f"a {t.dtype} tensor of shape {tuple(t.shape)} on {t.device}"


class AllToAll:
    """Dispatch tokens to the ranks that host their experts, and combine the results back.

    `device="cpu"` runs the compute steps as C++ loops on the calling thread;
    `device="cuda"` as kernels on the current CUDA stream (see
    `moe_a2a.backends.cuda`, and `graph_safe` there). Both move bytes the same
    way: shared memory or CUDA IPC within a node, the proxy and the fabric
    between nodes.
    """

    def __init__(
        self,
        cfg: Config,
        comm: Any = None,
        device: str = "cpu",
        provider: str = "auto",
        ranks_per_node: int | None = None,
        num_nics: int | None = None,
        graph_safe: bool = False,
        nics: Sequence[str] | str | None = None,
        abort_on_error: bool | None = None,
    ) -> None:
        self._boot = Bootstrap(comm, ranks_per_node)
        # Each local step of start-up fails on every rank if it fails on one (a
        # missing GPU, a mistyped switch, a NIC name, memory): a rank that only
        # raised would leave its peers waiting in the next collective.
        with self._boot.together("checking AllToAll's arguments"):
            self._check_arguments(cfg, device, graph_safe, abort_on_error)
            self._slice_bytes = switches.slice_bytes()
            num_nics = num_nics_default(num_nics)  # MOE_A2A_NUM_NICS (job presets) where not given
        self.cfg = cfg
        self.id = next(_instance_ids)
        self._args: dict[str, Any] = {
            "cfg": cfg,
            "comm": comm,
            "device": device,
            "provider": provider,
            "ranks_per_node": ranks_per_node,
            "num_nics": num_nics,
            "graph_safe": graph_safe,
            "nics": nics,
            "abort_on_error": abort_on_error,
        }
        topo = self._boot.topology
        self.rank, self.world_size = topo.rank, topo.world_size
        hint_universe_size(self.world_size)  # before anything starts libfabric in this process
        # A survivor that only raised would wait in MPI_Finalize for peers that wait for it.
        if abort_on_error is None:
            abort_on_error = switches.get("MOE_A2A_ABORT_ON_ERROR")
        self.abort_on_error = self._boot.launched_by_mpi if abort_on_error is None else bool(abort_on_error)
        # Before anything is sized from cfg: ranks that differ would fail apart, or not at all.
        settings = all_to_all_settings(
            cfg, device, provider, topo.local_size, num_nics, graph_safe, self._slice_bytes
        )
        check_agreement(self._boot, settings)
        self.max_private_tokens, self.max_recv_tokens = cfg.resolved(self.world_size)
        self.num_local_experts = cfg.num_experts // self.world_size
        self._node = set(topo.node_ranks)
        self._core_cfg = self._core_config(topo.local_size)
        with self._boot.together("checking that the workspace fits in memory"):
            memory_plan.check_fits(memory_plan.plan_of(self._core_cfg, cfg, device))
        self._setup: Setup | None = None
        self._lease: EngineLease | None = None
        try:
            self._backend: Backend = self._open(device, provider, num_nics, nics, graph_safe)
        except BaseException:
            self._release_partial()  # every rank failed at the same step: nobody wrote yet
            raise
        self.device = self._backend.device
        self.graph_safe = graph_safe
        # An unweighted combine's weights: views of one buffer, made here and never
        # regrown, so that a captured graph's view stays valid.
        self._ones_buf = torch.ones(cfg.max_tokens, cfg.topk, dtype=torch.float32, device=self.device)
        self._state = "idle"
        self._calls = 0  # API calls so far, rejected ones included: failures name theirs
        self._failure: str | None = None
        # The latest dispatch, weakly: combine checks it is the one in flight, and the
        # rows stay the caller's (held here, they would outlive the caller's use).
        self._last: weakref.ref[Dispatched] | None = None
        self._last_cached = False
        self._boot.barrier()  # every proxy runs and every peer is mapped before anyone writes

    # -- start-up -------------------------------------------------------------------------------

    @staticmethod
    def _check_arguments(cfg: Config, device: str, graph_safe: bool, abort_on_error: bool | None) -> None:
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

    def _open(
        self, device: str, provider: str, num_nics: int, nics: Sequence[str] | str | None, graph_safe: bool
    ) -> Backend:
        """Lease the engine, open and register the workspace, start the backend (collective)."""
        remote_peers = [r for r in range(self.world_size) if r not in self._node]
        # No engine (no endpoint, thread or /dev/shm file) where every peer shares our node.
        chosen = None if provider == "auto" else provider
        gpu = current_gpu_address() if device == "cuda" else None
        self._lease = lease_engine(self._boot, chosen, num_nics, nics=nics, gpu=gpu) if remote_peers else None
        self._core_cfg.instance = self._lease.slot if self._lease else 0
        engine = self._lease.engine if self._lease else None
        setup = Setup(
            cfg=self.cfg,
            core_cfg=self._core_cfg,
            workspace=None,
            engine=engine,
            region=None,  # no engine: nothing registered
            group=None,
            remote_peers=remote_peers,
            node=self._node,
            bootstrap=self._boot,
            pids=[],
        )
        self._setup = setup
        setup.workspace = self._open_workspace()
        if engine is not None:
            with self._boot.together("registering the workspace"):
                setup.region = engine.core.register_region(setup.workspace.ptr, setup.workspace.size)
            remotes = engine.exchange_region(setup.region)
            with self._boot.together("creating the peer group"):
                setup.group = engine.group(remote_peers, remotes)
        setup.pids = self._boot.local_pids()
        if device == "cuda":
            from moe_a2a.backends.cuda import CudaBackend

            return CudaBackend(setup, graph_safe)
        from moe_a2a.backends.cpu import CpuBackend

        with self._boot.together("starting the cpu backend"):
            return CpuBackend(setup)

    def _release_partial(self) -> None:
        """Undo a start-up that failed on every rank: the engine lease, its registrations, the memory."""
        setup, self._setup = self._setup, None
        if self._lease is not None:
            region, group, workspace = (
                (setup.region, setup.group, setup.workspace) if setup is not None else (None, None, None)
            )
            self._lease.close(region, group, workspace, 0.0)
            self._lease = None

    def _core_config(self, local_size: int) -> Any:
        return memory_plan.core_config(self.cfg, self.rank, self.world_size, local_size, self._slice_bytes)

    def _open_workspace(self) -> Any:
        name = f"/moe-a2a-{os.getpid()}-{uuid.uuid4().hex[:12]}-r{self.rank}"
        # Same-node peers read our rows only on the CPU backend; elsewhere the rows
        # are private memory (huge pages where the kernel gives them, which the
        # fabric moves faster than shared memory's 4 KB pages).
        share_rows = self._args["device"] == "cpu" and len(self._node) > 1
        with self._boot.together("allocating the workspace"):
            workspace = _core.Workspace(self._core_cfg, name, share_rows)
        names = self._boot.allgather(name.encode())
        with self._boot.together("mapping the node's workspaces"):
            workspace.map_node([n.decode() if r in self._node else "" for r, n in enumerate(names)])
        self._boot.barrier()  # everyone has mapped everyone: the names can go
        workspace.unlink()
        return workspace

    @property
    def epoch(self) -> int:
        """The number of dispatches started so far."""
        self._check_open()
        return self._backend.epoch

    @property
    def max_output_rows(self) -> int:
        """Rows of `expert_x` in graph-safe mode (the most a call can deliver, padded)."""
        return int(getattr(self._backend, "max_output_rows", 0))

    # -- dispatch -------------------------------------------------------------------------------

    @_counted("dispatch")
    def dispatch(
        self,
        x: torch.Tensor | None = None,
        topk_ids: torch.Tensor | None = None,
        topk_weights: torch.Tensor | None = None,
        *,
        x_scale: torch.Tensor | None = None,
        send: bool = True,
        recv: bool = True,
        handle: PendingDispatch | None = None,
        routing: Routing | None = None,
        keep_routing: bool = False,
        in_place: bool | None = None,
        row_scale: torch.Tensor | None = None,
        row_dot: torch.Tensor | None = None,
        row_weights: bool = False,
        dequantize: torch.dtype | None = None,
    ) -> Dispatched | PendingDispatch:
        """Send tokens to their experts' ranks and/or receive this rank's share.

        `send=True, recv=False` returns a `PendingDispatch` while bytes are in flight;
        `dispatch(handle=pending, send=False)` finishes it. `keep_routing=True`
        returns the call's `Routing` in `Dispatched.routing`; `routing=r` sends `x`
        along it (its ids and, unless given, its weights) with no routing exchange.
        `in_place=True` promises that `x` stays unchanged until the receive half is
        called, which may then read this rank's own copies from `x` (one pass over them
        instead of two); the default is True for a whole call, False for a send half.
        A call along `routing=` (so its rows are known) with bf16 or fp32 rows can do the
        weighted combine's backward in the pass that receives them: `row_scale` ([rows]
        float32) delivers row r times `row_scale[r]`, and `row_dot` ([rows, hidden], bf16 or
        float32) also gives `Dispatched.row_dot[r]`, the float32 dot product of row r as it
        arrived with `row_dot[r]`.
        `row_weights=True` (receive half) also returns `Dispatched.row_weights`: each row's
        routing weight (its copy's `topk_weights` entry, carried with the row; 0 on padding).
        `dequantize=torch.bfloat16` (or float32; receive half, fp8 rows) delivers the rows
        dequantised in that dtype by the receive pass itself (`expert_x_scale` is then None);
        a whole call also leaves this rank's own copies in `x` and quantises them there.
        """
        if not send and not recv:
            raise ValueError("dispatch: send and recv are both False; nothing to do")
        in_place = _resolve_in_place("dispatch", in_place, send, recv)
        if not recv and (
            row_scale is not None or row_dot is not None or row_weights is not False or dequantize is not None
        ):
            raise ValueError(
                "dispatch: row_scale=, row_dot=, row_weights= and dequantize= belong to the receive half "
                "(recv=True)"
            )
        if not isinstance(row_weights, bool):
            raise ValueError(f"dispatch: row_weights: got {row_weights!r}; expected True or False")
        if dequantize is not None and (
            self.cfg.dispatch_dtype != "fp8" or dequantize not in (torch.bfloat16, torch.float32)
        ):
            raise ValueError(
                f"dispatch: dequantize: got {dequantize!r} with dispatch_dtype {self.cfg.dispatch_dtype!r}; "
                "expected torch.bfloat16 or torch.float32 with dispatch_dtype 'fp8'"
            )
        row_math = req = None
        if send and recv:  # checked before anything is sent; the receive made ready to follow at once
            row_math = self._row_math(routing, row_scale, row_dot)
            keep = keep_routing is True and routing is None
            req = self._recv_request(keep, row_math, row_weights, dequantize)
        if send:
            if handle is not None:
                raise ValueError("dispatch: handle= is only for the receive half (send=False)")
            handle = self._dispatch_send(
                x, topk_ids, topk_weights, x_scale, routing, keep_routing, in_place, req
            )
        elif routing is not None or keep_routing:
            raise ValueError("dispatch: routing= and keep_routing= belong to the send half (send=True)")
        if not recv:
            return handle
        if handle is None or not isinstance(handle, PendingDispatch):
            raise ValueError(
                f"dispatch: the receive half needs handle= from dispatch(..., recv=False); got {handle!r}"
            )
        if not send:
            row_math = self._row_math(handle.routing, row_scale, row_dot)
            req = self._recv_request(handle.keep_routing, row_math, row_weights, dequantize)
        assert req is not None
        return self._dispatch_recv(handle, req)

    def _recv_request(
        self, keep_routing: bool, math: RowMath | None, row_weights: bool, dequantize: torch.dtype | None
    ) -> RecvRequest:
        keep = None
        if keep_routing:
            keep = torch.empty(
                self.world_size,
                self.cfg.num_experts,
                dtype=torch.int32,
                pin_memory=self.device.type == "cuda",
            )
        return RecvRequest(DISPATCH_DTYPES[self.cfg.dispatch_dtype], keep, math, row_weights, dequantize)

    def _dispatch_send(
        self,
        x: Any,
        topk_ids: Any,
        topk_weights: Any,
        x_scale: Any,
        routing: Any,
        keep_routing: Any,
        in_place: bool,
        then_recv: RecvRequest | None = None,
    ) -> PendingDispatch:
        if self._state != "idle":
            raise RuntimeError(
                f"dispatch: the previous dispatch (epoch {self.epoch}) has not been combined yet; "
                "every dispatch must be followed by combine before the next dispatch"
            )
        if not isinstance(keep_routing, bool):
            raise ValueError(f"dispatch: keep_routing: got {keep_routing!r}; expected True or False")
        if (routing is not None or keep_routing) and self.graph_safe:
            raise ValueError(
                "dispatch: routing= and keep_routing= need eager calls; graph_safe=True exchanges the routing"
            )
        if routing is not None:
            self._check_routing(routing, x, topk_ids)
        x, ids, weights, scale = self._validate_dispatch(x, topk_ids, topk_weights, x_scale, routing)
        if routing is not None and not self._backend.checks_ids:
            self._check_own_row(routing, ids)
        matrix = routing.matrix if routing is not None else None
        rows = routing.received_rows(self.cfg.expert_padding) if routing is not None else None
        self._backend.dispatch_send(x, scale, ids, matrix, in_place, weights, rows, then_recv)
        self._state = "dispatch_sent"
        return PendingDispatch(
            epoch=self.epoch,
            num_tokens=x.shape[0],
            topk_weights=weights,
            owner=self.id,
            routing=routing,
            keep_routing=keep_routing and routing is None,
            topk_ids=ids,
        )

    def _row_math(self, routing: Any, row_scale: Any, row_dot: Any) -> RowMath | None:
        """The receive half's row_scale and row_dot, checked against the rows `routing` delivers."""
        if row_scale is None:
            if row_dot is not None:
                raise ValueError(
                    "dispatch: row_dot= needs row_scale= (pass ones to only take the dot products)"
                )
            return None
        if not isinstance(routing, Routing):
            raise ValueError(
                "dispatch: row_scale= needs a call along routing= (whose rows are known before they arrive)"
            )
        if self.cfg.dispatch_dtype == "fp8":
            raise ValueError("dispatch: row_scale=: the rows are fp8; expected dispatch_dtype bf16 or fp32")
        rows, _ = routing.received_rows(self.cfg.expert_padding)
        if (
            not isinstance(row_scale, torch.Tensor)
            or row_scale.dtype != torch.float32
            or tuple(row_scale.shape) != (rows,)
            or row_scale.device != self.device
        ):
            raise ValueError(
                f"dispatch: row_scale: got {_describe(row_scale)}; expected float32 of shape ({rows},) "
                f"on {self.device} (one per row this rank receives)"
            )
        if row_dot is not None and (
            not isinstance(row_dot, torch.Tensor)
            or row_dot.dtype not in (torch.bfloat16, torch.float32)
            or tuple(row_dot.shape) != (rows, self.cfg.hidden)
            or row_dot.device != self.device
        ):
            raise ValueError(
                f"dispatch: row_dot: got {_describe(row_dot)}; expected bfloat16 or float32 of shape "
                f"({rows}, {self.cfg.hidden}) on {self.device}"
            )
        # Detached: the backend keeps them until its kernels ran, and no autograd graph (with
        # the routing handles behind it) may outlive its step.
        dot_y = row_dot.detach().contiguous() if row_dot is not None else None
        return RowMath(row_scale.detach().contiguous(), dot_y)

    def _check_routing(self, routing: Any, x: Any, topk_ids: Any) -> None:
        """A Routing made by an instance of the same ranks and shape, and no ids beside it."""
        if not isinstance(routing, Routing):
            raise TypeError(f"dispatch: routing: got {type(routing).__name__}; expected a moe_a2a.Routing")
        if topk_ids is not None:
            raise ValueError("dispatch: with routing=, leave topk_ids out (the routing has them)")
        want = (self.rank, self.world_size, self.cfg.num_experts, self.cfg.topk)
        got = (routing.rank, routing.world_size, routing.matrix.shape[1], routing.topk_ids.shape[1])
        if got != want or routing.max_tokens > self.cfg.max_tokens:
            raise ValueError(
                f"dispatch: routing: made for (rank, world size, num_experts, topk) = {got} and "
                f"max_tokens {routing.max_tokens}; expected {want} and at most {self.cfg.max_tokens}"
            )
        if routing.ids_version is not None and routing.topk_ids._version != routing.ids_version:
            raise ValueError(
                "dispatch: routing: its topk_ids were changed in place after dispatch returned it; "
                "expected the Routing unchanged"
            )
        if routing.topk_ids.device != self.device:
            raise ValueError(
                f"dispatch: routing: its topk_ids are on {routing.topk_ids.device}; expected {self.device}"
            )
        tokens = routing.topk_ids.shape[0]
        if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[0] != tokens:
            raise ValueError(
                f"dispatch: x: got {_describe(x)}; expected {tokens} rows (the routing's tokens)"
            )

    def _check_own_row(self, routing: Routing, ids: torch.Tensor) -> None:
        """Where it costs no stream synchronisation: our row of the matrix is what the ids count."""
        counts = torch.bincount(ids.flatten().to(torch.int64), minlength=self.cfg.num_experts)
        if not torch.equal(counts.to(torch.int32), routing.matrix[self.rank]):
            raise ValueError(
                f"dispatch: routing: row {self.rank} of its matrix does not count its topk_ids; "
                "expected the Routing as dispatch returned it, unchanged"
            )

    def _check_owner(self, what: str, handle: Any) -> None:
        """Before any buffer is touched: the handle must be this instance's own."""
        if handle.owner != self.id:
            raise RuntimeError(
                f"{what}: the handle belongs to AllToAll #{handle.owner}, not to this one (#{self.id}); "
                "a handle is only valid on the instance that returned it"
            )

    def _dispatch_recv(self, handle: PendingDispatch, req: RecvRequest) -> Dispatched:
        self._check_owner("dispatch", handle)
        if self._state != "dispatch_sent" or handle.epoch != self.epoch:
            raise RuntimeError(
                f"dispatch: handle of epoch {handle.epoch} is not the dispatch in flight "
                f"(state {self._state}, epoch {self.epoch})"
            )
        keep = req.routing_out
        try:
            expert_x, scale, counts, dot, weights = self._backend.dispatch_recv(req)
        except CapacityError:
            self._state = "idle"  # every rank failed this call alike; the next one starts clean
            raise
        self._state = "dispatched"
        routing = handle.routing
        if keep is not None:
            assert handle.topk_ids is not None
            routing = Routing(
                matrix=keep,
                topk_ids=handle.topk_ids,
                topk_weights=handle.topk_weights.detach(),
                rank=self.rank,
                world_size=self.world_size,
                max_tokens=self.cfg.max_tokens,
                ids_version=handle.topk_ids._version,
            )
        d = Dispatched(
            expert_x=expert_x,
            expert_x_scale=scale,
            tokens_per_expert=counts,
            epoch=handle.epoch,
            num_tokens=handle.num_tokens,
            topk_weights=handle.topk_weights,
            owner=self.id,
            routing=routing,
            row_dot=dot,
            row_weights=weights,
        )
        self._last, self._last_cached = weakref.ref(d), handle.routing is not None
        return d

    # -- combine --------------------------------------------------------------------------------

    @_counted("combine")
    def combine(
        self,
        y: torch.Tensor | None = None,
        d: Dispatched | None = None,
        *,
        send: bool = True,
        recv: bool = True,
        handle: PendingCombine | None = None,
        weighted: bool = True,
        in_place: bool | None = None,
        row_values: torch.Tensor | None = None,
        values_out: torch.Tensor | None = None,
    ) -> torch.Tensor | PendingCombine:
        """Return expert outputs to their tokens' ranks.

        Weighted (the default): `out[t] = sum_k w[t,k] * y[row of (t,k)]` with the
        dispatch's `topk_weights`; `weighted=False`: the plain sum over k, for callers
        that apply the routing weights themselves (as TorchTitan does, under autograd).
        `in_place`: as for dispatch, with `y`.
        `row_values` (send half, [rows] float32) travel back with the rows, one per row,
        and land unreduced in `values_out` (receive half, [T, topk] float32): entry (t, k)
        is the value of the row of copy (t, k) (0 where the sender passed none).
        """
        if not send and not recv:
            raise ValueError("combine: send and recv are both False; nothing to do")
        in_place = _resolve_in_place("combine", in_place, send, recv)
        if not send and row_values is not None:
            raise ValueError("combine: row_values= belongs to the send half (send=True)")
        if not recv and values_out is not None:
            raise ValueError("combine: values_out= belongs to the receive half (recv=True)")
        if send:
            if handle is not None:
                raise ValueError("combine: handle= is only for the receive half (send=False)")
            if not isinstance(weighted, bool):
                raise ValueError(f"combine: weighted: got {weighted!r}; expected True or False")
            handle = self._combine_send(y, d, weighted, in_place, row_values)
        if not recv:
            return handle
        if handle is None or not isinstance(handle, PendingCombine):
            raise ValueError(
                f"combine: the receive half needs handle= from combine(..., recv=False); got {handle!r}"
            )
        self._check_owner("combine", handle)
        if self._state != "combine_sent" or handle.epoch != self.epoch:
            raise RuntimeError(f"combine: handle of epoch {handle.epoch} is not the combine in flight")
        if values_out is not None:
            want = (handle.num_tokens, self.cfg.topk)
            if (
                not isinstance(values_out, torch.Tensor)
                or values_out.dtype != torch.float32
                or tuple(values_out.shape) != want
                or values_out.device != self.device
                or not values_out.is_contiguous()
            ):
                raise ValueError(
                    f"combine: values_out: got {_describe(values_out)}; expected a contiguous float32 "
                    f"tensor of shape {want} on {self.device}"
                )
        out = torch.empty(
            handle.num_tokens,
            self.cfg.hidden,
            dtype=COMBINE_DTYPES[self.cfg.combine_dtype],
            device=self.device,
        )
        self._backend.combine_recv(handle.topk_weights, out, values_out)
        self._state = "idle"
        return out

    def _combine_send(
        self, y: Any, d: Any, weighted: bool, in_place: bool, row_values: Any = None
    ) -> PendingCombine:
        if not isinstance(d, Dispatched):
            raise TypeError(
                f"combine: d: got {type(d).__name__}; expected the Dispatched returned by dispatch"
            )
        if self._state != "dispatched" or self._last is None or d is not self._last():
            raise RuntimeError(
                f"combine: d (epoch {d.epoch}) is not the latest dispatch of this AllToAll "
                f"(state {self._state}, epoch {self.epoch})"
            )
        expected = (d.expert_x.shape[0], self.cfg.hidden)
        if not isinstance(y, torch.Tensor) or y.dim() != 2 or tuple(y.shape) != expected:
            raise ValueError(
                f"combine: y: got {_describe(y)}; expected shape {expected} (that of d.expert_x)"
            )
        if y.dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"combine: y: got dtype {y.dtype}; expected torch.bfloat16 or torch.float32")
        if y.device != self.device:
            raise ValueError(f"combine: y is on {y.device}; expected {self.device}")
        if row_values is not None and (
            not isinstance(row_values, torch.Tensor)
            or row_values.dtype != torch.float32
            or tuple(row_values.shape) != (expected[0],)
            or row_values.device != self.device
        ):
            raise ValueError(
                f"combine: row_values: got {_describe(row_values)}; expected float32 of shape "
                f"({expected[0]},) on {self.device} (one per row of d.expert_x)"
            )
        values = row_values.detach().contiguous() if row_values is not None else None
        self._backend.combine_send(y.contiguous(), in_place, values)
        self._state = "combine_sent"
        assert d.topk_weights is not None
        weights = d.topk_weights if weighted else self._ones(d.topk_weights.shape[0])
        return PendingCombine(epoch=d.epoch, num_tokens=d.num_tokens, topk_weights=weights, owner=self.id)

    # -- validation and state ---------------------------------------------------------------------

    def _ones(self, tokens: int) -> torch.Tensor:
        return self._ones_buf[:tokens]

    def _on_device(self, name: str, t: torch.Tensor) -> None:
        if t.device != self.device:
            raise ValueError(f"dispatch: {name} is on {t.device}; expected {self.device}")

    def _validate_dispatch(
        self, x: Any, topk_ids: Any, topk_weights: Any, x_scale: Any, routing: Routing | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """x, ids, weights and x_scale as the core takes them. Along `routing` its ids (and its
        weights, unless others are given) were checked when the routing was made."""
        x, x_scale = self._validate_x(x, x_scale)
        shape = (x.shape[0], self.cfg.topk)
        ids = routing.topk_ids if routing is not None else self._validate_ids(topk_ids, shape)
        trusted = routing is not None and topk_weights is None
        weights = routing.topk_weights if trusted else self._validate_weights(topk_weights, shape)
        return x, ids, weights, x_scale

    def _validate_x(self, x: Any, x_scale: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        cfg = self.cfg
        if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[1] != cfg.hidden:
            raise ValueError(f"dispatch: x: got {_describe(x)}; expected [T, {cfg.hidden}]")
        tokens = x.shape[0]
        if tokens > cfg.max_tokens:
            raise ValueError(f"dispatch: x has {tokens} tokens; expected at most max_tokens={cfg.max_tokens}")
        self._on_device("x", x)
        if x.dtype == torch.float8_e4m3fn:
            if cfg.dispatch_dtype != "fp8":
                raise ValueError(f"dispatch: x is fp8 but dispatch_dtype is {cfg.dispatch_dtype!r}")
            blocks = num_scales(cfg.hidden)
            if (
                not isinstance(x_scale, torch.Tensor)
                or tuple(x_scale.shape) != (tokens, blocks)
                or x_scale.dtype != torch.float32
                or x_scale.device != self.device
            ):
                raise ValueError(
                    f"dispatch: x_scale: got {_describe(x_scale)}; expected float32 [{tokens}, {blocks}] "
                    f"on {self.device} for already-quantised fp8 x"
                )
            x_scale = x_scale.contiguous()
        elif x.dtype in (torch.bfloat16, torch.float32):
            if x_scale is not None:
                raise ValueError("dispatch: x_scale is only for already-quantised fp8 x")
        else:
            raise ValueError(f"dispatch: x: got dtype {x.dtype}; expected bfloat16, float32 or float8_e4m3fn")
        return x.contiguous(), x_scale

    def _validate_ids(self, topk_ids: Any, shape: tuple[int, int]) -> torch.Tensor:
        cfg = self.cfg
        if not isinstance(topk_ids, torch.Tensor) or tuple(topk_ids.shape) != shape:
            raise ValueError(f"dispatch: topk_ids: got {_describe(topk_ids)}; expected shape {shape}")
        if topk_ids.dtype.is_floating_point or topk_ids.dtype == torch.bool or topk_ids.is_complex():
            raise ValueError(f"dispatch: topk_ids: got dtype {topk_ids.dtype}; expected an integer dtype")
        self._on_device("topk_ids", topk_ids)
        # On the GPU, reading the ids back would synchronise the stream (about 50 us
        # on an H200, more than the decode step's kernels): the CUDA kernels check
        # the range instead, drop bad copies and raise from the receive half.
        if shape[0] > 0 and not self._backend.checks_ids:
            low, high = (int(v) for v in torch.aminmax(topk_ids))
            if low < 0 or high >= cfg.num_experts:
                bad = low if low < 0 else high
                raise ValueError(
                    f"dispatch: topk_ids: found expert id {bad}; expected ids in [0, {cfg.num_experts})"
                )
        ids_dtypes = self._backend.ids_dtypes
        ids = topk_ids if topk_ids.dtype in ids_dtypes else topk_ids.to(ids_dtypes[-1])
        return ids.contiguous()

    def _validate_weights(self, topk_weights: Any, shape: tuple[int, int]) -> torch.Tensor:
        if not isinstance(topk_weights, torch.Tensor) or tuple(topk_weights.shape) != shape:
            raise ValueError(f"dispatch: topk_weights: got {_describe(topk_weights)}; expected shape {shape}")
        if not topk_weights.dtype.is_floating_point:
            raise ValueError(f"dispatch: topk_weights: got dtype {topk_weights.dtype}; expected float32")
        self._on_device("topk_weights", topk_weights)
        return topk_weights.to(torch.float32).contiguous()

    @_counted("check")
    def check(self) -> None:
        """Raise the outcome of the last call (CUDA graph-safe mode; synchronise the stream first)."""
        self._backend.check()

    def _check_open(self) -> None:
        if self._setup is None:
            raise RuntimeError("AllToAll is closed")

    def _check_usable(self) -> None:
        self._check_open()
        if self._failure is not None:
            raise RuntimeError(
                f"AllToAll is unusable after an earlier failure: {self._failure}. Every rank's "
                "instance stops after a failure on any rank (its calls could no longer be paired); "
                "close it and create a new AllToAll on every rank: a2a = a2a.reopen()"
            )

    def _fail(self, what: str, exc: Exception) -> None:
        """Stop this instance after a failed call, and tell the peers, whose calls cannot pair with ours."""
        epoch = self._backend.epoch
        if isinstance(exc, PeerFailedError):
            self._failure = f"call {self._calls} ({what}, epoch {epoch}) on rank {self.rank} stopped: {exc}"
        else:
            self._failure = f"call {self._calls} ({what}, epoch {epoch}) failed on rank {self.rank}: " + (
                f"{type(exc).__name__}: {exc}"
            )
            self._backend.announce_failure(self._failure)
        if self.abort_on_error and isinstance(exc, FabricError):
            sys.stderr.write(
                f"moe-a2a: rank {self.rank}: {exc}\nmoe-a2a: rank {self.rank}: ending the job "
                "(abort_on_error; MOE_A2A_ABORT_ON_ERROR=0 raises instead)\n"
            )
            sys.stderr.flush()
            self._boot.abort(1)

    # -- statistics and teardown ------------------------------------------------------------------

    def traffic(self) -> np.ndarray:
        """Bytes this rank sent to each peer in the last dispatch + combine: int64 [world, len(PATHS)]."""
        self._check_open()
        out = np.zeros((self.world_size, len(PATHS)), dtype=np.int64)
        if self._last is None:
            return out
        sent, received = self._backend.copies()
        routing = 0 if self._last_cached else self.cfg.num_experts * 4
        for peer in range(self.world_size):
            if peer == self.rank:
                continue
            path = 0 if peer in self._node else 1
            out[peer, path] = (
                routing
                + int(sent[peer]) * self._core_cfg.dispatch_row_bytes
                + int(received[peer]) * self._core_cfg.combine_row_bytes
            )
        return out

    def routing_rows(self) -> tuple[int, int]:
        """(sent, received): routing rows this rank wrote to peers and peers' rows it waited for, so far.

        An uncached dispatch adds `world_size - 1` to each; a cached one
        (`dispatch(routing=...)`) adds nothing.
        """
        self._check_open()
        return self._backend.routing_rows()

    def close(self, wait_for_peers: bool = True) -> None:
        """Stop the proxy and the engine and release the buffers.

        Collective while healthy: it first waits until no peer can still write into
        this rank's buffers. Pass `wait_for_peers=False` when peers are gone.
        """
        if self._setup is None:
            return
        settled = wait_for_peers and self._failure is None
        if settled:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # our own writes into peers are done
            self._boot.barrier()
        # The proxy and kernels stop first, then the engine, and only then does
        # the memory it had registered go.
        self._backend.close()
        setup, self._setup = self._setup, None
        setup.engine = None
        if self._lease is not None:
            # Unsettled, a peer's call may still write here: for as long as its waits can last.
            retire_s = 0.0 if settled else 2 * self.cfg.timeout_s + 1
            self._lease.close(setup.region, setup.group, setup.workspace, retire_s)
        setup.workspace = None

    def reopen(self) -> AllToAll:
        """Close this instance and return a new one built with the same arguments.

        Collective, like the constructor: after a failure every rank's calls raise,
        and every rank calls `a2a = a2a.reopen()` (or closes and constructs anew).
        """
        self.close()
        return AllToAll(**self._args)

    def __enter__(self) -> AllToAll:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
