"""What an AllToAll is made from and what its calls hand back: the configuration, the
kept routing, the pending halves, the dispatched rows and the training call's request.

Plain frozen data where it can be: the tensors they hold are the caller's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from moe_a2a.backends.common import routing_rows

DISPATCH_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp8": torch.float8_e4m3fn}
COMBINE_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
DEVICES = ("cpu", "cuda")
# What one row on the fabric is (docs/protocol.md, "Rows per destination rank"): "rank" sends
# a token once per remote destination rank and combines it reduced there; "node" once per
# remote node, forwarded inside it; "expert" one row per (token, k) copy. Same-node peers
# exchange copies in all. "auto" is the fastest measured mode that the instance can run
# (Config.fabric_rows_for).
FABRIC_ROWS = ("auto", "rank", "node", "expert")
ON_PEER_LOSS = ("stop", "mask")
PATHS = ("same_node", "fabric")

# The core holds sizes and row indices as 32-bit ints.
CORE_INT_MAX = 2**31 - 1


def version_of(t: torch.Tensor) -> int | None:
    """`t`'s version counter (in-place changes raise it); None for a tensor made under
    `torch.inference_mode()`, which has none: checks that compare versions then do not run."""
    return None if t.is_inference() else t._version


def positive_int(name: str, value: Any, minimum: int = 1) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not minimum <= value <= CORE_INT_MAX:
        raise ValueError(f"{name}: got {value!r}; expected an integer in [{minimum}, {CORE_INT_MAX}]")


def default_fabric_rows(
    world_size: int, ranks_per_node: int, on_peer_loss: str = "stop", graph_safe: bool = False
) -> str:
    """What fabric_rows="auto" runs over `world_size` ranks, `ranks_per_node` to a node."""
    spans = 1 < ranks_per_node < world_size  # several ranks a node, and other nodes
    return "node" if spans and on_peer_loss != "mask" and not graph_safe else "rank"


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
    fabric_rows: str = "auto"
    # What a lost rank does to the survivors (docs/reliability.md, "Mask and continue"): "stop"
    # (every rank's instance stops; training) or "mask" (they agree on the live ranks and go on
    # without the lost rank's experts; serving, CPU backend, one node).
    on_peer_loss: str = "stop"
    # With a rank masked: scale each token's remaining weights to sum as its weights did.
    mask_renormalize: bool = False

    def __post_init__(self) -> None:
        for name in ("max_tokens", "hidden", "num_experts", "topk", "expert_padding"):
            positive_int(name, getattr(self, name))
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
        if self.fabric_rows not in FABRIC_ROWS:
            raise ValueError(f"fabric_rows: got {self.fabric_rows!r}; expected one of {list(FABRIC_ROWS)}")
        if self.on_peer_loss not in ON_PEER_LOSS:
            raise ValueError(f"on_peer_loss: got {self.on_peer_loss!r}; expected one of {list(ON_PEER_LOSS)}")
        if self.fabric_rows == "node" and self.on_peer_loss == "mask":
            # A lost forwarder would take its node's rows from every sender of its local index.
            raise ValueError(
                "fabric_rows: 'node' with on_peer_loss='mask' is not built yet; use fabric_rows='rank'"
            )
        if not isinstance(self.mask_renormalize, bool):
            raise ValueError(f"mask_renormalize: got {self.mask_renormalize!r}; expected True or False")
        if self.max_private_tokens is not None:
            positive_int("max_private_tokens", self.max_private_tokens, minimum=0)
        if self.max_recv_tokens is not None:
            positive_int("max_recv_tokens", self.max_recv_tokens)
        t = self.timeout_s
        if not isinstance(t, (int, float)) or isinstance(t, bool) or not (0 < t < math.inf):
            raise ValueError(f"timeout_s: got {t!r}; expected a positive, finite number of seconds")
        if self.max_tokens * self.topk > CORE_INT_MAX:  # a call's copies are numbered in 32 bits
            raise ValueError(
                f"max_tokens * topk: got {self.max_tokens} * {self.topk} = {self.max_tokens * self.topk}; "
                f"expected at most {CORE_INT_MAX}"
            )

    def fabric_rows_for(self, world_size: int, ranks_per_node: int, graph_safe: bool = False) -> str:
        """The mode an instance over `world_size` ranks, `ranks_per_node` to a node, runs:
        `fabric_rows` itself unless it is "auto". "auto" is "node" where a node has several ranks
        and peers on other nodes, which put fewer bytes on the fabric and measured faster in every
        shape where a NIC or a GPU bounds the step (docs/benchmarks-fabric.md, "Which mode auto runs");
        "rank" where node is not built (on_peer_loss="mask") or adds nothing (one rank per node,
        or one node), and in graph-safe instances, whose replayed decode step measured slower with
        node (its kernels wait twice more; "node" may be named there)."""
        if self.fabric_rows != "auto":
            return self.fabric_rows
        return default_fabric_rows(world_size, ranks_per_node, self.on_peer_loss, graph_safe)

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
    they are: the positions of every rank's rows follow from them. Once the
    Routing is gone its matrix serves a later kept routing: keep the Routing,
    not the matrix alone.
    """

    # [world, num_experts + world] int32, on the host (pinned for CUDA): row s is count[s][e],
    # then the wire rows s sends each rank (docs/protocol.md, "Rows per destination rank").
    matrix: torch.Tensor
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
        version = version_of(self.matrix)
        if version is None:  # an inference tensor: no counter to see a change by, so no memo
            return routing_rows(self.matrix, self.rank, padding)
        key = (version, padding)
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
    dropped: torch.Tensor | None = field(repr=False, default=None)  # as Dispatched.dropped


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
    row_dot: torch.Tensor | None = None  # [rows] float32, with RowRequest(row_dot=...)
    row_weights: torch.Tensor | None = None  # [rows] float32, with RowRequest(row_weights=True)
    # [tokens, topk] bool: True where (token, k)'s expert is on a masked rank, so that it went
    # nowhere and adds nothing to combine (on_peer_loss="mask"); None while no rank is masked.
    dropped: torch.Tensor | None = None


