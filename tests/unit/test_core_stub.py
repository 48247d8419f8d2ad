"""python/moe_a2a/_core.pyi is what nanobind's stub generator writes for the built module today."""

from __future__ import annotations

from pathlib import Path

import pytest

from moe_a2a import _core

STUB = Path(__file__).resolve().parents[2] / "python" / "moe_a2a" / "_core.pyi"
REGENERATE = "python -m nanobind.stubgen -q -m moe_a2a._core -o python/moe_a2a/_core.pyi"


def test_the_core_stub_is_current(tmp_path: Path) -> None:
    # The stub describes a build with the CUDA bindings (HAVE_CUDA, CudaAllToAll): a build
    # without nvcc has fewer names, so there is nothing to compare it with.
    if not _core.HAVE_CUDA:
        pytest.skip("moe_a2a._core was built without nvcc; the stub describes a CUDA build")
    stubgen = pytest.importorskip("nanobind.stubgen", reason="nanobind is not installed")
    fresh = tmp_path / "_core.pyi"
    stubgen.main(["-q", "-m", "moe_a2a._core", "-o", str(fresh)])
    assert fresh.read_text() == STUB.read_text(), (
        f"{STUB.name} differs from the bindings: regenerate it from the repository root with `{REGENERATE}`"
    )
