"""`moe-a2a trace summary|plot|compare`: read HDF5 run traces (docs/trace-format.md).

numpy, h5py and matplotlib are imported inside the commands so that building
the `moe-a2a` parser stays instant. matplotlib is optional (`pip install
'moe-a2a[plot]'`): only `plot` needs it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from moe_a2a.trace import RunTrace

#: Pseudo-phase of the summaries: a rank's first phase start to its last phase end in one iteration.
TOTAL = "total"
QUANTILES = (50, 90, 99)


# --------------------------------------------------------------------------- parser


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add `trace` with sub-commands summary, plot and compare to the `moe-a2a` sub-parsers."""
    trace = subparsers.add_parser(
        "trace",
        help="summarise, plot and compare HDF5 run traces",
        description="Summarise, plot and compare HDF5 run traces written by `moe-a2a run`.",
    )
    sub = trace.add_subparsers(dest="trace_command", required=True)

    warmup = argparse.ArgumentParser(add_help=False)
    warmup.add_argument(
        "--warmup", type=int, default=0, metavar="N", help="leave out the first N iterations (default 0)"
    )

    summary = sub.add_parser(
        "summary",
        parents=[warmup],
        help="p50/p90/p99 per phase, overall and per rank",
        description="Percentiles (p50, p90, p99) of each phase's duration in microseconds, over all "
        "ranks and iterations and per rank.",
    )
    summary.add_argument("file", metavar="FILE", help="trace file (.h5)")
    summary.add_argument("--json", action="store_true", help="print JSON instead of tables")
    summary.set_defaults(func=_cmd_summary)

    plot = sub.add_parser(
        "plot",
        parents=[warmup],
        help="PNG plots: timeline, latency, bytes heat map, tokens per expert",
        description="Write timeline.png, latency.png, bytes_heatmap.png and tokens_per_expert.png.",
    )
    plot.add_argument("file", metavar="FILE", help="trace file (.h5)")
    plot.add_argument("-o", "--output", required=True, metavar="DIR", help="directory for the PNG files")
    plot.add_argument(
        "--iteration",
        type=int,
        default=None,
        metavar="N",
        help="iteration of the timeline (default: the one of median duration)",
    )
    plot.set_defaults(func=_cmd_plot)

    compare = sub.add_parser(
        "compare",
        parents=[warmup],
        help="two runs side by side with ratios A/B",
        description="p50 and p99 of each phase for runs A (the baseline) and B, and the ratios "
        "A/B (A's time over B's: above 1, B is faster).",
    )
    compare.add_argument("a", metavar="A", help="baseline trace file")
    compare.add_argument("b", metavar="B", help="trace file compared with A")
    compare.add_argument("--json", action="store_true", help="print JSON instead of a table")
    compare.set_defaults(func=_cmd_compare)
    return trace


def main(argv: Sequence[str] | None = None) -> int:
    """Stand-alone entry point: `python -m moe_a2a.trace_tools summary FILE`."""
    from moe_a2a.usage import Parser

    parser = Parser(prog="moe-a2a")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["trace", *(sys.argv[1:] if argv is None else argv)])
    return int(args.func(args) or 0)


def _guard(name: str, body: Callable[[], int]) -> int:
    """Run a command; user errors become one line on stderr and exit status 1, not a traceback."""
    try:
        return body()
    except BrokenPipeError:
        raise  # the reader of stdout left (`| head`): moe_a2a.cli ends quietly
    except (OSError, ValueError) as exc:  # FileNotFoundError and TraceFormatError included
        print(f"moe-a2a trace {name}: error: {exc}", file=sys.stderr)
        return 1


def _load(path: str, warmup: int) -> RunTrace:
    from moe_a2a.trace import read_trace

    trace = read_trace(path)
    return skip_iterations(trace, warmup, path)


