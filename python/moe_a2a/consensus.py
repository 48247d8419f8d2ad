"""The survivors' agreement over TCP control connections, for a job whose ranks span nodes.

`Config.on_peer_loss="mask"` on one node agrees over the node's shared memory
(src/a2a/live_ranks.h). Across nodes there is no memory every survivor reads,
and the launcher's communicator would wait for the dead rank, so each instance
holds one TCP connection to every other rank (`ControlMesh`, made at
construction by `moe_a2a.peer_sockets`) and runs flooding consensus over it
with a perfect failure detector: a connection's end is its peer's death (the
kernel closes it when the process ends, SIGKILL included).

Each survivor proposes a `Vote` (the ranks it holds dead, the dispatches it has
started). Round r: send the vote to every peer not known dead, merge (union of
the dead, largest epoch) what every such peer sent for round r, and add the
peers whose connection ended meanwhile. A rank whose round r heard the same
ranks as its round r-1 decides its merged vote and sends DECIDE to every peer;
a rank that receives DECIDE adopts it and relays it before anything else, so
the survivors decide alike even where a decider dies right after deciding
(two survivors may see two deaths in different orders). Every message names
its agreement (the count of agreements before it, the same on every survivor),
so a late relay of the last one never pairs with the next.

After rebuilding, the survivors meet once more (`ready`), so that no one's next
call reaches a survivor still clearing the failed call's leftovers.
"""

from __future__ import annotations

import selectors
import socket
import struct
import time
from dataclasses import dataclass

HEADER = struct.Struct("<BIIQI")  # kind, agreement, round, epoch, bytes of the dead ranks' bitmap
PROPOSE, DECIDE, READY = 1, 2, 3
SEND_S = 5.0  # one message; a peer that does not take a few dozen bytes in that time is not alive


