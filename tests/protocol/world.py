"""N ranks of one AllToAll in this process, on the in-memory fabric (src/fabric/memory_engine.h).

Each rank is the real core: its own workspace, `_core.CpuAllToAll` (the CPU
backend and its proxy thread, unchanged) and a `MemoryEngine` endpoint. Ranks
run as threads that call the core with the GIL released. With
`ranks_per_node=1` every peer is remote, so every row crosses the fabric, where
the test chooses when and in what order writes land (`World.fabric`).

What the Python front end adds (argument checks, handles, reopen) is tested
under mpirun in tests/mpi; a rank whose call fails here announces it to its
peers as the front end does (AllToAll._fail).
"""

from __future__ import annotations

import os
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from inputs import Inputs, Router, draw_inputs, expert_fn, random_ids
from moe_a2a import Config, _core
from moe_a2a.backends.common import CORE_DTYPE, num_scales
from moe_a2a.reference import combine_reference, dispatch_reference

COMBINE = {"bf16": torch.bfloat16, "fp32": torch.float32}
HIDDEN = 200  # not a multiple of 128: the last fp8 block is short
EXPERTS_PER_RANK = 3
JOIN_S = 60.0  # the longest a test's ranks may take together


def make_inputs(
    seed: int, cfg: Config, world: int, tokens: list[int] | None = None, router: Router = random_ids
) -> Inputs:
    return draw_inputs(seed, cfg, world, tokens, router)


@dataclass
class Dispatched:
    expert_x: torch.Tensor
    expert_x_scale: torch.Tensor | None
    tokens_per_expert: torch.Tensor
    routing: torch.Tensor  # [world, num_experts + world] int32: the call's matrix, for cached calls


class Rank:
    """One rank's core objects and the calls a test makes on them."""

    def __init__(self, world: World, rank: int) -> None:
        self.world, self.rank = world, rank
        self.impl: Any = None
        self.tokens = 0
        self.weights: torch.Tensor | None = None
        self.failed: Exception | None = None

    def dispatch(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, routing=None) -> Dispatched:
        """Both halves of a dispatch (`routing`: a cached call along that matrix)."""
        self.send(x, ids, weights, routing)
        return self.recv()

    def send(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, routing=None) -> None:
        self.tokens, self.weights = x.shape[0], weights.float().contiguous()
        self._ids = ids.to(torch.int32).contiguous()
        self._x = x.contiguous()
        self._routing = routing.contiguous() if routing is not None else None
        self._call(
            self.impl.dispatch_send,
            self._x.data_ptr(),
            CORE_DTYPE[x.dtype],
            0,
            self._ids.data_ptr(),
            self.tokens,
            self._routing.data_ptr() if self._routing is not None else 0,
            self.weights.data_ptr(),
        )

    def recv(self) -> Dispatched:
        cfg = self.world.cfg
        rows = self._call(self.impl.dispatch_wait)
        matrix = torch.empty(self.world.size, cfg.num_experts + self.world.size, dtype=torch.int32)
        self.impl.copy_routing(matrix.data_ptr())
        fp8 = cfg.dispatch_dtype == "fp8"
        x = torch.empty(rows, cfg.hidden, dtype=torch.float8_e4m3fn if fp8 else torch.bfloat16)
        scale = torch.empty(rows, num_scales(cfg.hidden), dtype=torch.float32) if fp8 else None
        self._call(self.impl.dispatch_unpack, x.data_ptr(), scale.data_ptr() if scale is not None else 0)
        counts = torch.tensor(self.impl.tokens_per_expert, dtype=torch.int32)
        return Dispatched(x, scale, counts, matrix)

    def combine(self, y: torch.Tensor, weighted: bool = True) -> torch.Tensor:
        """Both halves of a combine; `weighted=False` sums the rows plainly."""
        self._call(self.impl.combine_send, y.data_ptr(), CORE_DTYPE[y.dtype], 0, weighted)
        assert self.weights is not None
        weights = self.weights if weighted else torch.ones_like(self.weights)
        out = torch.empty(self.tokens, self.world.cfg.hidden, dtype=COMBINE[self.world.cfg.combine_dtype])
        self._call(self.impl.combine_recv, weights.data_ptr(), out.data_ptr())
        return out

    def round(self, inp: Inputs, routing=None) -> tuple[Dispatched, torch.Tensor]:
        """Dispatch and combine this rank's part of `inp`, with expert_fn between."""
        r = self.rank
        d = self.dispatch(inp.xs[r], inp.ids[r], inp.weights[r], routing)
        return d, self.combine(expert_fn(d.expert_x, d.expert_x_scale))

    def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """A core call; a failure is announced to the peers, as the front end does."""
        try:
            return fn(*args)
        except _core.CapacityError:
            raise  # every rank raises it alike; the next call proceeds
        except Exception as exc:
            if self.failed is None and not isinstance(exc, _core.PeerFailedError):
                self.impl.announce_failure(f"rank {self.rank}: {type(exc).__name__}: {exc}")
            self.failed = self.failed or exc
            raise


