"""Rejoin (`Config.on_peer_loss="mask"`): a replacement process takes a masked rank's place and
the full set of ranks resumes.

The launcher's communicator cannot serve: it lost a member. The survivors and the replacement
meet instead through files of the node's /dev/shm (`NodeRendezvous`, a `Bootstrap` for one node),
named after a key that the caller gives both sides. Over it every participant runs the
constructor's steps; only the replacement builds an instance, at the survivors' epoch, and each
survivor keeps its own (engine, workspace, registration) and takes only what the replacement
brings: its address, region, segment and CUDA IPC handle (`Reuse`; docs/peer-loss.md,
"Rejoin"). A rejoin that fails (a replacement with a different configuration, one for a rank
that is not masked, a second loss, nobody arriving in time) re-arms the survivors' masked
instance, which serves as before.

Files, all under /dev/shm:
  moe-a2a-rejoin-{key}-r{rank}              claim of `rank`: the claimant's pid, role and a nonce
  moe-a2a-rejoin-{key}-r{rank}-{nonce}-g{n} what it contributes to the n-th all-gather
  moe-a2a-rejoin-{key}-r{rank}-error          why it failed, with its nonce (the others raise it)
The claim is created exclusively; a reader takes the nonce from it, so that files of an earlier
attempt with the same key are never read (an error file of a rank whose claim it has not read is
taken when newer than the reader's start). Each file is written whole and renamed into place, so
a reader never sees part of one, on any architecture. An all-gather's file goes once everyone
has written the next one, the claims once everyone has read them; a failed participant's error
file stays for the others to read and goes when its rank is next claimed with that key.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pickle
import re
import time
import uuid
import weakref
from dataclasses import dataclass, field
from typing import Any

from moe_a2a import _core, switches
from moe_a2a.bootstrap import Bootstrap, Topology, _host_id, _layout
from moe_a2a.cleanup import pid_alive
from moe_a2a.masking import LiveRanks, PeerLostError

SHM = "/dev/shm"
KEY = re.compile(r"[A-Za-z0-9_.-]{1,64}")
SURVIVOR, REPLACEMENT = "survivor", "replacement"
CLOSE_WAIT_S = 10.0  # how long a participant leaving a meeting in a store waits for the others


class RejoinError(_core.PeerFailedError):
    """A rejoin did not complete; where raised on a survivor, its masked instance serves on.
    `relayed`: the error happened on another participant (its text follows ours)."""

    relayed = False


def check_key(key: object) -> str:
    if not isinstance(key, str) or not KEY.fullmatch(key):
        raise ValueError(f"key: got {key!r}; expected 1-64 characters of letters, digits, '_', '.' or '-'")
    return key


class NodeRendezvous(Bootstrap):
    """A `Bootstrap` for the ranks of one node over /dev/shm files (module docstring).

    Construction claims `rank` and exchanges, with every other rank, its role, the ranks the
    survivors have masked and their epoch: the replacements must be exactly the masked ranks,
    and `first_epoch` is where everyone's calls resume. Each wait ends within `timeout_s`, at
    once when a participant's process is gone or any participant recorded an error.
    """

    def __init__(
        self,
        key: str,
        rank: int,
        world_size: int,
        role: str,
        timeout_s: float,
        masked: tuple[int, ...] = (),
        epoch: int = 0,
    ) -> None:
        self._key, self._timeout_s = check_key(key), float(timeout_s)
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size: got {world_size!r}; expected a positive int")
        if not isinstance(rank, int) or not 0 <= rank < world_size:
            raise ValueError(f"rank: got {rank!r}; expected an int in [0, {world_size})")
        if not self._timeout_s > 0:
            raise ValueError(f"timeout_s: got {timeout_s!r}; expected a positive number of seconds")
        self._comm = self._torch_group = None  # Bootstrap's: no launcher communicator here
        self.topology = Topology(rank, world_size, 0, rank, world_size, tuple(range(world_size)))
        self.single_host = True
        self._gen = 0
        self._nonce = uuid.uuid4().hex[:12]
        self._started = time.time()  # claims older than this, of processes gone, are stale
        self._claims: dict[int, tuple[int, str]] = {}  # rank: (pid, nonce) of its claimant
        self._claimed = False
        self._established = False  # the opening exchange done: close() leaves its mark
        self._closed = False
        self._layout_arg: int | None = None  # the survivors' ranks_per_node (StoreRendezvous)
        self.gone: set[int] = set()  # ranks lost since the meeting: close() waits for none of them
        self.reuse: Reuse | None = None  # a survivor's: what its constructor keeps (AllToAll.rejoin)
        self._claim(role)
        try:
            self._welcome(role, masked, epoch)
        except RejoinError as exc:
            if not exc.relayed and self._error_of(rank) is None:
                self._record(str(exc))
            self.close()
            raise
        except BaseException:
            self.close()
            raise

    def _lay_out(self, hosts: list[str], layouts: list[int]) -> None:
        """After the opening exchange: every rank on one node, as the files require."""

    # -- files ---------------------------------------------------------------------------------

    def _path(self, suffix: str) -> str:
        return os.path.join(SHM, f"moe-a2a-rejoin-{self._key}-{suffix}")

    def _write(self, suffix: str, data: bytes, exclusive: bool = False) -> None:
        """The whole file at once: written aside, then linked (exclusive) or renamed into place."""
        tmp = self._path(f"tmp-{os.getpid()}-{suffix}")
        with open(tmp, "wb") as f:
            f.write(data)
        try:
            if exclusive:
                os.link(tmp, self._path(suffix))  # fails if it exists
            else:
                os.replace(tmp, self._path(suffix))
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)

    def _read(self, suffix: str) -> bytes | None:
        try:
            with open(self._path(suffix), "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None

    def _remove(self, suffix: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._path(suffix))

    def _claim(self, role: str) -> None:
        me = self.rank
        for _ in range(2):  # a second try after removing a dead claimant's file
            try:
                self._write(f"r{me}", pickle.dumps((os.getpid(), role, self._nonce)), exclusive=True)
                break
            except FileExistsError:
                held = self._read(f"r{me}")
                if held is None:
                    continue
                pid, theirs, _ = pickle.loads(held)
                if pid_alive(pid):
                    raise RejoinError(
                        f"rank {me} ({role}, pid {os.getpid()}) found rank {me} already claimed by a "
                        f"{theirs} (pid {pid}) in the rejoin {self._key!r}: a replacement takes a masked "
                        "rank, and each rank comes once"
                    ) from None
                self._remove(f"r{me}")  # left by a process that is gone
        else:
            raise RejoinError(f"rank {me}: could not claim its place in the rejoin {self._key!r}")
        self._claimed = True
        self._claims[me] = (os.getpid(), self._nonce)
        for stale in glob.glob(self._path(f"r{me}-*")):  # an earlier attempt's, never read now
            if f"-{self._nonce}-" not in stale:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(stale)

    # -- errors and waits ----------------------------------------------------------------------

    def _fail(self, message: str) -> None:
        """Record the error for every other participant, then raise it here."""
        self._record(message)
        raise RejoinError(message)

    def _record(self, message: str) -> None:
        if self._claimed or self._established:
            self._write(f"r{self.rank}-error", pickle.dumps((self._nonce, message)))

    def _error_of(self, rank: int) -> str | None:
        """Rank `rank`'s error in this rejoin, if it recorded one."""
        path = self._path(f"r{rank}-error")
        try:
            with open(path, "rb") as f:
                nonce, message = pickle.loads(f.read())
                made = os.fstat(f.fileno()).st_mtime
        except FileNotFoundError:
            return None
        claim = self._claims.get(rank)
        current = claim[1] == nonce if claim is not None else made >= self._started - 0.05
        return message if current else None

    def _claim_of(self, rank: int) -> tuple[int, str] | None:
        if rank not in self._claims:
            path = self._path(f"r{rank}")
            try:
                with open(path, "rb") as f:
                    pid, _, nonce = pickle.loads(f.read())
                    made = os.fstat(f.fileno()).st_mtime
            except FileNotFoundError:
                return None
            if made < self._started - 0.05 and not pid_alive(pid):  # (tmpfs times are coarse)
                return None  # left by an earlier attempt's process: its replacement has not come yet
            self._claims[rank] = (pid, nonce)
        return self._claims[rank]

    def _check(self) -> None:
        """Raise the error another participant recorded, if any."""
        for r in range(self.world_size):
            error = self._error_of(r) if r != self.rank else None
            if error is not None:
                relayed = RejoinError(
                    f"rank {self.rank}: the rejoin {self._key!r} failed on rank {r}: {error}"
                )
                relayed.relayed = True
                raise relayed

    def _wait(self, rank: int, n: int) -> bytes:
        """Rank `rank`'s file of all-gather `n`, once its claimant has written it."""
        deadline = time.monotonic() + self._timeout_s
        pause = 0.0005
        while True:
            claim = self._claim_of(rank)
            pid = claim[0] if claim is not None else 0  # 0: no claim yet, or on another host
            # Gone before we look for its file: one that writes it and exits (its close)
            # between our look and this test has not died in the rejoin.
            gone = pid > 0 and not pid_alive(pid)
            if claim is not None:
                data = self._read(f"r{rank}-{claim[1]}-g{n}")
                if data is not None:
                    return data
            self._check()
            if gone:
                self._fail(f"rank {rank} (pid {pid}) is gone: it died during the rejoin {self._key!r}")
            if time.monotonic() > deadline:
                self._fail(
                    f"rank {self.rank} waited {self._timeout_s:g} s for rank {rank} in the rejoin "
                    f"{self._key!r} (all-gather {n}); "
                    + ("it never arrived (was its replacement started?)" if claim is None else "it stopped")
                )
            time.sleep(pause)
            pause = min(pause * 2, 0.01)

    # -- Bootstrap -----------------------------------------------------------------------------

    def allgather(self, blob: bytes) -> list[bytes]:
        """Every rank's blob, index = rank. Our file of the all-gather before goes once everyone
        has written this one: each of them has read it by then."""
        self._gen += 1
        n = self._gen
        self._write(f"r{self.rank}-{self._nonce}-g{n}", bytes(blob))
        out = [bytes(blob) if r == self.rank else self._wait(r, n) for r in range(self.world_size)]
        if n > 1:
            self._remove(f"r{self.rank}-{self._nonce}-g{n - 1}")
        return out

    def barrier(self) -> None:
        self.allgather(b"")

    def abort(self, code: int = 1) -> None:
        os._exit(code)

    def close(self) -> None:
        """Remove the files. Once the opening exchange is done, others may still read our last
        all-gather's file: we leave a mark that we are done reading theirs, and the last rank
        to leave one (a rank whose process is gone counts as done) removes every rank's."""
        if self._closed:
            return
        self._closed = True
        if not self._leave():
            return
        claims = sorted(self._claims.items())
        done = [
            os.path.exists(self._path(f"r{r}-{nonce}-closed")) or (r != self.rank and not pid_alive(pid))
            for r, (pid, nonce) in claims
        ]
        if len(claims) == self.world_size and all(done):
            for r, (_, nonce) in claims:
                for path in glob.glob(self._path(f"r{r}-{nonce}-*")):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(path)

    def _leave(self) -> bool:
        """Our claim goes, and before the opening exchange ended our last all-gather's record
        too; after it, our mark that we are done reading. Whether the exchange had ended."""
        if self._claimed:
            self._remove(f"r{self.rank}")
            self._claimed = False
        if not self._established:
            if self._gen:
                self._remove(f"r{self.rank}-{self._nonce}-g{self._gen}")
            return False
        self._write(f"r{self.rank}-{self._nonce}-closed", b"")
        return True

    # -- the opening exchange ------------------------------------------------------------------

    def _welcome(self, role: str, masked: tuple[int, ...], epoch: int) -> None:
        mine = (role, tuple(masked), int(epoch), _host_id(), self._layout_arg)
        everyone = [pickle.loads(b) for b in self.allgather(pickle.dumps(mine))]
        survivors = {r: (m, e) for r, (who, m, e, _, _) in enumerate(everyone) if who == SURVIVOR}
        joining = sorted(r for r, (who, *_) in enumerate(everyone) if who == REPLACEMENT)
        views = set(survivors.values())
        # Every participant computes the same verdict from the same data: all raise, or none.
        if not survivors:
            raise RejoinError(f"rejoin {self._key!r}: every rank is a replacement; no survivor to join")
        if len(views) != 1:
            raise RejoinError(
                f"rejoin {self._key!r}: the survivors disagree on the masked ranks or the epoch: {survivors}"
            )
        ((agreed, resume),) = views
        if tuple(joining) != tuple(sorted(agreed)):
            raise RejoinError(
                f"rejoin {self._key!r}: replacements came for ranks {joining}, but the survivors have "
                f"masked {sorted(agreed)}; a replacement takes a masked rank, and every masked rank needs one"
            )
        self.masked, self.first_epoch, self.joining = tuple(sorted(agreed)), int(resume), tuple(joining)
        self._lay_out([host for *_, host, _ in everyone], [rpn for *_, rpn in everyone if rpn is not None])
        self._established = True
        # Every participant has read every claim: the names can go (the files of the
        # all-gathers are removed as they are passed).
        self.barrier()
        if self._claimed:
            self._remove(f"r{self.rank}")
            self._claimed = False