@dataclass(frozen=True)
class Vote:
    """A survivor's proposal: the ranks it holds dead, and the dispatches it has started."""

    dead: frozenset[int]
    epoch: int

    def merge(self, other: Vote) -> Vote:
        return Vote(self.dead | other.dead, max(self.epoch, other.epoch))

    def encode(self, world: int) -> bytes:
        bitmap = bytearray((world + 7) // 8)
        for r in self.dead:
            bitmap[r // 8] |= 1 << (r % 8)
        return bytes(bitmap)

    @staticmethod
    def decode(bitmap: bytes, epoch: int) -> Vote:
        return Vote(
            frozenset(i * 8 + b for i, byte in enumerate(bitmap) for b in range(8) if byte >> b & 1), epoch
        )


@dataclass(frozen=True)
class Message:
    peer: int
    kind: int
    agreement: int
    round: int
    vote: Vote


class ControlMesh:
    """One connected TCP socket per other rank (index = rank), owned here: whose end tells that
    the peer is gone, and over which the survivors agree (`agree`). Blocks only in `agree` and
    `ready`, each bounded by its timeout."""

    def __init__(self, rank: int, world: int, socks: dict[int, socket.socket]) -> None:
        self.rank, self.world = rank, world
        self._socks = dict(socks)
        self._buffers = {r: bytearray() for r in socks}
        self._inbox: list[Message] = []
        self.gone: set[int] = set()
        self.agreements = 0  # decided so far: the next one's number
        self._selector = selectors.DefaultSelector()
        for r, s in self._socks.items():
            s.setblocking(False)
            self._selector.register(s, selectors.EVENT_READ, r)

    def adopt(self, socks: dict[int, socket.socket]) -> None:
        """Replacements' connections (moe_a2a.rejoin), in place of their old processes'."""
        for r, sock in socks.items():
            self._drop(r)
            self.gone.discard(r)
            self._socks[r] = sock
            self._buffers[r] = bytearray()
            sock.setblocking(False)
            self._selector.register(sock, selectors.EVENT_READ, r)

    def close(self) -> None:
        self._selector.close()
        for s in self._socks.values():
            s.close()
        self._socks.clear()

    def _drop(self, peer: int) -> None:
        sock = self._socks.pop(peer, None)
        if sock is not None:
            self._selector.unregister(sock)
            sock.close()
        self.gone.add(peer)

    def _read(self, peer: int) -> None:
        """What the peer sent so far (never blocks); its end marks it gone."""
        sock = self._socks.get(peer)
        if sock is None:
            return
        try:
            while True:
                data = sock.recv(65536)
                if not data:
                    self._drop(peer)
                    break
                self._buffers[peer] += data
        except BlockingIOError:
            pass
        except OSError:  # reset: as gone as an orderly end
            self._drop(peer)
        buf, bitmap_bytes = self._buffers[peer], (self.world + 7) // 8
        while len(buf) >= HEADER.size + bitmap_bytes:
            kind, agreement, rnd, epoch, n = HEADER.unpack_from(buf)
            if n != bitmap_bytes or kind not in (PROPOSE, DECIDE, READY):
                self._drop(peer)  # not one of ours: the connection cannot be trusted
                break
            bitmap = bytes(buf[HEADER.size : HEADER.size + n])
            del buf[: HEADER.size + n]
            self._inbox.append(Message(peer, kind, agreement, rnd, Vote.decode(bitmap, epoch)))

    def poll(self, wait_s: float = 0.0) -> None:
        """Read every peer's messages and ends, waiting up to `wait_s` for the first."""
        for key, _ in self._selector.select(wait_s if self._socks else 0):
            self._read(key.data)
        if not self._socks and wait_s > 0:
            time.sleep(min(wait_s, 0.01))

    def check(self) -> set[int]:
        """The peers whose connection has ended so far (never blocks)."""
        self.poll(0.0)
        return set(self.gone)

    def _send(self, peer: int, kind: int, agreement: int, rnd: int, vote: Vote) -> None:
        sock = self._socks.get(peer)
        if sock is None:
            return
        data = HEADER.pack(kind, agreement, rnd, vote.epoch, (self.world + 7) // 8) + vote.encode(self.world)
        try:
            sock.settimeout(SEND_S)
            sock.sendall(data)
        except OSError:
            self._drop(peer)
        finally:
            if peer in self._socks:
                sock.setblocking(False)

    def _broadcast(self, kind: int, agreement: int, rnd: int, vote: Vote, skip: frozenset[int]) -> None:
        for peer in sorted(self._socks):
            if peer not in skip:
                self._send(peer, kind, agreement, rnd, vote)

    def _take(self, agreement: int) -> list[Message]:
        """This agreement's proposals and decisions; its READYs (from a survivor that decided
        first) and a later agreement's messages stay, an earlier one's go."""
        mine = [m for m in self._inbox if m.agreement == agreement and m.kind != READY]
        self._inbox = [
            m
            for m in self._inbox
            if m.agreement > agreement or (m.agreement == agreement and m.kind == READY)
        ]
        return mine

    def agree(self, vote: Vote, timeout_s: float) -> tuple[Vote, int]:
        """Collective among the survivors: the same (vote, deciding round) on every one, or
        TimeoutError after `timeout_s` naming the ranks not heard from."""
        k = self.agreements
        deadline = time.monotonic() + timeout_s
        self.poll(0.0)
        vote = vote.merge(Vote(frozenset(self.gone), 0))
        heard_before = frozenset(range(self.world)) - vote.dead
        early: list[Message] = []  # proposals of later rounds, from peers a round ahead
        rnd = 1
        while True:
            self._broadcast(PROPOSE, k, rnd, vote, vote.dead)
            heard = {self.rank}
            merged = vote
            pending = list(early)
            early = []
            while True:
                pending += self._take(k)
                for m in pending:
                    if m.kind == DECIDE:
                        return self._decide(k, m.vote, m.round)
                    if m.kind == PROPOSE and m.round == rnd:
                        heard.add(m.peer)
                        merged = merged.merge(m.vote)
                    elif m.kind == PROPOSE and m.round > rnd:
                        early.append(m)
                pending = []
                waiting = set(heard_before) - heard - self.gone - merged.dead
                if not waiting:
                    break
                self._wait(deadline, f"the survivors' agreement (round {rnd})", timeout_s, waiting)
            merged = merged.merge(Vote(frozenset(self.gone), 0))
            if frozenset(heard) == heard_before:
                return self._decide(k, merged, rnd)
            heard_before, vote, rnd = frozenset(heard) - merged.dead, merged, rnd + 1

    def _decide(self, k: int, vote: Vote, rnd: int) -> tuple[Vote, int]:
        # Sent by a decider and relayed by every adopter: a decider may die right after deciding.
        self._broadcast(DECIDE, k, rnd, vote, vote.dead)
        self.agreements = k + 1
        for peer in vote.dead:
            self._drop(peer)
        return vote, rnd

    def ready(self, live: frozenset[int], timeout_s: float) -> None:
        """Collective among `live` after an agreement: every one has rebuilt (its leftovers of the
        failed call cleared) before anyone's next call can reach it. A peer that dies meanwhile
        is left to the next call's failure."""
        k = self.agreements - 1
        deadline = time.monotonic() + timeout_s
        self._broadcast(READY, k, 0, Vote(frozenset(), 0), frozenset(range(self.world)) - live)
        heard = {self.rank}
        while True:
            for m in self._take_ready(k):
                heard.add(m.peer)
            waiting = set(live) - heard - self.gone
            if not waiting:
                return
            self._wait(deadline, "the survivors' rebuild after their agreement", timeout_s, waiting)

    def _wait(self, deadline: float, what: str, timeout_s: float, waiting: set[int]) -> None:
        """Up to 0.1 s for more messages, or TimeoutError naming `waiting` past `deadline`."""
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(
                f"rank {self.rank}: {what} timed out after {timeout_s} s waiting for rank(s) "
                f"{sorted(waiting)}"
            )
        self.poll(min(left, 0.1))

    def _take_ready(self, k: int) -> list[Message]:
        """READY messages of agreement k; relays of its DECIDE go; the next agreement's stay."""
        ready = [m for m in self._inbox if m.kind == READY and m.agreement == k]
        self._inbox = [m for m in self._inbox if m.agreement > k]
        return ready
