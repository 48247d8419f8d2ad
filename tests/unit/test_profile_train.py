"""tools/gpu/profile_train.py's per-phase timeline, on a made-up Chrome trace (the GPU part needs a GPU)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
ROOT = Path(__file__).resolve().parents[2]


def _profile_train():
    path = ROOT / "tools" / "gpu" / "profile_train.py"
    spec = importlib.util.spec_from_file_location("profile_train", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["profile_train"] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


def _span(name: str, ts: float, dur: float) -> dict:
    return {"ph": "X", "cat": "user_annotation", "name": name, "ts": ts, "dur": dur}


def _kernel(name: str, ts: float, dur: float) -> dict:
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur}


def test_phase_timeline_medians_and_idle_gaps() -> None:
    pt = _profile_train()
    forward, backward = pt.PHASES
    events = []
    for step, first in enumerate([100.0, 104.0, 101.0]):
        t0 = 10_000.0 * step
        events += [_span(forward, t0, 900.0), _kernel("route", t0 + first, 10.0)]
        events.append(_kernel("copy", t0 + first + 12.0, 700.0))  # 2 us idle after route
        events += [_span(backward, t0 + 1_000.0, 1_100.0), _kernel("receive", t0 + 1_160.0, 900.0)]
    events.append(_kernel("later", 50_000.0, 5.0))  # outside every phase: ignored
    t = pt.phase_timelines(events)
    fwd, bwd = t[forward], t[backward]
    assert fwd.steps == 3 and fwd.span_us == 900.0
    assert fwd.kernels == [("route", 0 + 101.0, 10.0, 101.0), ("copy", 113.0, 700.0, 2.0)]
    assert fwd.idle_after_us == 900.0 - 813.0
    assert bwd.kernels == [("receive", 160.0, 900.0, 160.0)] and bwd.idle_after_us == 40.0
    assert fwd.busy_us == 710.0 and fwd.idle_us == 101.0 + 2.0 + 87.0
    assert bwd.busy_us + bwd.idle_us == bwd.span_us


def test_phase_timeline_refuses_steps_that_ran_other_kernels() -> None:
    pt = _profile_train()
    forward, backward = pt.PHASES
    events = [_span(forward, 0.0, 500.0), _kernel("a", 10.0, 5.0), _span(forward, 1_000.0, 500.0)]
    events.append(_kernel("b", 1_010.0, 5.0))
    t = pt.phase_timelines(events)
    assert "not the same kernels" in t[forward]
    assert "no kernels" in t[backward]  # no backward span at all


COMPILED = ["--compile", "--compiled-rows", "capacity"]


@pytest.mark.parametrize("extra", [[], COMPILED], ids=["eager", "compiled"])
def test_host_marks_runs_on_the_cpu(extra: list[str]) -> None:
    """tools/gpu/host_marks.py --device cpu: every layer of both phases noted, in call order;
    compiled, from Inductor's graph to the layers the operators' kernels call."""
    import subprocess

    tool = ROOT / "tools" / "gpu" / "host_marks.py"
    run = subprocess.run(
        [sys.executable, str(tool), "--device", "cpu", "--steps", "3", *extra],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    forward, backward = run.stdout.split("backward: ")
    first = "CompiledFxGraph.__call__" if extra else "ExpertParallel.dispatch"
    for layer in (first, "CpuBackend.dispatch_send", "CpuBackend.combine_recv", "(done)"):
        assert layer in forward, f"{layer} missing from the forward:\n{forward}"
    bwd = (
        ("ExpertParallel._backward_combine", "ExpertParallel._backward_dispatch")
        if extra
        else (
            "_CombineFn.backward",
            "_DispatchFn.backward",
        )
    )
    for layer in (*bwd, "CpuBackend.combine_recv returns"):
        assert layer in backward, f"{layer} missing from the backward:\n{backward}"
    us = [float(line.split()[0]) for line in forward.splitlines()[1:] if line.strip()]
    assert us == sorted(us), f"the forward's marks are not in call order:\n{forward}"