_ABSENT = b"\x00moe-a2a: no such key"  # StoreRendezvous._read


class StoreRendezvous(NodeRendezvous):
    """The same meeting over a `torch.distributed.Store` (a TCPStore every participant reaches),
    for ranks on several nodes, which share no /dev/shm. Keys replace the files (written whole,
    the claim by compare-and-set); the layout is the hosts' (or the survivors' ranks_per_node),
    not one node. No process of another host can be checked: a participant that dies is a
    timeout, not an at-once error. A key names one attempt: a claim left by a failed one is
    refused as taken (use a new key)."""

    def __init__(
        self,
        store: Any,
        key: str,
        rank: int,
        world_size: int,
        role: str,
        timeout_s: float,
        masked: tuple[int, ...] = (),
        epoch: int = 0,
        ranks_per_node: int | None = None,
    ) -> None:
        self._store = store
        self._rpn = ranks_per_node
        self._own_store = False  # made from MOE_A2A_REJOIN_STORE: its connection goes at close
        super().__init__(key, rank, world_size, role, timeout_s, masked, epoch)

    def _claim(self, role: str) -> None:
        self._layout_arg = self._rpn if role == SURVIVOR else None
        me = self.rank
        claim = pickle.dumps((os.getpid(), role, self._nonce, _host_id()))
        try:
            self._write(f"r{me}", claim, exclusive=True)
        except FileExistsError:
            held = self._read(f"r{me}")
            pid, theirs, _, host = pickle.loads(held) if held else (0, "?", "", "?")
            raise RejoinError(
                f"rank {me} ({role}, pid {os.getpid()}) found rank {me} already claimed by a {theirs} "
                f"(pid {pid} on {host}) in the rejoin {self._key!r}: a replacement takes a masked rank, each "
                "rank comes once, and a key names one attempt"
            ) from None
        self._claimed = True
        self._claims[me] = (os.getpid(), self._nonce)

    def _lay_out(self, hosts: list[str], layouts: list[int]) -> None:
        rpn = layouts[0] if layouts else None
        self.topology = _layout(self.rank, self.world_size, hosts, rpn)
        self.single_host = len(set(hosts)) == 1

    def _path(self, suffix: str) -> str:
        return f"moe-a2a-rejoin/{self._key}/{suffix}"

    def _write(self, suffix: str, data: bytes, exclusive: bool = False) -> None:
        if exclusive:
            if self._store.compare_set(self._path(suffix), "", data) != data:
                raise FileExistsError(self._path(suffix))
        else:
            self._store.set(self._path(suffix), data)

    def _read(self, suffix: str) -> bytes | None:
        # One atomic step: compare_set with an expected value no key holds returns the value, or
        # that mark where there is none, and writes nothing. A check, then a get, blocked for the
        # store's whole timeout where another participant's close removed the key in between.
        value = bytes(self._store.compare_set(self._path(suffix), _ABSENT, _ABSENT))
        return None if value == _ABSENT else value

    def _remove(self, suffix: str) -> None:
        self._store.delete_key(self._path(suffix))

    def _error_of(self, rank: int) -> str | None:
        data = self._read(f"r{rank}-error")
        if data is None:
            return None
        nonce, message = pickle.loads(data)
        claim = self._claims.get(rank)
        return message if claim is None or claim[1] == nonce else None

    def _claim_of(self, rank: int) -> tuple[int, str] | None:
        if rank not in self._claims:
            data = self._read(f"r{rank}")
            if data is None:
                return None
            pid, _, nonce, host = pickle.loads(data)
            self._claims[rank] = (pid if host == _host_id() else 0, nonce)  # 0: not ours to check
        return self._claims[rank]

    def close(self) -> None:
        """Remove the keys: each rank its own as it leaves, the last all-gather's once every rank
        left its mark (others may still read it until then). A store made here from
        MOE_A2A_REJOIN_STORE goes too (its connection closes)."""
        if self._closed:
            return
        self._closed = True
        # A store whose host is gone (its job ended first) took its keys with it.
        with contextlib.suppress(RuntimeError, OSError):
            self._remove_keys()
        if self._own_store:
            self._store = None

    def _remove_keys(self) -> None:
        if not self._leave():
            return
        claims = sorted(self._claims.items())
        # Wait (bounded) for every participant's mark: the store's host may be one of us, and a
        # participant still reading our last all-gather would lose its connection if we left.
        # Ranks lost since (`gone`) leave no mark: no wait for them.
        # A mark is only checked for, never read: the last to see them all removes them (ours too,
        # which then tells us every mark was there).
        need = {r for r, _ in claims} - self.gone
        deadline = time.monotonic() + min(self._timeout_s, CLOSE_WAIT_S)
        while True:
            marks = {r for r, (_, nonce) in claims if self._store.check([self._path(f"r{r}-{nonce}-closed")])}
            if marks >= need or self.rank not in marks or time.monotonic() > deadline:
                break
            time.sleep(0.005)
        if len(claims) == self.world_size and len(marks) == self.world_size:
            for r, (_, nonce) in claims:
                self._remove(f"r{r}-{nonce}-g{self._gen}")
                self._remove(f"r{r}-{nonce}-closed")


