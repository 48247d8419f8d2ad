"""tools/gpu/profile_step.py's step timeline, on made-up kernel records (the GPU part needs a GPU)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("torch")
ROOT = Path(__file__).resolve().parents[2]


def _profile_step():
    spec = importlib.util.spec_from_file_location("profile_step", ROOT / "tools" / "gpu" / "profile_step.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_step_timeline_medians_from_each_steps_first_kernel() -> None:
    # Four replays 100 us apart; the plan starts later in one of them; the
    # profiler's window cut the last replay after its first kernel.
    kernels = []
    for i, plan_start in enumerate([5.0, 5.0, 7.0, 5.0]):
        t0 = 100.0 * i
        kernels += [(t0, t0 + 9.0, "route_pack_kernel"), (t0 + plan_start, t0 + 11.0, "plan_kernel")]
        kernels.append((t0 + 11.5, t0 + 16.0, "copy_kernel"))
    kernels.append((400.0, 409.0, "route_pack_kernel"))
    rows, replayed = _profile_step().step_timeline(sorted(kernels))
    assert replayed == 3  # the first whole step and the cut one are left out
    assert rows == [("route_pack_kernel", 0.0, 9.0), ("plan_kernel", 5.0, 11.0), ("copy_kernel", 11.5, 16.0)]
