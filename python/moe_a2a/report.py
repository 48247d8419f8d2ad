"""What `run`, `bench` and `trace` print and write: one table style, one vocabulary, one progress bar.

The vocabulary (docs/running.md, "Reading the output"):
- "moe-a2a" is this library's time, "baseline" what it is compared with (the
  configuration block above each table names it);
- a ratio is written as its division, `baseline/moe-a2a`: above 1, moe-a2a is
  faster. `trace compare A B` reads the same way: A is the baseline, `A/B`
  above 1 means B is faster;
- times are microseconds; p50/p90/p99 are numpy percentiles over iterations.

Tables are tabulate's `github` style (Markdown pipes), so a table pastes into
docs/benchmarks.md as it is. The progress bar is tqdm's, on rank 0's stderr.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shlex
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

import numpy as np

OURS = "moe-a2a"
BASELINE = "baseline"
RATIO = f"{BASELINE}/{OURS}"
RATIO_NOTE = f"{RATIO} = baseline p50 / moe-a2a p50: above 1, moe-a2a is faster"
PERCENTILES = (50, 90, 99)
TABLE_FORMAT = "github"
OUTPUT_SUFFIXES = (".csv", ".json")
PROGRESS_MODES = ("auto", "always", "never")
# Launchers whose stderr is the user's when a rank's own stderr is a pipe to them.
_LAUNCHERS = {"mpirun", "mpiexec", "mpiexec.hydra", "orterun", "prterun", "prte"}


# ---------------------------------------------------------------- figures


def percentiles_us(values_ns: Any, qs: Sequence[float] = PERCENTILES) -> dict[str, float | int | None]:
    """n, p<q>, mean and max in microseconds of the finite values; None where there are none."""
    v = np.asarray(values_ns, dtype=np.float64).ravel()
    v = v[np.isfinite(v)] / 1e3
    out: dict[str, float | int | None] = {"n": int(v.size)}
    for q, p in zip(qs, np.percentile(v, qs) if v.size else [None] * len(qs), strict=True):
        out[f"p{q:g}"] = None if p is None else float(p)
    out["mean"] = float(v.mean()) if v.size else None
    out["max"] = float(v.max()) if v.size else None
    return out


def ratio(baseline: float | None, ours: float | None) -> float | None:
    """baseline / ours, the one direction every ratio reads (None when either is missing or ours is 0)."""
    return None if baseline is None or ours is None or ours == 0 else baseline / ours


# ---------------------------------------------------------------- text


def table(
    headers: Sequence[str],
    rows: Iterable[Sequence[Any]],
    floatfmt: str | Sequence[str] = ".1f",
    width: int | None = None,
) -> str:
    """The one table style: numbers right-aligned, missing values as '-'.

    `width`: wrap the last column so that every line fits in that many characters
    (where the other columns leave it room; at least 20).
    """
    from tabulate import tabulate

    rows = [list(r) for r in rows]

    def render(wrap: list[int | None] | None) -> str:
        return tabulate(
            rows,
            headers=list(headers),
            tablefmt=TABLE_FORMAT,
            floatfmt=floatfmt,
            missingval="-",
            maxcolwidths=wrap,
        )

    text = render(None)
    over = max(map(len, text.splitlines()), default=0) - (width or 0)
    if width is None or over <= 0 or not rows:
        return text
    last = max(len(str(x)) for x in [headers[-1], *(r[-1] for r in rows)])
    return render([None] * (len(headers) - 1) + [max(20, last - over)])


def columns_table(
    columns: Sequence[tuple[str, str]],
    rows: Iterable[Mapping[str, Any]],
    formats: Mapping[str, str] | None = None,
    default: str = ".1f",
) -> str:
    """A table of `rows` (dicts) by `columns`, (key, header) pairs; `formats` by key, else `default`.

    A benchmark's table is its COLUMNS tuple: a new column is one more pair.
    """
    formats = {"ratio": ".2f", **(formats or {})}
    floatfmt = [formats.get(key, default) for key, _ in columns]
    return table([h for _, h in columns], ([r.get(k) for k, _ in columns] for r in rows), floatfmt)


def sizes_text(tokens: int, hidden: int, num_experts: int, topk: int) -> str:
    """One shape, as every configuration block says it."""
    return f"{tokens} tokens/rank, hidden {hidden}, {num_experts} experts, top-{topk}"


def config_block(title: str, settings: Mapping[str, Any]) -> str:
    """`title`, then one `key: value` line per setting: what a run ran, printed above its table."""
    width = max((len(k) for k in settings), default=0) + 1
    return "\n".join([title, *(f"  {k + ':':<{width}} {v}" for k, v in settings.items())])


def cuda_tuning() -> dict[str, Any]:
    """The CUDA kernels' launch tuning this build uses (src/a2a/cuda/tuning.h); {'cuda': False}
    in a build without them."""
    from moe_a2a import _core

    return dict(_core.cuda_tuning())


def tuning_set() -> str:
    """The launch tuning as one header line: the build's architectures and a fingerprint of the
    whole table (equal fingerprints: equal tuning); --output and --json carry the table itself."""
    import hashlib

    t = cuda_tuning()
    if not t.get("cuda"):
        return "no CUDA kernels in this build"
    digest = hashlib.sha256(json.dumps(t, sort_keys=True).encode()).hexdigest()[:12]
    return f"sm_{t['architectures']}, table {digest} (src/a2a/cuda/tuning.h)"


def rows_path_text(paths: dict[str, dict[str, str]]) -> str:
    """Each shape's rows' path and why; one line where every shape took the same."""
    if len({(p["path"], p["reason"]) for p in paths.values()}) == 1:
        p = next(iter(paths.values()))
        return f"{p['path']} ({p['reason']})"
    return "; ".join(f"{n}: {p['path']} ({p['reason']})" for n, p in paths.items())


def switches_set() -> str:
    """The library's switches that are set (moe_a2a.switches), as NAME=VALUE, or 'none set'."""
    from moe_a2a import switches

    got = switches.recorded()
    return " ".join(f"{k}={v}" for k, v in sorted(got.items())) or "none set"


