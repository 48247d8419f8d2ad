"""Remove the shared-memory files a dead job left behind (`moe-a2a cleanup`).

libfabric's shm provider backs each endpoint with a 16 MiB file in /dev/shm
named `<pid>:<n>:<m>` (ours `<pid>:<random>:<n>`: src/fabric/libfabric_backend.cc),
unlinked when the endpoint closes. A rank killed by
SIGKILL (or the OOM killer) never closes it, and nothing the library runs can
then remove it. The library avoids the endpoint where it can (no engine is
opened when every peer shares the node); where it cannot, this removes the
files whose owning process is gone. A file is removed only when its name
carries a pid and no process with that pid runs (a zombie, dead but not yet
reaped by its launcher, counts as gone): files of live processes,
and files this module does not know, are left alone. Pids are those of this
host's pid namespace, so run it where the job ran.
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass

SHM_DIR = "/dev/shm"
# libfabric shm endpoints, and our own workspaces (unlinked once every rank has
# mapped them, so only a rank that died during start-up leaves one).
PATTERNS = (re.compile(r"^(\d+):\d+:\d+$"), re.compile(r"^moe-a2a-(\d+)-[0-9a-f]+-r\d+$"))


@dataclass(frozen=True)
class Leftover:
    path: str
    pid: int
    size: int


def _pid_of(name: str) -> int | None:
    for pattern in PATTERNS:
        m = pattern.match(name)
        if m:
            return int(m.group(1))
    return None


def pid_alive(pid: int) -> bool:
    """Whether `pid` runs: it exists and is not a zombie, a dead process its parent has not
    reaped yet (mpirun right after a forced end), as the library's own peer watch holds."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process: its state says whether it runs
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:  # no /proc here, or it just ended
        return os.path.exists(f"/proc/{pid}") or not os.path.isdir("/proc")
    state = stat[stat.rfind(")") + 2 :][:1]  # the name may hold spaces and parentheses
    return state not in ("Z", "X")


def dead_files(directory: str = SHM_DIR, pids: Iterable[int] | None = None) -> list[Leftover]:
    """Files of dead processes in `directory`; only those of `pids` when given."""
    only = set(pids) if pids is not None else None
    out = []
    try:
        names = sorted(os.listdir(directory))
    except FileNotFoundError:
        return []
    for name in names:
        pid = _pid_of(name)
        if pid is None or (only is not None and pid not in only) or pid_alive(pid):
            continue
        path = os.path.join(directory, name)
        try:
            size = os.stat(path).st_size
        except FileNotFoundError:
            continue
        out.append(Leftover(path, pid, size))
    return out


def remove_dead_files(directory: str = SHM_DIR, pids: Iterable[int] | None = None) -> list[Leftover]:
    """Remove the files of dead processes (see `dead_files`); returns what was removed."""
    removed = []
    for f in dead_files(directory, pids):
        if pid_alive(f.pid):  # checked again just before: the pid may have been reused
            continue
        try:
            os.unlink(f.path)
        except FileNotFoundError:
            continue
        removed.append(f)
    return removed


def _run(args: argparse.Namespace) -> int:
    if args.dry_run:
        found = dead_files(args.dir, args.pid or None)
    else:
        found = remove_dead_files(args.dir, args.pid or None)
    verb = "would remove" if args.dry_run else "removed"
    for f in found:
        print(f"{verb} {f.path} ({f.size / 2**20:.1f} MiB, pid {f.pid} is gone)")
    print(f"{verb} {len(found)} file(s), {sum(f.size for f in found) / 2**20:.1f} MiB")
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "cleanup",
        help="remove /dev/shm files left by ranks that died",
        description="Remove the shared-memory files (/dev/shm) of ranks whose process is gone; "
        "files of live processes are kept.",
    )
    p.add_argument("--dir", default=SHM_DIR, metavar="DIR", help="where to look (default: %(default)s)")
    p.add_argument(
        "--pid", type=int, action="append", metavar="PID", help="only files of this pid (repeatable)"
    )
    p.add_argument("--dry-run", action="store_true", help="list, do not remove")
    p.set_defaults(func=_run)
