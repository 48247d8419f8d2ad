"""The transfer engine from Python: open, connect through a bootstrap, register buffers.

Regions, remote regions and groups are typed handles (`Region`, `RemoteRegion`,
`Group`): the core refuses one where another is expected."""

from __future__ import annotations

import atexit
import contextlib
import os
import pickle
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from moe_a2a import _core, peer_sockets, switches
from moe_a2a import nics as _nics
from moe_a2a.bootstrap import Bootstrap

PROVIDERS = ("tcp", "shm", "efa", "verbs")

ScatterItem = _core.ScatterItem
Region = _core.Region
RemoteRegion = _core.RemoteRegion
Group = _core.Group
MEMORY_KINDS = ("host", "cuda")  # only host memory registers with the libfabric backend built here


def default_provider(provider: str | None = "auto") -> str:
    """The libfabric provider a rank uses: `provider` as given, or for "auto" (and None or "")
    `MOE_A2A_PROVIDER`, else `efa` where libfabric offers it, else `tcp`. The one place where
    "auto" is resolved; each rank resolves it from its own environment."""
    if provider and provider != "auto":
        return provider
    chosen = switches.get("MOE_A2A_PROVIDER")
    if chosen:
        return str(chosen)
    offered = _core.libfabric_providers()
    return "efa" if "efa" in offered else "tcp"


def hint_universe_size(world_size: int) -> None:
    """Size libfabric's per-peer queues for this job, before libfabric starts in this process.

    tcp (ofi_rxm) sizes a completion ring for FI_UNIVERSE_SIZE peers (256 by
    default): tens of MB whose pages were touched one after another, call after
    call, for the first ~10^5 calls (the slow RSS growth of issue 17, item 8).
    A value the user set is kept; read once, so later engines share it.
    """
    os.environ.setdefault("FI_UNIVERSE_SIZE", str(max(world_size, 2)))


def prepare_environment(bootstrap: Bootstrap, provider: str) -> None:
    """Provider settings that must be in place before libfabric starts."""
    if provider == "tcp" and bootstrap.single_host:
        # Without it, tcp binds the first network interface, which may not route to ourselves.
        os.environ.setdefault("FI_TCP_IFACE", "lo")
    hint_universe_size(bootstrap.world_size)


