"""One AllToAll driven in halves for `ExpertParallel`, with the dispatch that waits for its
combine (and whose routing it is)."""

from __future__ import annotations

from typing import Any

import torch

from moe_a2a.a2a_types import PLAIN, Dispatched, Routing, RowRequest
from moe_a2a.all_to_all import AllToAll
from moe_a2a.ep_types import ExpertRouting


class Channel:
    """One AllToAll, in halves, and the dispatch of it that waits for its combine (and whose).

    A dispatch opened with `closable=True` is one nobody may come back for (a
    backward whose counterpart autograd skipped): the next dispatch closes it
    with a combine of zeros. Every rank runs the same autograd
    graph, so every rank closes alike.
    """

    def __init__(self, a2a: AllToAll) -> None:
        self.a2a = a2a
        self.open: ExpertRouting | None = None
        self._pending: Any = None  # a half in flight (PendingDispatch or PendingCombine)
        self._d: Dispatched | None = None
        self._closable = False

    def is_open_for(self, h: ExpertRouting) -> bool:
        return self._d is not None and self.open is h

    def dispatch_send(
        self,
        x: torch.Tensor,
        ids: torch.Tensor,
        weights: torch.Tensor,
        closable: bool,
        routing: Routing | None = None,
        keep_routing: bool = False,
        in_place: bool = True,
    ) -> None:
        """With `routing`, along it (no routing exchange); `keep_routing` returns this call's.
        `in_place`: `x` stays as it is until dispatch_recv (true of every tensor made here)."""
        self._make_room()
        self._pending = self._dispatch(
            x, ids, weights, routing, keep_routing, RowRequest(in_place), recv=False
        )
        self._closable = closable

    def dispatch_whole(
        self,
        x: torch.Tensor,
        ids: torch.Tensor,
        weights: torch.Tensor,
        closable: bool,
        routing: Routing | None = None,
        keep_routing: bool = False,
        rows: RowRequest = PLAIN,
        dequantize: torch.dtype | None = None,
    ) -> Dispatched:
        """Both halves in one call, so the receive kernel follows the send's at once; `x` is
        read in place. The arguments are dispatch_send's, and `rows` and `dequantize` the
        receive half's."""
        self._make_room()
        d = self._dispatch(x, ids, weights, routing, keep_routing, rows, dequantize=dequantize)
        assert isinstance(d, Dispatched)
        self._closable, self._d = closable, d
        return d

    def _dispatch(
        self,
        x: torch.Tensor,
        ids: torch.Tensor,
        weights: torch.Tensor,
        routing: Routing | None,
        keep_routing: bool,
        rows: RowRequest,
        recv: bool = True,
        dequantize: torch.dtype | None = None,
    ) -> Any:
        """AllToAll.dispatch along `routing` (its ids and weights, checked when it was made), or of
        `ids` and `weights` (`keep_routing`)."""
        if routing is not None:
            return self.a2a._dispatch_rows(rows, x, routing=routing, recv=recv, dequantize=dequantize)
        return self.a2a._dispatch_rows(
            rows, x, ids, weights, keep_routing=keep_routing, recv=recv, dequantize=dequantize
        )

    def _make_room(self) -> None:
        """Close a closable dispatch left open; refuse to start one over any other."""
        if self._d is not None and self._closable:
            assert self.open is not None
            self.combine_send(torch.zeros_like(self._d.expert_x), self.open, weighted=False)
            self.combine_recv()
        if self._d is not None or self._pending is not None:
            seq = self.open.seq if self.open is not None else "?"
            raise RuntimeError(
                f"dispatch: the dispatch of routing #{seq} has not been combined yet; "
                "every dispatch must be followed by its combine"
            )

    def dispatch_recv(self, rows: RowRequest, dequantize: torch.dtype | None = None) -> Dispatched:
        d = self.a2a._dispatch_rows(rows, handle=self._pending, send=False, dequantize=dequantize)
        assert isinstance(d, Dispatched)
        self._pending, self._d = None, d
        return d

    def dispatch(self, x: torch.Tensor, h: ExpertRouting, closable: bool) -> Dispatched:
        d = self.dispatch_whole(x, h.topk_ids, h.topk_weights, closable, routing=h.gathered)
        self.open = h
        return d

    def combine_send(
        self,
        y: torch.Tensor,
        h: ExpertRouting,
        weighted: bool,
        in_place: bool = True,
        row_values: torch.Tensor | None = None,
    ) -> None:
        if not self.is_open_for(h):
            raise RuntimeError(
                f"combine: routing #{h.seq} is not the dispatch in flight on this instance; "
                "combine each dispatch before the next one"
            )
        rows = RowRequest(in_place=in_place, row_values=row_values)
        self._pending = self.a2a._combine_rows(rows, y, self._d, weighted=weighted, recv=False)
        self._d = None

    def combine_recv(self, values_out: torch.Tensor | None = None) -> torch.Tensor:
        out = self.a2a._combine_rows(RowRequest(values_out=values_out), handle=self._pending, send=False)
        assert isinstance(out, torch.Tensor)
        self._pending, self.open = None, None
        return out