def skip_iterations(trace: RunTrace, n: int, path: str = "trace") -> RunTrace:
    """The trace without its first `n` iterations (warm-up)."""
    from moe_a2a.trace import RunTrace

    if n == 0:
        return trace
    if not 0 < n < trace.num_iters:
        raise ValueError(
            f"--warmup {n}: {path} has {trace.num_iters} iterations, expected 0 <= N < {trace.num_iters}"
        )
    return RunTrace(
        config=trace.config,
        environment=trace.environment,
        hosts=trace.hosts,
        start_ns=trace.start_ns[:, n:],
        end_ns=trace.end_ns[:, n:],
        tokens_per_expert=trace.tokens_per_expert[n:],
        bytes_per_peer=trace.bytes_per_peer[:, n:],
        phases=trace.phases,
    )


# --------------------------------------------------------------------------- summary


def summarize(trace: RunTrace) -> dict[str, Any]:
    """Percentiles per phase (and `total`) in microseconds, overall and per rank; JSON-ready."""
    from moe_a2a.report import percentiles_us

    durations = trace.durations_ns()  # [ranks, iters, phases]
    total = trace.total_ns()  # [ranks, iters]
    names = [*trace.phases, TOTAL]

    def stats(d: Any, t: Any) -> dict[str, Any]:
        out = {p: percentiles_us(d[..., i], QUANTILES) for i, p in enumerate(trace.phases)}
        out[TOTAL] = percentiles_us(t, QUANTILES)
        return out

    return {
        "units": "us",
        "phases": names,
        "num_ranks": trace.num_ranks,
        "num_iters": trace.num_iters,
        "num_experts": trace.num_experts,
        "hosts": trace.hosts,
        "config": trace.config,
        "overall": stats(durations, total),
        "per_rank": [
            {"rank": r, "host": trace.hosts[r], "phases": stats(durations[r], total[r])}
            for r in range(trace.num_ranks)
        ],
    }


def _config_line(config: dict[str, Any]) -> str:
    scalars = [f"{k}={v}" for k, v in config.items() if isinstance(v, (str, int, float, bool)) or v is None]
    return "config: " + (" ".join(scalars) if scalars else "(none)")


def format_summary(summary: dict[str, Any], path: str) -> str:
    """The summary as text: a header, the overall table, then one block per rank."""
    from moe_a2a.report import table

    q = [f"p{x}" for x in QUANTILES]
    nhosts = len(set(summary["hosts"]))
    out = [
        f"trace: {path}",
        f"{summary['num_ranks']} ranks on {nhosts} host{'s' if nhosts != 1 else ''}, "
        f"{summary['num_iters']} iterations, {summary['num_experts']} experts",
        _config_line(summary["config"]),
        f"durations in microseconds; '{TOTAL}' = first phase start to last phase end of a rank's iteration",
        "",
        "overall (all ranks and iterations)",
    ]
    rows = []
    for p in summary["phases"]:
        s = summary["overall"][p]
        rows.append([p, s["n"], *(s[k] for k in q), s["max"]])
    out.append(table(["phase", "n", *(f"{k} (us)" for k in q), "max (us)"], rows))
    out += ["", "per rank"]
    rows = []
    for entry in summary["per_rank"]:
        for i, p in enumerate(summary["phases"]):
            s = entry["phases"][p]
            lead = [entry["rank"], entry["host"]] if i == 0 else [None, None]
            rows.append([*lead, p, s["n"], *(s[k] for k in q)])
    out.append(table(["rank", "host", "phase", "n", *(f"{k} (us)" for k in q)], rows))
    return "\n".join(out)


def _cmd_summary(args: argparse.Namespace) -> int:
    def body() -> int:
        summary = summarize(_load(args.file, args.warmup))
        if args.json:
            print(json.dumps({"file": args.file, "warmup": args.warmup, **summary}, indent=2))
        else:
            print(format_summary(summary, args.file))
        return 0

    return _guard("summary", body)


# --------------------------------------------------------------------------- compare


