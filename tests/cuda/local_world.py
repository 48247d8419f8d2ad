"""Several ranks of the CUDA implementation in one process, for kernel tests.

Each rank is a standalone `_core.CudaAllToAll` (its own device workspace and a
pinned host workspace). Ranks of one (virtual) node map each other's
workspaces directly, as CUDA IPC does between processes; between nodes this
harness plays the host proxy: after the send halves it copies the fabric rows
between host workspaces with the formulas of docs/protocol.md and raises the
proxy's flags, so both the same-node path and the fabric path of the kernels
carry traffic. With rows per node it also plays the forwarder's proxy (the rows
it received copied to its device workspace, then forward[s] raised at every rank
of its node), and runs the ranks' combine sends in threads of their own: each
waits for its node peers' staged outputs.
"""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from moe_a2a import _core
from moe_a2a.all_to_all import COMBINE_DTYPES, DISPATCH_DTYPES, Config
from moe_a2a.backends.common import CORE_DTYPE, FP8_BLOCK
from moe_a2a.backends.cuda import cuda_available
from moe_a2a.layers.experts import padded_offsets

DTYPES = {**DISPATCH_DTYPES, **COMBINE_DTYPES}
POISON_BYTE = 0xA5


@dataclass(frozen=True)
class Shape:
    """`world` ranks in nodes of `ranks_per_node`, all running one Config (whose
    fields read through: shape.hidden is shape.config.hidden)."""

    world: int
    ranks_per_node: int
    config: Config

    @classmethod
    def of(cls, world: int, ranks_per_node: int, *args: Any, **kwargs: Any) -> Shape:
        """Shape.of(world, ranks_per_node, <Config's arguments>); fabric_rows="auto" taken as
        "rank": the cases name the other modes where they test them."""
        config = Config(*args, **kwargs)
        mode = "rank" if config.fabric_rows == "auto" else config.fabric_rows
        return cls(world, ranks_per_node, replace(config, fabric_rows=mode))

    def __getattr__(self, name: str) -> Any:
        if name == "config":  # not set yet (copying): no recursion
            raise AttributeError(name)
        return getattr(self.config, name)

    @property
    def local_experts(self) -> int:
        return self.config.num_experts // self.world

    def resolved(self) -> tuple[int, int]:
        """(max_private_tokens, max_recv_tokens), defaults as AllToAll fills them in."""
        return self.config.resolved(self.world)


@dataclass
class RankOutput:
    expert_x: torch.Tensor  # [rows, hidden]
    expert_x_scale: torch.Tensor | None
    tokens_per_expert: torch.Tensor


def cuda_unavailable_reason() -> str | None:
    """Why the CUDA tests cannot run here, or None when they can."""
    return cuda_available()


def _set_u64(address: int, value: int) -> None:
    ctypes.c_uint64.from_address(address).value = value


def _get_u64(address: int) -> int:
    return ctypes.c_uint64.from_address(address).value


class _DeviceBytes:
    """`n` bytes of device memory at `ptr`, for torch.as_tensor."""

    def __init__(self, ptr: int, n: int) -> None:
        self.__cuda_array_interface__ = {"shape": (n,), "typestr": "|u1", "data": (ptr, False), "version": 3}


def _host_to_device(device_ptr: int, host_ptr: int, n: int) -> None:
    if n == 0:
        return
    host = torch.frombuffer((ctypes.c_uint8 * n).from_address(host_ptr), dtype=torch.uint8)
    torch.as_tensor(_DeviceBytes(device_ptr, n), device="cuda").copy_(host)


