"""Dispatch and combine as `torch.library` operators, for training under torch.compile.

Dynamo cannot trace into the core (it would hand it fake tensors) nor carry an
`ExpertRouting` through a graph, so under compile `ExpertParallel`'s whole calls go
through five operators:

- `moe_a2a::dispatch(x, ids, weights, inst, E, keep)` -> tokens per local expert [E],
  routing key [] and row count U [] (int64): the exchange itself;
- `moe_a2a::dispatch_rows(x, weights, key, inst, U)` -> rows [U, H], row weights [U];
- `moe_a2a::combine(y, row_weights, key, inst, T, out_dtype, weighted, backward)` -> [T, H];
- their backwards, `moe_a2a::dispatch_backward` and `moe_a2a::combine_backward`.

Each is defined with `torch.library.Library` and autograd passes through it in the
dispatcher (`_gradless_op`); `dispatch_rows_op` and `combine_op` are autograd.Functions
around theirs whose backward calls the backward operator, traced by Dynamo into the graph.

Shapes: the row count U is data-dependent. With `ExpertParallel(compiled_rows="exact")`
the caller reads it with `.item()`, which TorchTitan's `capture_scalar_outputs=True`
turns into an unbacked size (checked as one: `autograd._check_size`), and hands it to
`dispatch_rows`, whose fake implementation gives rows of that size: the experts see
exactly eager's rows. With `"capacity"` the caller passes the instance's
`max_output_rows` R instead (a constant): rows [R, H] with zeros past U, and the ops
that take rows back (`combine`, the backwards) use their first U. No host read, and
Inductor compiles the experts for a static size. The handle is two tensors: `inst` (the
instance's `_op_handle`, its id) names the `ExpertParallel` in a per-process registry, the
routing key (made at run time) its `ExpertRouting`. As tensors they are graph inputs, so one
graph serves every instance of a shape, each layer's own included; the fake implementations
take the shapes from their arguments, never from the instance. A routing stays there
until its last use: the dispatch's backward, else the combine's backward, else the combine.

The real implementations call the same methods as eager autograd (`_forward_dispatch`,
`_backward_combine`, ...), so results and gradients are eager's bit for bit; eager
calls do not go through these operators at all. docs/training.md has the design.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable
from typing import Any

import torch

from moe_a2a.ep_types import ExpertRouting

# moe_a2a.autograd imports this module: its ExpertParallel is `Any` here.
_instances: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
_routings: dict[tuple[int, int], ExpertRouting] = {}


def register(ep: Any) -> None:
    _instances[ep.id] = ep


def _ep(inst: torch.Tensor) -> Any:
    ep_id = int(inst.item())
    ep = _instances.get(ep_id)
    if ep is None:
        raise RuntimeError(f"moe_a2a ops: ExpertParallel #{ep_id} is closed or was never opened")
    return ep


def _routing(ep: Any, key: torch.Tensor, pop: bool) -> ExpertRouting:
    k = (ep.id, int(key.item()))
    h = _routings.pop(k, None) if pop else _routings.get(k)
    if h is None:
        raise RuntimeError(
            f"moe_a2a ops: routing {k[1]} of ExpertParallel #{k[0]} is gone (its backward already ran)"
        )
    return h


def drop_routings(ep_id: int) -> None:
    """Forget an instance's routings (on close)."""
    for k in [k for k in _routings if k[0] == ep_id]:
        del _routings[k]


_LIB = torch.library.Library("moe_a2a", "FRAGMENT")


def _gradless_op(schema: str, fake: Callable[..., Any]) -> Callable[[Callable[..., Any]], Any]:
    """`schema`'s operator with the decorated function as its kernel, which autograd passes
    through in the dispatcher itself: no `torch.library.custom_op` Python layers around each
    call (10-15 us a call on the CPU VM, and the compiled step waits on the host). Operators
    with a gradient get it from an autograd.Function around them (`_DispatchRows`,
    `_Combine`), which Dynamo traces into the graph; their kernels refuse a call that autograd
    would need to record (`_no_grad_needed`). `fake` gives Dynamo the shapes. Returns the
    operator (`torch.ops.moe_a2a.NAME.default`)."""

    def register(fn: Callable[..., Any]) -> Any:
        name = schema.split("(", 1)[0]
        _LIB.define(schema)
        _LIB.impl(name, fn, "CompositeExplicitAutograd")
        _LIB.impl(name, torch.library.fallthrough_kernel, "Autograd")
        torch.library.register_fake(f"moe_a2a::{name}", fake, lib=_LIB)
        return getattr(torch.ops.moe_a2a, name).default

    return register


