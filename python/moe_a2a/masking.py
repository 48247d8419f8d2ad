"""Mask and continue (`Config.on_peer_loss="mask"`): the ranks lost so far, what a call
drops because of them, and the survivors' agreement on them.

After a call fails while a peer's process is gone, every survivor stops its
backend (the proxy thread joins), then agrees with the others on the dead ranks
and on the epoch to resume after: on one node over the node's shared memory
(`_core.agree_on_live`, src/a2a/live_ranks.h), across nodes over a TCP
connection between every two ranks (moe_a2a.consensus); the launcher's
communicator is not used (its collectives would wait for the dead rank). The
backend is then rebuilt on the same workspace with those ranks masked, its peer
group without the masked remote peers, whose failed writes the engine forgives.
docs/reliability.md, "Mask and continue", has the protocol and what it
guarantees.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from moe_a2a import _core, peer_sockets
from moe_a2a.cleanup import pid_alive
from moe_a2a.consensus import ControlMesh, Vote

NOTICE_S = 0.5  # a peer the engine saw gone: its control connection's end reaches us within this


class PeerLostError(_core.PeerFailedError):
    """A call failed because a peer's process is gone; the survivors agreed and masked it.

    The instance stays usable: the next call runs without the masked ranks' experts.
    `lost`: the ranks masked by this agreement; `masked`: every rank masked so far;
    `epoch`: the dispatches every survivor counts as started (`AllToAll.epoch`), the same
    on every survivor, so callers that number their steps by it stay in step.
    """

    def __init__(self, message: str, lost: tuple[int, ...], masked: tuple[int, ...], epoch: int) -> None:
        super().__init__(message)
        self.lost, self.masked, self.epoch = lost, masked, epoch


class LiveRanks:
    """The ranks masked so far on this rank, the same on every survivor."""

    def __init__(
        self,
        num_experts: int,
        world_size: int,
        rank: int,
        mesh: ControlMesh | None = None,
        device: str = "cpu",
    ) -> None:
        self.rank, self.world_size = rank, world_size
        self.device = (
            torch.device(device) if device != "cuda" else torch.device("cuda", torch.cuda.current_device())
        )
        self.mesh = mesh  # across nodes: a connection to every rank, for the agreement
        self.local_experts = num_experts // world_size
        self.masked: frozenset[int] = frozenset()
        self.experts: torch.Tensor | None = None  # [num_experts] bool: on a masked rank; None: none masked
        self.next_round = 1  # every survivor ends an agreement in the same round
        self.calls = 0  # dispatches that ran with a rank masked

    @classmethod
    def of(cls, boot: Any, cfg: Any, device: str) -> LiveRanks | None:
        """An instance's, where cfg.on_peer_loss is "mask" (None otherwise)."""
        if cfg.on_peer_loss != "mask":
            return None
        topo = boot.topology
        mesh = None
        if topo.local_size != topo.world_size:  # several nodes: no memory every survivor reads
            socks = peer_sockets.mesh(boot, boot.local_pids())
            mesh = ControlMesh(topo.rank, topo.world_size, socks)
        return cls(cfg.num_experts, topo.world_size, topo.rank, mesh, device)

    def close(self) -> None:
        if self.mesh is not None:
            self.mesh.close()

    def drop(
        self,
        ids: torch.Tensor,
        weights: torch.Tensor,
        renormalize: bool,
        routing: Any = None,
        keep_routing: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(ids with -1 for each dropped (token, k), the weights the call uses, dropped [T, topk])."""
        assert self.experts is not None
        if routing is not None or keep_routing:
            raise ValueError(
                f"dispatch: routing= and keep_routing= with ranks {sorted(self.masked)} masked; "
                "expected neither (cached calls after a loss are not built yet)"
            )
        dropped = self.experts[ids.long()]
        self.calls += 1
        kept = weights.masked_fill(dropped, 0.0)
        if renormalize:
            total, left = weights.sum(dim=1, keepdim=True), kept.sum(dim=1, keepdim=True)
            kept = torch.where(left != 0, kept * (total / torch.where(left != 0, left, 1.0)), kept)
        # MASKED_EXPERT, not any negative id: on CUDA the kernels take it for a dropped copy and
        # still report every other id out of range.
        return ids.masked_fill(dropped, _core.MASKED_EXPERT), kept.contiguous(), dropped

    def lost_peers(self, pids: list[int]) -> list[int]:
        """Peers not yet masked whose process is gone: on this host by its pid, elsewhere by the
        end of its control connection (which may trail the engine's own by a moment)."""
        deadline = time.monotonic() + (NOTICE_S if self.mesh is not None else 0.0)
        while True:
            gone = self.mesh.check() if self.mesh is not None else set()
            lost = [
                r
                for r, pid in enumerate(pids)
                if r != self.rank and r not in self.masked and (r in gone or (pid > 0 and not pid_alive(pid)))
            ]
            if lost or time.monotonic() >= deadline:
                return lost
            time.sleep(0.02)

    def agree(
        self, workspace: Any, pids: list[int], lost: list[int], epoch: int, timeout_s: float
    ) -> tuple[tuple[int, ...], int]:
        """Collective among the survivors: the dead ranks and the epoch to resume after.
        Masks them here and returns (ranks newly masked, epoch)."""
        if self.mesh is not None:
            vote, _ = self.mesh.agree(Vote(self.masked | frozenset(lost), epoch), timeout_s)
            masked, resume = vote.dead, vote.epoch
        else:
            dead = [1 if r in self.masked or r in lost else 0 for r in range(self.world_size)]
            agreed, resume, last_round = _core.agree_on_live(
                workspace, pids, dead, epoch, self.next_round, timeout_s
            )
            self.next_round = int(last_round) + 1
            masked = frozenset(r for r, d in enumerate(agreed) if d)
        newly = tuple(sorted(masked - self.masked))
        self.masked = masked
        on_masked = torch.zeros(self.world_size, dtype=torch.bool, device=self.device)
        on_masked[list(masked)] = True
        self.experts = on_masked.repeat_interleave(self.local_experts)
        return newly, int(resume)

    def rearm(self, backend: Any, setup: Any, resume: int, fence_s: float | None = None) -> Any:
        """The backend re-armed with the masked ranks, calls resuming after epoch `resume`: a new
        CPU backend (`backend` None: the old one is closed), the CUDA one re-armed in place. After
        an agreement (`fence_s`: the fence's timeout, collective among the survivors), or a
        rejoin that failed (moe_a2a.rejoin)."""
        from moe_a2a.backends.cpu import CpuBackend

        remote = [r for r in range(self.world_size) if r not in setup.node]
        gone_remote = [r for r in remote if r in self.masked]
        for r in gone_remote:  # their writes' failures no longer fail the engine (again, after a rejoin)
            setup.engine.core.forgive_peer(r)
        if set(setup.remote_peers) & set(gone_remote):
            # The masked remote peers leave the group (the old one stays with the engine until it
            # closes: a few bytes a loss).
            setup.remote_peers = [r for r in remote if r not in self.masked]
            setup.group = setup.engine.group(setup.remote_peers, setup.remotes, setup.rails)
        else:
            gone_remote = []
        if fence_s is not None and setup.engine is not None and setup.remote_peers:
            # The failed call's writes of a live remote peer may still be in the engines' queues or
            # on the wire, and would pair with the next call (the new proxy forgets only what has
            # landed). Each survivor writes a fence behind all of its own, and waits for every
            # live remote peer's: writes to one peer are placed in order (tcp, shm; not efa's
            # unordered RDM). The lost peers' writes that never complete (shm) were counted done
            # when they were forgiven, so the fence is not held behind them.
            fence = _core.fence_tag(int(setup.core_cfg.instance))
            setup.engine.core.barrier(setup.group, fence, fence_s)
        flags = [1 if r in self.masked else 0 for r in range(self.world_size)]
        if backend is None:
            return CpuBackend(setup, flags, resume)
        # The same kernels and memory: the node's CUDA IPC needs no new exchange.
        backend.remask(setup, flags, resume, gone_remote)
        return backend

    def unmask(self) -> None:
        """A rejoin let every masked rank in again (moe_a2a.rejoin)."""
        self.masked, self.experts = frozenset(), None

    def rejoin_mesh(self, boot: Any, joining: tuple[int, ...]) -> None:
        """`of`'s collectives on a survivor of a rejoin: control connections to `joining` only."""
        if self.mesh is not None:
            self.mesh.adopt(peer_sockets.mesh(boot, boot.local_pids(), set(joining)))

    def recover(
        self, backend: Any, setup: Any, what: str, exc: BaseException, timeout_s: float, lost: list[int]
    ) -> tuple[Any, PeerLostError]:
        """After a failed call (`exc`), or idle beside the instance whose call failed
        (moe_a2a.rejoin): the backend rebuilt with the agreed ranks masked, `lost` (found gone)
        among them, and the error the call raises. Collective among the survivors; raises where
        they cannot agree in time."""
        from moe_a2a.backends.cpu import CpuBackend

        cpu = isinstance(backend, CpuBackend)
        # Nothing of ours moves after this, before anyone agrees: the CPU backend's proxy thread
        # joins; the CUDA one's kernels end (eager kernels never wait for a peer; a graph's end
        # at their deadline) and its proxy joins. A graph's replays count on the device only.
        if cpu:
            epoch = backend.epoch
            backend.close()
        else:
            epoch = backend.halt()
        newly, resume = self.agree(setup.workspace, setup.pids, lost, epoch, timeout_s)
        masked = tuple(sorted(self.masked))
        rebuilt = self.rearm(None if cpu else backend, setup, resume, timeout_s)
        if self.mesh is not None:
            # No survivor's next call may reach one still clearing the failed call's leftovers.
            live = frozenset(range(self.world_size)) - self.masked
            self.mesh.ready(live, timeout_s)
        error = PeerLostError(
            f"rank {self.rank}: the {what} of epoch {epoch} failed: peer(s) {lost} gone ({exc}); the "
            f"survivors agreed to mask rank(s) {list(newly)} (masked now: {list(masked)}) and go on after "
            f"epoch {resume}",
            newly,
            masked,
            resume,
        )
        return rebuilt, error
