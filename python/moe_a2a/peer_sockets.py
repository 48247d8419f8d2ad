"""Control connections to peers on other hosts, whose end tells that a peer is gone.

A peer on this host is watched by its pid (`PeerWatch` in src/a2a/peer_watch.h).
One on another host was only noticed where the provider reported a failed
write, else at `timeout_s`. So the engine also holds one TCP connection to each
peer on another host (`TransferEngine.watch_peers`): nothing is sent on it but
one goodbye byte where the peer's script ends (`TransferEngine.leave`, at
interpreter exit: its writes may still land), and when the peer's process ends
for any reason, SIGKILL included, its kernel closes the connection and our
waits see the EOF at their next check (every 100 ms). A whole host that stops
answering is noticed by TCP keepalive (about 16 s here), else at `timeout_s` as
before.

The connections are best effort, and agreed: where one rank cannot make its
own (no IPv4 address a peer reaches, a firewall), every rank goes without them
and says why, and dead peers on other hosts are noticed as before.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import pickle
import socket
import struct
import threading
import time
import warnings
from typing import Any

SIOCGIFADDR = 0x8915  # <linux/sockios.h>
CONNECT_S = 2.0  # one attempt at one address
SETUP_S = 60.0  # the whole mesh
HELLO = struct.Struct("<16sii")  # job token, the connecting rank, the rank it means to reach
KEEPALIVE = {"TCP_KEEPIDLE": 10, "TCP_KEEPINTVL": 2, "TCP_KEEPCNT": 3}


def local_addresses() -> list[str]:
    """This host's IPv4 addresses other than loopback, interface by interface."""
    found: list[str] = []
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:  # no interface list here: the host name's address, where it has one
        with contextlib.suppress(OSError):
            address = socket.gethostbyname(socket.gethostname())
            if not address.startswith("127."):
                found.append(address)
        return found
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for name in names:
            try:
                raw = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue  # no IPv4 address on it
            address = socket.inet_ntoa(raw[20:24])
            if not address.startswith("127.") and address not in found:
                found.append(address)
    return found


def _keepalive(sock: socket.socket) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in KEEPALIVE.items():
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


def _read_exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("closed during the handshake")
        data += chunk
    return data


def _dial(addresses: list[str], port: int, hello: bytes, deadline: float) -> socket.socket:
    """A connection to the first of `addresses` whose listener answers our hello."""
    tried = []
    for address in addresses:
        if time.monotonic() > deadline:
            break
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.settimeout(CONNECT_S)
            sock.connect((address, port))
            sock.sendall(hello)
            if _read_exactly(sock, 1) == b"\x01":
                sock.settimeout(None)
                return sock
            tried.append(f"{address}: refused the hello")
        except OSError as e:
            tried.append(f"{address}: {e}")
        sock.close()
    raise ConnectionError("; ".join(tried) or "no address to try")


def _accept(
    listener: socket.socket, token: bytes, me: int, expected: set[int], stop: threading.Event
) -> dict[int, socket.socket]:
    """Connections from the ranks in `expected`, each checked by its hello (others closed), until
    all came or `stop` is set."""
    got: dict[int, socket.socket] = {}
    listener.settimeout(0.1)
    while set(got) != expected and not stop.is_set():
        try:
            sock, _ = listener.accept()
        except TimeoutError:
            continue
        rank = -1
        try:
            sock.settimeout(CONNECT_S)
            their_token, rank, target = HELLO.unpack(_read_exactly(sock, HELLO.size))
            ok = their_token == token and target == me and rank in expected and rank not in got
            if ok:
                got[rank] = sock  # before the reply: a dialer that read it is counted here
            sock.sendall(b"\x01" if ok else b"\x00")
            if ok:
                sock.settimeout(None)
        except OSError:
            if got.get(rank) is sock:
                del got[rank]
            ok = False
        if not ok:
            sock.close()
    return got