def compare(a: RunTrace, b: RunTrace) -> dict[str, Any]:
    """p50 and p99 of every phase of A (the baseline) and B (overall), with ratios A/B; JSON-ready."""
    from moe_a2a.report import ratio

    sa, sb = summarize(a)["overall"], summarize(b)["overall"]
    names = [*a.phases, *(p for p in b.phases if p not in a.phases)]
    names = [p for p in names if p != TOTAL] + [TOTAL]
    rows = {}
    for p in names:
        pa, pb = sa.get(p, {}), sb.get(p, {})
        row: dict[str, Any] = {}
        for k in ("p50", "p99"):
            row[f"a_{k}"], row[f"b_{k}"] = pa.get(k), pb.get(k)
            row[f"ratio_{k}"] = ratio(pa.get(k), pb.get(k))  # A/B: above 1, B is faster
        rows[p] = row
    keys = sorted(set(a.config) | set(b.config))
    differ = {k: [a.config.get(k), b.config.get(k)] for k in keys if a.config.get(k) != b.config.get(k)}
    return {"units": "us", "phases": rows, "config_differences": differ}


def format_compare(result: dict[str, Any], path_a: str, path_b: str) -> str:
    """The comparison as a table, A the baseline: the ratio reads as `run` and `bench` ratios do."""
    from moe_a2a.report import table

    out = [f"A (baseline): {path_a}", f"B: {path_b}"]
    for k, (va, vb) in result["config_differences"].items():
        out.append(f"config {k}: A={va} B={vb}")
    out.append("durations in microseconds, all ranks and iterations")
    out.append("")
    keys = ("a_p50", "b_p50", "ratio_p50", "a_p99", "b_p99", "ratio_p99")
    rows = [[p, *(r[k] for k in keys)] for p, r in result["phases"].items()]
    head = ["phase", "A p50 (us)", "B p50 (us)", "A/B p50", "A p99 (us)", "B p99 (us)", "A/B p99"]
    out.append(table(head, rows, [".1f", ".1f", ".1f", ".2f", ".1f", ".1f", ".2f"]))
    out.append("(A/B = A's time / B's time: above 1, B is faster)")
    return "\n".join(out)


def _cmd_compare(args: argparse.Namespace) -> int:
    def body() -> int:
        result = compare(_load(args.a, args.warmup), _load(args.b, args.warmup))
        if args.json:
            print(json.dumps({"a": args.a, "b": args.b, "warmup": args.warmup, **result}, indent=2))
        else:
            print(format_compare(result, args.a, args.b))
        return 0

    return _guard("compare", body)


# --------------------------------------------------------------------------- plots

PLOT_FILES = ("timeline.png", "latency.png", "bytes_heatmap.png", "tokens_per_expert.png")
_DPI = 110


def _byte_unit(value: float) -> tuple[float, str]:
    for scale, unit in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if value >= scale:
            return float(scale), unit
    return 1.0, "B"


def _human_bytes(value: float) -> str:
    scale, unit = _byte_unit(value)
    return f"{value / scale:.3g} {unit}"


def _plot_timeline(trace: RunTrace, iteration: int, path: str, median: bool = False) -> None:
    import numpy as np
    from matplotlib.figure import Figure

    start, end = trace.aligned_ns()
    s, e = start[:, iteration] / 1e3, end[:, iteration] / 1e3  # [ranks, phases], us
    fig = Figure(figsize=(10, 1.6 + 0.32 * trace.num_ranks), layout="constrained")
    ax = fig.add_subplot()
    colors = [f"C{i % 10}" for i in range(len(trace.phases))]
    for i, p in enumerate(trace.phases):
        bars = [(r, s[r, i], e[r, i] - s[r, i]) for r in range(trace.num_ranks) if np.isfinite(s[r, i])]
        for r, x, w in bars:
            ax.broken_barh([(x, w)], (r - 0.4, 0.8), facecolors=colors[i], edgecolor="black", linewidth=0.3)
        ax.bar(0, 0, color=colors[i], label=p)  # legend entry even for a phase absent on every rank
    ax.set_yticks(range(trace.num_ranks), [f"rank {r} ({h})" for r, h in enumerate(trace.hosts)])
    ax.set_ylim(trace.num_ranks - 0.5, -0.5)  # rank 0 at the top
    ax.set_xlabel("time since the iteration's earliest start over all ranks (µs)")
    title = f"timeline of iteration {iteration} (of 0-{trace.num_iters - 1})"
    if median:
        title += ", the one of median duration"
    if len(set(trace.hosts)) > 1:
        title += "\n(clocks of different hosts are not synchronised: cross-host offsets are approximate)"
    ax.set_title(title)
    ax.grid(axis="x", alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), title="phase", fontsize="small")
    fig.savefig(path, dpi=_DPI)


