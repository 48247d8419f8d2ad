"""What the benchmarks print and write, without MPI: help with defaults, the agreed columns, --output names.

The runs themselves (config block, progress on rank 0 only, CSV and JSON files) are
tested under mpirun in tests/mpi/test_bench_a2a.py and test_bench_train.py.
"""

from __future__ import annotations

import argparse
import os

import numpy as np
import pytest

from moe_a2a import cli, report
from moe_a2a.bench import a2a, a2a_bytes, a2a_cuda, common, engine_ref, fabric, train
from moe_a2a.usage import UsageError

# Columns every moe-a2a-against-a-baseline table has, in this order, after its labels.
COMPARED = [
    "moe-a2a p50 (us)",
    "moe-a2a p99 (us)",
    "baseline p50 (us)",
    "baseline p99 (us)",
    "baseline/moe-a2a",
]


def cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _subparser(parser: argparse.ArgumentParser, *names: str) -> argparse.ArgumentParser:
    for name in names:
        (sub,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = sub.choices[name]
    return parser


def _standalone_cuda_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    a2a_cuda.add_arguments(parser)
    return parser


@pytest.mark.parametrize(
    "parser",
    [
        pytest.param(lambda: _subparser(cli.build_parser(), "bench", "a2a"), id="bench a2a"),
        pytest.param(lambda: _subparser(cli.build_parser(), "bench", "fabric"), id="bench fabric"),
        pytest.param(_standalone_cuda_parser, id="a2a_cuda"),
    ],
)
def test_every_benchmark_flag_says_its_default(parser: object) -> None:
    p = parser()  # type: ignore[operator]
    flags = [a for a in p._actions if a.option_strings and not isinstance(a, argparse._HelpAction)]
    assert flags
    missing = [a.option_strings[0] for a in flags if "default" not in (a.help or "")]
    assert missing == []
    help_text = p.format_help()
    assert "(default: 20)" in help_text or "(default: 100)" in help_text


def test_bench_output_of_another_kind_is_a_usage_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "0")
    for argv in (["bench", "a2a", "--output", "x.txt"], ["bench", "fabric", "--output", "x.txt"]):
        with pytest.raises(SystemExit) as exc:
            cli.main(argv)
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert "argument --output: got 'x.txt'; expected a file name ending in .csv" in err, err


def _samples(ours: float, base: float) -> list[float]:
    return [ours * 1e3 * (1 + i / 10) for i in range(10)], [base * 1e3 * (1 + i / 10) for i in range(10)]


def test_bench_a2a_rows_and_table() -> None:
    (od, bd), (oc, bc) = _samples(10, 30), _samples(20, 20)
    result = dict(
        shape="decode",
        tokens=128,
        samples_ns={"base_dispatch": bd, "base_combine": bc},
        modes={"rank": {"samples_ns": {"ours_dispatch": od, "ours_combine": oc}}},
    )
    rows = a2a.rows_of(result)
    assert [r["phase"] for r in rows] == ["dispatch", "combine", "total"]
    assert {r["fabric_rows"] for r in rows} == {"rank"}
    dispatch, combine, total = rows
    assert dispatch["moe_a2a_p50_us"] == pytest.approx(np.percentile(od, 50) / 1e3)
    assert dispatch["ratio"] == pytest.approx(3.0) and combine["ratio"] == pytest.approx(1.0)
    # total: percentiles of each iteration's dispatch + combine, not sums of percentiles
    assert total["moe_a2a_p99_us"] == pytest.approx(np.percentile(np.add(od, oc), 99) / 1e3)
    lines = a2a.format_table(rows).splitlines()
    assert cells(lines[0]) == ["shape", "tokens/rank", "fabric_rows", "phase", *COMPARED]
    assert cells(lines[2])[:4] == ["decode", "128", "rank", "dispatch"] and cells(lines[2])[-1] == "3.00"


