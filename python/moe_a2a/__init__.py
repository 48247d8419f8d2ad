"""moe-a2a: expert-parallel dispatch and combine over NVLink and RDMA."""

from moe_a2a._core import FabricError, FabricTimeoutError

__version__ = "0.1.0"

__all__ = ["FabricError", "FabricTimeoutError", "__version__"]
