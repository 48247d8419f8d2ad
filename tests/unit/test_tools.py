"""tools/gpu/run_cuda_tests.sh answers --help and a wrong stage without building or running anything."""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tools" / "gpu" / "run_cuda_tests.sh"


def _run(*args: str, out: Path) -> subprocess.CompletedProcess[str]:
    env = {"PATH": "/usr/bin:/bin", "OUT": str(out)}
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=30)


def test_help_prints_usage_and_makes_nothing(tmp_path: Path) -> None:
    done = _run("--help", out=tmp_path / "out")
    assert done.returncode == 0, done.stderr
    assert "stages: build kernels multirank training bench" in done.stdout
    assert not (tmp_path / "out").exists()


def test_unknown_stage_is_a_usage_error(tmp_path: Path) -> None:
    done = _run("kernel", out=tmp_path / "out")
    assert done.returncode == 2
    assert done.stderr.strip() == (
        "run_cuda_tests.sh: unknown stage 'kernel'; expected any of: build kernels multirank training bench "
        "(see --help)"
    )
    assert not (tmp_path / "out").exists()