def _no_grad_needed(op: str, *inputs: torch.Tensor) -> None:
    """A differentiable operator's kernel, called where autograd would record it: the gradient
    would be lost without a word, so refuse (the autograd.Function runs it without grad)."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in inputs):
        raise RuntimeError(
            f"moe_a2a::{op}: called directly on inputs that require grad; expected "
            f"moe_a2a.compiled_ops.{op}_op (differentiable), or ExpertParallel under torch.compile"
        )


# -- dispatch ---------------------------------------------------------------------------------


def _dispatch_fake(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    inst: torch.Tensor,
    num_local_experts: int,
    keep: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    scalar = torch.empty((), dtype=torch.int64)
    return x.new_empty(num_local_experts, dtype=torch.int32), scalar, scalar.clone()


@_gradless_op(
    "dispatch(Tensor x, Tensor topk_ids, Tensor topk_weights, Tensor inst, SymInt num_local_experts, "
    "bool keep) -> (Tensor, Tensor, Tensor)",
    _dispatch_fake,
)
def dispatch_op(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    inst: torch.Tensor,
    num_local_experts: int,
    keep: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The exchange: tokens per local expert [E], the routing key [] and the row count []
    (int64); the rows wait in the routing for `dispatch_rows`."""
    ep = _ep(inst)
    ep._check_open()
    expert_x, h = ep._forward_dispatch(x, topk_ids, topk_weights, None)
    assert h.row_weights is not None
    _routings[(ep.id, h.seq)] = h
    h._compiled = (expert_x, keep)  # keep: this dispatch's backward will come
    key = torch.tensor(h.seq, dtype=torch.int64)
    rows = torch.tensor(h.num_rows, dtype=torch.int64)
    return h.tokens_per_expert.to(x.device, copy=True), key, rows  # where the fake one says


def _dispatch_rows_fake(
    x: torch.Tensor, topk_weights: torch.Tensor, key: torch.Tensor, inst: torch.Tensor, num_rows: int
) -> tuple[torch.Tensor, torch.Tensor]:
    return x.new_empty(num_rows, x.shape[1]), x.new_empty(num_rows, dtype=torch.float32)


@_gradless_op(
    "dispatch_rows(Tensor x, Tensor topk_weights, Tensor key, Tensor inst, SymInt num_rows) "
    "-> (Tensor, Tensor)",
    _dispatch_rows_fake,
)
def _dispatch_rows_kernel(
    x: torch.Tensor, topk_weights: torch.Tensor, key: torch.Tensor, inst: torch.Tensor, num_rows: int
) -> tuple[torch.Tensor, torch.Tensor]:
    _no_grad_needed("dispatch_rows", x, topk_weights)
    h = _routing(_ep(inst), key, pop=False)
    expert_x, _ = h._compiled  # type: ignore[attr-defined]
    h._compiled = (None, h._compiled[1])  # type: ignore[attr-defined]
    assert h.row_weights is not None and expert_x is not None
    # Fresh tensors: the routing keeps its own row weights for the backward.
    return _padded(expert_x, num_rows), _padded(h.row_weights.clone(), num_rows)


def _padded(t: torch.Tensor, rows: int) -> torch.Tensor:
    """`t`'s rows, then zero rows up to `rows` (compiled_rows="capacity"). On `t`'s own
    storage where it holds them (the CUDA backend's outputs are views of buffers of the
    capacity, so only the rows past t's are written), else a copy."""
    have = t.shape[0]
    if have == rows:
        return t
    if have > rows:  # the backend's capacity checks make this unreachable
        raise RuntimeError(f"moe_a2a ops: {have} rows do not fit the capacity of {rows}")
    shape = (rows, *t.shape[1:])
    need = (t.storage_offset() + rows * math.prod(t.shape[1:])) * t.element_size()
    if t.is_contiguous() and t.untyped_storage().nbytes() >= need:
        full = t.new_empty(0).set_(t.untyped_storage(), t.storage_offset(), shape, t.stride())
        full[have:].zero_()
        return full
    full = t.new_zeros(shape)
    full[:have] = t
    return full


