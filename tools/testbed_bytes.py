"""Fabric bytes per token on the testbed: interface counters against AllToAll.traffic().

    python tools/testbed_bytes.py --hosts 4 --ranks-per-host 2 --rate 100mbit --tokens 512

brings up `tools/testbed.py` hosts (NICs va1, va2 rate-limited with tbf where
--rate is given), starts every rank inside its host, and runs a prefill-like
step (DeepSeek-V3 group-limited routing, scaled) with one AllToAll per
(--ranks-per-node, --fabric-rows) case, all built in the same job and fed the
same tokens. For each case it reads the hosts' NIC byte counters (va1 + va2,
tx, inside each namespace) around the timed steps and prints, per token:

- nic: the bytes the NICs sent (real bytes: TCP/IP headers, acks, libfabric's
  own headers and all);
- traffic: what `AllToAll.traffic()` counts towards ranks of other hosts (routing
  rows, wire rows with their tails), and nic/traffic;
- the bounds: one row per token per distinct remote destination rank (and node),
  dispatch and combine payload together (hidden x dtype, fp8 scales; no tails,
  no routing rows), and nic over each;
- copies per token to other hosts: per expert, distinct ranks, distinct nodes,
  and the most distinct ranks/nodes any token reached against the routing's bound;
- dispatch + combine time per step (p50 of the slowest rank, bench/common's clock)
  and the ratios of mode expert's bytes and time over each case's.

`--ranks-per-node 1` makes every peer remote to the library, also the rank on
the same host (reached over tcp through the host's loopback, which no NIC
counts); `--ranks-per-node R` (the host's ranks) puts a host's ranks on one node
(shared memory). Only traffic towards other hosts crosses a NIC, so that is
what the counters are compared with. tests/testbed/test_fabric_bytes.py runs
this small; docs/testbed.md and docs/benchmarks.md say more.

Run as `rank` (inside a host, by the tool itself): `testbed_bytes.py rank OUT.json JSON_ARGS`.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import testbed  # noqa: E402

NICS = ("va1", "va2")
TIMEOUT_S = 300.0


# -- one rank (inside a host) ------------------------------------------------------------------


def _nic_bytes() -> dict[str, int]:
    """This host's NICs' tx and rx bytes (sysfs as `ip netns exec` mounts it: the namespace's)."""
    out = {}
    for way in ("tx", "rx"):
        out[way] = sum(int(Path(f"/sys/class/net/{n}/statistics/{way}_bytes").read_text()) for n in NICS)
    return out


def _payload_bytes(hidden: int, dispatch_dtype: str) -> int:
    """One token's dispatch row and combine row (bf16) without tails: what a row must carry."""
    dispatch = hidden + 4 * -(-hidden // 128) if dispatch_dtype == "fp8" else 2 * hidden
    return dispatch + 2 * hidden


def rank_main(out: str, a: dict[str, Any]) -> int:
    import os

    import torch
    import torch.distributed as dist

    from moe_a2a.all_to_all import AllToAll, Config
    from moe_a2a.bench.common import elapsed_ns
    from moe_a2a.bench.routing import Routing, destinations

    dist.init_process_group("gloo", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(list(range(world)), backend="gloo")
    rph = int(os.environ["LOCAL_WORLD_SIZE"])
    torch.set_num_threads(1)
    routing = Routing(a["num_experts"], a["topk"], a["num_groups"], a["topk_groups"])
    cases = [(rpn, mode) for rpn in a["ranks_per_node"] for mode in a["fabric_rows"]]
    a2as = {}
    for rpn, mode in cases:
        cfg = Config(
            max_tokens=a["tokens"],
            hidden=a["hidden"],
            num_experts=a["num_experts"],
            topk=a["topk"],
            dispatch_dtype=a["dispatch_dtype"],
            combine_dtype="bf16",
            timeout_s=TIMEOUT_S,
            fabric_rows=mode,
        )
        a2as[rpn, mode] = AllToAll(
            cfg, comm=group, device="cpu", provider="tcp", ranks_per_node=rpn, num_nics=len(NICS)
        )
    steps = a["steps"]
    inputs = []
    for step in range(steps + 1):  # step 0: untimed (connections, first-touch pages)
        ids, w = routing.ids_weights(a["seed"] + step, rank, a["tokens"])
        g = torch.Generator().manual_seed(a["seed"] * 1000 + step * 64 + rank)
        inputs.append((torch.randn(a["tokens"], a["hidden"], generator=g).to(torch.bfloat16), ids, w))
    other_host = [p // rph != rank // rph for p in range(world)]
    report: dict[str, Any] = {"rank": rank, "host_leader": rank % rph == 0, "cases": []}
    outputs: dict[str, torch.Tensor] = {}
    for rpn, mode in cases:
        a2a = a2as[rpn, mode]
        seconds, traffic, nic = [], np.zeros(2, dtype=np.int64), {}
        for step, (x, ids, w) in enumerate(inputs):
            if step == 1:
                dist.barrier(group)
                nic = _nic_bytes()
            dist.barrier(group)

            def run(x: torch.Tensor = x, ids: torch.Tensor = ids, w: torch.Tensor = w, a2a: Any = a2a) -> Any:
                d = a2a.dispatch(x, ids, w)
                return a2a.combine(d.expert_x.to(torch.bfloat16), d)

            y, ns = elapsed_ns(run)
            slowest = torch.tensor([ns], dtype=torch.float64)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
            if step == 0:
                outputs.setdefault(str(rpn), y)  # every mode computes the same sums (to rounding)
                torch.testing.assert_close(y.float(), outputs[str(rpn)].float(), rtol=2e-2, atol=2e-2)
                continue
            seconds.append(float(slowest) / 1e9)
            t = a2a.traffic()  # [peer, path]: bytes this rank sent (path 1: the fabric)
            traffic += [int(t[other_host, :].sum()), int(t[~np.array(other_host), 1].sum())]
        dist.barrier(group)
        after = _nic_bytes()
        dests = [destinations(ids.numpy(), a["num_experts"], world, rph, rank) for _, ids, _ in inputs[1:]]
        report["cases"].append(
            {
                "ranks_per_node": rpn,
                "fabric_rows": mode,
                "seconds": seconds,
                "tokens": a["tokens"] * steps,
                "traffic_other_hosts": int(traffic[0]),
                "traffic_same_host_fabric": int(traffic[1]),
                "nic_tx": after["tx"] - nic["tx"],
                "nic_rx": after["rx"] - nic["rx"],
                **{f"{k}_sum": int(sum(d[k].sum() for d in dests)) for k in ("copies", "ranks", "nodes")},
                **{f"{k}_max": int(max(d[k].max(initial=0) for d in dests)) for k in ("ranks", "nodes")},
            }
        )
    for a2a in a2as.values():
        a2a.close()
    with open(out, "w") as f:
        json.dump(report, f)
    dist.barrier(group)
    dist.destroy_process_group()
    return 0


# -- the driver (outside the hosts) ------------------------------------------------------------


def run(a: dict[str, Any], tmp: Path) -> list[dict[str, Any]]:
    """Bring the testbed up, run every rank, tear it down; returns one summary per case."""
    from moe_a2a.bench.routing import Routing

    routing = Routing(a["num_experts"], a["topk"], a["num_groups"], a["topk_groups"])
    with testbed.Testbed(a["hosts"], rate=a["rate"], ranks_per_host=a["ranks_per_host"]) as bed:
        world = bed.ranks
        procs, logs = [], []
        for r in range(world):
            log = open(tmp / f"rank{r}.log", "w")  # noqa: SIM115 (closed below)
            logs.append(log)
            argv = [sys.executable, __file__, "rank", str(tmp / f"rank{r}.json"), json.dumps(a)]
            env = bed.rank_env(r, world, {"MOE_A2A_NICS": ",".join(NICS), "OMP_NUM_THREADS": "1"})
            procs.append(bed.popen(bed.host_of(r), argv, env, stdout=log, stderr=subprocess.STDOUT))
        try:
            codes = [p.wait(timeout=a["run_s"]) for p in procs]
        except subprocess.TimeoutExpired:
            codes = [None] * world
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
            for log in logs:
                log.close()
    if codes != [0] * world:
        text = "\n".join(f"--- rank {r}\n" + (tmp / f"rank{r}.log").read_text()[-2000:] for r in range(world))
        raise RuntimeError(f"testbed_bytes: exit codes {codes} (None: past {a['run_s']} s)\n{text}")
    ranks = [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(world)]
    payload = _payload_bytes(a["hidden"], a["dispatch_dtype"])
    summaries = []
    for i, case in enumerate(ranks[0]["cases"]):
        per = [r["cases"][i] for r in ranks]
        leaders = [r["cases"][i] for r in ranks if r["host_leader"]]
        tokens = sum(c["tokens"] for c in per)
        bound = routing.bound(world, case["ranks_per_node"])
        s = {
            "ranks_per_node": case["ranks_per_node"],
            "fabric_rows": case["fabric_rows"],
            "tokens": tokens,
            "nic": sum(c["nic_tx"] for c in leaders) / tokens,
            "nic_rx": sum(c["nic_rx"] for c in leaders) / tokens,
            "traffic": sum(c["traffic_other_hosts"] for c in per) / tokens,
            "per_rank_rows": payload * sum(c["ranks_sum"] for c in per) / tokens,
            "per_node_rows": payload * sum(c["nodes_sum"] for c in per) / tokens,
            "copies": sum(c["copies_sum"] for c in per) / tokens,
            "ranks": sum(c["ranks_sum"] for c in per) / tokens,
            "nodes": sum(c["nodes_sum"] for c in per) / tokens,
            "ranks_max": max(c["ranks_max"] for c in per),
            "nodes_max": max(c["nodes_max"] for c in per),
            "ranks_bound": bound["ranks"],
            "nodes_bound": routing.bound(world, a["ranks_per_host"])["nodes"],
            "seconds_p50": float(np.median(per[0]["seconds"])),
        }
        s["nic_traffic"] = s["nic"] / s["traffic"] if s["traffic"] else None
        s["nic_per_rank"] = s["nic"] / s["per_rank_rows"] if s["per_rank_rows"] else None
        s["nic_per_node"] = s["nic"] / s["per_node_rows"] if s["per_node_rows"] else None
        summaries.append(s)
    for s in summaries:  # ratios against mode expert at the same ranks_per_node
        ref = next(
            (
                e
                for e in summaries
                if e["fabric_rows"] == "expert" and e["ranks_per_node"] == s["ranks_per_node"]
            ),
            None,
        )
        s["bytes_vs_expert"] = ref["nic"] / s["nic"] if ref and s["nic"] else None
        s["time_vs_expert"] = ref["seconds_p50"] / s["seconds_p50"] if ref else None
    return summaries


COLUMNS = (
    ("ranks_per_node", "ranks/node"),
    ("fabric_rows", "fabric_rows"),
    ("nic", "NIC B/token"),
    ("traffic", "traffic() B/token"),
    ("nic_traffic", "NIC/traffic()"),
    ("per_rank_rows", "1 row/remote rank B/token"),
    ("nic_per_rank", "NIC/per-rank rows"),
    ("nic_per_node", "NIC/per-node rows"),
    ("copies", "copies/token"),
    ("ranks", "remote ranks/token"),
    ("ranks_max", "max ranks"),
    ("ranks_bound", "bound ranks"),
    ("nodes", "remote nodes/token"),
    ("nodes_bound", "bound nodes"),
    ("seconds_p50", "dispatch+combine p50 (s)"),
    ("bytes_vs_expert", "expert/this bytes"),
    ("time_vs_expert", "expert/this time"),
)


def format_table(summaries: list[dict[str, Any]]) -> str:
    from moe_a2a import report

    return report.columns_table(COLUMNS, summaries, formats={"seconds_p50": ".3f"}, default=".2f")


def _list(kind: type) -> Any:
    def parse(text: str) -> list[Any]:
        return [kind(v) for v in text.split(",") if v]

    return parse


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="testbed_bytes.py",
        description="NIC byte counters against AllToAll.traffic() and dispatch + combine time, per "
        "fabric_rows mode, on emulated hosts (tools/testbed.py; needs root).",
        epilog="example: testbed_bytes.py --hosts 4 --ranks-per-host 2 --rate 100mbit --tokens 512",
    )
    p.add_argument("--hosts", type=int, default=4, help="emulated hosts (default: %(default)s)")
    p.add_argument("--ranks-per-host", type=int, default=2, help="ranks per host (default: %(default)s)")
    p.add_argument("--rate", default=None, help="tbf rate of each NIC's egress, e.g. 100mbit (default: none)")
    p.add_argument("--tokens", type=int, default=512, help="tokens per rank and step (default: %(default)s)")
    p.add_argument("--hidden", type=int, default=2048, help="hidden size (default: %(default)s)")
    p.add_argument("--num-experts", type=int, default=64, help="routed experts (default: %(default)s)")
    p.add_argument("--topk", type=int, default=8, help="experts per token (default: %(default)s)")
    p.add_argument("--num-groups", type=int, default=8, help="expert groups (default: %(default)s)")
    p.add_argument(
        "--topk-groups", type=int, default=4, help="groups a token picks in (default: %(default)s)"
    )
    p.add_argument("--dispatch-dtype", choices=["fp8", "bf16"], default="fp8", help="(default: %(default)s)")
    p.add_argument(
        "--fabric-rows",
        type=_list(str),
        default=["expert", "rank"],
        help="modes, comma-separated (default: expert,rank)",
    )
    p.add_argument(
        "--ranks-per-node",
        type=_list(int),
        default=None,
        help="AllToAll ranks_per_node values, comma-separated (default: ranks per host, then 1)",
    )
    p.add_argument(
        "--steps", type=int, default=3, help="timed steps after one untimed (default: %(default)s)"
    )
    p.add_argument("--seed", type=int, default=1, help="(default: %(default)s)")
    p.add_argument(
        "--run-s", type=float, default=600.0, help="give up after this long (default: %(default)s)"
    )
    p.add_argument("--output", help="write the summaries as JSON here")
    return p


def main(argv: list[str]) -> int:
    if argv[1:2] == ["rank"]:
        return rank_main(argv[2], json.loads(argv[3]))
    args = build_parser().parse_args(argv[1:])
    why = testbed.unavailable()
    if why is not None:
        print(f"testbed_bytes.py: the testbed cannot run here: {why}", file=sys.stderr)
        return 1
    a = {k: v for k, v in vars(args).items() if k != "output"}
    a["ranks_per_node"] = args.ranks_per_node or sorted({args.ranks_per_host, 1}, reverse=True)
    with tempfile.TemporaryDirectory(prefix="testbed-bytes-") as tmp:
        summaries = run(a, Path(tmp))
    print(
        f"testbed: {args.hosts} hosts x {args.ranks_per_host} ranks, NICs {','.join(NICS)} at "
        f"{args.rate or 'no limit'}; {args.tokens} tokens/rank, hidden {args.hidden}, {args.dispatch_dtype} "
        f"dispatch, bf16 combine; {args.num_experts} experts, top-{args.topk} within {args.topk_groups} "
        f"of {args.num_groups} groups; {args.steps} timed steps"
    )
    print(format_table(summaries))
    if args.output:
        Path(args.output).write_text(json.dumps({"args": a, "cases": summaries}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