@dataclass
class PendingCombine:
    """A combine whose send half is done; pass it to `combine(handle=..., send=False)`."""

    epoch: int
    num_tokens: int
    topk_weights: torch.Tensor
    owner: int = field(repr=False, default=0)


@dataclass(frozen=True)
class RowRequest:
    """The training extras of one dispatch or combine, which `moe_a2a.autograd.ExpertParallel`
    builds and passes to `AllToAll._dispatch_rows` / `_combine_rows` (docs/training.md).

    Plain data (tensors and booleans), so that an operator schema can carry it field by
    field. The receive-half fields are checked against the rows before anything is sent.
    """

    in_place: bool | None = None  # send half: x (y) unchanged until the receive half; None: the default
    row_weights: bool = False  # dispatch receive: Dispatched.row_weights, each row's routing weight
    row_scale: torch.Tensor | None = None  # dispatch receive along a routing: [rows] fp32 row factors
    row_dot: torch.Tensor | None = None  # with row_scale: [rows, hidden]; Dispatched.row_dot = <row, it>
    row_values: torch.Tensor | None = None  # combine send: [rows] fp32, one in each row's tail
    values_out: torch.Tensor | None = None  # combine receive: [T, topk] fp32, the tails unreduced

    def check_for(self, what: str) -> None:
        """Refuse the other call kind's fields (a dispatch's on a combine and the reverse)."""
        if what == "dispatch":
            wrong = self.row_values is not None or self.values_out is not None
        else:  # attribute reads, not getattr by name: every call of a training step passes here
            wrong = self.row_weights is not False or self.row_scale is not None or self.row_dot is not None
        if wrong:
            others = ("row_values", "values_out") if what == "dispatch" else _DISPATCH_FIELDS
            given = [n for n in others if getattr(self, n) is not None and getattr(self, n) is not False]
            raise ValueError(f"{what}: {', '.join(given)} belong to the other call kind, not to {what}")


_DISPATCH_FIELDS = ("row_weights", "row_scale", "row_dot")

PLAIN = RowRequest()  # a user's call: no training extras


def describe(t: Any) -> str:
    """How an argument looks, for error messages."""
    if not isinstance(t, torch.Tensor):
        return f"a {type(t).__name__}"
    return f"a {t.dtype} tensor of shape {tuple(t.shape)} on {t.device}"