def test_bench_a2a_graph_rows_compare_the_replayed_step_with_the_baseline_step() -> None:
    """--graph: each mode gets a `graph` row, the replayed step against the baseline's
    dispatch + combine of the same iterations."""
    (od, bd), (oc, bc), (og, _) = _samples(10, 30), _samples(20, 20), _samples(25, 0)
    result = dict(
        shape="decode",
        tokens=128,
        samples_ns={"base_dispatch": bd, "base_combine": bc},
        modes={
            "rank": {"samples_ns": {"ours_dispatch": od, "ours_combine": oc, "ours_graph": og}},
            "node": {"samples_ns": {"ours_dispatch": od, "ours_combine": oc}},
        },
    )
    rows = a2a.rows_of(result)
    assert [(r["fabric_rows"], r["phase"]) for r in rows][3:5] == [("rank", "graph"), ("node", "dispatch")]
    graph = rows[3]
    assert graph["moe_a2a_p50_us"] == pytest.approx(np.percentile(og, 50) / 1e3)
    assert graph["ratio"] == pytest.approx(2.0)  # 50 us of baseline dispatch + combine over 25


@pytest.mark.parametrize("flags", [["--device", "cpu"], ["--device", "cuda"]])
def test_bench_a2a_graph_needs_cuda_and_a_baseline(flags: list[str]) -> None:
    from moe_a2a.usage import UsageError

    args = cli.build_parser().parse_args(["bench", "a2a", "--graph", *flags])
    with pytest.raises(UsageError, match=r"^--graph: got it with --device .*; expected --device cuda and a"):
        a2a.check_graph(args)
    a2a.check_graph(
        cli.build_parser().parse_args(["bench", "a2a", "--graph", "--device", "cuda", "--baseline", "mpi"])
    )


def test_bench_a2a_modes_take_turns_at_running_first() -> None:
    modes = ["expert", "rank", "node"]
    orders = [a2a.in_turn(modes, it) for it in range(6)]
    assert orders[:3] == [["expert", "rank", "node"], ["rank", "node", "expert"], ["node", "expert", "rank"]]
    assert orders[3:] == orders[:3]
    # each mode runs first equally often
    assert sorted(o[0] for o in orders) == sorted(modes * 2)
    assert a2a.in_turn(["rank"], 5) == ["rank"] and a2a.in_turn([], 3) == []


def test_bench_a2a_byte_rows_per_mode_with_ratios_to_expert() -> None:
    def mode(fabric: int, node: int, rows: int, ranks: int, ns: float) -> dict:
        tally = dict(
            fabric_bytes=fabric,
            node_bytes=node,
            fabric_rows=rows,
            tokens=100,
            copies=600,
            ranks=ranks,
            ranks_max=4,
        )
        return {"samples_ns": {"ours_dispatch": [ns] * 3, "ours_combine": [ns] * 3}, "bytes": tally}

    result = dict(
        shape="prefill",
        bound={"ranks": 4, "nodes": 4},
        modes={"expert": mode(4000, 100, 600, 300, 2e6), "rank": mode(2000, 100, 300, 300, 1e6)},
    )
    expert, rank = a2a_bytes.rows_of(result)
    assert (expert["fabric_b_per_token"], rank["fabric_b_per_token"], rank["node_b_per_token"]) == (40, 20, 1)
    assert (expert["fabric_rows_per_token"], rank["fabric_rows_per_token"]) == (6, 3)
    assert rank["copies_per_token"] == 6 and rank["remote_ranks_per_token"] == 3 and rank["ranks_bound"] == 4
    assert rank["total_p50_us"] == pytest.approx(2e3)
    assert (rank["bytes_vs_expert"], rank["time_vs_expert"]) == pytest.approx((2.0, 2.0))
    assert (expert["bytes_vs_expert"], expert["time_vs_expert"]) == pytest.approx((1.0, 1.0))
    lines = a2a_bytes.format_table([expert, rank]).splitlines()
    assert cells(lines[0]) == [h for _, h in a2a_bytes.COLUMNS]
    assert cells(lines[3])[:3] == ["prefill", "rank", "20.00"] and cells(lines[3])[-2:] == ["2.00", "2.00"]


