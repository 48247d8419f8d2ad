"""The README's `moe-a2a` command lines, run as printed, so that they stay true.

Every `moe-a2a` line of the README's bash and console blocks is parsed by the
real parser. The cheap ones (`--version`, `info`, the tiny `run` under mpirun,
`trace summary`, `trace plot`) are also run, in that order and in one empty
folder, as a new user would after the quick start; the `bench` lines are only
parsed, as they take a minute each on a small machine.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from moe_a2a import cli

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
#: Subcommands run for real; any other `moe-a2a` line is only parsed.
RUN = ("--version", "info", "run", "trace")


def readme_commands() -> list[list[str]]:
    """The words of each README command line that starts `moe-a2a` or `mpirun ... moe-a2a`."""
    commands = []
    for lang, body in re.findall(r"```(bash|console)\n(.*?)```", README.read_text(), flags=re.S):
        for line in body.splitlines():
            if lang == "console":
                if not line.startswith("$ "):
                    continue
                line = line[2:]
            words = shlex.split(line, comments=True)
            if "moe-a2a" in words and words[0] in ("moe-a2a", "mpirun"):
                commands.append(words)
    return commands


def _cli_args(words: list[str]) -> list[str]:
    return words[words.index("moe-a2a") + 1 :]


def test_readme_has_the_quick_start_commands() -> None:
    subcommands = [" ".join(_cli_args(w)[:2]) for w in readme_commands()]
    for wanted in ("run --mode", "trace summary", "trace plot", "bench a2a", "bench fabric"):
        assert any(s.startswith(wanted) for s in subcommands), (wanted, subcommands)


@pytest.mark.parametrize("words", readme_commands(), ids=lambda w: " ".join(w))
def test_readme_command_parses(words: list[str]) -> None:
    args = _cli_args(words)
    if args == ["--version"]:
        return  # argparse's version action exits; run below
    parsed = cli.build_parser().parse_args(args)
    assert callable(parsed.func)


@pytest.mark.timeout(600)
def test_readme_quick_start_runs(tmp_path: Path) -> None:
    bindir = os.path.dirname(sys.executable)
    if shutil.which("moe-a2a", path=bindir) is None:
        pytest.skip(f"moe-a2a is not installed next to {sys.executable}")
    commands = [w for w in readme_commands() if _cli_args(w)[0] in RUN]
    if any(w[0] == "mpirun" for w in commands) and shutil.which("mpirun") is None:
        pytest.skip("mpirun is not on PATH")
    if os.geteuid() == 0:
        # The normal user's form beside them cannot run as root; the root form must.
        commands = [w for w in commands if w[0] != "mpirun" or "--allow-run-as-root" in w]
    env = {**os.environ, "PATH": f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}"}
    ran = []
    for words in commands:
        # In a fresh folder: `run --trace out/run.h5` must make out/ itself.
        done = subprocess.run(words, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        output = f"{done.stdout}\n{done.stderr}"
        assert done.returncode == 0, f"{shlex.join(words)}: exit {done.returncode}\n{output}"
        ran.append(_cli_args(words)[0])
    assert set(ran) == set(RUN), ran
    assert (tmp_path / "out" / "run.h5").is_file()
    assert sorted(p.name for p in (tmp_path / "out" / "plots").iterdir())