def store_from_env() -> Any:
    """A client of the TCPStore at MOE_A2A_REJOIN_STORE ("host:port"), or None where unset: the
    meeting point of a rejoin across nodes (a torchrun job's MASTER_ADDR:MASTER_PORT serves)."""
    where = switches.get("MOE_A2A_REJOIN_STORE") or ""
    if not where:
        return None
    import datetime

    import torch.distributed as dist

    host, _, port = where.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"MOE_A2A_REJOIN_STORE: got {where!r}; expected host:port")
    return dist.TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=60))


def replacement(
    key: str, rank: int, world_size: int, timeout_s: float = 60.0, store: Any = None
) -> NodeRendezvous:
    """The bootstrap of a process that replaces masked rank `rank`: pass it as `comm` to
    `AllToAll(cfg, comm=...)`, with the survivors' arguments. Waits (up to `timeout_s`) until
    every survivor called `AllToAll.rejoin(key)`. With `store` (a `torch.distributed.Store`; or
    MOE_A2A_REJOIN_STORE) the meeting is there, for survivors on several nodes; else in this
    node's /dev/shm."""
    if store is not None:
        return StoreRendezvous(store, key, rank, world_size, REPLACEMENT, timeout_s)
    owned = store_from_env()
    if owned is None:
        return NodeRendezvous(key, rank, world_size, REPLACEMENT, timeout_s)
    rdzv = StoreRendezvous(owned, key, rank, world_size, REPLACEMENT, timeout_s)
    rdzv._own_store = True
    return rdzv