def test_bench_a2a_config_block_names_sizes_and_baseline() -> None:
    s = dict(
        world=4,
        ranks_per_node=1,
        provider="tcp",
        device="cpu",
        baseline="MPI",
        dispatch_dtype="fp8",
        combine_dtype="bf16",
        iters=20,
        warmup=3,
        shapes={"decode": dict(tokens=128, hidden=7168, num_experts=256, topk=8)},
    )
    lines = a2a.format_config(s).splitlines()
    assert lines[0] == "moe-a2a bench a2a"
    keys = [line.split(":")[0].strip() for line in lines[1:]]
    assert keys == ["ranks", "provider", "device", "baseline", "payloads", "sizes", "iterations", "switches"]
    assert "decode 128 tokens/rank, hidden 7168, 256 experts, top-8" in lines[6]


def test_bench_train_rows_pair_moe_a2a_with_each_baseline() -> None:
    ours = train.Contender(train.OURS, lambda *a: None, fwd_ns=[1e3, 2e3], bwd_ns=[3e3, 3e3])
    titan = train.Contender(train.ALL_TO_ALL, lambda *a: None, fwd_ns=[4e3, 8e3], bwd_ns=[6e3, 6e3])
    rows = train.summarize([ours, titan])
    assert [(r["phase"], r["baseline"]) for r in rows] == [
        ("fwd", train.ALL_TO_ALL),
        ("bwd", train.ALL_TO_ALL),
        ("fwd+bwd", train.ALL_TO_ALL),
    ]
    assert [r["ratio"] for r in rows] == pytest.approx([4.0, 2.0, 12.0 / 4.5])
    alone = train.summarize([ours])
    assert [r["baseline"] for r in alone] == [None, None, None] and alone[0]["ratio"] is None
    header = report.columns_table(train.COLUMNS, rows).splitlines()[0]
    assert cells(header) == ["phase", "baseline", *COMPARED]


def _cuda_result(world: int, **more: object) -> dict[str, object]:
    """A shape's result as run_shape returns it (every phase 0.1 ms at 1000 GB/s)."""
    phase = {"ms": 0.1, "gbs": 1000.0}
    return dict(
        shape="decode",
        tokens=128,
        world=world,
        copy_gbs=4000.0,
        step_ms=0.5,
        torch_native_ms=2.0,
        phases_ms=0.4,
        step_bytes=10**9,
        **{p: dict(phase) for p in a2a_cuda.PHASES},
        **more,
    )


def test_bench_a2a_cuda_rows_and_table() -> None:
    res = _cuda_result(1, graph_step_ms=0.2, graph_span_ms=0.1)
    rows = a2a_cuda.rows_of([res])
    assert [r["phase"] for r in rows] == [*a2a_cuda.PHASES, "step"]
    step = rows[-1]
    assert step["ratio"] == pytest.approx(4.0) and step["graph_replay_us"] == pytest.approx(200.0)
    assert rows[0]["pct_of_copy"] == pytest.approx(25.0)
    lines = a2a_cuda.format_table(rows).splitlines()
    assert cells(lines[0]) == [h for _, h in a2a_cuda.COLUMNS]
    assert "baseline/moe-a2a" in cells(lines[0]) and cells(lines[2])[5] == "25"
    assert cells(lines[-1])[-4:] == ["2000.0", "4.00", "250.0", "200.0"]
    rows_path = {"path": "gpu-direct", "reason": "FI_HMEM, iface CUDA, FI_HMEM_DEVICE_ONLY (CUDA IPC)"}
    res.update(ranks_per_node=1, fill_gbs=3000.0, rows_path=rows_path, fabric_rows="node")
    args = argparse.Namespace(provider="shm", iters=10, warmup=3, rounds=4, shapes=["decode"])
    config = a2a_cuda.format_config(a2a_cuda.settings_of(args, 1, [res])).splitlines()
    assert config[0] == "moe-a2a bench a2a --device cuda"
    assert "gpu-direct (FI_HMEM, iface CUDA" in config[3]  # the rows' path each figure measured
    assert config[4].split() == ["fabric_rows:", "node"]  # "auto" resolved: the mode measured
    assert "decode 128 tokens/rank, hidden 7168, 256 experts, top-8" in config[8]
    assert [line.split(":")[0].strip() for line in config[1:]] == [
        *(
            "ranks",
            "provider",
            "rows' path",
            "fabric_rows",
            "device",
            "baseline",
            "payloads",
            "sizes",
            "iterations",
            "ceilings",
            "tuning",
            "switches",
        )
    ]
    assert config[11].split(":", 1)[1].strip() == report.tuning_set()  # the build's launch tuning


