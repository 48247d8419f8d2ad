"""HDF5 trace: format round trip, validation, reader errors, recorder, gather, and the trace tools."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest

from moe_a2a import trace_tools
from moe_a2a.trace import (
    FORMAT_MARKER,
    MISSING,
    PATHS,
    PHASES,
    SCHEMA_VERSION,
    RunTrace,
    TraceFormatError,
    TraceRecorder,
    gather_trace,
    median_iteration,
    read_trace,
    write_trace,
)

# Nominal phase durations of the synthetic run (ns), in PHASES order.
_NOMINAL_NS = (20_000, 60_000, 30_000, 80_000, 20_000, 50_000)


def make_trace(
    ranks: int = 4, iters: int = 12, experts: int = 16, ranks_per_node: int = 2, seed: int = 0
) -> RunTrace:
    """A deterministic run: phases back to back per rank, ranks slightly staggered, jittered durations.

    Rank r's host is node r // ranks_per_node; decode skips no phase except
    `shared_expert` on the last iteration of rank 0 (to exercise MISSING).
    """
    rng = np.random.default_rng(seed)
    start = np.empty((ranks, iters, len(PHASES)), dtype=np.int64)
    end = np.empty_like(start)
    for r in range(ranks):
        for i in range(iters):
            # Iterations begin every 500 us (as after a barrier); rank r starts r us late.
            t = 1_000_000_000 + 500_000 * i + 1_000 * r
            for p, nominal in enumerate(_NOMINAL_NS):
                d = int(nominal * (1 + 0.2 * r / ranks) + rng.integers(0, 5_000))
                start[r, i, p], end[r, i, p] = t, t + d
                t += d
    start[0, -1, PHASES.index("shared_expert")] = MISSING
    end[0, -1, PHASES.index("shared_expert")] = MISSING
    tokens = rng.integers(0, 64, size=(iters, experts)).astype(np.int64)
    nbytes = np.zeros((ranks, iters, ranks, len(PATHS)), dtype=np.int64)
    for s in range(ranks):
        for d in range(ranks):
            path = 0 if s // ranks_per_node == d // ranks_per_node else 1
            nbytes[s, :, d, path] = 7168 * (1 + (s + 2 * d) % 5)
    return RunTrace(
        config={
            "mode": "decode",
            "world_size": ranks,
            "ranks_per_node": ranks_per_node,
            "model": {"hidden": 7168},
        },
        environment={"moe_a2a": "0.1.0", "created": "2026-01-01T00:00:00+00:00"},
        hosts=[f"node{r // ranks_per_node}" for r in range(ranks)],
        start_ns=start,
        end_ns=end,
        tokens_per_expert=tokens,
        bytes_per_peer=nbytes,
    )


def assert_traces_equal(a: RunTrace, b: RunTrace) -> None:
    assert a.config == b.config
    assert a.environment == b.environment
    assert a.hosts == b.hosts
    assert a.phases == b.phases
    for name in ("start_ns", "end_ns", "tokens_per_expert", "bytes_per_peer"):
        x, y = getattr(a, name), getattr(b, name)
        assert y.dtype == np.int64, name
        np.testing.assert_array_equal(x, y, err_msg=name)


@pytest.fixture
def trace_file(tmp_path: Path) -> Path:
    path = tmp_path / "run.h5"
    write_trace(path, make_trace())
    return path


# --------------------------------------------------------------------------- format


def test_round_trip(tmp_path: Path) -> None:
    t = make_trace()
    write_trace(tmp_path / "t.h5", t)
    assert_traces_equal(t, read_trace(tmp_path / "t.h5"))
    assert not [p for p in os.listdir(tmp_path) if ".tmp" in p]  # the temporary file was renamed


def test_file_layout_matches_documented_schema(trace_file: Path) -> None:
    with h5py.File(trace_file, "r") as f:
        assert f.attrs["format"] == FORMAT_MARKER
        assert f.attrs["schema_version"] == SCHEMA_VERSION
        assert json.loads(f.attrs["config"])["model"] == {"hidden": 7168}
        assert list(f["phases"].asstr()[()]) == list(PHASES)
        assert list(f["paths"].asstr()[()]) == list(PATHS)
        assert f["timing/start_ns"].shape == (4, 12, len(PHASES))
        assert f["timing/start_ns"].attrs["units"] == "ns"
        assert f["timing/start_ns"].attrs["missing"] == MISSING
        assert f["bytes_per_peer"].attrs["dims"] == "sender,iteration,receiver,path"
        assert f["tokens_per_expert"].attrs["units"] == "tokens"


def test_big_datasets_are_gzip_compressed(tmp_path: Path) -> None:
    t = make_trace(ranks=8, iters=100, experts=64, ranks_per_node=4)
    write_trace(tmp_path / "big.h5", t)
    with h5py.File(tmp_path / "big.h5", "r") as f:
        assert f["timing/start_ns"].compression == "gzip"  # 8*100*6 = 4800 elements
        assert f["bytes_per_peer"].compression == "gzip"
        assert f["hosts"].compression is None
    assert_traces_equal(t, read_trace(tmp_path / "big.h5"))


def test_write_replaces_existing_file(tmp_path: Path) -> None:
    write_trace(tmp_path / "t.h5", make_trace(ranks=2, ranks_per_node=1))
    write_trace(tmp_path / "t.h5", make_trace(ranks=4))
    assert read_trace(tmp_path / "t.h5").num_ranks == 4


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            lambda t: setattr(t, "start_ns", t.start_ns.astype(np.float64)),
            "start_ns: expected an integer array",
        ),
        (lambda t: setattr(t, "end_ns", t.end_ns[:, :-1]), "end_ns: expected shape (4, 12, 6)"),
        (lambda t: setattr(t, "start_ns", t.start_ns[..., :-1]), "last dimension must match the 6 phases"),
        (lambda t: setattr(t, "hosts", t.hosts[:-1]), "hosts: expected one host per rank (4), got 3"),
        (
            lambda t: setattr(t, "tokens_per_expert", t.tokens_per_expert[:-1]),
            "tokens_per_expert: expected shape",
        ),
        (lambda t: setattr(t, "bytes_per_peer", t.bytes_per_peer[..., :1]), "bytes_per_peer: expected shape"),
        (
            lambda t: t.bytes_per_peer.__setitem__((0, 0, 0, 0), -1),
            "bytes_per_peer: byte counts must be >= 0",
        ),
        (lambda t: t.end_ns.__setitem__((1, 2, 3), 0), "rank 1 iteration 2 phase 'experts'"),
        (lambda t: t.end_ns.__setitem__((1, 2, 3), MISSING), "both must be recorded or both -1"),
        (lambda t: t.config.__setitem__("bad", object()), "config: must be JSON-serialisable"),
        (lambda t: setattr(t, "phases", ("a", "a", "b", "c", "d", "e")), "phases: expected unique"),
    ],
)
def test_write_rejects_invalid_trace(tmp_path: Path, change: Any, message: str) -> None:
    t = make_trace()
    change(t)
    with pytest.raises(ValueError, match="RunTrace") as info:
        write_trace(tmp_path / "bad.h5", t)
    assert message in str(info.value)
    assert not os.listdir(tmp_path)  # nothing half-written


# --------------------------------------------------------------------------- reader errors


def test_read_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.h5"
    with pytest.raises(FileNotFoundError) as info:
        read_trace(path)
    assert str(info.value) == f"trace file not found: {path}"


def test_read_file_that_is_not_hdf5(tmp_path: Path) -> None:
    path = tmp_path / "notes.txt"
    path.write_text("not a trace\n")
    with pytest.raises(TraceFormatError, match="not an HDF5 file") as info:
        read_trace(path)
    assert str(path) in str(info.value)
    assert isinstance(info.value, ValueError)


def test_read_directory(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="is a directory"):
        read_trace(tmp_path)


def test_read_hdf5_that_is_not_a_trace(tmp_path: Path) -> None:
    path = tmp_path / "other.h5"
    with h5py.File(path, "w") as f:
        f["x"] = np.arange(3)
    with pytest.raises(ValueError, match=r"not a moe-a2a trace: HDF5 file has no 'format' attribute") as info:
        read_trace(path)
    assert str(path) in str(info.value)


def test_read_other_format_marker(tmp_path: Path) -> None:
    path = tmp_path / "other.h5"
    with h5py.File(path, "w") as f:
        f.attrs["format"] = "someone-else"
    with pytest.raises(ValueError, match="format attribute 'someone-else'"):
        read_trace(path)


def test_read_newer_schema_version(trace_file: Path) -> None:
    with h5py.File(trace_file, "a") as f:
        f.attrs["schema_version"] = np.int64(SCHEMA_VERSION + 1)
    with pytest.raises(ValueError) as info:
        read_trace(trace_file)
    msg = str(info.value)
    assert str(trace_file) in msg
    assert f"schema version {SCHEMA_VERSION + 1} is newer" in msg
    assert f"(schema version {SCHEMA_VERSION})" in msg


@pytest.mark.parametrize("version", [0, -3, "1", 1.5])
def test_read_unknown_schema_version(trace_file: Path, version: object) -> None:
    with h5py.File(trace_file, "a") as f:
        f.attrs["schema_version"] = version
    with pytest.raises(ValueError, match="unknown trace schema version"):
        read_trace(trace_file)


def test_read_incomplete_trace_names_missing_dataset(trace_file: Path) -> None:
    with h5py.File(trace_file, "a") as f:
        del f["bytes_per_peer"]
    with pytest.raises(ValueError, match="incomplete moe-a2a trace: missing bytes_per_peer"):
        read_trace(trace_file)


def test_read_corrupt_shapes(trace_file: Path) -> None:
    with h5py.File(trace_file, "a") as f:
        del f["hosts"]
        f.create_dataset("hosts", data=["a"], dtype=h5py.string_dtype())
    with pytest.raises(ValueError, match="corrupt moe-a2a trace: RunTrace.hosts"):
        read_trace(trace_file)


@pytest.mark.parametrize("name", ["config", "environment"])
@pytest.mark.parametrize("value", ["{model: 1}", np.int64(3)])  # not JSON; not text at all
def test_read_attribute_that_is_not_json_names_it(trace_file: Path, name: str, value: object) -> None:
    with h5py.File(trace_file, "a") as f:
        f.attrs[name] = value
    with pytest.raises(ValueError, match=f"corrupt moe-a2a trace: attribute '{name}' is not JSON"):
        read_trace(trace_file)


# --------------------------------------------------------------------------- derived views


def test_durations_alignment_and_missing() -> None:
    t = make_trace()
    d = t.durations_ns()
    assert np.isnan(d[0, -1, PHASES.index("shared_expert")])
    assert np.isnan(d).sum() == 1  # only that one
    start, end = t.aligned_ns()
    np.testing.assert_array_equal(np.nanmin(start, axis=(0, 2)), np.zeros(t.num_iters))
    np.testing.assert_allclose(end - start, d)
    # Ranks start 1 us apart and run longer phases as r grows, so rank 0 starts every iteration first.
    assert (np.nanmin(start[0], axis=1) == 0).all()
    total = t.total_ns()
    np.testing.assert_array_equal(total, t.end_ns[:, :, -1] - t.start_ns[:, :, 0])


def test_median_iteration_picks_median_span() -> None:
    t = make_trace(iters=5)
    t.end_ns[:, 3, -1] += 10_000_000  # iteration 3 is by far the longest
    _, end = t.aligned_ns()
    spans = np.nanmax(end, axis=(0, 2))
    assert spans[median_iteration(t)] == np.sort(spans)[2]


# --------------------------------------------------------------------------- recorder and gather


def test_recorder_phase_and_record() -> None:
    rec = TraceRecorder(num_iters=3, num_ranks=2, num_experts=4)
    with rec.phase(1, "experts"):
        sum(range(1000))
    i = PHASES.index("experts")
    assert 0 < rec.start_ns[1, i] <= rec.end_ns[1, i]
    assert (rec.start_ns[0] == MISSING).all()
    rec.record(2, "combine_recv", 10, 25)
    assert (rec.start_ns[2, -1], rec.end_ns[2, -1]) == (10, 25)
    with pytest.raises(ValueError, match="already recorded"):
        rec.record(2, "combine_recv", 30, 40)
    with pytest.raises(ValueError, match="unknown phase 'expert'"):
        rec.phase(0, "expert")
    with pytest.raises(IndexError, match=r"iteration must be in \[0, 3\), got 3"):
        rec.phase(3, "experts")
    with pytest.raises(ValueError, match="start_ns=5 end_ns=4"):
        rec.record(0, "experts", 5, 4)


def test_recorder_phase_that_raises_is_not_recorded() -> None:
    rec = TraceRecorder(num_iters=1, num_ranks=1, num_experts=1)
    with pytest.raises(RuntimeError), rec.phase(0, "experts"):
        raise RuntimeError("boom")
    assert (rec.start_ns == MISSING).all()


def test_recorder_counts_accumulate() -> None:
    rec = TraceRecorder(num_iters=2, num_ranks=3, num_experts=6)
    rec.add_tokens(0, 2, np.array([1, 2], dtype=np.int32))
    rec.add_tokens(0, 2, np.array([1, 1]))
    np.testing.assert_array_equal(rec.tokens_per_expert[0], [0, 0, 2, 3, 0, 0])
    rec.add_bytes(1, 2, "fabric", 100)
    rec.add_bytes(1, 2, "fabric", 28)
    rec.add_bytes(1, 0, "same_node", 5)
    assert rec.bytes_per_peer[1, 2, PATHS.index("fabric")] == 128
    assert rec.bytes_per_peer[1, 0, PATHS.index("same_node")] == 5
    with pytest.raises(ValueError, match=r"experts \[5, 7\) are outside \[0, 6\)"):
        rec.add_tokens(0, 5, np.array([1, 1]))
    with pytest.raises(ValueError, match="1-D integer array"):
        rec.add_tokens(0, 0, np.array([0.5]))
    with pytest.raises(ValueError, match="unknown path 'nvlink'"):
        rec.add_bytes(0, 0, "nvlink", 1)
    with pytest.raises(ValueError, match=r"peer must be in \[0, 3\), got 3"):
        rec.add_bytes(0, 3, "fabric", 1)


class FakeComm:
    """Enough of an mpi4py communicator for gather_trace.

    Rank 0's gather returns its own object followed by what ranks 1.. sent before.
    """

    def __init__(self, rank: int, size: int, mailbox: list[Any]) -> None:
        self.rank, self.size, self.mailbox = rank, size, mailbox

    def Get_rank(self) -> int:  # noqa: N802 - mpi4py's name
        return self.rank

    def Get_size(self) -> int:  # noqa: N802 - mpi4py's name
        return self.size

    def gather(self, obj: Any, root: int = 0) -> list[Any] | None:
        assert root == 0
        if self.rank != 0:
            self.mailbox.append(obj)
            return None
        return [obj, *self.mailbox]


def test_gather_trace_merges_ranks(tmp_path: Path) -> None:
    size, experts, iters = 3, 6, 2
    recs = [TraceRecorder(iters, size, experts) for _ in range(size)]
    for r, rec in enumerate(recs):
        for i in range(iters):
            for p in PHASES:
                rec.record(i, p, 1000 * i + 10 * r, 1000 * i + 10 * r + 5)
            rec.add_tokens(i, r * 2, np.array([r + 1, r + 2]))  # 2 local experts per rank
            for peer in range(size):
                rec.add_bytes(i, peer, "same_node" if peer == r else "fabric", 100 * r + peer)
    mailbox: list[Any] = []
    config = {"mode": "decode", "world_size": size}
    for r in (1, 2):  # ranks != 0 send first in this simulation and get None
        assert gather_trace(FakeComm(r, size, mailbox), recs[r], config) is None
    t = gather_trace(FakeComm(0, size, mailbox), recs[0], config, environment={"note": "unit"})
    assert t is not None
    assert t.num_ranks == size and t.num_iters == iters and t.num_experts == experts
    np.testing.assert_array_equal(t.tokens_per_expert, [[1, 2, 2, 3, 3, 4]] * iters)
    assert t.bytes_per_peer[2, 1, 0, PATHS.index("fabric")] == 200
    assert t.bytes_per_peer[1, 0, 1, PATHS.index("same_node")] == 101
    assert t.start_ns[2, 1, 0] == 1020
    assert len(t.hosts) == size and all(t.hosts)
    assert t.environment["note"] == "unit"
    assert {"created", "command", "python", "numpy", "h5py"} <= set(t.environment)
    assert all(isinstance(v, str) for v in t.environment.values())
    write_trace(tmp_path / "g.h5", t)
    assert_traces_equal(t, read_trace(tmp_path / "g.h5"))


def test_gather_trace_rejects_mismatched_sizes() -> None:
    with pytest.raises(ValueError, match="recorder has num_ranks=2, communicator has 3 ranks"):
        gather_trace(FakeComm(0, 3, []), TraceRecorder(1, 2, 1), {})
    with pytest.raises(ValueError, match="hosts must name each of the 1 ranks, got 2"):
        gather_trace(FakeComm(0, 1, []), TraceRecorder(1, 1, 1), {}, hosts=["a", "b"])


# --------------------------------------------------------------------------- tools


def run_cli(argv: list[str]) -> int:
    """Parse as `moe-a2a trace ...` with a parser built here (cli.py imports modules of other layers)."""
    parser = argparse.ArgumentParser(prog="moe-a2a")
    trace_tools.add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["trace", *argv])
    return args.func(args)


def test_summary_percentiles_match_numpy(trace_file: Path) -> None:
    t = read_trace(trace_file)
    s = trace_tools.summarize(t)
    d = t.durations_ns() / 1e3
    i = PHASES.index("experts")
    assert s["overall"]["experts"]["p90"] == pytest.approx(np.percentile(d[..., i], 90))
    assert s["per_rank"][2]["phases"]["experts"]["p99"] == pytest.approx(np.percentile(d[2, :, i], 99))
    # One shared_expert measurement is MISSING: it is left out, not counted as zero.
    assert s["overall"]["shared_expert"]["n"] == t.num_ranks * t.num_iters - 1
    assert s["overall"]["total"]["n"] == t.num_ranks * t.num_iters


def test_summary_text(trace_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run_cli(["summary", str(trace_file)]) == 0
    out = capsys.readouterr().out
    assert "microseconds" in out
    header = next(line for line in out.splitlines() if line.startswith("| phase"))
    assert cells(header) == ["phase", "n", "p50 (us)", "p90 (us)", "p99 (us)", "max (us)"]
    for p in (*PHASES, "total"):
        assert any(line.startswith(f"| {p} ") for line in out.splitlines()), p
    assert "per rank" in out and "node1" in out


def test_summary_json_and_warmup(trace_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run_cli(["summary", str(trace_file), "--json", "--warmup", "2"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["units"] == "us" and data["num_iters"] == 10 and data["warmup"] == 2
    assert set(data["overall"]) == {*PHASES, "total"}
    assert set(data["overall"]["experts"]) >= {"n", "p50", "p90", "p99"}
    assert [r["rank"] for r in data["per_rank"]] == [0, 1, 2, 3]


def test_compare_ratios(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a = make_trace()
    b = make_trace()
    b.end_ns = b.start_ns + 2 * (b.end_ns - b.start_ns)  # every phase twice as long
    b.end_ns[b.start_ns == MISSING] = MISSING
    b.config["mode"] = "prefill"
    write_trace(tmp_path / "a.h5", a)
    write_trace(tmp_path / "b.h5", b)
    assert run_cli(["compare", str(tmp_path / "a.h5"), str(tmp_path / "b.h5"), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    for p in PHASES:  # A is the baseline: A/B, below 1 as B is slower
        assert data["phases"][p]["ratio_p50"] == pytest.approx(0.5), p
        assert data["phases"][p]["ratio_p99"] == pytest.approx(0.5), p
    assert data["config_differences"] == {"mode": ["decode", "prefill"]}
    assert run_cli(["compare", str(tmp_path / "a.h5"), str(tmp_path / "b.h5")]) == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.startswith("| phase"))
    assert cells(header) == [
        *("phase", "A p50 (us)", "B p50 (us)", "A/B p50", "A p99 (us)", "B p99 (us)", "A/B p99")
    ]
    experts = next(cells(line) for line in out.splitlines() if line.startswith("| experts "))
    assert experts[3] == experts[6] == "0.50" and "config mode: A=decode B=prefill" in out
    assert "A/B = A's time / B's time: above 1, B is faster" in out


def test_compare_help_names_the_ratio_the_table_prints() -> None:
    """`trace compare --help` and the table read the ratio the same way (A/B, A the baseline)."""
    parser = argparse.ArgumentParser(prog="moe-a2a")
    trace_tools.add_parser(parser.add_subparsers(dest="command", required=True))
    (trace,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    (sub,) = (a for a in trace.choices["trace"]._actions if isinstance(a, argparse._SubParsersAction))
    compare = sub.choices["compare"]
    helps = [compare.description, *(c.help for c in sub._choices_actions if c.dest == "compare")]
    for text in helps:
        assert "ratios A/B" in text and "B/A" not in text, text


def cells(line: str) -> list[str]:
    """The cells of one line of a github-style table."""
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _assert_png(path: Path) -> None:
    import matplotlib.image

    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", path
    assert len(data) > 10_000, f"{path}: only {len(data)} bytes"
    img = matplotlib.image.imread(path)
    h, w = img.shape[:2]
    assert h >= 200 and w >= 400, f"{path}: {w}x{h} pixels"
    assert img[..., :3].std() > 0.05, f"{path}: looks blank"  # not one flat colour


def test_plot_writes_every_png(trace_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "plots"
    assert run_cli(["plot", str(trace_file), "-o", str(out), "--iteration", "3"]) == 0
    printed = capsys.readouterr().out.split()
    assert printed == [str(out / name) for name in trace_tools.PLOT_FILES]
    for name in trace_tools.PLOT_FILES:
        _assert_png(out / name)


def test_plot_many_ranks_and_uneven_experts(tmp_path: Path) -> None:
    # 20 ranks (no cell labels), experts not divisible by ranks (one colour), default iteration.
    write_trace(tmp_path / "t.h5", make_trace(ranks=20, iters=4, experts=30, ranks_per_node=4))
    paths = trace_tools.plot(read_trace(tmp_path / "t.h5"), str(tmp_path / "p"))
    for p in paths:
        _assert_png(Path(p))


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["summary", "{missing}"], "trace file not found: {missing}"),
        (["summary", "{text}"], "{text}: not a moe-a2a trace: not an HDF5 file"),
        (["compare", "{trace}", "{missing}"], "trace file not found: {missing}"),
        (["plot", "{text}", "-o", "{out}"], "{text}: not a moe-a2a trace"),
        (
            ["plot", "{trace}", "-o", "{out}", "--iteration", "12"],
            "--iteration 12: {trace} has iterations 0 to 11",
        ),
        (["summary", "{trace}", "--warmup", "12"], "--warmup 12: {trace} has 12 iterations"),
        (["plot", "{trace}", "-o", "{text}"], "-o {text}: exists and is not a directory"),
    ],
)
def test_cli_errors_are_one_line(
    trace_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    text = tmp_path / "notes.txt"
    text.write_text("hello\n")
    names = {"missing": str(tmp_path / "missing.h5"), "text": str(text), "trace": str(trace_file)}
    names["out"] = str(tmp_path / "out")
    assert run_cli([a.format(**names) for a in argv]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    err = captured.err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith(f"moe-a2a trace {argv[0]}: error: ")
    assert message.format(**names) in err


def test_cli_error_exit_status_without_traceback(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "moe_a2a.trace_tools", "summary", str(tmp_path / "absent.h5")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    assert (
        proc.stderr.strip() == f"moe-a2a trace summary: error: trace file not found: {tmp_path / 'absent.h5'}"
    )


# --------------------------------------------------------------------------- run --trace


def test_run_refuses_a_trace_path_it_could_not_write(tmp_path: Path) -> None:
    """Checked before the run: a folder given as the file, a folder that cannot be made."""
    from moe_a2a.layers.run_args import check_trace_path
    from moe_a2a.usage import UsageError

    with pytest.raises(UsageError, match=f"^--trace: got {tmp_path}, a folder; expected the path of a file"):
        check_trace_path(str(tmp_path))
    (tmp_path / "plain").write_text("a file, not a folder")
    with pytest.raises(UsageError, match=r"^--trace: cannot make the folder .*plain/sub \(Not a directory\)"):
        check_trace_path(str(tmp_path / "plain" / "sub" / "run.h5"))
    check_trace_path(str(tmp_path / "new" / "run.h5"))  # a missing folder is made, and left empty
    assert (tmp_path / "new").is_dir() and list((tmp_path / "new").iterdir()) == []


def test_run_prints_its_results_when_the_trace_cannot_be_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The folder went away after the check (here: replaced by a file): the table still prints,
    then one line saying nothing was written; status 1."""
    from moe_a2a.layers.run_report import publish

    (tmp_path / "gone").write_text("was a folder when the run started")
    path = str(tmp_path / "gone" / "run.h5")
    assert publish(make_trace(), 100, ["head"], ["foot"], path) == 1
    out, err = capsys.readouterr()
    assert "measured iterations" in out and "foot" in out and "trace:" not in out
    assert err.startswith(f"moe-a2a run: error: --trace {path}: could not write the trace (")
    assert err.strip().endswith("nothing was written there") and err.count("\n") == 1
    assert publish(make_trace(), 100, ["head"], [], str(tmp_path / "ok.h5")) == 0
    assert f"trace: {tmp_path / 'ok.h5'}" in capsys.readouterr().out
