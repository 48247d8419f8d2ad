"""MoE layers over the all-to-all: router, experts, shared expert, reference, presets.

Names are loaded on first use, so `moe-a2a --help` (which imports the `run` driver's
parser from this package) does not pay for importing torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "MoEShape": "presets",
    "PRESETS": "presets",
    "get_preset": "presets",
    "Router": "router",
    "route": "router",
    "node_limited": "router",
    "grouped_mm": "experts",
    "swiglu_experts": "experts",
    "dequantize": "experts",
    "MoEWeights": "weights",
    "random_weights": "weights",
    "shard_state_dict": "weights",
    "local_experts": "weights",
    "MoELayer": "moe",
    "reference_forward": "reference",
    "max_relative_error": "reference",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
