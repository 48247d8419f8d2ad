"""How the library shares its process with the user (docs/process.md, "Signals" and "Forked children").

Signal dispositions stay the user's. Loading `_core` loads libfabric and the
libraries it links, whose constructors may install handlers: Debian's
libfabric links psm's library, which takes SIGINT, SIGTERM, SIGSEGV, SIGBUS,
SIGILL and SIGABRT with a backtrace handler that exits with status 1.
`keep_signal_dispositions` puts back every disposition that changed while
`_core` loaded; the core does the same around the calls that start libfabric
and its providers (src/bindings/keep_signals.h), which may load and start later.

An instance belongs to the process that created it. A forked child shares its
workspaces and endpoint files with the parent, but has none of its threads:
its calls are refused (`check_not_forked`), and what the child inherited is
kept alive until the child exits, so that no destructor in the child joins a
thread the child does not have or closes an endpoint or workspace the parent
still uses.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import weakref
from collections.abc import Iterator
from typing import Any

# More than struct sigaction takes on any Linux ABI; it starts with the handler
# on the ABIs the project builds for (x86_64, aarch64), which is what we compare.
_SIGACTION_BYTES = 512
_HANDLER_BYTES = ctypes.sizeof(ctypes.c_void_p)


def _sigaction() -> Any:
    try:
        fn = ctypes.CDLL(None, use_errno=True).sigaction
    except (OSError, AttributeError):  # no C library to ask: nothing can be kept
        return None
    fn.argtypes = (ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)
    fn.restype = ctypes.c_int
    return fn


@contextlib.contextmanager
def keep_signal_dispositions() -> Iterator[None]:
    """Put back, on the way out, every signal disposition the block changed."""
    sigaction = _sigaction()
    saved: dict[int, ctypes.Array[ctypes.c_char]] = {}
    if sigaction is not None:
        for signum in range(1, signal.NSIG):
            buf = ctypes.create_string_buffer(_SIGACTION_BYTES)
            if sigaction(signum, None, buf) == 0:
                saved[signum] = buf
    try:
        yield
    finally:
        for signum, before in saved.items():
            now = ctypes.create_string_buffer(_SIGACTION_BYTES)
            if sigaction(signum, None, now) == 0 and now.raw[:_HANDLER_BYTES] != before.raw[:_HANDLER_BYTES]:
                sigaction(signum, before, None)


# Objects whose native state a forked child must never release (AllToAll instances).
_owned: weakref.WeakSet[Any] = weakref.WeakSet()


def adopt(obj: Any) -> int:
    """Register `obj` as owning native state of this process; returns this process's id."""
    _owned.add(obj)
    return os.getpid()


def in_forked_child(pid: int) -> bool:
    """True in a process forked from `pid` (the creator's id, as `adopt` returned it)."""
    return os.getpid() != pid


def check_not_forked(what: str, pid: int) -> None:
    if in_forked_child(pid):
        raise RuntimeError(
            f"{what} was created in process {pid}; not usable in a forked child (this is process "
            f"{os.getpid()}): create it in the process that uses it"
        )


def _keep_inherited() -> None:
    """In a forked child: one more reference, never dropped, to everything the parent owned."""
    keep: list[Any] = list(_owned)
    fabric = sys.modules.get("moe_a2a.fabric")
    if fabric is not None:
        keep.extend(fabric._shared.values())  # engines, and regions retired but not yet released
    for obj in keep:
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))


os.register_at_fork(after_in_child=_keep_inherited)


class ProcessBound:
    """An instance tied to its process's connections (`AllToAll`, `ExpertParallel`).

    A copy of a model that holds one (an EMA or reference model made with
    `copy.deepcopy`) shares it, as a copied `DeviceMesh` shares its process groups:
    making another is a collective call of every rank, and layers may share one.
    Pickling is refused: another process has none of these connections."""

    def __copy__(self) -> Any:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        return self

    def __reduce__(self) -> Any:
        raise TypeError(
            f"{type(self).__name__} cannot be pickled: it holds this process's connections to its "
            "peers; construct one in each process that calls it (a deep copy shares it)"
        )