def command_line() -> str:
    """This process's command line, quoted for the shell."""
    return shlex.join(sys.argv)


# ---------------------------------------------------------------- output files


def output_path(text: str) -> Path:
    """argparse type of `--output`: a .csv or .json file name (checked before the run starts)."""
    path = Path(text)
    if path.suffix.lower() not in OUTPUT_SUFFIXES:
        raise argparse.ArgumentTypeError(
            f"got {text!r}; expected a file name ending in .csv (one row per line) or .json "
            "(rows with the version, command and settings)"
        )
    return path


def write_output(path: Path, rows: Sequence[Mapping[str, Any]], meta: Mapping[str, Any]) -> None:
    """CSV (a header, then one line per row) for .csv, JSON (`meta` and `rows`) for .json."""
    suffix = path.suffix.lower()
    if suffix not in OUTPUT_SUFFIXES:  # output_path refuses these at parse time; callers may not use it
        raise ValueError(f"--output: got {str(path)!r}; expected a file name ending in .csv or .json")
    path.parent.mkdir(parents=True, exist_ok=True)
    if suffix == ".csv":
        fields = list(dict.fromkeys(k for r in rows for k in r))
        with path.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=fields)
            writer.writeheader()
            writer.writerows(rows)
    else:
        path.write_text(json.dumps({**meta, "rows": list(rows)}, indent=2) + "\n")


def run_meta(benchmark: str, settings: Mapping[str, Any]) -> dict[str, Any]:
    """What every benchmark JSON starts with: which benchmark, version, command, switches, settings."""
    import platform

    from moe_a2a import __version__, switches

    return {
        "benchmark": benchmark,
        "moe_a2a_version": __version__,
        "command": command_line(),
        "switches": switches.recorded(),
        "cuda_tuning": cuda_tuning(),
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "settings": dict(settings),
    }