class LocalWorld:
    """`shape.world` ranks in this process; nodes of `shape.ranks_per_node` consecutive ranks."""

    def __init__(self, shape: Shape, host_wait: bool = False) -> None:
        self.shape = shape
        self.host_wait = host_wait  # else the kernels wait for the flags (as in a captured graph)
        self.private, self.max_recv = shape.resolved()
        self.ranks = [_core.CudaAllToAll(self._config(r)) for r in range(shape.world)]
        if not host_wait:  # as a graph-safe instance: rows per node forwarded in the stream
            for a in self.ranks:
                a.kernel_waits()
        for a in range(shape.world):
            for b in range(shape.world):
                if a != b and self.same_node(a, b):
                    self.ranks[a].connect_local(self.ranks[b])
        self.layout = self.ranks[0].layout
        # Each sender's routing row: count[s][0..E), then its wire rows u[s][0..N).
        self.counts = np.zeros((shape.world, shape.num_experts + shape.world), dtype=np.int64)

    def _config(self, rank: int) -> object:
        s = self.shape
        c = _core.A2AConfig()
        c.rank, c.world, c.ranks_per_node = rank, s.world, s.ranks_per_node
        c.max_tokens, c.hidden, c.num_experts, c.topk = s.max_tokens, s.hidden, s.num_experts, s.topk
        c.dispatch_dtype = CORE_DTYPE[DTYPES[s.dispatch_dtype]]
        c.combine_dtype = CORE_DTYPE[DTYPES[s.combine_dtype]]
        c.expert_padding = s.expert_padding
        c.max_private_tokens, c.max_recv_tokens = self.private, self.max_recv
        c.fabric_rows = getattr(_core.FabricRows, s.fabric_rows)
        c.timeout_s = 10.0
        return c

    def same_node(self, a: int, b: int) -> bool:
        return a // self.shape.ranks_per_node == b // self.shape.ranks_per_node

    def remote_pairs(self) -> list[tuple[int, int]]:
        n = self.shape.world
        return [(s, r) for s in range(n) for r in range(n) if not self.same_node(s, r)]

    # ------------------------------------------------------------------ the proxy's part

    def _host(self, rank: int, section: str, offset: int = 0) -> int:
        return self.ranks[rank].host_workspace + self.layout[section] + offset

    def _copies(self, s: int, r: int) -> int:
        lx = self.shape.local_experts
        return int(self.counts[s, r * lx : (r + 1) * lx].sum())

    def _rows(self, s: int, r: int) -> int:
        """u[s][r]: the wire rows (docs/protocol.md, "Rows per destination rank")."""
        return int(self.counts[s, self.shape.num_experts + r])

    def _send_off(self, s: int, r: int) -> int:
        return sum(self._rows(s, q) for q in range(r))

    def _play_proxy_dispatch(self, epoch: int) -> None:
        s_ = self.shape
        words = s_.num_experts + s_.world
        row_bytes = words * 4
        for s in range(s_.world):
            own = self._host(s, "routing", s * row_bytes)
            self.counts[s] = np.frombuffer((ctypes.c_uint32 * words).from_address(own), dtype=np.uint32)
        row = self.layout["dispatch_row"]
        p = self.private
        # As the proxy: no overflow writes when some rank would receive too many copies
        # (rows per node: or wire rows, plan.h's worst_overflow).
        noded = s_.fabric_rows == "node" and s_.world > s_.ranks_per_node
        overflow = any(
            sum(self._copies(s, r) for s in range(s_.world)) > self.max_recv
            or (noded and sum(self._rows(s, r) for s in range(s_.world)) > self.max_recv)
            for r in range(s_.world)
        )
        for s, r in self.remote_pairs():
            ctypes.memmove(
                self._host(r, "routing", s * row_bytes), self._host(s, "routing", s * row_bytes), row_bytes
            )
            c, off = self._rows(s, r), self._send_off(s, r)
            n = min(c, p)
            ctypes.memmove(
                self._host(r, "private_rows", s * p * row), self._host(s, "send", off * row), n * row
            )
            if c > p and not overflow:
                shared = sum(max(0, self._rows(q, r) - p) for q in range(s))
                ctypes.memmove(
                    self._host(r, "shared_rows", shared * row),
                    self._host(s, "send", (off + p) * row),
                    (c - p) * row,
                )
        if noded and not overflow and self.host_wait:  # else the forwarders' kernels forward
            self._play_forwarding(epoch)
        for rank in self.ranks:
            if overflow:
                _set_u64(rank.signals["overflow"], epoch)
            _set_u64(rank.signals["dispatch_done"], epoch)

    def _play_forwarding(self, epoch: int) -> None:
        """Rows per node: each forwarder's proxy copies the rows it received from a remote
        sender to its device workspace, then raises that sender's forward flag at every rank
        of its node (docs/protocol.md, "Rows per destination node")."""
        s_ = self.shape
        rpn, p, row = s_.ranks_per_node, self.private, self.layout["dispatch_row"]
        for s, f in self.remote_pairs():
            if f % rpn != s % rpn:
                continue  # not s's forwarder on f's node
            u = self._rows(s, f)
            shared = sum(max(0, self._rows(q, f) - p) for q in range(s))
            for section, offset, n in (
                ("private_rows", s * p * row, min(u, p) * row),
                ("shared_rows", shared * row, max(0, u - p) * row),
            ):
                at = self.layout[section] + offset
                _host_to_device(self.ranks[f].device_workspace + at, self.ranks[f].host_workspace + at, n)
            torch.cuda.synchronize()
            for t in range(f // rpn * rpn, f // rpn * rpn + rpn):
                flag = self.ranks[t].host_workspace + self.layout["flags"] + (s * 6 + 4) * 64  # kFlagForward
                _set_u64(flag, epoch)

    def _play_proxy_combine(self, epoch: int) -> None:
        crow = self.layout["combine_row"]
        for s, r in self.remote_pairs():  # rows r received from s go back to s
            base = sum(self._rows(q, r) for q in range(s))
            ctypes.memmove(
                self._host(s, "combine_recv", self._send_off(s, r) * crow),
                self._host(r, "combine_send", base * crow),
                self._rows(s, r) * crow,
            )
        for rank in self.ranks:
            _set_u64(rank.signals["combine_done"], epoch)

    # ------------------------------------------------------------------ the four halves

    def dispatch(
        self,
        xs: list[torch.Tensor],
        ids: list[torch.Tensor],
        x_scales: list[torch.Tensor] | None = None,
        weights: list[torch.Tensor] | None = None,
    ) -> list[RankOutput]:
        """Every rank's dispatch; inputs on the GPU. Raises what the ranks report. `weights`
        go in the rows' tails: rows per rank are weighted with them where the experts are."""
        stream = torch.cuda.current_stream().cuda_stream
        for r, a in enumerate(self.ranks):
            x, scale = xs[r], (x_scales[r] if x_scales is not None else None)
            a.dispatch_send(
                x.data_ptr(),
                CORE_DTYPE[x.dtype],
                scale.data_ptr() if scale is not None else 0,
                ids[r].data_ptr(),
                ids[r].dtype == torch.int64,
                x.shape[0],
                0,
                stream,
                weights=weights[r].data_ptr() if weights is not None else 0,
            )
        torch.cuda.synchronize()
        epoch = self.ranks[0].epoch
        for a in self.ranks if self.shape.world > 1 else []:  # alone, a rank has nobody to tell
            for flag in ("route_ready", "packed"):
                assert _get_u64(a.signals[flag]) == epoch, f"{flag} not raised for the proxy"
        self._play_proxy_dispatch(epoch)

        s_ = self.shape
        dtype = DTYPES[s_.dispatch_dtype]
        blocks = -(-s_.hidden // FP8_BLOCK)
        outs = []
        # Rows per node waiting in kernels: a rank's entries wait for the forward kernel of
        # another rank, so each rank receives on a stream of its own (one stream would queue
        # that kernel behind the wait).
        noded = s_.fabric_rows == "node" and s_.world > s_.ranks_per_node and not self.host_wait
        for a in self.ranks:
            rows = a.max_output_rows
            x = torch.empty(rows, s_.hidden, dtype=dtype, device="cuda")
            x.view(torch.uint8).fill_(POISON_BYTE)
            scale = None
            if s_.dispatch_dtype == "fp8":
                scale = torch.full((rows, blocks), float("nan"), dtype=torch.float32, device="cuda")
            tpe = torch.full((s_.local_experts,), -1, dtype=torch.int32, device="cuda")
            scale_ptr = scale.data_ptr() if scale is not None else 0
            recv_stream = _side_stream() if noded else stream  # after the fills above
            a.dispatch_recv(x.data_ptr(), scale_ptr, tpe.data_ptr(), self.host_wait, recv_stream)
            outs.append(RankOutput(x, scale, tpe))
        filled = []
        if self.host_wait:  # as eager AllToAll: the plan's host word, before any stream synchronisation
            for a in self.ranks:
                a.wait_planned()
                filled.append(a.output_rows)
        torch.cuda.synchronize()
        for a in self.ranks:
            a.check()
        if not filled:  # calls that wait in kernels leave output_rows: the padded segments' end
            filled = [int(padded_offsets(o.tokens_per_expert, s_.expert_padding)[-1]) for o in outs]
        for rows, o in zip(filled, outs, strict=True):
            o.expert_x = o.expert_x[:rows]
            if o.expert_x_scale is not None:
                o.expert_x_scale = o.expert_x_scale[:rows]
        return outs

    def combine(
        self, ys: list[torch.Tensor], weights: list[torch.Tensor], tokens: list[int], weighted: bool = True
    ) -> list[torch.Tensor]:
        """`weighted`: rows per rank summed with the dispatch's weights where the experts are
        (else plainly: pass weights of one then)."""
        stream = torch.cuda.current_stream().cuda_stream
        noded = self.shape.fabric_rows == "node" and self.shape.world > self.shape.ranks_per_node
        # Rows per node: each rank's send waits for its node peers' staged outputs (on the
        # host, or in a kernel), so each runs in a thread and on a stream of its own.
        streams = [_side_stream() if noded else stream for _ in self.ranks]
        sends = [
            lambda a=a, y=y, s=s: a.combine_send(
                y.data_ptr(), CORE_DTYPE[y.dtype], y.shape[0], s, weighted=weighted
            )
            for a, y, s in zip(self.ranks, ys, streams, strict=True)
        ]
        if noded:
            _in_threads(sends)
        else:
            for send in sends:
                send()
        torch.cuda.synchronize()
        epoch = self.ranks[0].epoch
        for a in self.ranks if self.shape.world > 1 else []:
            assert _get_u64(a.signals["combine_packed"]) == epoch, "combine_packed not raised for the proxy"
        self._play_proxy_combine(epoch)
        dtype = DTYPES[self.shape.combine_dtype]
        outs = []
        for a, w, t in zip(self.ranks, weights, tokens, strict=True):
            out = torch.full((t, self.shape.hidden), float("nan"), dtype=dtype, device="cuda")
            a.combine_recv(w.data_ptr(), out.data_ptr(), self.host_wait, stream)
            outs.append(out)
        torch.cuda.synchronize()
        for a in self.ranks:
            a.check()
        return outs


def _side_stream() -> int:
    """A stream of its own whose work starts after what the current stream has queued (the
    outputs' poison fills). torch's streams do not wait for the default stream by themselves:
    a receive on one raced the fill of its own output (counts of -1 on the H100)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    return side.cuda_stream


def _in_threads(calls: list) -> None:
    """Runs each call in a thread of its own; raises the first error."""
    errors: list[BaseException] = []

    def run(call: object) -> None:
        try:
            call()  # type: ignore[operator]
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(c,)) for c in calls]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