class Engine:
    """A connected transfer engine: every rank's address is known once this returns."""

    def __init__(
        self,
        bootstrap: Bootstrap,
        provider: str | None = None,
        num_nics: int | None = None,
        split_threshold: int = 1 << 20,
        nics: Sequence[str] | str | None = None,
        gpu: int | str | None = None,
        backend: str = "libfabric",
        gpu_memory: bool = False,
    ) -> None:
        """`backend`: which transport implementation opens the NICs (`_core.backend_names()`).
        `gpu_memory`: ask the provider for CUDA memory registration (FI_HMEM; a CUDA rank),
        which `capabilities()` reports as taken or not and why.
        `nics`: domain names for this rank (a list, or a `MOE_A2A_NICS` string); default
        `MOE_A2A_NICS`, else the `num_nics` nearest devices (to `gpu`, an index or PCI
        address, where given; else to this process's NUMA node). See `moe_a2a.nics`."""
        self.bootstrap = bootstrap
        with bootstrap.together("opening the fabric engine"):  # a bad NIC name is one rank's
            self._open(provider, num_nics, split_threshold, nics, gpu, backend, gpu_memory)
        addresses = bootstrap.allgather(self.core.address())
        with bootstrap.together("connecting the fabric engine"):
            self.core.connect(addresses)
        self._watch_other_hosts(bootstrap)

    def rejoin(self, bootstrap: Bootstrap, joining: Sequence[int]) -> None:
        """The constructor's collectives on a survivor of a rejoin (moe_a2a.rejoin), whose
        replacements open new engines: only `joining` are connected anew (and watched)."""
        with bootstrap.together("opening the fabric engine"):
            pass
        addresses = bootstrap.allgather(self.core.address())
        with bootstrap.together("connecting the fabric engine"):
            for r in joining:
                self.core.reconnect_peer(r, addresses[r])
        self._watch_other_hosts(bootstrap, joining)

    def _watch_other_hosts(self, bootstrap: Bootstrap, joining: Sequence[int] | None = None) -> None:
        """Collective: control connections to the peers on other hosts, whose end the waits notice
        (moe_a2a.peer_sockets); none where every peer shares our host. `joining`: a rejoin's
        survivor, which connects only to those."""
        pids = bootstrap.local_pids()
        mine = any(p == 0 for r, p in enumerate(pids) if r != bootstrap.rank)
        if not any(bootstrap.allgather(b"1" if mine else b"")):
            return
        only = None if joining is None else {r for r in joining if pids[r] == 0}
        fds = peer_sockets.connect(bootstrap, pids, only)
        if fds is None:
            return
        if joining is None:
            self.core.watch_peers(fds)
        else:
            for r in only or ():
                self.core.watch_peer(r, fds[r])

    def _open(
        self,
        provider: str | None,
        num_nics: int | None,
        split_threshold: int,
        nics: Sequence[str] | str | None,
        gpu: int | str | None,
        backend: str,
        gpu_memory: bool = False,
    ) -> None:
        """This rank's part of start-up: check the arguments, pick the NICs, open them."""
        bootstrap = self.bootstrap
        provider = default_provider(provider)
        if not isinstance(provider, str) or not provider:
            raise ValueError(f"provider: got {provider!r}; expected one of {PROVIDERS} or a libfabric name")
        if backend not in _core.backend_names():
            raise ValueError(f"backend: got {backend!r}; expected one of {_core.backend_names()}")
        num_nics = _nics.num_nics_default(num_nics)
        if not isinstance(num_nics, int) or num_nics < 1:
            raise ValueError(f"num_nics: got {num_nics!r}; expected a positive integer")
        prepare_environment(bootstrap, provider)
        local_rank = bootstrap.topology.local_rank
        explicit = _nics.parse_spec(nics, local_rank) if isinstance(nics, str) else nics
        if explicit is None:
            explicit = _nics.explicit_from_env(local_rank)
        domains = _core.libfabric_domains(provider)
        # No domains: the provider is absent, which the engine reports with the providers there are.
        self.nics = (
            _nics.select(domains, num_nics, explicit=explicit, gpu=gpu, provider=provider)
            if domains
            else _nics.Selection([], "none")
        )
        self.core = _core.TransferEngine(
            bootstrap.rank,
            bootstrap.world_size,
            provider,
            num_nics,
            split_threshold,
            self.nics.names,
            backend,
            gpu_memory,
        )

    @property
    def rank(self) -> int:
        return self.core.rank

    @property
    def world_size(self) -> int:
        return self.core.world

    def register(self, array: np.ndarray) -> Region:
        """Register a contiguous host array; returns its region handle."""
        if not array.flags.c_contiguous:
            raise ValueError("register: expected a C-contiguous array")
        return self.core.register_region(array.ctypes.data, array.nbytes)

    def capabilities(self, nic: int = 0) -> dict[str, Any]:
        """What NIC `nic`'s backend reports: GPU memory, ordering, sizes (`moe-a2a info` prints them)."""
        return dict(self.core.capabilities(nic))

    def exchange_region(
        self,
        region: Region,
        only: Sequence[int] | None = None,
        known: Sequence[RemoteRegion | None] | None = None,
        bootstrap: Bootstrap | None = None,
    ) -> list[RemoteRegion | None]:
        """All-gather a region's descriptor; returns each peer's remote region (None for ourselves).
        `only` (a rejoin's survivor): add those peers' regions, keep the rest of `known`."""
        boot = bootstrap if bootstrap is not None else self.bootstrap
        blobs = boot.allgather(self.core.region_descriptor(region))
        with boot.together("adding the peers' regions"):
            if only is None:
                return [
                    None if peer == self.rank else self.core.add_remote_region(peer, blob)
                    for peer, blob in enumerate(blobs)
                ]
            remotes = list(known or [None] * len(blobs))
            for peer in only:
                remotes[peer] = self.core.add_remote_region(peer, blobs[peer])
            return remotes

    def group(self, peers: Sequence[int], remotes: Sequence[RemoteRegion | None], rails: int = 0) -> Group:
        """A peer group whose writes land in each peer's `remotes[peer]` region. `rails`: the
        ranks per node where the group's data goes only to the peers with our local index on
        other nodes (rows per node), spread over the NICs by node distance (0: every peer)."""
        regions: list[RemoteRegion] = []
        for p in peers:
            region = remotes[p]
            if region is None:
                raise ValueError(f"remotes: peer {p} has none; expected a region for every peer of the group")
            regions.append(region)
        return self.core.create_group(list(peers), regions, rails)


