"""moe-a2a: expert-parallel dispatch and combine over NVLink and RDMA."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import Any

from moe_a2a.process import keep_signal_dispositions

# Every import of the core comes through here: the libraries it loads may take
# the process's signal handlers, which stay the user's (moe_a2a.process).
with keep_signal_dispositions():
    from moe_a2a._core import CapacityError, FabricError, FabricTimeoutError, PeerFailedError, StaleGraphError

try:
    # pyproject.toml holds the version; the installed metadata carries it here.
    __version__ = version("moe-a2a")
except PackageNotFoundError:  # imported from a source tree that was never installed
    __version__ = "0+unknown"

__all__ = [
    "AllToAll",
    "CapacityError",
    "Config",
    "FabricError",
    "FabricTimeoutError",
    "PeerFailedError",
    "PeerLostError",
    "RejoinError",
    "Routing",
    "StaleGraphError",
    "__version__",
]


def __getattr__(name: str) -> Any:
    # AllToAll pulls in torch: load it on first use, so the CLI starts fast.
    if name in ("AllToAll", "Config", "Routing"):
        from moe_a2a import all_to_all

        return getattr(all_to_all, name)
    if name == "PeerLostError":
        from moe_a2a import masking

        return masking.PeerLostError
    if name == "RejoinError":
        from moe_a2a import rejoin

        return rejoin.RejoinError
    raise AttributeError(f"module 'moe_a2a' has no attribute {name!r}")
