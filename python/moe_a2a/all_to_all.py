"""AllToAll: expert-parallel dispatch and combine on torch tensors.

The contract is docs/design.md section 6; positions and numerics are in
docs/protocol.md. This module validates inputs, owns the tensors and drives
the C++ core, which does the work with the GIL released.
"""

from __future__ import annotations

import functools
import itertools
import sys
import warnings
import weakref
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any, TypeVar

import numpy as np
import torch

from moe_a2a import _core, memory_plan, process, switches
from moe_a2a.a2a_checks import CallChecks, resolve_in_place
from moe_a2a.a2a_startup import check_arguments, core_config, open_backend
from moe_a2a.a2a_types import (
    COMBINE_DTYPES,
    DISPATCH_DTYPES,
    PATHS,
    PLAIN,
    Config,
    Dispatched,
    PendingCombine,
    PendingDispatch,
    Routing,
    RowRequest,
    version_of,
)
from moe_a2a.agreement import all_to_all_settings, check_agreement
from moe_a2a.backends.common import Backend, RecvRequest, RowMath, Setup
from moe_a2a.bootstrap import Bootstrap
from moe_a2a.fabric import EngineLease, hint_universe_size
from moe_a2a.nics import num_nics_default
from moe_a2a.rejoin import LostRanks, live_ranks, register_masking

CapacityError = _core.CapacityError
FabricError = _core.FabricError
PeerFailedError = _core.PeerFailedError
StaleGraphError = _core.StaleGraphError

# Identity of each AllToAll in this process: handles carry it, so one instance
# never reads buffers sized from another instance's handle.
_instance_ids = itertools.count(1)


F = TypeVar("F", bound=Callable[..., Any])


def _counted(what: str) -> Callable[[F], F]:
    """An API call: counted, and any failure but a capacity error stops the instance on every rank."""

    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def call(self: AllToAll, *args: Any, **kwargs: Any) -> Any:
            self._check_usable()
            self._check_idle(what)
            self._calls += 1
            self._busy = what
            try:
                return fn(self, *args, **kwargs)
            except (CapacityError, StaleGraphError):
                # Capacity: every rank raised it for the same call, the next one starts clean.
                # A stale graph's replay did nothing at all.
                raise
            except BaseException as exc:  # KeyboardInterrupt too: a wait ends with it (wait.h)
                self._mask_after_loss(what, exc)  # on_peer_loss="mask": raises PeerLostError
                self._fail(what, exc)
                raise
            finally:
                self._busy = None

        return call  # type: ignore[return-value]

    return wrap