class World:
    """`size` ranks with one AllToAll each (one Config), connected over one MemoryFabric."""

    def __init__(self, size: int, ranks_per_node: int = 1, slice_bytes: int = 0, **config: Any) -> None:
        params: dict[str, Any] = dict(
            max_tokens=24, hidden=HIDDEN, num_experts=EXPERTS_PER_RANK * size, topk=4, timeout_s=30.0
        )
        params.update(config)
        cfg = Config(**params)
        self.cfg = replace(cfg, fabric_rows=cfg.fabric_rows_for(size, ranks_per_node))  # as AllToAll does
        self.size, self.rpn = size, ranks_per_node
        self.fabric = _core.MemoryFabric(size)
        self.max_private_tokens, self.max_recv_tokens = self.cfg.resolved(size)
        self.core = [self._core_config(r, slice_bytes) for r in range(size)]
        self.workspaces = self._workspaces(self.core)
        self.ranks = [Rank(self, r) for r in range(size)]
        self._connect()

    def node(self, rank: int) -> list[int]:
        first = rank // self.rpn * self.rpn
        return list(range(first, first + self.rpn))

    def remote_peers(self, rank: int) -> list[int]:
        return [p for p in range(self.size) if p not in self.node(rank)]

    def wire_rows(self, ids: list[torch.Tensor], s: int, r: int) -> int:
        """Rows sender s sends rank r for `ids` (docs/protocol.md, "Rows per destination rank"):
        its tokens with a k on r towards a rank of another node with fabric_rows="rank"; with
        "node", towards the rank of another node with s's local index (its forwarder) its tokens
        with a k on that node, and none to the node's other ranks; else its copies."""
        owner = ids[s].to(torch.int64) // (self.cfg.num_experts // self.size)
        if self.cfg.fabric_rows == "rank" and r not in self.node(s):
            return int((owner == r).any(dim=1).sum())
        if self.cfg.fabric_rows == "node" and r not in self.node(s):
            if r % self.rpn != s % self.rpn:
                return 0
            return int((owner // self.rpn == r // self.rpn).any(dim=1).sum())
        return int((owner == r).sum())

    def matrix(self, ids: list[torch.Tensor]) -> torch.Tensor:
        """The routing matrix of a call of `ids`, as a cached call brings it: each sender's
        copies per expert, then its wire rows per rank."""
        rows = []
        for s, i in enumerate(ids):
            wire = [self.wire_rows(ids, s, r) for r in range(self.size)]
            counts = torch.bincount(i.reshape(-1), minlength=self.cfg.num_experts)
            rows.append(torch.cat([counts, torch.tensor(wire)]))
        return torch.stack(rows).int()

    def _core_config(self, rank: int, slice_bytes: int) -> Any:
        cfg, c = self.cfg, _core.A2AConfig()
        c.rank, c.world, c.ranks_per_node = rank, self.size, self.rpn
        c.max_tokens, c.hidden, c.num_experts, c.topk = cfg.max_tokens, cfg.hidden, cfg.num_experts, cfg.topk
        c.dispatch_dtype = _core.DType.fp8 if cfg.dispatch_dtype == "fp8" else _core.DType.bf16
        c.combine_dtype = CORE_DTYPE[COMBINE[cfg.combine_dtype]]
        c.fabric_rows = getattr(_core.FabricRows, cfg.fabric_rows)
        c.expert_padding = cfg.expert_padding
        c.max_private_tokens, c.max_recv_tokens = self.max_private_tokens, self.max_recv_tokens
        c.timeout_s = float(cfg.timeout_s)
        c.slice_bytes = slice_bytes
        return c

    def _workspaces(self, core: list[Any]) -> list[Any]:
        names = [f"/moe-a2a-proto-{os.getpid()}-{uuid.uuid4().hex[:12]}-r{r}" for r in range(self.size)]
        made = [_core.Workspace(core[r], names[r], self.rpn > 1) for r in range(self.size)]
        for r, ws in enumerate(made):
            ws.map_node([n if p in self.node(r) else "" for p, n in enumerate(names)])
        for ws in made:
            ws.unlink()
        return made

    def _connect(self) -> None:
        """Regions, groups and each rank's CpuAllToAll (its proxy starts here)."""
        engines = [self.fabric.engine(r) for r in range(self.size)]
        regions = [engines[r].register_region(ws.ptr, ws.size) for r, ws in enumerate(self.workspaces)]
        for r, rank in enumerate(self.ranks):
            peers = self.remote_peers(r)
            engine, region, group = None, None, None
            if peers:
                engine, region = engines[r], regions[r]
                group = engine.create_group(peers, [engine.add_remote_region(p, regions[p]) for p in peers])
            rank.impl = _core.CpuAllToAll(self.workspaces[r], engine, region, group, peers, [0] * self.size)

    def run(self, fn: Callable[[Rank], Any], ranks: list[int] | None = None) -> list[Any]:
        """fn(rank) on a thread per rank (all, or `ranks`); each rank's result, or the exception it raised."""
        chosen = list(range(self.size)) if ranks is None else ranks
        out: list[Any] = [None] * self.size

        def body(r: int) -> None:
            try:
                out[r] = fn(self.ranks[r])
            except Exception as exc:  # reported to the caller, rank by rank
                out[r] = exc

        threads = [threading.Thread(target=body, args=(r,), name=f"rank{r}") for r in chosen]
        for t in threads:
            t.start()
        for t in threads:
            t.join(JOIN_S)
            assert not t.is_alive(), f"{t.name} still runs after {JOIN_S} s"
        return out

    def start(self, fn: Callable[[Rank], Any], ranks: list[int] | None = None) -> Running:
        """As run, in the background, while the test steers the fabric."""
        return Running(self, fn, ranks)

    def check(self, inp: Inputs, results: list[Any]) -> None:
        """Each rank's (Dispatched, combine output) equals the reference, bit for bit."""
        for r, got in enumerate(results):
            assert not isinstance(got, Exception), f"rank {r} failed: {got!r}"
            self.check_rank(inp, r, *got)

    def check_rank(self, inp: Inputs, r: int, d: Dispatched, out: torch.Tensor) -> None:
        """Rank r's dispatch and combine output equal the reference, bit for bit."""
        cfg = self.cfg
        ref = dispatch_reference(inp.xs, inp.ids, cfg.num_experts, cfg.dispatch_dtype, cfg.expert_padding)
        ys = [expert_fn(x.expert_x, x.expert_x_scale) for x in ref]
        expected = combine_reference(ys, ref, inp.weights, cfg.combine_dtype, cfg.fabric_rows, self.rpn)
        ours = ref[r]
        assert torch.equal(d.tokens_per_expert, ours.tokens_per_expert), f"rank {r}: tokens per expert"
        valid = ours.origin[:, 0] >= 0
        assert d.expert_x.shape == ours.expert_x.shape, f"rank {r}: rows"
        assert torch.equal(d.expert_x[valid].view(torch.uint8), ours.expert_x[valid].view(torch.uint8)), (
            f"rank {r}: expert_x differs from the reference"
        )
        if d.expert_x_scale is not None:
            assert torch.equal(d.expert_x_scale[valid], ours.expert_x_scale[valid]), f"rank {r}: scales"
        assert torch.equal(out.view(torch.uint8), expected[r].view(torch.uint8)), f"rank {r}: combine output"

    def close(self) -> None:
        """Stops every proxy, then lets the memory go (the fabric outlives the proxies)."""
        for rank in self.ranks:
            rank.impl = None
        self.workspaces = []


class Running:
    """Ranks running in the background (World.start)."""

    def __init__(self, world: World, fn: Callable[[Rank], Any], ranks: list[int] | None) -> None:
        self._box: list[list[Any]] = []
        self._thread = threading.Thread(target=lambda: self._box.append(world.run(fn, ranks)))
        self._thread.start()

    def alive(self) -> bool:
        return self._thread.is_alive()

    def join(self) -> list[Any]:
        """Each rank's result or exception, once all are done."""
        self._thread.join(JOIN_S + 5)
        assert self._box, "the ranks did not finish"
        return self._box[0]