def test_bench_a2a_cuda_compares_whole_phases_with_the_engine_alone() -> None:
    # Samples as run_shape records them with every peer remote (ns of the timed iterations).
    whole = {"dispatch": [4e6, 5e6, 9e6], "combine": [3e6, 3e6, 4e6]}
    engine = {"dispatch": [2e6, 2.5e6, 2e6], "combine": [1e6, 2e6, 1.5e6]}
    rows = a2a_cuda.rows_of([_cuda_result(2, whole_ns=whole, engine_ns=engine)])
    assert [r["phase"] for r in rows] == [*a2a_cuda.PHASES, "dispatch", "combine", "total", "step"]
    dispatch, combine, total = rows[4:7]
    got = [(r["moe_a2a_us"], r["engine_p50_us"], r["phase_engine"]) for r in (dispatch, combine)]
    assert got == [pytest.approx((5000.0, 2000.0, 2.5)), pytest.approx((3000.0, 1500.0, 2.0))]
    # total: each iteration's dispatch + combine (7, 8, 13 ms; engine 3, 4.5, 3.5 ms), not sums of medians
    assert total["moe_a2a_us"] == pytest.approx(8000.0) and total["engine_p50_us"] == pytest.approx(3500.0)
    assert total["phase_engine"] == pytest.approx(8 / 3.5)
    # The halves and the step are not compared with the engine; every engine row has the shape.
    assert all("engine_p50_us" not in r for r in rows[:4] + rows[7:])
    assert all(r["shape"] == "decode" and r["tokens"] == 128 for r in rows)
    lines = a2a_cuda.format_table(rows).splitlines()
    # The same two columns and headers as `bench a2a` on the CPU (times in this table's .1f).
    assert cells(lines[0]) == [h for _, h in a2a_cuda.COLUMNS + a2a.ENGINE_COLUMNS]
    assert cells(lines[6])[2:4] == ["dispatch", "5000.0"] and cells(lines[6])[-2:] == ["2000.0", "2.50"]
    assert cells(lines[2])[-2:] == ["-", "-"]
    note = a2a_cuda.note_of(rows)
    assert note.startswith(a2a_cuda.NOTE) and note.endswith(engine_ref.NOTE)
    assert "dispatch, combine: each whole phase (send and recv halves) in one span" in note


def test_bench_a2a_cuda_compares_rows_paths_side_by_side() -> None:
    """--rows-path staged,gpu-direct: one result per shape and path; the table names each row's
    path, and a second table gives staged over GPU-direct per phase."""
    staged = _cuda_result(2, path="staged")
    direct = {**_cuda_result(2, path="gpu-direct"), "step_ms": 0.25}
    for phase in a2a_cuda.PHASES:
        direct[phase] = {"ms": 0.05, "gbs": 2000.0}
    rows = a2a_cuda.rows_of([staged, direct])
    lines = a2a_cuda.format_table(rows).splitlines()
    assert cells(lines[0])[:4] == ["shape", "tokens/rank", "rows' path", "phase"]
    assert [cells(line)[2] for line in lines[2:]] == ["staged"] * 5 + ["gpu-direct"] * 5
    compared = a2a_cuda.path_rows(rows)
    assert [(r["phase"], r["staged_over_direct"]) for r in compared] == [
        *((p, pytest.approx(2.0)) for p in a2a_cuda.PHASES),
        ("step", pytest.approx(2.0)),
    ]
    assert a2a_cuda.path_rows(a2a_cuda.rows_of([staged])) == []  # one path: nothing to compare