# -- one engine per process, provider and set of ranks ------------------------------------------
#
# An engine costs tens of MB, two threads and a set of connections; every AllToAll
# of a model (one per layer, more in training) used to open its own. Instances
# now lease a shared one: each registers its own region and group on it, and
# its immediate tags carry its slot (A2AConfig.instance), so instances on one
# engine never count each other's arrivals. The engine closes with its last lease.

_MAX_SLOTS = int(_core.A2AConfig.max_instances)
_shared: dict[tuple[Any, ...], _SharedEngine] = {}
_shared_lock = threading.Lock()
# A rank whose script ends right after its last call may still have that call's writes queued in its
# engine, at its NIC's pace, and its slower peers' calls wait for them. At interpreter exit each
# engine hands them over, then says goodbye on its control connections: a peer on another host
# then lets them land after the connection's end (peer_watch.h). os._exit and a kill skip this.
_EXIT_FLUSH_S = 10.0


@atexit.register
def _leave_at_exit() -> None:
    """At interpreter exit, each engine's writes go to the network before the process does."""
    with _shared_lock:  # a forked child's copies are its parent's: their connections too
        engines = [s.engine for s in _shared.values() if s.pid == os.getpid()]
    for engine in engines:
        with contextlib.suppress(Exception):  # a failed engine: its peers see their own errors
            engine.core.wait_tx(_EXIT_FLUSH_S)
            engine.core.leave()


@dataclass
class _Retired:
    """A closed instance's region, memory and tag slot, kept until no peer can still write to them."""

    slot: int
    region: Region | None
    group: Group | None
    memory: object  # what keeps the registered bytes alive
    until: float  # time.monotonic() after which it goes


class _SharedEngine:
    def __init__(self, engine: Engine, token: bytes) -> None:
        self.engine = engine
        self.pid = os.getpid()  # the process whose engine it is
        self.token = token  # the same on every rank: proof that all ranks hold this engine
        self.slots: set[int] = set()  # of open instances
        self.retired: list[_Retired] = []

    def busy(self) -> set[int]:
        return self.slots | {r.slot for r in self.retired}

    def reap(self, now: float) -> None:
        """Releases what was retired long enough ago (callers hold _shared_lock)."""
        keep = []
        for r in self.retired:
            if r.until > now:
                keep.append(r)
            elif r.region is not None:
                self.engine.core.release(r.region, r.group)
        self.retired = keep


class EngineLease:
    """One instance's use of a shared engine: its tag slot, released with `close`."""

    def __init__(self, key: tuple[Any, ...], shared: _SharedEngine, slot: int) -> None:
        self._key, self._shared, self.slot = key, shared, slot
        self.engine: Engine | None = shared.engine

    def release(
        self, region: Region, group: Group | None, memory: object = None, retire_s: float = 0.0
    ) -> None:
        """Release one more region of this instance (GPU-direct's device workspace) as `close` does,
        before it: kept with `memory` for `retire_s` where peers may still write to it."""
        if self.engine is None:
            return
        with _shared_lock:
            self._release(region, group, memory, retire_s, time.monotonic())

    def _release(
        self, region: Region | None, group: Group | None, memory: object, retire_s: float, now: float
    ) -> None:
        """Releases (or retires, `retire_s` > 0) one region; callers hold _shared_lock."""
        if retire_s > 0:
            self._shared.retired.append(_Retired(self.slot, region, group, memory, now + retire_s))
        elif region is not None:  # no group: a start-up that failed before making it
            self._shared.engine.core.release(region, group)

    def close(
        self, region: Region | None, group: Group | None, memory: object = None, retire_s: float = 0.0
    ) -> None:
        """Release this instance's region and group; the engine closes with its last lease.

        `retire_s` > 0 (a close after a failure, or without waiting for the peers):
        peers may still have writes to this region in flight, and a write to a
        deregistered region breaks the provider's connection (tcp drops it) for
        every instance on the engine. The region, `memory` and the tag slot then
        stay for that long, and go at a later lease or close.
        """
        if self.engine is None:
            return
        now = time.monotonic()
        with _shared_lock:
            shared = self._shared
            shared.slots.discard(self.slot)
            self._release(region, group, memory, retire_s, now)
            shared.reap(now)
            if not shared.busy() and _shared.get(self._key) is shared:
                del _shared[self._key]
        self.engine = None
        self._shared = None  # type: ignore[assignment]


