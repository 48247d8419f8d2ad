"""`bench a2a`'s byte table: per fabric_rows mode, bytes per token across the fabric and within the node.

Every mode runs in the same job on the same tokens (one AllToAll each), so the
table compares them side by side:

- fabric / node B/token: `AllToAll.traffic()` summed over ranks and timed
  iterations (routing rows and wire rows with their tails; dispatch and
  combine), over the tokens sent;
- fabric rows/token: dispatch wire rows towards ranks of other nodes
  (`wire_rows`), against what the routing asks for: copies per token (a row
  per expert), distinct remote ranks per token (a row per rank), and the most
  distinct remote ranks one token reached with the bound the routing puts on
  it (`moe_a2a.bench.routing`);
- dispatch + combine p50 (us, bench/common's clock, the slowest rank) and the
  ratios of mode expert's fabric bytes and time over each mode's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from moe_a2a import report


@dataclass
class Tally:
    """One rank's counts for one mode, summed over the timed iterations."""

    fabric_bytes: int = 0
    node_bytes: int = 0
    fabric_rows: int = 0
    tokens: int = 0
    counts: dict[str, int] = field(default_factory=lambda: {"copies": 0, "ranks": 0, "ranks_max": 0})

    def add(self, a2a: Any, ids: np.ndarray, ranks_per_node: int) -> None:
        from moe_a2a.bench.routing import destinations

        t = a2a.traffic()  # [peer, path]: path 0 within the node, 1 across the fabric
        self.fabric_bytes += int(t[:, 1].sum())
        self.node_bytes += int(t[:, 0].sum())
        sent, _ = a2a._backend.wire_rows()
        me = a2a.rank // ranks_per_node
        self.fabric_rows += int(sum(int(n) for p, n in enumerate(sent) if p // ranks_per_node != me))
        self.tokens += len(ids)
        d = destinations(ids, a2a.cfg.num_experts, a2a.world_size, ranks_per_node, a2a.rank)
        self.counts["copies"] += int(d["copies"].sum())
        self.counts["ranks"] += int(d["ranks"].sum())
        self.counts["ranks_max"] = max(self.counts["ranks_max"], int(d["ranks"].max(initial=0)))

    def gathered(self, comm: Any) -> dict[str, float]:
        """Every rank's tallies together: sums (maxima for `ranks_max`)."""
        mine = [
            self.fabric_bytes,
            self.node_bytes,
            self.fabric_rows,
            self.tokens,
            self.counts["copies"],
            self.counts["ranks"],
        ]
        total = np.sum(comm.allgather(mine), axis=0)
        top = max(comm.allgather(self.counts["ranks_max"]))
        keys = ("fabric_bytes", "node_bytes", "fabric_rows", "tokens", "copies", "ranks")
        return {**dict(zip(keys, (int(v) for v in total), strict=True)), "ranks_max": top}


def rows_of(result: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per mode of a shape's result (`run_shape`'s `modes`)."""
    rows = []
    for mode, m in result["modes"].items():
        b, tokens = m["bytes"], max(1, m["bytes"]["tokens"])
        t = np.add(m["samples_ns"]["ours_dispatch"], m["samples_ns"]["ours_combine"])
        rows.append(
            {
                "shape": result["shape"],
                "fabric_rows": mode,
                "fabric_b_per_token": b["fabric_bytes"] / tokens,
                "node_b_per_token": b["node_bytes"] / tokens,
                "fabric_rows_per_token": b["fabric_rows"] / tokens,
                "copies_per_token": b["copies"] / tokens,
                "remote_ranks_per_token": b["ranks"] / tokens,
                "ranks_max": b["ranks_max"],
                "ranks_bound": result["bound"]["ranks"],
                "total_p50_us": report.percentiles_us(t)["p50"],
            }
        )
    ref = next((r for r in rows if r["fabric_rows"] == "expert"), None)
    for r in rows:  # no fabric bytes (one node): no ratio
        r["bytes_vs_expert"] = (
            None if ref is None else report.ratio(ref["fabric_b_per_token"], r["fabric_b_per_token"])
        )
        r["time_vs_expert"] = None if ref is None else report.ratio(ref["total_p50_us"], r["total_p50_us"])
    return rows


COLUMNS = (
    ("shape", "shape"),
    ("fabric_rows", "fabric_rows"),
    ("fabric_b_per_token", "fabric B/token"),
    ("node_b_per_token", "node B/token"),
    ("fabric_rows_per_token", "fabric rows/token"),
    ("copies_per_token", "remote copies/token"),
    ("remote_ranks_per_token", "remote ranks/token"),
    ("ranks_max", "max remote ranks"),
    ("ranks_bound", "bound on ranks"),
    ("total_p50_us", "dispatch+combine p50 (us)"),
    ("bytes_vs_expert", "expert/this bytes"),
    ("time_vs_expert", "expert/this time"),
)
NOTE = (
    "bytes per token from AllToAll.traffic() (routing rows and wire rows with tails, dispatch and combine), "
    "over every rank's tokens; rows/copies/ranks count destinations on other nodes; "
    "bound on ranks: the most distinct ranks (own node included) the routing lets one token reach; "
    "expert/this = mode expert's figure over this mode's"
)


def format_table(rows: list[dict[str, Any]]) -> str:
    return report.columns_table(
        COLUMNS, rows, formats={"ranks_max": "d", "ranks_bound": "d", "total_p50_us": ".0f"}, default=".2f"
    )