def connect(bootstrap: Any, pids: list[int], only: set[int] | None = None) -> list[int] | None:
    """Collective: a connected socket's descriptor per peer on another host (`pids[r] == 0`, index =
    rank, -1 elsewhere), for `TransferEngine.watch_peers`; None, on every rank, where some rank
    could not make its own (each rank then warns why). `only`: a rejoin's survivor connects to
    those replacements alone (moe_a2a.rejoin)."""
    others = {r for r in range(bootstrap.world_size) if pids[r] == 0}
    fds, why = _connect(bootstrap, pids, others if only is None else only)
    if fds is None:
        warnings.warn(
            "moe-a2a: no control connections to peers on other hosts, so a dead peer there is noticed "
            f"only by a failed write or at timeout_s: {why}",
            RuntimeWarning,
            stacklevel=2,
        )
    return fds


def mesh(bootstrap: Any, pids: list[int], only: set[int] | None = None) -> dict[int, socket.socket]:
    """Collective: a connected socket to every other rank, for the survivors' agreement across
    nodes (moe_a2a.consensus); raises the same error on every rank where some rank could not make
    its own. `only`: a rejoin's survivor connects to those replacements alone."""
    rank = bootstrap.rank
    fds, why = _connect(bootstrap, pids, set(range(bootstrap.world_size)) if only is None else only)
    if fds is None:
        raise ConnectionError(
            f"on_peer_loss='mask' across nodes needs a TCP connection between every two ranks: {why}"
        )
    return {r: socket.socket(fileno=fd) for r, fd in enumerate(fds) if r != rank and fd >= 0}


def _connect(bootstrap: Any, pids: list[int], peers: set[int]) -> tuple[list[int] | None, str]:
    """Collective: a connected socket's descriptor per rank of `peers` (index = rank, -1 elsewhere),
    or None on every rank, with why, where some rank could not make its own. A peer on this host
    (`pids[r] > 0`) is also tried over loopback."""
    rank, world = bootstrap.rank, bootstrap.world_size
    remote = {r for r in peers if r != rank}
    token = bootstrap.allgather(os.urandom(16))[0]
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("0.0.0.0", 0))
    listener.listen(max(1, len(remote)))
    where = (local_addresses(), listener.getsockname()[1])
    table = [pickle.loads(b) for b in bootstrap.allgather(pickle.dumps(where))]
    deadline = time.monotonic() + SETUP_S
    socks: dict[int, socket.socket] = {}
    stop = threading.Event()
    accepted: dict[int, socket.socket] = {}

    def accept_lower() -> None:  # the lower ranks dial us while we dial the higher ones
        accepted.update(_accept(listener, token, rank, {r for r in remote if r < rank}, stop))

    thread = threading.Thread(target=accept_lower, name="moe-a2a-peer-sockets", daemon=True)
    thread.start()
    error = ""
    # Ranks of one host list the same addresses: the one that answered first is tried first for
    # the others, so an address that does not answer costs its timeout once a host, not once a rank.
    answered: dict[tuple[str, ...], str] = {}
    for peer in sorted(r for r in remote if r > rank):  # every one, so that no acceptor waits in vain
        addresses, port = table[peer]
        if pids[peer] > 0:  # same host: loopback answers where no interface has an address
            addresses = [*addresses, "127.0.0.1"]
        key = tuple(addresses)
        first = [answered[key]] if key in answered else []
        try:
            socks[peer] = _dial(
                first + [a for a in addresses if a not in first],
                port,
                HELLO.pack(token, rank, peer),
                deadline,
            )
            answered[key] = socks[peer].getpeername()[0]
        except ConnectionError as e:
            error = error or f"rank {rank} could not reach rank {peer}'s control socket ({e})"
    # Every dial has ended on every rank, so each acceptor has what it will get.
    errors = [b.decode() for b in bootstrap.allgather(error.encode()) if b]
    stop.set()
    thread.join()
    listener.close()
    socks.update(accepted)
    if not errors and set(socks) != remote:
        errors = [f"rank {rank}: no connection from ranks {sorted(remote - set(socks))}"]
    if any(bootstrap.allgather(b"x" if errors else b"")):
        for sock in socks.values():
            sock.close()
        return None, errors[0] if errors else "another rank's connections failed"
    fds = [-1] * world
    for peer, sock in socks.items():
        _keepalive(sock)
        fds[peer] = sock.detach()
    return fds, ""