def _plot_latency(trace: RunTrace, path: str) -> None:
    import numpy as np
    from matplotlib.figure import Figure

    d = trace.durations_ns() / 1e3
    series = {p: d[..., i].ravel() for i, p in enumerate(trace.phases)}
    series[TOTAL] = trace.total_ns().ravel() / 1e3
    series = {p: v[np.isfinite(v)] for p, v in series.items()}
    shown = {p: v for p, v in series.items() if v.size}  # a phase never recorded has no box
    fig = Figure(figsize=(max(6.0, 1.2 * len(shown) + 2), 4.8), layout="constrained")
    ax = fig.add_subplot()
    if shown:
        ax.boxplot(
            list(shown.values()),
            whis=(1, 99),
            flierprops={"markersize": 2, "alpha": 0.5},
            medianprops={"color": "C3"},
        )
        ax.set_xticks(range(1, len(shown) + 1), list(shown), rotation=20, ha="right")
        lo = min(float(v.min()) for v in shown.values())
        hi = max(float(v.max()) for v in shown.values())
        if lo > 0 and hi / lo > 50:  # phases span orders of magnitude: a linear axis hides the short ones
            ax.set_yscale("log")
    ax.set_ylabel("duration (µs)")
    absent = [p for p in series if p not in shown]
    title = (
        f"phase durations, {trace.num_ranks} ranks x {trace.num_iters} iterations "
        "(box p25-p75, whiskers p1-p99)"
    )
    if absent:
        title += f"\nnot recorded: {', '.join(absent)}"
    ax.set_title(title, fontsize="medium")
    ax.grid(axis="y", alpha=0.3, which="both")
    fig.savefig(path, dpi=_DPI)