def test_rows_path_flag_and_the_forced_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    from moe_a2a.bench.args import rows_paths

    assert rows_paths("staged,gpu-direct") == ["staged", "gpu-direct"]
    for bad in ("staged,staged", "direct", ""):
        with pytest.raises(argparse.ArgumentTypeError, match="expected distinct paths of"):
            rows_paths(bad)
    monkeypatch.setenv("MOE_A2A_GPU_DIRECT", "auto-was-here")
    with a2a_cuda.forced_path("staged"):
        assert os.environ["MOE_A2A_GPU_DIRECT"] == "0"
    assert os.environ["MOE_A2A_GPU_DIRECT"] == "auto-was-here"
    monkeypatch.delenv("MOE_A2A_GPU_DIRECT")
    with a2a_cuda.forced_path("gpu-direct"):
        assert os.environ["MOE_A2A_GPU_DIRECT"] == "1"
    assert "MOE_A2A_GPU_DIRECT" not in os.environ
    # Only the per-phase CUDA benchmark compares paths.
    args = cli.build_parser().parse_args(["bench", "a2a", "--rows-path", "staged,gpu-direct"])
    with pytest.raises(UsageError, match=r"^--rows-path: got staged,gpu-direct; only the per-phase CUDA"):
        a2a.main(args)


def test_bench_a2a_cuda_without_remote_peers_has_no_engine_columns() -> None:
    rows = a2a_cuda.rows_of([_cuda_result(2)])
    assert cells(a2a_cuda.format_table(rows).splitlines()[0]) == [h for _, h in a2a_cuda.COLUMNS]
    assert a2a_cuda.note_of(rows) == a2a_cuda.NOTE


def test_bench_a2a_footnote_explains_the_engine_column_only_with_it() -> None:
    rows = [{"phase": "dispatch", "moe_a2a_p50_us": 5.0}]
    assert a2a.note_of(rows) == a2a.NOTE and "moe-a2a/engine" not in a2a.NOTE
    rows[0].update(engine_p50_us=2.0, phase_engine=2.5)
    assert a2a.note_of(rows) == f"{a2a.NOTE}; {engine_ref.NOTE}"


def test_engine_fields_are_the_p50_and_the_phase_over_it() -> None:
    assert engine_ref.fields(30.0, [10e3, 20e3, 40e3]) == {"engine_p50_us": 20.0, "phase_engine": 1.5}
    assert engine_ref.fields(30.0, []) == {"engine_p50_us": None, "phase_engine": None}


def test_bench_fabric_columns_use_the_same_words() -> None:
    row = fabric.Row(1024, 10.0, 12.0, 30.0, 33.0, 3.0, 0.1, 0.03)
    header = cells(fabric.format_table([row]).splitlines()[0])
    assert header[1:6] == [
        "moe-a2a p50 (us)",
        "moe-a2a p90 (us)",
        "baseline p50 (us)",
        "baseline p90 (us)",
        "baseline/moe-a2a",
    ]


def test_bench_fabric_says_what_transport_each_side_used() -> None:
    """MPI's transport comes from the launcher's settings; one host on Open MPI's default is
    shared memory against moe-a2a's tcp, which the output says is not like with like."""
    ompi = {"OMPI_COMM_WORLD_SIZE": "4"}
    default = common.mpi_transport(ompi, one_host=True)
    assert default == "Open MPI's default: shared memory (one host)"
    assert "not like with like" in (common.transport_warning("tcp", default) or "")
    assert (
        common.transport_warning("shm", default) is None
        and common.transport_warning("shm (auto)", default) is None
    )
    forced = common.mpi_transport({**ompi, "OMPI_MCA_btl": "self,tcp"}, one_host=True)
    assert forced == "Open MPI btl self,tcp" and common.transport_warning("tcp", forced) is None
    assert common.mpi_transport(ompi, one_host=False).endswith(
        "shared memory within a host, tcp between hosts"
    )