def survivors_rendezvous(
    key: str,
    rank: int,
    world_size: int,
    masked: tuple[int, ...],
    epoch: int,
    timeout_s: float,
    store: Any = None,
    ranks_per_node: int | None = None,
) -> NodeRendezvous:
    if store is not None:
        return StoreRendezvous(
            store, key, rank, world_size, SURVIVOR, timeout_s, masked, epoch, ranks_per_node
        )
    return NodeRendezvous(key, rank, world_size, SURVIVOR, timeout_s, masked, epoch)


def leftovers(key: str) -> list[str]:
    """/dev/shm files of the rejoins with `key` still there."""
    return sorted(glob.glob(os.path.join(SHM, f"moe-a2a-rejoin-{check_key(key)}-*")))


# Instance state the mixin reads and replaces; the rejoin swaps everything else the constructor
# set (its bootstrap, checks, the backend it re-armed) and keeps these of the survivor's own.
_KEPT = frozenset({"_pid", "_busy", "id", "_calls", "_args", "abort_on_error"})


@dataclass
class Reuse:
    """A survivor's side of a rejoin: what its constructor keeps instead of making anew. The
    constructor runs every collective step as the replacement does (moe_a2a.a2a_startup), but
    connects, registers and maps only what the replacements bring."""

    setup: Any  # the survivor's Setup: workspace, engine, region, remotes, updated in place
    lease: Any  # its EngineLease, kept
    backend: Any  # the CUDA backend, re-armed in place; None on the CPU (a new one is built)
    live: LiveRanks
    joining: tuple[int, ...]
    paths: dict[int, str] = field(default_factory=dict)  # same-node replacements' segments
    built: Any = None  # the CPU backend built, stopped again where the rejoin fails later

    def forget_old_peers(self) -> None:
        """What the replaced processes left in our memory and engine: abort records, arrivals."""
        setup = self.setup
        tag, mask = _core.instance_tags(int(setup.core_cfg.instance))
        for r in self.joining:
            setup.workspace.forget_sender(r)
            if setup.engine is not None and r not in setup.node:
                setup.engine.core.forget_peer_imm(r, tag, mask)


