"""tools/gpu/run_cuda_tests.sh and ab.sh answer --help and bad arguments, building nothing."""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tools" / "gpu" / "run_cuda_tests.sh"
AB = ROOT / "tools" / "gpu" / "ab.sh"


def _run(*args: str, out: Path, script: Path = SCRIPT) -> subprocess.CompletedProcess[str]:
    env = {"PATH": "/usr/bin:/bin", "OUT": str(out)}
    return subprocess.run(["bash", str(script), *args], capture_output=True, text=True, env=env, timeout=30)


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
        "gpudirect peerloss (see --help)"
    )
    assert not (tmp_path / "out").exists()


def test_ab_help_and_bad_arguments_make_nothing(tmp_path: Path) -> None:
    out = tmp_path / "out"
    done = _run("--help", out=out, script=AB)
    assert done.returncode == 0 and "git archive REV python/moe_a2a" in done.stdout, done.stderr
    assert "git archive REV | tar" in done.stdout
    done = _run(out=out, script=AB)
    assert done.returncode == 2 and "usage: ab.sh OLD [ROUNDS]" in done.stderr
    done = _run(str(tmp_path), out=out, script=AB)
    assert done.returncode == 2
    want = f"OLD: got '{tmp_path}', which holds neither a moe_a2a package nor a moe-a2a source tree"
    assert want in done.stderr
    for old in (ROOT / "python" / "moe_a2a", ROOT):  # a package, a tree
        done = _run(str(old), "0", out=out, script=AB)
        assert done.returncode == 2 and "ROUNDS: got '0'; expected a whole number >= 1" in done.stderr
    env = {"PATH": "/usr/bin:/bin", "OUT": str(out), "NP": "two"}
    done = subprocess.run(["bash", str(AB), str(ROOT)], capture_output=True, text=True, env=env, timeout=30)
    assert done.returncode == 2 and "NP: got 'two'; expected a whole number >= 1" in done.stderr
    assert not out.exists()