def lease_engine(
    bootstrap: Bootstrap,
    provider: str | None,
    num_nics: int = 1,
    nics: Sequence[str] | str | None = None,
    gpu: int | str | None = None,
    gpu_memory: bool = False,
    rejoining: EngineLease | None = None,
) -> EngineLease:
    """The process's engine for this provider, NICs and ranks (collective: every rank calls it).
    `gpu_memory`: an engine that registers CUDA memory where the provider can (a CUDA rank's).
    In a rejoin (moe_a2a.rejoin) a survivor passes its lease as `rejoining`: it keeps it and
    connects the replacements, which take its tag slot and token."""
    provider = default_provider(provider)
    members = bootstrap.allgather(pickle.dumps((socket.gethostname(), os.getpid())))
    named = nics if nics is None or isinstance(nics, str) else tuple(nics)
    key = (provider, num_nics, named, gpu, gpu_memory, tuple(members))
    held: _SharedEngine | None = None
    if rejoining is not None:
        held = rejoining._shared
        mine: tuple[bytes, list[int], int | None] = (held.token, sorted(held.busy()), rejoining.slot)
    else:
        with _shared_lock:
            held = _shared.get(key)
            if held is not None and held.engine.core.error:
                held = None  # a fabric error is sticky: new instances get a fresh engine
            if held is not None:
                held.reap(time.monotonic())
            mine = (held.token, sorted(held.busy()), None) if held is not None else (b"", [], None)
    # Shared only where every rank holds the same engine: a rank that closed its
    # last instance meanwhile has none, and then all open a new one together.
    offers = [pickle.loads(b) for b in bootstrap.allgather(pickle.dumps(mine))]
    tokens = {token for token, _, _ in offers}
    kept = [(token, slot) for token, _, slot in offers if slot is not None]  # a rejoin's survivors'
    fresh = not (len(tokens) == 1 and b"" not in tokens)
    if rejoining is not None:
        if fresh:  # the replacements open engines of their own: connect them
            rejoining._shared.engine.rejoin(bootstrap, getattr(bootstrap, "joining", ()))
            bootstrap.allgather(rejoining._shared.token)
        return rejoining
    if held is not None and not fresh:
        busy = set().union(*(set(slots) for _, slots, _ in offers))
        free = next((s for s in range(_MAX_SLOTS) if s not in busy), None)
        if kept:  # a replacement takes the survivors' slot (it is free on theirs)
            free = kept[0][1] if kept[0][1] not in held.busy() else None
        if free is None:
            raise RuntimeError(
                f"AllToAll: {_MAX_SLOTS} instances already share the {provider} engine "
                f"(the most its immediate tags can tell apart); close some first"
                if not kept
                else f"AllToAll: the survivors' tag slot {kept[0][1]} is taken on this replacement's "
                f"{provider} engine; rejoin the survivors' instances in the order they were made"
            )
        shared = held
    else:
        engine = Engine(bootstrap, provider, num_nics=num_nics, nics=nics, gpu=gpu, gpu_memory=gpu_memory)
        token = bootstrap.allgather(os.urandom(16))[0]
        shared = _SharedEngine(engine, kept[0][0] if kept else token)
        free = kept[0][1] if kept else 0
    with _shared_lock:
        shared.slots.add(free)
        _shared[key] = shared
    return EngineLease(key, shared, free)