# Instances with on_peer_loss="mask" in this process, in the order they were made (AllToAll.id).
_masking: weakref.WeakSet[Any] = weakref.WeakSet()


def register_masking(inst: Any) -> None:
    _masking.add(inst)


def _siblings(inst: Any) -> list[Any]:
    """The open, usable mask instances of `inst`'s job in this process (itself included), by id:
    the same rank and world, and the same processes on this host."""
    job = (inst.rank, inst.world_size, tuple(inst._setup.pids))
    return sorted(
        (
            o
            for o in _masking
            if o._setup is not None
            and o._failure is None
            and o._live is not None
            and (o.rank, o.world_size, tuple(o._setup.pids)) == job
            and (o is inst or o._busy is None)
        ),
        key=lambda o: o.id,
    )


def live_ranks(boot: Bootstrap, cfg: Any, device: str) -> LiveRanks | None:
    """The constructor's LiveRanks (on_peer_loss="mask"): a rejoin's survivor keeps its own and
    connects the replacements, which take the survivors' agreement counters."""
    reuse = getattr(boot, "reuse", None)
    if reuse is None:
        live = LiveRanks.of(boot, cfg, device)
    else:
        live = reuse.live
        live.rejoin_mesh(boot, reuse.joining)
    if getattr(boot, "joining", None) and live is not None:
        counters = (live.next_round, live.mesh.agreements if live.mesh is not None else 0)
        offered = [b for b in boot.allgather(pickle.dumps(counters) if reuse is not None else b"") if b]
        live.next_round, agreements = pickle.loads(offered[0])
        if live.mesh is not None:
            live.mesh.agreements = agreements
    return live


