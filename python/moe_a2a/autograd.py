"""Differentiable dispatch and combine, for expert-parallel training.

`ExpertParallel` wraps the forward `AllToAll` with what the backward needs:
- a routing per dispatch (`ExpertRouting`, `routed.routing`) that it owns, so any number
  of layers can sit between their forward and their backward;
- gradients that travel in `grad_dtype` (bf16 or fp32) whatever the forward
  dispatch dtype (an fp8 forward gets its own gradient instance);
- per-row routing weights on the expert side, and their gradients back to
  `topk_weights`, in the tails of the rows themselves (each dispatched row
  carries its copy's weight; each returned row one value, unreduced).

Backward of dispatch is an unweighted combine of the row gradients; backward of
combine is a dispatch of the output gradient along the dispatch's routing, scaled
by the per-row weights in weighted mode. fp8 quantisation has the
straight-through gradient (the identity). docs/training.md has the details.

The core keeps one dispatch in flight per instance: every dispatch is followed
by its combine. The forward pair (dispatch, combine) and the backward pair
(combine's backward, then dispatch's backward) of a layer each keep that order,
because autograd runs a layer's combine backward before its dispatch backward.
"""

from __future__ import annotations

import dataclasses
import itertools
import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch.autograd.function import once_differentiable

from moe_a2a import compiled_ops, process
from moe_a2a.a2a_types import COMBINE_DTYPES, Config, Dispatched, RowRequest, describe, version_of
from moe_a2a.all_to_all import AllToAll
from moe_a2a.ep_channel import Channel
from moe_a2a.ep_types import CompiledRouting, ExpertRouting, PendingCombined, PendingRouted, Routed

GRAD_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
COMPILED_ROWS = ("exact", "capacity")
_ids = itertools.count(1)
# The forward dispatch's receive extras: each row's weight, unless along a cached routing (which has them).
_NEW_ROWS = RowRequest(row_weights=True)
_CACHED_ROWS = RowRequest(row_weights=False)  # not PLAIN: training extras all the same


# Torch that deprecates _check_is_size (a FutureWarning at every compile) takes _check(n >= 0)
# as making an unbacked size one; older torch needs _check_is_size for it.
_IS_SIZE_DEPRECATED = getattr(torch._check_is_size, "__deprecated__", None) is not None


def _check_size(n: Any) -> None:
    """The dispatch's row count, an unbacked size under compile, checked as one."""
    if _IS_SIZE_DEPRECATED:
        torch._check(n >= 0)
    else:
        torch._check_is_size(n)