class AllToAll(LostRanks, process.ProcessBound):
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
        self._pid = process.adopt(self)  # a forked child neither calls nor releases it (moe_a2a.process)
        self._busy: str | None = None  # the call under way: signal handlers run inside its waits
        # A Bootstrap as `comm`: a replacement's (moe_a2a.rejoin.replacement), or a survivor's rejoin.
        self._boot = comm if isinstance(comm, Bootstrap) else Bootstrap(comm, ranks_per_node)
        try:
            self._start(
                cfg, comm, device, provider, ranks_per_node, num_nics, graph_safe, nics, abort_on_error
            )
        except BaseException:
            self._boot.close()  # a rejoin's files (moe_a2a.rejoin): this start-up is over
            raise

    def _start(
        self,
        cfg: Config,
        comm: Any,
        device: str,
        provider: str,
        ranks_per_node: int | None,
        num_nics: int | None,
        graph_safe: bool,
        nics: Sequence[str] | str | None,
        abort_on_error: bool | None,
    ) -> None:
        """The constructor's collective part, over `self._boot`."""
        # Each local step of start-up fails on every rank if it fails on one (a
        # missing GPU, a mistyped switch, a NIC name, memory): a rank that only
        # raised would leave its peers waiting in the next collective.
        with self._boot.together("checking AllToAll's arguments"):
            check_arguments(cfg, device, graph_safe, abort_on_error)
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
        # "auto" resolved from what every rank agreed on: a2a.cfg names the mode that runs.
        cfg = replace(cfg, fabric_rows=cfg.fabric_rows_for(self.world_size, topo.local_size, graph_safe))
        self.cfg = cfg
        # on_peer_loss="mask": ranks masked so far (a rejoin's survivor keeps its own).
        self._live = live_ranks(self._boot, cfg, device)
        reuse = getattr(self._boot, "reuse", None)  # a survivor's instance in a rejoin (moe_a2a.rejoin)
        self.max_private_tokens, self.max_recv_tokens = cfg.resolved(self.world_size)
        self.num_local_experts = cfg.num_experts // self.world_size
        self._node = set(topo.node_ranks)
        self._core_cfg = core_config(cfg, self.rank, self.world_size, topo.local_size, self._slice_bytes)
        with self._boot.together("checking that the workspace fits in memory"):
            if reuse is None:  # a survivor keeps its workspace
                memory_plan.check_fits(memory_plan.plan_of(self._core_cfg, cfg, device))
        opened = open_backend(self._boot, cfg, self._core_cfg, device, provider, num_nics, nics, graph_safe)
        self._lease: EngineLease | None = opened.lease
        self._setup: Setup | None = opened.setup
        self._backend: Backend = opened.backend
        # How rows cross the fabric, agreed by every rank (moe_a2a.gpu_direct): traces and bench record it.
        self.rows_path: dict[str, str] = opened.setup.transfer.as_dict()
        self.device = self._backend.device
        self.graph_safe = graph_safe
        b = self._backend
        self._checks = CallChecks(cfg, self.device, self.rank, self.world_size, b.checks_ids, b.ids_dtypes)
        # An unweighted combine's weights: views of one buffer, made here and never
        # regrown, so that a captured graph's view stays valid.
        self._ones_buf = torch.ones(cfg.max_tokens, cfg.topk, dtype=torch.float32, device=self.device)
        self._state = "idle"
        self._calls = 0  # API calls so far, rejected ones included: failures name theirs
        self._warned_grad = False  # _warn_no_backward: once per instance
        self._failure: str | None = None
        # The latest dispatch, weakly: combine checks it is the one in flight, and the
        # rows stay the caller's (held here, they would outlive the caller's use).
        self._last: weakref.ref[Dispatched] | None = None
        self._last_cached = False
        # The matrices of kept routings that are gone, for the next ones: on CUDA a pinned
        # allocation, made before the call's first kernel, is host time the GPU waits for. The
        # kernels that read a matrix come earlier in the stream than those that write it again.
        self._spare_matrices: list[torch.Tensor] = []
        self._cached_routing: Routing | None = None
        self._boot.barrier()  # every proxy runs and every peer is mapped before anyone writes
        if self._live is not None:  # a loss another instance of the job sees is masked here too
            register_masking(self)

    @property
    def epoch(self) -> int:
        """The number of dispatches started so far."""
        self._check_open()
        return self._backend.epoch

    @property
    def max_output_rows(self) -> int:
        """The most rows a call can deliver, padded: `expert_x`'s rows in graph-safe mode."""
        return int(self._core_cfg.max_output_rows)

    # -- dispatch -------------------------------------------------------------------------------

    @_counted("dispatch")
    def dispatch(
        self,
        x: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = None,
        topk_ids: torch.Tensor | None = None,
        topk_weights: torch.Tensor | None = None,
        *,
        send: bool = True,
        recv: bool = True,
        handle: PendingDispatch | None = None,
        routing: Routing | None = None,
        keep_routing: bool = False,
        dequantize: torch.dtype | None = None,
    ) -> Dispatched | PendingDispatch:
        """Send tokens to their experts' ranks and/or receive this rank's share.

        `x` is bf16 or fp32 rows, or already-quantised fp8 rows with their scales as one
        pair `(x, x_scale)`. `send=True, recv=False` returns a `PendingDispatch` while
        bytes are in flight; `dispatch(handle=pending, send=False)` finishes it.
        `keep_routing=True` returns the call's `Routing` in `Dispatched.routing`;
        `routing=r` sends `x` along it (its ids and, unless given, its weights) with no
        routing exchange. `dequantize=torch.bfloat16` (or float32; receive half, fp8 rows)
        delivers the rows dequantised by the receive pass itself (`expert_x_scale` None).
        A whole call reads this rank's own copies from `x` in place; a send half copies
        them, so `x` may change before the receive half.
        """
        self._warn_no_backward("dispatch", x=x, topk_weights=topk_weights)
        return self._dispatch(
            PLAIN, x, topk_ids, topk_weights, send, recv, handle, routing, keep_routing, dequantize
        )

    @_counted("dispatch")
    def _dispatch_rows(self, rows: RowRequest, *args: Any, **keywords: Any) -> Dispatched | PendingDispatch:
        """`dispatch(*args, **keywords)` with the training extras of `rows`: ExpertParallel's entry
        point (docs/training.md)."""
        return self._dispatch(rows, *args, **keywords)

    def _dispatch(
        self,
        rows: RowRequest,
        x: Any = None,
        topk_ids: Any = None,
        topk_weights: Any = None,
        send: bool = True,
        recv: bool = True,
        handle: Any = None,
        routing: Any = None,
        keep_routing: Any = False,
        dequantize: Any = None,
    ) -> Dispatched | PendingDispatch:
        if not send and not recv:
            raise ValueError("dispatch: send and recv are both False; nothing to do")
        if rows is not PLAIN and self._live is not None and self._live.masked:
            raise ValueError(f"dispatch: training extras with ranks {list(self.masked_ranks)} masked")
        rows.check_for("dispatch")
        in_place = resolve_in_place("dispatch", rows.in_place, send, recv)
        if not recv and (
            rows.row_scale is not None
            or rows.row_dot is not None
            or rows.row_weights is not False
            or dequantize is not None
        ):
            raise ValueError(
                "dispatch: row_scale=, row_dot=, row_weights= and dequantize= belong to the receive half "
                "(recv=True)"
            )
        if not isinstance(rows.row_weights, bool):
            raise ValueError(f"dispatch: row_weights: got {rows.row_weights!r}; expected True or False")
        if dequantize is not None and (
            self.cfg.dispatch_dtype != "fp8" or dequantize not in (torch.bfloat16, torch.float32)
        ):
            raise ValueError(
                f"dispatch: dequantize: got {dequantize!r} with dispatch_dtype {self.cfg.dispatch_dtype!r}; "
                "expected torch.bfloat16 or torch.float32 with dispatch_dtype 'fp8'"
            )
        row_math = req = None
        if send and recv:  # checked before anything is sent; the receive made ready to follow at once
            row_math = self._checks.row_math(routing, rows.row_scale, rows.row_dot)
            keep = keep_routing is True and routing is None
            req = self._recv_request(keep, row_math, rows.row_weights, dequantize)
        if send:
            if handle is not None:
                raise ValueError("dispatch: handle= is only for the receive half (send=False)")
            handle = self._dispatch_send(x, topk_ids, topk_weights, routing, keep_routing, in_place, req)
        elif routing is not None or keep_routing:
            raise ValueError("dispatch: routing= and keep_routing= belong to the send half (send=True)")
        if not recv:
            return handle
        if handle is None or not isinstance(handle, PendingDispatch):
            raise ValueError(
                f"dispatch: the receive half needs handle= from dispatch(..., recv=False); got {handle!r}"
            )
        if not send:
            row_math = self._checks.row_math(handle.routing, rows.row_scale, rows.row_dot)
            req = self._recv_request(handle.keep_routing, row_math, rows.row_weights, dequantize)
        assert req is not None
        return self._dispatch_recv(handle, req)

    def _recv_request(
        self, keep_routing: bool, math: RowMath | None, row_weights: bool, dequantize: torch.dtype | None
    ) -> RecvRequest:
        keep = None
        if keep_routing and self._spare_matrices:
            keep = self._spare_matrices.pop()
        elif keep_routing:
            keep = torch.empty(
                self.world_size,
                self.cfg.num_experts + self.world_size,
                dtype=torch.int32,
                pin_memory=self.device.type == "cuda",
            )
        return RecvRequest(DISPATCH_DTYPES[self.cfg.dispatch_dtype], keep, math, row_weights, dequantize)

    def _dispatch_send(
        self,
        x: Any,
        topk_ids: Any,
        topk_weights: Any,
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
            self._checks.routing(routing, x, topk_ids)
        x, ids, weights, scale = self._checks.dispatch_inputs(x, topk_ids, topk_weights, routing)
        dropped = None
        if self._live is not None and self._live.experts is not None:  # a rank is masked
            ids, weights, dropped = self._live.drop(
                ids, weights, self.cfg.mask_renormalize, routing, keep_routing
            )
        if routing is not None and not self._backend.checks_ids:
            self._checks.own_row(routing, ids)
        matrix = routing.matrix if routing is not None else None
        rows = routing.received_rows(self.cfg.expert_padding) if routing is not None else None
        self._backend.dispatch_send(x, scale, ids, matrix, in_place, weights, rows, then_recv)
        # A cached call's statistics (traffic()) read its matrix again: held until the next
        # call, so that no kept routing takes it over (_spare_matrices) meanwhile.
        self._cached_routing = routing
        self._state = "dispatch_sent"
        return PendingDispatch(
            epoch=self.epoch,
            num_tokens=x.shape[0],
            topk_weights=weights,
            owner=self.id,
            routing=routing,
            keep_routing=keep_routing and routing is None,
            topk_ids=ids,
            dropped=dropped,
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
                ids_version=version_of(handle.topk_ids),
            )
            weakref.finalize(routing, self._spare_matrices.append, keep)
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
            dropped=handle.dropped,
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
    ) -> torch.Tensor | PendingCombine:
        """Return expert outputs to their tokens' ranks.

        Weighted (the default): `out[t] = sum_k w[t,k] * y[row of (t,k)]` with the
        dispatch's `topk_weights`; `weighted=False`: the plain sum over k, for callers
        that apply the routing weights themselves (as TorchTitan does, under autograd).
        As for dispatch, a whole call reads `y` in place and a send half copies it.
        """
        self._warn_no_backward("combine", y=y)
        return self._combine(PLAIN, y, d, send, recv, handle, weighted)

    @_counted("combine")
    def _combine_rows(self, rows: RowRequest, *args: Any, **keywords: Any) -> torch.Tensor | PendingCombine:
        """`combine(*args, **keywords)` with the training extras of `rows`: ExpertParallel's entry
        point (docs/training.md)."""
        return self._combine(rows, *args, **keywords)

    def _combine(
        self,
        rows: RowRequest,
        y: Any = None,
        d: Any = None,
        send: bool = True,
        recv: bool = True,
        handle: Any = None,
        weighted: Any = True,
    ) -> torch.Tensor | PendingCombine:
        if not send and not recv:
            raise ValueError("combine: send and recv are both False; nothing to do")
        rows.check_for("combine")
        in_place = resolve_in_place("combine", rows.in_place, send, recv)
        row_values, values_out = rows.row_values, rows.values_out
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
        return self._combine_recv(handle, values_out)

    def _combine_recv(self, handle: PendingCombine, values_out: Any) -> torch.Tensor:
        self._check_owner("combine", handle)
        if self._state != "combine_sent" or handle.epoch != self.epoch:
            raise RuntimeError(f"combine: handle of epoch {handle.epoch} is not the combine in flight")
        self._checks.values_out(values_out, handle.num_tokens)
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
        y, values = self._checks.combine_inputs(y, d.expert_x.shape[0], row_values)
        self._backend.combine_send(y.contiguous(), in_place, values, weighted)
        self._state = "combine_sent"
        assert d.topk_weights is not None
        weights = d.topk_weights if weighted else self._ones(d.topk_weights.shape[0])
        return PendingCombine(epoch=d.epoch, num_tokens=d.num_tokens, topk_weights=weights, owner=self.id)

    # -- validation and state ---------------------------------------------------------------------

    def _warn_no_backward(self, what: str, **inputs: Any) -> None:
        """Once per instance: an input that requires grad, with gradients on, would silently get
        none back (the public calls have no backward; ExpertParallel's entry points do not warn)."""
        if self._warned_grad or not torch.is_grad_enabled():
            return
        for name, t in inputs.items():
            if isinstance(t, tuple):  # prequantised (x, x_scale)
                t = t[0]
            if isinstance(t, torch.Tensor) and t.requires_grad:
                self._warned_grad = True
                warnings.warn(
                    f"AllToAll.{what}: {name} requires grad, but AllToAll has no backward: what it "
                    f"returns carries no gradient back to {name}. Train with "
                    "moe_a2a.autograd.ExpertParallel; for inference call it under torch.no_grad() "
                    "or torch.inference_mode()",
                    stacklevel=4,
                )
                return

    def _ones(self, tokens: int) -> torch.Tensor:
        return self._ones_buf[:tokens]

    @_counted("check")
    def check(self) -> None:
        """Raise the outcome of the last call (CUDA graph-safe mode; synchronise the stream first).

        With `on_peer_loss="mask"`, a call that failed because a peer's process is gone raises
        `PeerLostError` here, once the survivors have masked it; graphs captured before then must
        be captured again (their replay raises `StaleGraphError`, having done nothing)."""
        self._backend.check()

    def _check_open(self) -> None:
        process.check_not_forked("AllToAll", self._pid)
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

    def _check_idle(self, what: str) -> None:
        if self._busy is not None:
            raise RuntimeError(
                f"{what}: the {self._busy} of this AllToAll is still under way (called from a signal "
                "handler, which runs inside the call's waits, or from another thread); expected one call "
                "at a time"
            )

    def _fail(self, what: str, exc: BaseException) -> None:
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
        """Bytes this rank sent to each peer in the last dispatch + combine: int64 [world, len(PATHS)].

        Routing row (E + N words, none when cached), then the wire rows (docs/protocol.md,
        "Rows per destination rank") at the mode's row sizes: dispatch rows out, and one
        combine row back for each row received. With `fabric_rows="node"` the forwarding
        inside the node is counted at the forwarder, towards each node peer: the dispatch rows
        it read its entries from, and each output of its that the forwarder summed, as the peer
        staged it (CPU: its y's dtype; CUDA: fp32), with its row value."""
        self._check_open()
        out = np.zeros((self.world_size, len(PATHS)), dtype=np.int64)
        if self._last is None:
            return out
        sent, received = self._backend.wire_rows()
        routing = 0 if self._last_cached else self._core_cfg.routing_width * 4
        for peer in range(self.world_size):
            if peer == self.rank:
                continue
            path = 0 if peer in self._node else 1
            out[peer, path] = (
                routing
                + int(sent[peer]) * self._core_cfg.dispatch_row_bytes
                + int(received[peer]) * self._core_cfg.combine_row_bytes
            )
        forwarded = getattr(self._backend, "forwarded", None)
        if self.cfg.fabric_rows == "node" and forwarded is not None:
            rows, output_bytes = forwarded()
            out[:, 0] += rows * self._core_cfg.dispatch_row_bytes + output_bytes
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
        if self._setup is None or process.in_forked_child(self._pid):
            return  # a forked child's copy: the parent's workspace, engine and proxy are not its own
        self._check_idle("close")
        # With a rank masked no collective of the launcher can run (it would wait for the dead
        # rank): a live peer on another node may still write here, so the memory is retired.
        settled = wait_for_peers and self._failure is None and not self.masked_ranks
        if settled:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # our own writes into peers are done
            self._boot.barrier()
        self._shut(settled)

    def __del__(self) -> None:
        # Dropped without close() (a failed call's instance, as often as not): the engine is the
        # process's and lives on, and a peer may still write into this instance's registered
        # memory. Freed now, those writes would land in memory that is gone (a SIGSEGV in the
        # engine's thread); closed unsettled, it is retired with its registration instead.
        if getattr(self, "_setup", None) is None or self._busy is not None:
            return
        # At interpreter exit this module's globals may already be None: no name of it is used
        # before the try, and whatever fails there is dropped (__del__ would only print it).
        try:
            if not process.in_forked_child(self._pid):
                self._shut(settled=False)
        except Exception:
            pass

    def _shut(self, settled: bool) -> None:
        """close() past its barrier; `settled`: no peer can still write here (else retired)."""
        # The proxy and kernels stop first, then the engine, and only then does
        # the memory it had registered go.
        self._backend.close()
        setup, self._setup = self._setup, None
        assert setup is not None
        setup.engine = None
        if self._lease is not None:
            # Unsettled, a peer's call may still write here: for as long as its waits can last.
            retire_s = 0.0 if settled else self._core_cfg.caller_timeout_s
            # GPU-direct's (region, group, memory), taken from the backend so that the device
            # memory goes now (or, retired, with the lease), not when this object is collected:
            # it holds the engine alive, and with it shm's CUDA IPC mappings of the peers' device
            # workspaces (which is also why those workspaces are pooled, never freed: resources.cc).
            take = getattr(self._backend, "take_device_rows", None)
            rows = take() if take is not None else None
            if rows is not None:
                region, group, memory = rows
                self._lease.release(region, group, memory, retire_s)
            self._lease.close(setup.region, setup.group, setup.workspace, retire_s)
        setup.workspace = None
        if self._live is not None:
            self._live.close()  # its control connections, across nodes
            if hasattr(self._boot, "gone"):  # a rejoin's meeting: the lost ranks never leave it
                self._boot.gone |= set(self._live.masked)
        self._boot.close()

    def reopen(self) -> AllToAll:
        """Close this instance and return a new one built with the same arguments.

        Collective, like the constructor: after a failure every rank's calls raise,
        and every rank calls `a2a = a2a.reopen()` (or closes and constructs anew).
        """
        if isinstance(self._args["comm"], Bootstrap):  # a rejoin's, whose files go at close
            raise ValueError(
                "reopen: this instance was built by a rejoin (moe_a2a.rejoin), whose meeting ends "
                "with it; close it and construct anew over a communicator of the live ranks"
            )
        self.close()
        return AllToAll(**self._args)

    def __enter__(self) -> AllToAll:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        # Leaving on an exception (a failed check of the caller's own, say) the peers may be
        # waiting in a call of ours that will not come: close without the barrier, so the
        # error surfaces now instead of after their timeout.
        self.close(wait_for_peers=exc_type is None)