def _dispatch_setup(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    x, weights, key, inst, _rows = inputs
    ctx.save_for_backward(key, inst)
    ctx.shape, ctx.x_dtype, ctx.device = (x.shape[0], x.shape[1], weights.shape[1]), x.dtype, x.device


def _dispatch_backward(ctx: Any, grad_rows: Any, grad_row_weights: Any) -> tuple:
    key, inst = ctx.saved_tensors
    wants_w = bool(ctx.needs_input_grad[1])
    tokens, hidden, topk = ctx.shape
    grad_x, grad_w = dispatch_backward_op(
        grad_rows, grad_row_weights, key, inst, tokens, hidden, topk, ctx.x_dtype, ctx.device, wants_w
    )
    return (grad_x if ctx.needs_input_grad[0] else None, grad_w if wants_w else None, None, None, None)


class _DispatchRows(torch.autograd.Function):
    """dispatch_rows with its gradient: the backward operator along the same routing."""

    @staticmethod
    def forward(x: Any, topk_weights: Any, key: Any, inst: Any, num_rows: Any) -> Any:
        return _dispatch_rows_kernel(x, topk_weights, key, inst, num_rows)

    setup_context = staticmethod(_dispatch_setup)
    backward = staticmethod(_dispatch_backward)


# The rows [num_rows, H] and their routing weights [num_rows] of the dispatch `key`;
# differentiable w.r.t. `x` and `topk_weights` (the dispatch's inputs).
dispatch_rows_op = _DispatchRows.apply


def _dispatch_backward_fake(
    grad_rows: torch.Tensor | None,
    grad_row_weights: torch.Tensor | None,
    key: torch.Tensor,
    inst: torch.Tensor,
    num_tokens: int,
    hidden: int,
    topk: int,
    x_dtype: torch.dtype,
    device: torch.device,
    weights_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    return (
        torch.empty(num_tokens, hidden, dtype=x_dtype, device=device),
        torch.empty(num_tokens, topk, dtype=torch.float32, device=device),
    )


@_gradless_op(
    "dispatch_backward(Tensor? grad_rows, Tensor? grad_row_weights, Tensor key, Tensor inst, "
    "SymInt num_tokens, SymInt hidden, SymInt topk, ScalarType x_dtype, Device device, bool weights_grad) "
    "-> (Tensor, Tensor)",
    _dispatch_backward_fake,
)
def dispatch_backward_op(
    grad_rows: torch.Tensor | None,
    grad_row_weights: torch.Tensor | None,
    key: torch.Tensor,
    inst: torch.Tensor,
    num_tokens: int,
    hidden: int,
    topk: int,
    x_dtype: torch.dtype,
    device: torch.device,
    weights_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    ep = _ep(inst)
    h = _routing(ep, key, pop=True)  # its last use
    if grad_rows is not None:  # capacity rows: the first num_rows are the dispatch's
        grad_rows = grad_rows[: h.num_rows]
    if grad_row_weights is not None:
        grad_row_weights = grad_row_weights[: h.num_rows]
    grad_x, grad_w = ep._backward_dispatch(grad_rows, grad_row_weights, h, weights_grad)
    if grad_w is None:
        grad_w = torch.zeros(num_tokens, ep.cfg.topk, dtype=torch.float32, device=grad_x.device)
    return grad_x.to(x_dtype), grad_w


# -- combine ----------------------------------------------------------------------------------


def _combine_fake(
    y: torch.Tensor,
    row_weights: torch.Tensor,
    key: torch.Tensor,
    inst: torch.Tensor,
    num_tokens: int,
    out_dtype: torch.dtype,
    weighted: bool,
    backward: bool,
) -> torch.Tensor:
    return y.new_empty(num_tokens, y.shape[1], dtype=out_dtype)


@_gradless_op(
    "combine(Tensor y, Tensor row_weights, Tensor key, Tensor inst, SymInt num_tokens, ScalarType out_dtype, "
    "bool weighted, bool backward) -> Tensor",
    _combine_fake,
)
def _combine_kernel(
    y: torch.Tensor,
    row_weights: torch.Tensor,
    key: torch.Tensor,
    inst: torch.Tensor,
    num_tokens: int,
    out_dtype: torch.dtype,
    weighted: bool,
    backward: bool,
) -> torch.Tensor:
    _no_grad_needed("combine", y, row_weights)
    ep = _ep(inst)
    ep._check_open()
    h = _routing(ep, key, pop=False)
    ep._forward_combine_send(y[: h.num_rows], h, weighted)  # capacity rows: the filled ones
    out = ep._forward_combine_recv()
    if not backward and not h._compiled[1]:  # type: ignore[attr-defined]  # no backward will come
        _routings.pop((ep.id, h.seq), None)
    elif h.gathered is not None:  # as eager: the backward's row count, memoised now
        h.gathered.received_rows(ep.cfg.expert_padding)
    return out


def _combine_setup(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    y, _w, key, inst, _t, _dtype, weighted, _backward = inputs
    ctx.save_for_backward(y, key, inst)
    ctx.weighted = weighted


def _combine_backward(ctx: Any, grad_out: torch.Tensor) -> tuple:
    y, key, inst = ctx.saved_tensors
    dot = bool(ctx.weighted and ctx.needs_input_grad[1])
    grad_y, grad_w = combine_backward_op(grad_out, y, key, inst, ctx.weighted, dot)
    return grad_y, (grad_w if dot else None), None, None, None, None, None, None


class _Combine(torch.autograd.Function):
    """combine with its gradient: the backward operator along the same routing."""

    @staticmethod
    def forward(
        y: Any,
        row_weights: Any,
        key: Any,
        inst: Any,
        num_tokens: Any,
        out_dtype: Any,
        weighted: Any,
        backward: Any,
    ) -> Any:
        return _combine_kernel(y, row_weights, key, inst, num_tokens, out_dtype, weighted, backward)

    setup_context = staticmethod(_combine_setup)
    backward = staticmethod(_combine_backward)


# The combined rows [num_tokens, H] of the dispatch `key`; differentiable w.r.t. `y` and
# `row_weights` (the weights' gradient where `weighted`).
combine_op = _Combine.apply


def _combine_backward_fake(
    grad_out: torch.Tensor, y: torch.Tensor, key: torch.Tensor, inst: torch.Tensor, weighted: bool, dot: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(y), y.new_empty(y.shape[0], dtype=torch.float32)


@_gradless_op(
    "combine_backward(Tensor grad_out, Tensor y, Tensor key, Tensor inst, bool weighted, bool dot) "
    "-> (Tensor, Tensor)",
    _combine_backward_fake,
)
def combine_backward_op(
    grad_out: torch.Tensor, y: torch.Tensor, key: torch.Tensor, inst: torch.Tensor, weighted: bool, dot: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    ep = _ep(inst)
    h = _routing(ep, key, pop=False)
    if weighted and h.row_weights is None:
        raise RuntimeError("backward: this combine's dispatch ran with gradients disabled")
    grad_y, grad_w = ep._backward_combine(grad_out, h, weighted, y[: h.num_rows] if dot else None)
    if not h._compiled[1]:  # type: ignore[attr-defined]  # no dispatch backward will come
        _routings.pop((ep.id, h.seq), None)
    if grad_w is None:
        grad_w = torch.zeros(grad_y.shape[0], dtype=torch.float32, device=grad_y.device)
    rows = y.shape[0]  # capacity rows: zero past the filled ones, as the dispatch gave them
    return _padded(grad_y.to(y.dtype), rows), _padded(grad_w.to(torch.float32), rows)


# Communication: every rank must run these in program order, once each. Ordered effects
# keep torch.compile from reordering them, dropping them or recomputing them in the backward.
for _name in ("dispatch", "dispatch_rows", "dispatch_backward", "combine", "combine_backward"):
    torch.library._register_effectful_op(f"moe_a2a::{_name}", torch._library.effects.EffectType.ORDERED)