# ---------------------------------------------------------------- progress


def _launcher_stderr_is_terminal() -> bool:
    """Whether the launcher that started this rank writes its stderr to a terminal.

    Open MPI hands each rank a pipe for stderr (and a pseudo-terminal for stdout,
    whatever mpirun's own stdout is), so the rank's isatty() says nothing; the
    launcher's own stderr does. Looked up in /proc, a few parents up.
    """
    pid = os.getppid()
    for _ in range(4):
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
            name = stat[stat.index("(") + 1 : stat.rindex(")")]
            if name in _LAUNCHERS:
                target = os.readlink(f"/proc/{pid}/fd/2")
                return target.startswith(("/dev/pts/", "/dev/tty"))
            pid = int(stat[stat.rindex(")") + 2 :].split()[1])
        except (OSError, ValueError, IndexError):
            return False
        if pid <= 1:
            return False
    return False


def progress_enabled(mode: str, rank: int, stream: TextIO) -> bool:
    """Rank 0 only; `auto`: when a person watches (a terminal, or mpirun's terminal); `never`: off."""
    if mode not in PROGRESS_MODES:
        raise ValueError(f"--progress: got {mode!r}; expected one of {', '.join(PROGRESS_MODES)}")
    if rank != 0 or mode == "never":
        return False
    if mode == "always":
        return True
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty()) or _launcher_stderr_is_terminal()


def progress(total: int, desc: str, *, rank: int, mode: str = "auto", stream: TextIO | None = None) -> Any:
    """A tqdm bar of `total` steps on rank 0's stderr (a disabled one elsewhere).

    `auto` waits 2 s before it draws, so short runs stay quiet.
    """
    from tqdm import tqdm

    stream = stream or sys.stderr
    return tqdm(
        total=total,
        desc=desc,
        unit="it",
        file=stream,
        disable=not progress_enabled(mode, rank, stream),
        leave=False,  # the table that follows says what ran; the bar is only for the wait
        dynamic_ncols=True,
        delay=2.0 if mode == "auto" else 0.0,
    )


def case_done(line: str, *, rank: int, mode: str = "auto", stream: TextIO | None = None) -> None:
    """Rank 0 says a case (a shape, a size) finished, where no progress bar shows it.

    Off a terminal (a log, CI) the bar is hidden: without these lines a long benchmark
    would print nothing until its table. `--progress never` silences them too.
    """
    stream = stream or sys.stderr
    if rank == 0 and mode != "never" and not progress_enabled(mode, rank, stream):
        print(line, file=stream, flush=True)


def interrupted(prog: str, finished: Sequence[str], *, rank: int) -> int:
    """After Ctrl-C: rank 0 says what finished (its results were printed above); status 130."""
    if rank == 0:
        done = ", ".join(finished) if finished else "nothing"
        print(f"{prog}: interrupted; finished: {done}", file=sys.stderr, flush=True)
    return 130  # 128 + SIGINT, as a shell reports a command ended by Ctrl-C


def add_output_argument(parser: Any, rows: str = "one row per line") -> None:
    """`--output PATH` (.csv or .json, checked when parsed), as every benchmark takes it."""
    parser.add_argument(
        "--output",
        type=output_path,
        metavar="PATH",
        default=None,
        help=f"also write the figures to PATH: .csv ({rows}) or .json (rows with the version, "
        "command and settings) (default: none)",
    )


def add_progress_argument(parser: Any) -> None:
    """`--progress auto|always|never`, as `run` and `bench` take it."""
    parser.add_argument(
        "--progress",
        choices=PROGRESS_MODES,
        default="auto",
        help="progress bar on rank 0's stderr: auto shows it when stderr (or mpirun's) is a terminal "
        "(default: %(default)s)",
    )
