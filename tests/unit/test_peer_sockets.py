"""moe_a2a.peer_sockets: the engine's control connections to peers on other hosts, whose end
tells that a peer is gone. Its ranks here are processes forked from this one, every peer taken
as on another host; across real emulated hosts, tests/testbed/test_testbed.py kills one."""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import time
import warnings
from pathlib import Path
from typing import Any

import pytest

from moe_a2a import _core, peer_sockets

CTX = mp.get_context("fork")
pytestmark = pytest.mark.skipif(
    not peer_sockets.local_addresses(), reason="no IPv4 address but loopback here"
)


class FileBootstrap:
    """The part of a Bootstrap that peer_sockets uses: an all-gather through files of a folder."""

    def __init__(self, folder: Path, rank: int, world: int) -> None:
        self.folder, self.rank, self.world_size, self.gen = folder, rank, world, 0

    def allgather(self, blob: bytes) -> list[bytes]:
        self.gen += 1
        mine = self.folder / f"{self.gen}-{self.rank}"
        mine.with_suffix(".tmp").write_bytes(blob)
        mine.with_suffix(".tmp").rename(mine)
        paths = [self.folder / f"{self.gen}-{r}" for r in range(self.world_size)]
        deadline = time.monotonic() + 30
        while not all(p.exists() for p in paths):
            assert time.monotonic() < deadline, "all-gather timed out"
            time.sleep(0.005)
        return [p.read_bytes() for p in paths]


def _rank(folder: Path, rank: int, world: int, reachable: bool, q: Any) -> None:
    real = peer_sockets.local_addresses()
    # An address nobody reaches first (as a host's docker bridge would be): the dial goes on to the next.
    peer_sockets.local_addresses = lambda: ["0.0.0.1", *real] if reachable else []  # type: ignore[assignment]
    boot = FileBootstrap(folder, rank, world)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fds = peer_sockets.connect(boot, [0] * world)
    if fds is None:
        q.put((rank, None, [str(w.message) for w in caught]))
        return
    engine = _core.TransferEngine(rank, world, "tcp")
    engine.watch_peers(fds)
    boot.allgather(b"connected")
    if rank == world - 1:
        os._exit(0)  # the last rank goes; its kernel closes its connections
    deadline = time.monotonic() + 5
    while not engine.peer_gone(world - 1) and time.monotonic() < deadline:
        time.sleep(0.005)
    q.put((rank, [engine.peer_gone(p) for p in range(world)], time.monotonic() < deadline))
    done = folder / "done"  # stay until every survivor looked: our end would look like a loss
    while not done.exists() and time.monotonic() < deadline + 30:
        time.sleep(0.01)


def _run(folder: Path, world: int, unreachable: int | None = None) -> dict[int, tuple[Any, ...]]:
    q = CTX.Queue()
    procs = [CTX.Process(target=_rank, args=(folder, r, world, r != unreachable, q)) for r in range(world)]
    for p in procs:
        p.start()
    expected = world if unreachable is not None else world - 1  # the last rank exits without a word
    out = {}
    for _ in range(expected):
        got = q.get(timeout=60)
        out[got[0]] = got[1:]
    (folder / "done").touch()
    for p in procs:
        p.join(timeout=10)
    return out


def test_a_peer_that_ends_is_seen_gone_by_every_other(tmp_path: Path) -> None:
    out = _run(tmp_path, 4)
    for rank in range(3):
        gone, in_time = out[rank]
        assert in_time and gone == [False, False, False, True], (rank, out)


def test_a_rank_nobody_reaches_leaves_every_rank_without_connections(tmp_path: Path) -> None:
    """Rank 1 advertises no address: every rank, rank 1 included, goes without (None) and warns."""
    out = _run(tmp_path, 3, unreachable=1)
    assert sorted(out) == [0, 1, 2] and all(fds is None for fds, _ in out.values()), out
    for _, warned in out.values():
        assert len(warned) == 1 and "could not reach rank 1's control socket" in warned[0], out


def test_a_stranger_s_hello_is_refused(tmp_path: Path) -> None:
    """A connection that does not bring this job's token and our rank is closed, and the
    listener goes on waiting for the right one."""
    import socket
    import threading

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    port = listener.getsockname()[1]
    token = os.urandom(16)
    got: dict[str, Any] = {}
    stop = threading.Event()
    accept = peer_sockets._accept
    thread = threading.Thread(target=lambda: got.update(socks=accept(listener, token, 1, {0}, stop)))
    thread.start()

    def dial(hello: bytes) -> socket.socket:
        return peer_sockets._dial(["127.0.0.1"], port, hello, time.monotonic() + 5)

    with pytest.raises(ConnectionError, match="refused the hello"):
        dial(peer_sockets.HELLO.pack(os.urandom(16), 0, 1))
    with pytest.raises(ConnectionError, match="refused the hello"):  # the right job, the wrong rank
        dial(peer_sockets.HELLO.pack(token, 0, 2))
    sock = dial(peer_sockets.HELLO.pack(token, 0, 1))
    thread.join(timeout=10)
    assert list(got["socks"]) == [0]
    sock.close()
    got["socks"][0].close()
    listener.close()


@pytest.mark.parametrize("leaves", [True, False])
def test_a_peer_that_leaves_says_so_before_its_end(leaves: bool) -> None:
    """TransferEngine.leave: one goodbye byte on each control connection, which the peer reads as
    peer_left (its script ended, its writes may still land) and not yet as gone; its end then
    reads as gone. A peer that ends without leave() (a kill) is gone and never left."""
    ours, theirs = socket.socketpair()
    us, them = _core.TransferEngine(0, 2, "tcp"), _core.TransferEngine(1, 2, "tcp")
    us.watch_peers([-1, ours.detach()])
    them.watch_peers([theirs.detach(), -1])
    if leaves:
        them.leave()
        assert us.peer_left(1) and not us.peer_gone(1)
    del them  # its engine closes its control connections, as its process's end would
    assert us.peer_gone(1) and us.peer_left(1) == leaves
    assert not us.peer_gone(0) and not us.peer_left(0)  # no connection to itself
