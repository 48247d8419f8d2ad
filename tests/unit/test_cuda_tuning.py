"""The launch tuning of the CUDA kernels, as the core reports it and traces record it.

The kernels cannot run here, but their tuning table (src/a2a/cuda/tuning.h) is
compiled into every build that has nvcc, and a build without it says so.
"""

import json

from moe_a2a import _core
from moe_a2a.trace import default_environment

FAMILIES = {
    "route_pack",
    "pack",
    "route",
    "bulk",
    "plan",
    "entry",
    "copy",
    "row_copy",
    "stage",
    "return",
    "reduce",
    "wait",
    "grid",
}


def test_the_core_reports_the_tuning_of_its_build() -> None:
    tuning = _core.cuda_tuning()
    assert tuning["cuda"] is _core.HAVE_CUDA
    if not _core.HAVE_CUDA:
        assert tuning == {"cuda": False}
        return
    assert tuning["architectures"], "the build's CUDA architectures (MOE_A2A_CUDA_ARCHITECTURES)"
    families = {k: v for k, v in tuning.items() if isinstance(v, dict)}
    assert set(families) == FAMILIES
    for family, values in families.items():
        assert values, family
        assert all(isinstance(v, int) and v > 0 for v in values.values()), (family, values)
    # A block of the fused receive kernel runs the plan: both take one block size.
    assert families["plan"]["threads"] == families["copy"]["threads"]
    # Persistent grids are sized so every block is resident: at most 64 warps a multiprocessor.
    for family in ("pack", "bulk", "copy", "stage", "return"):
        warps = families[family]["threads"] // 32 * families[family]["blocks_per_sm"]
        assert warps <= 64, (family, warps)


def test_traces_record_the_tuning() -> None:
    env = default_environment()
    assert json.loads(env["cuda_tuning"]) == _core.cuda_tuning()