class ExpertParallel(process.ProcessBound):
    """Differentiable dispatch and combine for one expert-parallel group.

    `cfg` is the forward's `Config`; `grad_dtype` ("bf16" or "fp32") is what
    gradients travel in. Layers may share one `ExpertParallel` (each layer's
    forward and backward pairs stay in order) or hold their own. At most
    `max_live_routings` routings are alive at once: a model with L layers
    needs L (2L with activation recomputation); more is an error, never a
    silent overwrite.

    `compiled_rows` is what a dispatch under torch.compile hands the experts:
    `"exact"` the rows it received (a data-dependent size: the caller's graph
    reads it on the host and compiles for an unbacked size), `"capacity"` always
    `max_output_rows` rows, those past the received ones zero (a static size:
    no host read in the graph, and Inductor compiles the experts for a fixed
    shape; experts must then take `tokens_per_expert` as the filled rows, as
    TorchTitan's do). Eager calls always return the exact rows.
    """

    def __init__(
        self,
        cfg: Config,
        comm: Any = None,
        device: str = "cpu",
        provider: str = "auto",
        ranks_per_node: int | None = None,
        num_nics: int | None = None,
        grad_dtype: str = "bf16",
        max_live_routings: int = 64,
        nics: Sequence[str] | str | None = None,
        compiled_rows: str = "exact",
    ) -> None:
        if not isinstance(cfg, Config):
            raise TypeError(f"cfg: got {type(cfg).__name__}; expected moe_a2a.Config")
        if grad_dtype not in GRAD_DTYPES:
            raise ValueError(f"grad_dtype: got {grad_dtype!r}; expected one of {list(GRAD_DTYPES)}")
        if (
            not isinstance(max_live_routings, int)
            or isinstance(max_live_routings, bool)
            or max_live_routings < 1
        ):
            raise ValueError(f"max_live_routings: got {max_live_routings!r}; expected an integer >= 1")
        if compiled_rows not in COMPILED_ROWS:
            raise ValueError(f"compiled_rows: got {compiled_rows!r}; expected one of {list(COMPILED_ROWS)}")
        self.compiled_rows = compiled_rows
        self.cfg = cfg
        self.grad_dtype = grad_dtype
        self.max_live_routings = max_live_routings
        self.id = next(_ids)
        self._seq = itertools.count(1)
        self._live = 0
        # The instances share one engine per process (moe_a2a.fabric.lease_engine).
        opts = dict(
            comm=comm,
            device=device,
            provider=provider,
            ranks_per_node=ranks_per_node,
            num_nics=num_nics,
            nics=nics,
        )
        self.forward_a2a = AllToAll(cfg, **opts)
        if cfg.dispatch_dtype == grad_dtype and cfg.combine_dtype == grad_dtype:
            self.backward_a2a = self.forward_a2a
        else:
            grad_cfg = dataclasses.replace(cfg, dispatch_dtype=grad_dtype, combine_dtype=grad_dtype)
            self.backward_a2a = AllToAll(grad_cfg, **opts)
        self._fwd = Channel(self.forward_a2a)
        self._bwd = self._fwd if self.backward_a2a is self.forward_a2a else Channel(self.backward_a2a)
        self.rank, self.world_size = self.forward_a2a.rank, self.forward_a2a.world_size
        self.num_local_experts = self.forward_a2a.num_local_experts
        self.device = self.forward_a2a.device
        self._ids_dtypes = self.forward_a2a._backend.ids_dtypes  # what the core takes unconverted
        self._all = list({id(a): a for a in (self.forward_a2a, self.backward_a2a)}.values())
        self._capacity_rows = self.forward_a2a.max_output_rows  # a plain int for Dynamo
        # The operators' handle on us: a tensor, which Dynamo passes as a graph input, so one
        # graph serves every instance of a shape (each layer may hold its own; a constant would
        # compile a graph per instance, and fullgraph fails past the recompile limit).
        self._op_handle = torch.tensor(self.id, dtype=torch.int64)
        compiled_ops.register(self)

    # -- public API ---------------------------------------------------------------------------

    def dispatch(
        self,
        x: torch.Tensor | None = None,
        topk_ids: torch.Tensor | None = None,
        topk_weights: torch.Tensor | None = None,
        *,
        routing: ExpertRouting | None = None,
        recv: bool = True,
        handle: PendingRouted | None = None,
    ) -> Routed | PendingRouted:
        """Send rows to their experts' ranks; differentiable w.r.t. `x` and `topk_weights`.

        With `routing=` (an earlier dispatch's `routed.routing`), `x` goes along that
        routing and its weights; `topk_ids` and `topk_weights` must then be left out.
        `recv=False` returns after the send half (`PendingRouted`), so other work
        can run while rows travel; `dispatch(handle=p)` finishes it.
        """
        if torch.compiler.is_compiling():
            return self._compiled_dispatch(x, topk_ids, topk_weights, routing, recv, handle)
        self._check_open()
        if handle is not None:
            if not isinstance(handle, PendingRouted) or x is not None or routing is not None:
                raise ValueError(
                    "dispatch: handle= takes the PendingRouted of dispatch(..., recv=False) alone"
                )
            return self._dispatch_recv(handle, sent=True)
        if not isinstance(x, torch.Tensor) or x.dtype not in GRAD_DTYPES.values():
            raise ValueError(f"dispatch: x: got {describe(x)}; expected a bfloat16 or float32 tensor")
        if routing is not None:
            self._check_routing("dispatch", routing)
            if topk_ids is not None or topk_weights is not None:
                raise ValueError(
                    "dispatch: with routing=, leave topk_ids and topk_weights out (the routing has them)"
                )
            ids, weights = routing.topk_ids, routing.topk_weights
        else:
            if not isinstance(topk_weights, torch.Tensor) or not topk_weights.dtype.is_floating_point:
                raise ValueError(
                    f"dispatch: topk_weights: got {describe(topk_weights)}; expected a float tensor"
                )
            ids, weights = self._check_ids(topk_ids), topk_weights
        if self._live >= self.max_live_routings:
            raise RuntimeError(
                f"dispatch: {self._live} routings are alive, the most max_live_routings="
                f"{self.max_live_routings} allows; finish the backward of earlier steps (or call "
                "routed.routing.release()) or raise max_live_routings"
            )
        p = PendingRouted(x, ids, weights, routing, torch.is_grad_enabled())
        if recv:
            return self._dispatch_recv(p, sent=False)
        # The caller's x, which it may change before the receive half: not read in place.
        self._forward_dispatch_send(x, ids, weights, routing, in_place=False)
        return p

    def _dispatch_recv(self, p: PendingRouted, sent: bool) -> Routed:
        # The kernels first, then the autograd node around what they return: its Python then
        # runs while the GPU copies, not before the first launch. No graph is recorded here
        # (the core keeps its inputs until its kernels ran; no graph may outlive the step).
        with torch.no_grad():
            if sent:
                rows, h = self._forward_dispatch_recv(p.x.dtype, p.topk_ids, p.topk_weights, p.cached)
            else:
                rows, h = self._forward_dispatch(p.x, p.topk_ids, p.topk_weights, p.cached)
        with torch.set_grad_enabled(p.track):
            # rows in a box, not as an input: an input returned as it is would come back as a view
            expert_x, row_weights = _DispatchFn.apply(self, h, {"rows": rows}, p.x, p.topk_weights, p.cached)
        if not p.track or p.cached is not None:
            row_weights = h.row_weights
        return Routed(
            expert_x=expert_x, tokens_per_expert=h.tokens_per_expert, routing=h, row_weights=row_weights
        )

    def combine(
        self,
        y: torch.Tensor | None = None,
        routed: Routed | None = None,
        *,
        weighted: bool = True,
        recv: bool = True,
        handle: PendingCombined | None = None,
    ) -> torch.Tensor | PendingCombined:
        """Return expert rows to their tokens: `out[t] = sum_k w[t,k] * y[row of (t,k)]`.

        `weighted=False` sums the rows unweighted (apply `routed.row_weights` to
        `y` yourself; autograd then owns their gradient). Differentiable w.r.t. `y`
        and, in weighted mode, the dispatch's `topk_weights`. `recv=False` and
        `combine(handle=p)` split it in halves, as for dispatch.
        """
        if torch.compiler.is_compiling():
            return self._compiled_combine(y, routed, weighted, recv, handle)
        self._check_open()
        if handle is not None:
            if not isinstance(handle, PendingCombined) or y is not None or routed is not None:
                raise ValueError(
                    "combine: handle= takes the PendingCombined of combine(..., recv=False) alone"
                )
            return self._combine_apply(handle, sent=True)
        if not isinstance(routed, Routed):
            raise TypeError(
                f"combine: routed: got {type(routed).__name__}; expected the Routed from dispatch"
            )
        if not isinstance(weighted, bool):
            raise ValueError(f"combine: weighted: got {weighted!r}; expected True or False")
        h = routed.routing
        self._check_routing("combine", h)
        if not isinstance(y, torch.Tensor) or tuple(y.shape) != (h.num_rows, self.cfg.hidden):
            raise ValueError(f"combine: y: got {describe(y)}; expected shape {(h.num_rows, self.cfg.hidden)}")
        p = PendingCombined(y, routed, weighted)
        if recv:
            return self._combine_apply(p, sent=False)
        self._forward_combine_send(y, h, weighted, in_place=False)  # as dispatch's send half
        return p

    def _combine_apply(self, p: PendingCombined, sent: bool) -> torch.Tensor:
        r = p.routed
        w = r.row_weights if p.weighted and r.row_weights is not None else torch.empty(0)
        return _CombineFn.apply(self, r.routing, p.y, w, p.weighted, sent)

    # -- under torch.compile: the custom operators of moe_a2a.compiled_ops ------------------------

    def _compiled_dispatch(
        self, x: Any, topk_ids: Any, topk_weights: Any, routing: Any, recv: bool, handle: Any
    ) -> Routed:
        if routing is not None or not recv or handle is not None:
            raise NotImplementedError(
                "dispatch under torch.compile: routing=, recv=False and handle= are eager-only; "
                "expected a whole dispatch(x, topk_ids, topk_weights)"
            )
        if not isinstance(x, torch.Tensor) or x.dtype not in GRAD_DTYPES.values():
            raise ValueError(f"dispatch: x: got {describe(x)}; expected a bfloat16 or float32 tensor")
        if not isinstance(topk_weights, torch.Tensor) or not topk_weights.dtype.is_floating_point:
            raise ValueError(f"dispatch: topk_weights: got {describe(topk_weights)}; expected a float tensor")
        ids = self._check_ids(topk_ids)
        track = torch.is_grad_enabled() and (x.requires_grad or topk_weights.requires_grad)
        counts, key, num_rows = compiled_ops.dispatch_op(
            x, ids, topk_weights, self._op_handle, self.num_local_experts, track
        )
        if self.compiled_rows == "capacity":
            rows = self._capacity_rows  # static: nothing read on the host
        else:
            rows = num_rows.item()  # an unbacked size under capture_scalar_outputs
            _check_size(rows)
        expert_x, row_weights = compiled_ops.dispatch_rows_op(x, topk_weights, key, self._op_handle, rows)
        return Routed(
            expert_x=expert_x,
            tokens_per_expert=counts,
            routing=CompiledRouting(key, x.shape[0]),  # type: ignore[arg-type]
            row_weights=row_weights,
        )

    def _compiled_combine(self, y: Any, routed: Any, weighted: bool, recv: bool, handle: Any) -> torch.Tensor:
        if not recv or handle is not None:
            raise NotImplementedError("combine under torch.compile: recv=False and handle= are eager-only")
        if not isinstance(routed, Routed) or not isinstance(routed.routing, CompiledRouting):
            raise TypeError("combine: routed: expected the Routed of a dispatch in the same compiled region")
        if not isinstance(y, torch.Tensor) or y.dim() != 2 or y.shape[1] != self.cfg.hidden:
            raise ValueError(f"combine: y: got {describe(y)}; expected shape (rows, {self.cfg.hidden})")
        h = routed.routing
        w = routed.row_weights
        assert w is not None
        backward = torch.is_grad_enabled() and (y.requires_grad or w.requires_grad)
        out_dtype = COMBINE_DTYPES[self.cfg.combine_dtype]
        return compiled_ops.combine_op(
            y, w, h.key, self._op_handle, h.num_tokens, out_dtype, weighted, backward
        )

    @property
    def live_routings(self) -> int:
        return self._live

    def close(self) -> None:
        # A failure stops every instance alike, whichever one a rank saw it in: on the
        # failing rank all of them, on a peer the one whose call raised PeerFailedError.
        # Closing waits for the peers only where none failed, the same choice on every rank.
        compiled_ops.drop_routings(self.id)
        healthy = all(a._failure is None for a in self._all if a._setup is not None)
        for a2a in self._all:
            a2a.close(wait_for_peers=healthy)

    def __enter__(self) -> ExpertParallel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the work behind the autograd functions ---------------------------------------------------

    def _new_routing(
        self,
        ids: torch.Tensor,
        weights: torch.Tensor,
        d: Dispatched,
        x_dtype: torch.dtype,
        cached: ExpertRouting | None,
    ) -> ExpertRouting:
        """The routing of a dispatch just received (along `cached`: the same rows)."""
        h = ExpertRouting(
            owner=self.id,
            seq=next(self._seq),
            topk_ids=ids,
            topk_weights=weights.detach().to(torch.float32).contiguous(),
            tokens_per_expert=d.tokens_per_expert,
            num_rows=int(d.expert_x.shape[0]),
            expert_padding=self.cfg.expert_padding,
            row_weights=cached.row_weights if cached is not None else d.row_weights,
            x_dtype=x_dtype,
            gathered=d.routing,
        )
        if h.row_weights is not None:
            h._weights_version = version_of(h.row_weights)
        self._live += 1
        h._finalizer = weakref.finalize(h, self._drop_routing)
        return h

    def _drop_routing(self) -> None:
        self._live -= 1

    def _forward_dispatch_send(
        self,
        x: torch.Tensor,
        ids: torch.Tensor,
        weights: torch.Tensor,
        cached: ExpertRouting | None = None,
        in_place: bool = True,
    ) -> None:
        """The forward dispatch's send half, along `cached`'s routing when given. `in_place`:
        the receive half follows with no caller's code between (x unchanged)."""
        routing = cached.gathered if cached is not None else None
        self._fwd.dispatch_send(
            x, ids, weights, closable=False, routing=routing, keep_routing=True, in_place=in_place
        )

    def _forward_dispatch(
        self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, cached: ExpertRouting | None
    ) -> tuple[torch.Tensor, ExpertRouting]:
        """The forward dispatch as one call (its receive kernel launched right after the send's)."""
        routing = cached.gathered if cached is not None else None
        d = self._fwd.dispatch_whole(
            x,
            ids,
            weights,
            closable=False,
            routing=routing,
            keep_routing=True,
            rows=_NEW_ROWS if cached is None else _CACHED_ROWS,
            dequantize=self._dequantize(x.dtype),
        )
        return self._forward_routed(d, x.dtype, ids, weights, cached)

    def _dequantize(self, x_dtype: torch.dtype) -> torch.dtype | None:
        """fp8 rows come back dequantised to the input's dtype by the receive pass itself."""
        return x_dtype if self.cfg.dispatch_dtype == "fp8" else None

    def _forward_dispatch_recv(
        self, x_dtype: torch.dtype, ids: torch.Tensor, weights: torch.Tensor, cached: ExpertRouting | None
    ) -> tuple[torch.Tensor, ExpertRouting]:
        # Each row's weight rides in its tail; along a cached routing they are the routing's.
        d = self._fwd.dispatch_recv(_NEW_ROWS if cached is None else _CACHED_ROWS, self._dequantize(x_dtype))
        return self._forward_routed(d, x_dtype, ids, weights, cached)

    def _forward_routed(
        self,
        d: Dispatched,
        x_dtype: torch.dtype,
        ids: torch.Tensor,
        weights: torch.Tensor,
        cached: ExpertRouting | None,
    ) -> tuple[torch.Tensor, ExpertRouting]:
        h = self._new_routing(ids, weights, d, x_dtype, cached)
        self._fwd.open = h
        expert_x = d.expert_x  # fp8 rows come dequantised (_dequantize)
        # A fresh tensor object for autograd, which sets its grad_fn: the channel's
        # Dispatched holds d.expert_x, and rows -> grad_fn -> ctx -> self -> channel
        # would be a cycle through C++ that Python's gc cannot collect.
        return expert_x.to(x_dtype).detach(), h

    def _forward_combine_send(
        self, y: torch.Tensor, h: ExpertRouting, weighted: bool, in_place: bool = True
    ) -> None:
        self._fwd.combine_send(y.contiguous(), h, weighted, in_place)

    def _forward_combine_recv(self) -> torch.Tensor:
        return self._fwd.combine_recv()

    def _backward_combine(
        self, grad_out: torch.Tensor, h: ExpertRouting, weighted: bool, y: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Combine's backward: the output gradient dispatched along h (rows of every copy), in
        grad_dtype; `weighted`, each row times its weight and, with `y`, <row, y[row]> (the
        weights' gradient) in the same pass."""
        gd = GRAD_DTYPES[self.grad_dtype]
        grad = grad_out.to(gd).contiguous()
        scale = dot = None
        if weighted:
            assert h.row_weights is not None
            if h._weights_version is not None and h.row_weights._version != h._weights_version:
                raise RuntimeError(
                    "backward: routed.row_weights was changed in place after dispatch; the "
                    "weighted combine's backward scales by them: expected them unchanged"
                )
            scale = h.row_weights
            if y is not None:  # bf16 or fp32 as they are (the kernel sums in fp32)
                dot = y if y.dtype in GRAD_DTYPES.values() else y.to(gd)
        rows = RowRequest(row_scale=scale, row_dot=dot)
        d = self._bwd.dispatch_whole(
            grad, h.topk_ids, h.topk_weights, closable=True, routing=h.gathered, rows=rows
        )
        self._bwd.open = h
        return d.expert_x, d.row_dot

    def _backward_dispatch(
        self,
        grad_rows: torch.Tensor | None,
        grad_row_weights: torch.Tensor | None,
        h: ExpertRouting,
        weights_grad: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Dispatch's backward: the row gradients summed onto their tokens and, with
        `weights_grad`, the weights' gradients: each row's returns in its tail, unreduced, to
        the (t, k) it came from (zero from a rank whose rows' weights had no gradient)."""
        gd = GRAD_DTYPES[self.grad_dtype]
        if not self._bwd.is_open_for(h):  # combine's backward did not run (rows used without combine)
            zeros = torch.zeros(h.num_tokens, self.cfg.hidden, dtype=gd, device=self.device)
            self._bwd.dispatch(zeros, h, closable=True)
        if grad_rows is None:
            grad_rows = torch.zeros(h.num_rows, self.cfg.hidden, dtype=gd, device=self.device)
        values = None
        if grad_row_weights is not None and grad_row_weights.numel() == h.num_rows:
            values = grad_row_weights.to(torch.float32).contiguous()
        self._bwd.combine_send(grad_rows.to(gd).contiguous(), h, weighted=False, row_values=values)
        grad_w = None
        if weights_grad:
            grad_w = torch.empty(h.num_tokens, self.cfg.topk, dtype=torch.float32, device=self.device)
        grad_x = self._bwd.combine_recv(values_out=grad_w)
        return grad_x, grad_w

    # -- validation -----------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self.forward_a2a._setup is None:
            raise RuntimeError("ExpertParallel is closed")
        for a2a in self._all:  # a failure in any of them stops them all (the called one checks the rest)
            if a2a._failure is not None or a2a._setup is None:
                a2a._check_usable()

    def _check_routing(self, what: str, h: Any) -> None:
        if not isinstance(h, ExpertRouting):
            raise TypeError(f"{what}: routing: got {type(h).__name__}; expected an ExpertRouting")
        if h.owner != self.id:
            raise RuntimeError(
                f"{what}: the routing belongs to ExpertParallel #{h.owner}, not to this one (#{self.id})"
            )

    def _check_ids(self, topk_ids: Any) -> torch.Tensor:
        """Integer [T, topk] ids, in a dtype the core takes as it is."""
        if not isinstance(topk_ids, torch.Tensor) or topk_ids.dim() != 2 or topk_ids.dtype.is_floating_point:
            raise ValueError(
                f"dispatch: topk_ids: got {describe(topk_ids)}; expected an integer [T, topk] tensor"
            )
        if topk_ids.dtype not in self._ids_dtypes:
            topk_ids = topk_ids.to(self._ids_dtypes[-1])
        return topk_ids.contiguous()


class _DispatchFn(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        ep: ExpertParallel,
        h: ExpertRouting,
        box: dict[str, torch.Tensor],
        x: torch.Tensor,
        weights: torch.Tensor,
        cached: ExpertRouting | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The node of a dispatch already launched (ExpertParallel._dispatch_recv): `h` is its
        routing and `box["rows"]` its received rows; `x` and `weights` the inputs they have
        gradients for."""
        ctx.ep, ctx.handle = ep, h
        assert h.row_weights is not None
        # A new tensor object on the routing's storage (autograd sets its grad_fn; the routing
        # keeps the plain one); the backward refuses weights changed in place since.
        row_weights = h.row_weights.detach()
        if cached is not None:
            ctx.mark_non_differentiable(row_weights)
        return box["rows"], row_weights

    @staticmethod
    @once_differentiable  # the exchange has no backward of its own: a double backward raises
    def backward(
        ctx: Any, grad_rows: torch.Tensor | None, grad_row_weights: torch.Tensor | None
    ) -> tuple[Any, ...]:
        h: ExpertRouting = ctx.handle
        weights_grad = bool(ctx.needs_input_grad[4])
        grad_x, grad_w = ctx.ep._backward_dispatch(grad_rows, grad_row_weights, h, weights_grad)
        grad_x = grad_x.to(h.x_dtype) if ctx.needs_input_grad[3] else None
        return None, None, None, grad_x, grad_w, None


class _CombineFn(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        ep: ExpertParallel,
        h: ExpertRouting,
        y: torch.Tensor,
        row_weights: torch.Tensor,
        weighted: bool,
        sent: bool,
    ) -> torch.Tensor:
        if not sent:
            ep._forward_combine_send(y, h, weighted)
        out = ep._forward_combine_recv()
        if h.gathered is not None and any(ctx.needs_input_grad):
            # While the GPU runs this layer: the row count the backward's dispatch along the
            # routing needs, memoised, instead of on the host at the backward's start.
            h.gathered.received_rows(ep.cfg.expert_padding)
        ctx.ep, ctx.handle, ctx.weighted = ep, h, weighted
        ctx.y_dtype = y.dtype
        ctx.save_for_backward(y if weighted else None)
        return out

    @staticmethod
    @once_differentiable  # as _DispatchFn's: never a silently missing second-order term
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        ep: ExpertParallel = ctx.ep
        h: ExpertRouting = ctx.handle
        (y,) = ctx.saved_tensors
        if ctx.weighted and h.row_weights is None:
            raise RuntimeError(
                "backward: this combine's dispatch ran with gradients disabled, so its per-row "
                "weights were never delivered; dispatch with torch.enable_grad() to train"
            )
        # Weighted: the rows arrive scaled by their weights, with the weights' gradient
        # <row, y> beside them, in the pass that receives them (in grad_dtype).
        dot_y = y if ctx.weighted and ctx.needs_input_grad[3] else None
        grad_y, grad_w = ep._backward_combine(grad_out, h, ctx.weighted, dot_y)
        return None, None, grad_y.to(ctx.y_dtype), grad_w, None, None