def _plot_bytes(trace: RunTrace, path: str) -> None:
    from matplotlib.figure import Figure

    from moe_a2a.trace import PATHS

    per_path = trace.bytes_per_peer.sum(axis=1)  # [sender, receiver, path]
    total = per_path.sum(axis=2).astype(float)
    scale, unit = _byte_unit(float(total.max()))
    n = trace.num_ranks
    fig = Figure(figsize=(2.5 + 0.55 * max(n, 4), 1.8 + 0.5 * max(n, 4)), layout="constrained")
    ax = fig.add_subplot()
    im = ax.imshow(total / scale, cmap="viridis", vmin=0)
    fig.colorbar(im, ax=ax, label=f"bytes sent ({unit}), all iterations and paths")
    if n <= 16:  # beyond that the numbers no longer fit the cells
        vmax = float(total.max()) or 1.0
        for r in range(n):
            for c in range(n):
                v = total[r, c]
                ax.text(c, r, f"{v / scale:.3g}", ha="center", va="center", fontsize="small",
                        color="black" if v > 0.6 * vmax else "white")  # fmt: skip
    rpn = trace.config.get("ranks_per_node")
    if isinstance(rpn, int) and 0 < rpn < n and n % rpn == 0:
        for k in range(rpn, n, rpn):  # node boundaries: off-diagonal blocks go over the fabric
            ax.axhline(k - 0.5, color="red", linewidth=1)
            ax.axvline(k - 0.5, color="red", linewidth=1)
    ticks = range(n) if n <= 32 else range(0, n, max(1, n // 16))
    ax.set_xticks(ticks)
    ax.set_yticks(ticks)
    ax.set_xlabel("receiver rank")
    ax.set_ylabel("sender rank")
    sums = per_path.sum(axis=(0, 1))
    parts = ", ".join(f"{p.replace('_', ' ')} {_human_bytes(float(sums[i]))}" for i, p in enumerate(PATHS))
    ax.set_title(f"bytes between ranks over {trace.num_iters} iterations\n{parts}", fontsize="medium")
    fig.savefig(path, dpi=_DPI)


def _plot_tokens(trace: RunTrace, path: str) -> None:
    import numpy as np
    from matplotlib.figure import Figure

    tok = trace.tokens_per_expert.astype(float)  # [iters, experts]
    mean, lo, hi = tok.mean(axis=0), tok.min(axis=0), tok.max(axis=0)
    e, n = trace.num_experts, trace.num_ranks
    x = np.arange(e)
    fig = Figure(figsize=(min(16.0, 4 + 0.12 * e), 4.5), layout="constrained")
    ax = fig.add_subplot()
    if e % n == 0:  # contiguous blocks: rank r hosts experts [r*E/N, (r+1)*E/N)
        owner = x // (e // n)
        for r in range(n):
            sel = owner == r
            if n <= 10:  # one colour per rank while the colour cycle lasts
                ax.bar(x[sel], mean[sel], width=0.8, color=f"C{r}", label=f"rank {r}")
            else:  # alternate two colours so the rank blocks stay visible
                label = ("even ranks" if r == 0 else "odd ranks") if r < 2 else None
                ax.bar(x[sel], mean[sel], width=0.8, color="C0" if r % 2 == 0 else "C1", label=label)
        legend_title = "experts hosted on"
    else:
        ax.bar(x, mean, width=0.8, color="C0", label="mean")
        legend_title = None
    ax.errorbar(x, mean, yerr=[mean - lo, hi - mean], fmt="none", ecolor="black", elinewidth=0.6, capsize=1.5)
    uniform = tok.sum(axis=1).mean() / e
    ax.axhline(uniform, color="gray", linestyle="--", linewidth=1, label=f"uniform ({uniform:.3g})")
    ax.legend(title=legend_title, fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.set_xlim(-0.7, e - 0.3)
    ax.set_xlabel("expert (global index)")
    ax.set_ylabel("tokens per iteration")
    ax.set_title(
        f"tokens received per expert: mean over {trace.num_iters} iterations, bars min-max", fontsize="medium"
    )
    ax.grid(axis="y", alpha=0.3)
    fig.savefig(path, dpi=_DPI)


def plot(
    trace: RunTrace, out_dir: str, iteration: int | None = None, warmup: int = 0, source: str = "trace"
) -> list[str]:
    """Write the PLOT_FILES into `out_dir` (created if needed); return their paths.

    The timeline shows `iteration` (an index of the full trace; default the
    iteration of median duration after the warm-up); the other plots leave out
    the first `warmup` iterations. `source` names the trace in error messages.
    """
    from moe_a2a.trace import median_iteration

    steady = skip_iterations(trace, warmup, source)
    median = iteration is None
    if iteration is None:
        iteration = warmup + median_iteration(steady)
    elif not 0 <= iteration < trace.num_iters:
        raise ValueError(f"--iteration {iteration}: {source} has iterations 0 to {trace.num_iters - 1}")
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise ValueError(f"-o {out_dir}: exists and is not a directory")
    os.makedirs(out_dir, exist_ok=True)
    paths = [os.path.join(out_dir, name) for name in PLOT_FILES]
    _plot_timeline(trace, iteration, paths[0], median)
    _plot_latency(steady, paths[1])
    _plot_bytes(steady, paths[2])
    _plot_tokens(steady, paths[3])
    return paths


def _cmd_plot(args: argparse.Namespace) -> int:
    def body() -> int:
        from moe_a2a.trace import read_trace

        try:
            import matplotlib  # noqa: F401
        except ImportError:
            # An optional extra: a library user's image need not carry plotting.
            raise ValueError(
                "needs matplotlib, which is not installed: pip install 'moe-a2a[plot]'"
            ) from None
        for path in plot(read_trace(args.file), args.output, args.iteration, args.warmup, args.file):
            print(path)
        return 0

    return _guard("plot", body)


if __name__ == "__main__":
    sys.exit(main())
