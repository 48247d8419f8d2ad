"""moe-a2a: expert-parallel dispatch and combine over NVLink and RDMA."""

from __future__ import annotations

from typing import Any

from moe_a2a._core import CapacityError, FabricError, FabricTimeoutError

__version__ = "0.1.0"

__all__ = ["AllToAll", "CapacityError", "Config", "FabricError", "FabricTimeoutError", "__version__"]


def __getattr__(name: str) -> Any:
    # AllToAll pulls in torch: load it on first use, so the CLI starts fast.
    if name in ("AllToAll", "Config"):
        from moe_a2a import all_to_all

        return getattr(all_to_all, name)
    raise AttributeError(f"module 'moe_a2a' has no attribute {name!r}")