class LostRanks:
    """`AllToAll`'s side of on_peer_loss="mask": the ranks masked so far, the survivors'
    agreement after a loss (moe_a2a.masking), and the rejoin of replacements."""

    _live: LiveRanks | None
    _setup: Any
    _backend: Any
    _boot: Any
    _lease: Any
    _state: str
    _last: Any
    _failure: str | None
    _calls: int
    _args: dict[str, Any]
    cfg: Any
    rank: int
    world_size: int
    # The last rejoin on this survivor: (seconds waiting for the replacements to arrive, seconds
    # from the meeting to every rank connected and re-armed).
    rejoin_times: tuple[float, float] = (0.0, 0.0)

    @property
    def masked_ranks(self) -> tuple[int, ...]:
        """Ranks lost and masked so far (on_peer_loss="mask"); the same on every survivor."""
        return tuple(sorted(self._live.masked)) if self._live is not None else ()

    @property
    def masked_calls(self) -> int:
        """Dispatches this rank ran with a rank masked."""
        return self._live.calls if self._live is not None else 0

    def _mask_after_loss(self, what: str, exc: BaseException) -> None:
        """on_peer_loss="mask" and a peer's process gone: agree with the survivors, rebuild the
        backend without the lost ranks and raise PeerLostError (the instance stays usable).

        A lost process is lost to every instance of the job (a model's layers): the other idle
        instances of this process mask it too, each agreeing with its survivors, in the order
        the instances were made. Every survivor runs the same agreements in the same order, so
        none waits in one instance's agreement for a survivor that waits in another's (a
        survivor whose call needed nothing from the lost rank may be a call further on)."""
        if self._live is None or self._setup is None:
            return
        if not isinstance(exc, (_core.FabricError, _core.PeerFailedError)):
            return
        lost = self._live.lost_peers(self._setup.pids)
        if not lost:
            return
        error: BaseException | None = None
        try:
            for inst in _siblings(self):
                if inst is self:
                    error = inst._agree_after_loss(what, exc, lost)
                elif set(lost) - inst._live.masked:
                    inst._agree_after_loss("(idle)", exc, lost)
        except BaseException as agreeing:  # an earlier instance's agreement failed: this one stops too
            if self._failure is None:
                self._failure = f"call {self._calls} ({what}) on rank {self.rank}: {exc}; {agreeing}"
            raise
        assert error is not None
        raise error from exc

    def _agree_after_loss(self, what: str, exc: BaseException, lost: list[int]) -> PeerLostError:
        """This instance's agreement on `lost` and its re-armed backend (collective among the
        survivors); the error its failed call raises. Where the agreement fails, so does the
        instance."""
        assert self._live is not None
        epoch = self._backend.epoch
        try:
            self._backend, error = self._live.recover(
                self._backend, self._setup, what, exc, self.cfg.timeout_s, list(lost)
            )
        except BaseException as agreeing:
            self._failure = (
                f"call {self._calls} ({what}, epoch {epoch}) on rank {self.rank}: {exc}; {agreeing}"
            )
            raise
        self._state, self._last = "idle", None
        return error

    def rejoin(self, key: str, timeout_s: float | None = None, store: Any = None) -> tuple[int, ...]:
        """Collective among the survivors and one replacement per masked rank: let them in.

        Every survivor calls it at the same point of its calls (between a combine and the next
        dispatch), with the same `key`; each replacement constructs its instance with
        `comm=moe_a2a.rejoin.replacement(key, rank, world_size)` and the survivors' other
        arguments. Waits up to `timeout_s` (default `cfg.timeout_s`) for them. Afterwards no
        rank is masked and every rank's next dispatch is epoch `self.epoch + 1`. Returns the
        ranks that rejoined. On failure (`RejoinError`, or the constructor's own error for a
        replacement whose arguments differ) the survivors' masked instance serves on. With
        ranks on several nodes the meeting is in `store` (a `torch.distributed.Store` that every
        participant reaches; or MOE_A2A_REJOIN_STORE=host:port), the replacement passing the same.
        """
        self._check_open()  # type: ignore[attr-defined]
        self._check_idle("rejoin")  # type: ignore[attr-defined]
        if self._live is None:
            raise ValueError("rejoin: needs Config(on_peer_loss='mask'); this instance stops on a loss")
        masked = self.masked_ranks
        if not masked:
            raise ValueError("rejoin: no rank is masked; a replacement takes the place of a masked rank")
        owned = store is None
        store = store if store is not None else store_from_env()
        if self._live.mesh is not None and store is None:
            raise ValueError(
                "rejoin: this instance's ranks span several nodes, which share no /dev/shm: pass "
                "store= (a torch.distributed.Store every participant reaches) or set "
                "MOE_A2A_REJOIN_STORE=host:port, on the survivors and the replacement alike; masked "
                "ranks stay masked"
            )
        wait = self.cfg.timeout_s if timeout_s is None else timeout_s  # checked by the rendezvous
        started = time.monotonic()
        rdzv = survivors_rendezvous(
            key,
            self.rank,
            self.world_size,
            masked,
            self._backend.epoch,
            wait,
            store,
            self._args.get("ranks_per_node"),
        )
        if isinstance(rdzv, StoreRendezvous):
            rdzv._own_store = owned
        met = time.monotonic()
        # Every survivor is here, between calls: stop ours (the CUDA kernels ended, the proxy
        # joined) while the replacements are connected, then re-arm with them.
        cpu = self.device.type == "cpu"  # type: ignore[attr-defined]
        if cpu:
            self._backend.close()
        else:
            self._backend.halt()
        reuse = Reuse(self._setup, self._lease, None if cpu else self._backend, self._live, rdzv.joining)
        rdzv.reuse = reuse
        boot = self._setup.bootstrap
        try:
            fresh = type(self)(**{**self._args, "comm": rdzv})  # closes rdzv if it fails
        except BaseException as exc:
            # Masked as before: the replacements' ranks stay out of our group and kernels.
            if reuse.built is not None:
                reuse.built.close()
            self._setup.bootstrap = boot
            self._backend = self._live.rearm(None if cpu else self._backend, self._setup, rdzv.first_epoch)
            if isinstance(exc, RejoinError):
                raise
            raise RejoinError(
                f"rank {self.rank}: the rejoin {key!r} failed, rank(s) {list(masked)} stay masked: {exc}"
            ) from exc
        # Settled: every participant is past the constructor's last barrier. The constructor kept
        # our workspace, engine and registration: only its bootstrap and checks are new.
        old_boot = self._boot
        if isinstance(old_boot, NodeRendezvous):
            old_boot.gone = set(masked)
        self.__dict__.update({k: v for k, v in fresh.__dict__.items() if k not in _KEPT})
        self._args = {**self._args, "comm": rdzv}  # reopen() refuses it: the meeting ends at close
        fresh.__dict__["_setup"] = None  # its resources are ours: its close() does nothing
        old_boot.close()
        self._live.unmask()
        # (waiting for the replacements to arrive, connecting them): what probes print.
        self.rejoin_times = (met - started, time.monotonic() - met)
        return rdzv.joining
