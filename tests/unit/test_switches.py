"""The switch registry: every MOE_A2A_* name in the project is declared, documented and parsed one way."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from moe_a2a import switches
from moe_a2a.trace import default_environment

ROOT = Path(__file__).resolve().parents[2]
NAME = re.compile(r"\bMOE_A2A_[A-Z0-9_]*[A-Z0-9]\b")
# Build-system variables (CMake, Spack) and C++ macros, not runtime switches.
BUILD = {
    "MOE_A2A_CUDA",
    "MOE_A2A_CUDA_ARCHITECTURES",
    "MOE_A2A_HAVE_CUDA",
    "MOE_A2A_VECTOR_CLONES",
    "MOE_A2A_FLAG_ACCESS",
    "MOE_A2A_HD",
}


def _used_names() -> set[str]:
    files = subprocess.run(
        ["git", "ls-files", "python", "src", "jobs", "tools", "tests"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    found: set[str] = set()
    for f in files:
        path = ROOT / f
        if path.is_file() and path.suffix not in (".png", ".h5"):
            found |= set(NAME.findall(path.read_text(errors="replace")))
    return found - BUILD


def test_every_switch_the_project_reads_is_declared() -> None:
    missing = sorted(_used_names() - set(switches.REGISTRY))
    assert not missing, f"declare these in moe_a2a.switches: {missing}"


def test_every_switch_is_in_the_docs_table() -> None:
    text = (ROOT / "docs" / "running.md").read_text()
    table = text[text.index("## Environment switches") :]
    absent = [name for name in switches.REGISTRY if f"`{name}`" not in table]
    assert not absent, f"docs/running.md's switch table lacks {absent}"


def test_slice_bytes_takes_zero_and_refuses_words(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MOE_A2A_SLICE_BYTES", "0")
    assert switches.slice_bytes() == 0
    monkeypatch.setenv("MOE_A2A_SLICE_BYTES", "4MB")
    expected = r"MOE_A2A_SLICE_BYTES: got '4MB'; expected a whole number, 0 or more"
    with pytest.raises(ValueError, match=expected):
        switches.check_all()


@pytest.mark.parametrize(
    ("raw", "value"), [("1", True), ("ON", True), ("yes", True), ("0", False), ("False", False)]
)
def test_on_off_words(monkeypatch: pytest.MonkeyPatch, raw: str, value: bool) -> None:
    monkeypatch.setenv("MOE_A2A_CUDA_FUSED_RECV", raw)
    assert switches.get("MOE_A2A_CUDA_FUSED_RECV") is value


def test_a_misspelt_value_is_an_error_naming_the_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    # Before the registry, "false" forced the one-launch receive on.
    monkeypatch.setenv("MOE_A2A_CUDA_FUSED_RECV", "flase")
    with pytest.raises(ValueError, match="MOE_A2A_CUDA_FUSED_RECV: got 'flase'; expected one of 1, true"):
        switches.check_all()
    monkeypatch.setenv("MOE_A2A_CUDA_FUSED_RECV", "false")
    monkeypatch.setenv("MOE_A2A_PROVIDER", "tpc")
    with pytest.raises(ValueError, match="MOE_A2A_PROVIDER: got 'tpc'"):
        switches.check_all()


def test_traces_record_the_set_switches(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MOE_A2A_CUDA_PDL", "0")
    monkeypatch.delenv("MOE_A2A_PROVIDER", raising=False)
    env = default_environment()
    assert '"MOE_A2A_CUDA_PDL": "0"' in env["switches"]
    assert "MOE_A2A_PROVIDER" not in env["switches"]


def test_info_lists_every_switch(capsys: pytest.CaptureFixture[str]) -> None:
    from moe_a2a.cli import main

    assert main(["info", "--all"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in switches.REGISTRY)
