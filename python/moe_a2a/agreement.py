"""Start-up agreement: every rank of an AllToAll must be built with the same settings.

Both ends of every write size and place rows from the configuration, so ranks
that differ corrupt memory, wait for writes that never come or try to allocate
absurd buffers. Comparing once at construction, before anything is sized,
turns that into one error, the same on every rank.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from moe_a2a import __version__
from moe_a2a.bootstrap import MISSING, Bootstrap, difference
from moe_a2a.fabric import default_provider


def all_to_all_settings(
    cfg: Any,
    device: str,
    provider: str,
    ranks_per_node: int,
    num_nics: int,
    graph_safe: bool,
    slice_bytes: int = 0,
) -> dict[str, Any]:
    """What must agree between the ranks of one AllToAll; `ranks_per_node` as laid out."""
    return {
        **dataclasses.asdict(cfg),
        "device": device,
        # "auto" is resolved from each rank's environment, which may differ.
        "provider": default_provider(provider),
        "ranks_per_node": ranks_per_node,
        "num_nics": num_nics,
        "graph_safe": graph_safe,
        # Both ends of a write cut a peer's rows into slices alike (MOE_A2A_SLICE_BYTES).
        "slice_bytes": slice_bytes,
        "version": __version__,
    }


def check_agreement(bootstrap: Bootstrap, settings: dict[str, Any]) -> None:
    """Collective: raise the same ValueError on every rank when any setting differs between ranks."""
    everyone = [json.loads(blob) for blob in bootstrap.allgather(json.dumps(settings).encode())]
    names = list(everyone[0]) + sorted({n for s in everyone for n in s} - set(everyone[0]))
    found = (difference(name, [s.get(name, MISSING) for s in everyone]) for name in names)
    differences = [d for d in found if d is not None]
    if differences:
        raise ValueError(
            "AllToAll: the ranks were given different settings (every rank must pass the same): "
            + "; ".join(differences)
        )
