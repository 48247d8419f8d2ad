"""The `moe-a2a` command at its top level: version, no abbreviations, one-line usage errors, pipes.

These run without MPI: each rank of an mpirun job parses the same arguments, so a
usage error is checked here in one process with the launcher's rank variable set.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from moe_a2a import __version__, cli
from moe_a2a.trace import write_trace

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]


def _make_trace() -> object:
    sys.path.insert(0, str(Path(__file__).parent))
    try:
        from test_trace import make_trace
    finally:
        sys.path.pop(0)
    return make_trace()


def _parsers(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    """The parser and every sub-parser under it."""
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                yield from _parsers(child)


def _main(argv: list[str], rank: str, monkeypatch: pytest.MonkeyPatch) -> int:
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", rank)
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    return int(exc.value.code)


def test_version_is_pyproject_version(capsys: pytest.CaptureFixture[str]) -> None:
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert __version__ == version
    with pytest.raises(SystemExit) as exc:
        cli.main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"moe-a2a {version}"


def test_python_dash_m_runs_the_cli() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "moe_a2a", "--version"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"moe-a2a {__version__}"


def test_no_parser_abbreviates() -> None:
    parsers = list(_parsers(cli.build_parser()))
    names = {p.prog for p in parsers}
    assert {"moe-a2a run", "moe-a2a bench a2a", "moe-a2a bench fabric", "moe-a2a trace plot"} <= names
    assert [p.prog for p in parsers if p.allow_abbrev] == []


@pytest.mark.parametrize(
    ("argv", "bad"),
    [
        (["run", "--model", "tiny", "--iter", "3"], "--iter 3"),
        (["bench", "a2a", "--warm", "1"], "--warm 1"),
        (["trace", "summary", "x.h5", "--js"], "--js"),
    ],
)
def test_abbreviated_flag_is_an_error(
    argv: list[str], bad: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _main(argv, "0", monkeypatch) == 2
    assert f"error: unrecognized arguments: {bad}" in capsys.readouterr().err


def test_usage_error_one_line_from_rank_0(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["bench", "a2a", "--warmup", "-5"]
    assert _main(argv, "0", monkeypatch) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert errors == [
        "moe-a2a bench a2a: error: argument --warmup: got '-5'; expected an integer >= 0 "
        "(see moe-a2a bench a2a --help)"
    ]
    assert "Traceback" not in err
    # The other ranks found the same error: they stay silent and exit alike.
    assert _main(argv, "1", monkeypatch) == 2
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("argv", [["run", "--model", "tiny"], ["bench", "fabric"], ["bench", "a2a"]])
def test_unavailable_provider_is_a_usage_error(
    argv: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _main([*argv, "--provider", "no-such-provider"], "0", monkeypatch) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"moe-a2a {' '.join(argv[:2] if argv[0] == 'bench' else argv[:1])}: error: ")
    assert "--provider: got 'no-such-provider'" in err and "expected auto or one of: " in err
    assert "\n" not in err
    assert _main([*argv, "--provider", "no-such-provider"], "3", monkeypatch) == 2
    assert capsys.readouterr().err == ""


@pytest.fixture
def trace_file_dir(tmp_path: Path) -> Path:
    write_trace(tmp_path / "run.h5", _make_trace())
    return tmp_path


def test_info_says_whether_a_gpu_is_usable(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["info"]) == 0
    lines = capsys.readouterr().out.splitlines()
    gpu = [line for line in lines if line.startswith("GPU usable (device='cuda'): ")]
    assert len(gpu) == 1 and gpu[0].split(": ", 1)[1].split(":")[0] in ("yes", "no"), lines


def test_trace_compare_into_a_closed_pipe_is_quiet(trace_file_dir: Path) -> None:
    """`moe-a2a trace compare A B | head`: no "Broken pipe" once the reader has gone."""
    trace = str(trace_file_dir / "run.h5")
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the first line is written
    try:
        done = subprocess.run(
            [sys.executable, "-m", "moe_a2a", "trace", "compare", trace, trace],
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
        )
    finally:
        os.close(write)
    assert done.stderr == "" and done.returncode == 141, (done.returncode, done.stderr)


def test_plot_without_matplotlib_says_what_to_install(
    trace_file_dir: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    assert cli.main(["trace", "plot", str(trace_file_dir / "run.h5"), "-o", str(trace_file_dir / "p")]) == 1
    assert capsys.readouterr().err.strip() == (
        "moe-a2a trace plot: error: needs matplotlib, which is not installed: pip install 'moe-a2a[plot]'"
    )


def test_subcommand_usage_message_is_one_line_and_exit_2() -> None:
    """A subcommand's `raise SystemExit("bench a2a: ...")` becomes one line and exit status 2."""
    done = subprocess.run(
        [sys.executable, "-m", "moe_a2a", "bench", "a2a", "--grad-dtype", "bf16"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, (done.returncode, done.stderr)
    assert done.stderr.strip() == "moe-a2a bench a2a: error: --grad-dtype: only used with --train"


def test_info_shows_what_each_backend_can_do(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["info", "--provider", "shm"]) == 0
    out = capsys.readouterr().out
    assert "transport backends built: libfabric (ibverbs: not built" in out
    caps = [line.strip() for line in out.splitlines() if line.strip().startswith("capabilities (shm): ")]
    assert len(caps) == 1, out
    assert "backend libfabric (shm), GPU memory registration no (host memory only)" in caps[0]
    assert "max message " in caps[0] and "inject " in caps[0] and "immediate 8 B" in caps[0]


def _value_options(parser: argparse.ArgumentParser) -> Iterator[tuple[str, argparse.Action]]:
    """(longest flag, action) of every option that takes a value."""
    for action in parser._actions:
        if action.option_strings and action.nargs != 0 and not isinstance(action, argparse._HelpAction):
            yield max(action.option_strings, key=len), action


def test_one_placeholder_style_across_subcommands() -> None:
    """Every value placeholder is named (not argparse's NUM_EXPERTS from the flag), and one flag
    has one placeholder in every subcommand."""
    seen: dict[str, set[str]] = {}
    unnamed = []
    for parser in _parsers(cli.build_parser()):
        for flag, action in _value_options(parser):
            if action.choices is not None or flag == "--output":
                continue  # choices show as {a,b,c}; --output is a FILE for bench, a DIR for trace plot
            if action.metavar is None:
                unnamed.append(f"{parser.prog} {flag}")
            else:
                seen.setdefault(flag, set()).add(str(action.metavar))
    assert unnamed == []
    assert {flag: names for flag, names in seen.items() if len(names) > 1} == {}


def test_every_subcommand_has_a_description() -> None:
    missing = [p.prog for p in _parsers(cli.build_parser()) if not p.description]
    assert missing == []


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["trace"], "moe-a2a trace: error: expected a command: summary, plot, compare"),
        ([], "moe-a2a: error: expected a command: run, bench, trace, cleanup, plan, info"),
        (["run", "--bogus-flag"], "moe-a2a run: error: unrecognized arguments: --bogus-flag"),
        (["bench", "a2a", "--tokens", "x"], "moe-a2a bench a2a: error: argument --tokens: got 'x'"),
        (["bench", "a2a", "--grad-dtype", "bf16"], "moe-a2a bench a2a: error: --grad-dtype: only used"),
    ],
)
def test_usage_errors_are_one_line_naming_the_command(
    argv: list[str], expected: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("OMPI_COMM_WORLD_SIZE", raising=False)
    assert _main(argv, "0", monkeypatch) == 2
    err = capsys.readouterr().err
    assert err.startswith(expected) and err.count("\n") == 1, err


def test_bench_a2a_refuses_experts_that_do_not_divide_over_the_ranks() -> None:
    """`bench a2a` at 3 ranks: a usage error found before any exchange (alike on every rank),
    not a traceback from each rank's AllToAll."""
    from moe_a2a.bench import a2a
    from moe_a2a.usage import UsageError

    parser = cli.build_parser()
    args = parser.parse_args(["bench", "a2a", "--mode", "decode"])
    args.mode = args.mode or "both"
    with pytest.raises(
        UsageError, match=r"^--num-experts: got 256 \(decode\), which is not divisible by the 3"
    ):
        a2a.check_shapes(args, 3)
    a2a.check_shapes(args, 4)
    args = parser.parse_args(["bench", "a2a", "--mode", "decode", "--num-experts", "4", "--topk", "8"])
    with pytest.raises(UsageError, match=r"^--topk: got 8; expected at most --num-experts=4"):
        a2a.check_shapes(args, 2)


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--fabric-rows", "expert,rank"], "--fabric-rows: got expert,rank"),
        (["--num-groups", "8", "--topk-groups", "4"], "--num-groups: got 8"),
        (["--tokens", "64"], "--tokens: got 64"),
        (["--dispatch-dtype", "bf16"], "--dispatch-dtype: got bf16"),
    ],
)
def test_bench_a2a_cuda_refuses_what_its_per_phase_benchmark_would_ignore(
    flags: list[str], named: str
) -> None:
    """`--device cuda` without `--baseline` runs the per-phase CUDA benchmark, whose shapes and
    mode are fixed: a flag it would drop is an error naming it (and --baseline), not a table
    of something else."""
    import argparse

    from moe_a2a.bench import a2a
    from moe_a2a.usage import UsageError

    args = cli.build_parser().parse_args(["bench", "a2a", "--device", "cuda", *flags])
    args.mode, args.dispatch_dtype = "both", args.dispatch_dtype or "fp8"
    with pytest.raises(UsageError, match=f"^{named}; .*--baseline mpi"):
        a2a._run_cuda(argparse.Namespace(**vars(args)))


def test_info_switch_table_fits_the_terminal_and_hides_test_switches(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("COLUMNS", "100")
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    switches = out[out.index("environment switches") :].splitlines()
    assert max(map(len, switches)) <= 100, max(switches, key=len)
    assert "MOE_A2A_PROVIDER" in out and "MOE_A2A_TEST_" not in out and "MOE_A2A_RANK_LOGS" not in out
    assert "for tests only: --all" in switches[0]
    assert cli.main(["info", "--all"]) == 0
    out = capsys.readouterr().out
    assert "MOE_A2A_TEST_PROVIDER" in out and "MOE_A2A_TEST_DELAY_WRITES_MS" in out
