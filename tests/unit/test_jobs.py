"""The job scripts in jobs/: shellcheck and bash -n, argument checks, the exact commands
their dry runs print (mpirun locally, srun under Slurm), that a real run executes
exactly that command, and the local launcher running the tiny decode job end to end.

Nothing here needs Slurm: the Slurm scripts are run with bash and the SLURM_*
variables an allocation would set, and a fake `srun`/`mpirun` records what a real
run would start.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
JOBS = ROOT / "jobs"
RUN_LOCAL = JOBS / "run-local.sh"
SBATCH = {mode: JOBS / "slurm" / f"{mode}.sbatch" for mode in ("decode", "prefill")}
PRESETS = ("cx7", "efa", "shm", "tcp")
ENTRY_SCRIPTS = [RUN_LOCAL, *SBATCH.values()]
ALL_SCRIPTS = sorted({*ENTRY_SCRIPTS, *JOBS.rglob("*.sh"), *JOBS.rglob("*.sbatch")})
PY = sys.executable

#: Variables the scripts read or set: cleared so the tests see only what they give.
_OWN_VARS = re.compile(r"^(FI_|MOE_A2A_|SLURM_|NCCL_|RDMAV_|UCX_)")


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not _OWN_VARS.match(k)}
    env["MOE_A2A_PYTHON"] = PY  # the interpreter running the tests, so the CLI is predictable
    env.update(extra)
    return env


def _run(
    script: Path, *args: str, env: dict[str, str] | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(script), *args],
        env=_env() if env is None else env,
        cwd=cwd or ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


def _split_env(argv: list[str]) -> tuple[list[str], list[str]]:
    """`env A=1 B=2 cmd args` -> (["A=1", "B=2"], ["cmd", "args"])."""
    assert argv[0] == "env", argv
    end = 1
    while "=" in argv[end]:
        end += 1
    return argv[1:end], argv[end:]


def _dry(script: Path, *args: str, **env: str) -> list[str]:
    """The command a dry run prints, split as the shell would."""
    result = _run(script, "--dry-run", *args, env=_env(**env))
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 1, f"a dry run prints one line, got: {result.stdout!r}"
    return shlex.split(lines[0])


@pytest.fixture
def fake_mpirun(tmp_path: Path) -> Path:
    """An Open MPI look-alike: answers --version, records argv and FI_/MOE_A2A_ variables."""
    script = tmp_path / "mpirun"
    script.write_text(
        "#!/usr/bin/env bash\n"
        'if [[ "${1:-}" == --version ]]; then echo "mpirun (Open MPI) 4.1.4"; exit 0; fi\n'
        'printf "%s\\n" "$0" "$@" > "$(dirname "$0")/argv"\n'
        'env | grep -E "^(FI_|MOE_A2A_PROVIDER|MOE_A2A_NUM_NICS|MOE_A2A_NICS|NCCL_|RDMAV_)" '
        '| sort > "$(dirname "$0")/env"\n'
    )
    script.chmod(0o755)
    return script


# ------------------------------------------------------------------ static checks


def test_the_expected_scripts_exist() -> None:
    assert RUN_LOCAL.is_file() and all(p.is_file() for p in SBATCH.values())
    assert sorted(p.stem for p in (JOBS / "presets").glob("*.sh")) == list(PRESETS)
    for script in ENTRY_SCRIPTS:
        assert os.access(script, os.X_OK), f"{script.relative_to(ROOT)} is not executable"


@pytest.mark.parametrize("script", ALL_SCRIPTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_bash_syntax(script: Path) -> None:
    result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("script", ALL_SCRIPTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_shellcheck(script: Path) -> None:
    shellcheck = shutil.which("shellcheck")
    if shellcheck is None:
        pytest.fail("shellcheck is not installed (apt-get install shellcheck; tools/quickstart.sh does)")
    # -x follows the `source` lines, so lib.sh is checked as the scripts use it.
    result = subprocess.run(
        [shellcheck, "-x", "--severity=style", str(script)], cwd=ROOT, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("script", ALL_SCRIPTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_strict_mode(script: Path) -> None:
    """Entry scripts run with set -euo pipefail; sourced files declare their shell."""
    text = script.read_text()
    if script in ENTRY_SCRIPTS:
        assert text.startswith("#!"), "an entry script starts with a shebang"
        assert "\nset -euo pipefail\n" in text
    else:
        assert text.startswith("# shellcheck shell=bash\n"), "a sourced file starts with its shell"


@pytest.mark.parametrize("script", ENTRY_SCRIPTS, ids=lambda p: p.name)
def test_help(script: Path) -> None:
    result = _run(script, "--help")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("Usage:")
    for word in ("--dry-run", "--preset", "--provider", "--model", "--iters", *PRESETS):
        assert word in result.stdout, f"--help does not mention {word}"


# ------------------------------------------------------------------ run-local.sh


def test_run_local_dry_run_prints_the_mpirun_command(fake_mpirun: Path) -> None:
    argv = _dry(
        RUN_LOCAL, "-n", "2", "--preset", "tcp", "--mode", "decode", "--model", "tiny", "--iters", "3",
        MOE_A2A_MPIRUN=str(fake_mpirun),
    )  # fmt: skip
    assert argv == [
        "env", "FI_PROVIDER=tcp", "MOE_A2A_PROVIDER=tcp", "FI_TCP_IFACE=lo",
        str(fake_mpirun), "--allow-run-as-root", "--oversubscribe", "--bind-to", "none", "-n", "2",
        PY, "-m", "moe_a2a.cli", "run", "--mode", "decode", "--model", "tiny", "--provider", "tcp",
        "--iters", "3",
    ]  # fmt: skip


def test_run_local_all_options(fake_mpirun: Path, tmp_path: Path) -> None:
    trace = tmp_path / "with space" / "t.h5"
    argv = _dry(
        RUN_LOCAL, "--ranks=8", "--preset", "shm", "--mode", "prefill", "--model", "deepseek-v3",
        "--iters", "5", "--warmup", "0", "--trace", str(trace), "--verify", "--ranks-per-node", "4",
        "--device", "cpu", "--", "--seed", "7",
        MOE_A2A_MPIRUN=str(fake_mpirun),
    )  # fmt: skip
    assert argv[:3] == ["env", "FI_PROVIDER=shm", "MOE_A2A_PROVIDER=shm"]
    cli = argv[argv.index(PY) :]
    assert cli == [
        PY, "-m", "moe_a2a.cli", "run", "--mode", "prefill", "--model", "deepseek-v3",
        "--provider", "shm", "--iters", "5", "--warmup", "0", "--trace", str(trace), "--verify",
        "--ranks-per-node", "4", "--device", "cpu", "--seed", "7",
    ]  # fmt: skip
    assert argv[argv.index("-n") + 1] == "8"


def test_run_local_other_mpi_gets_no_open_mpi_flags(tmp_path: Path) -> None:
    mpich = tmp_path / "mpiexec"
    mpich.write_text("#!/bin/sh\necho 'HYDRA build details:'\n")
    mpich.chmod(0o755)
    argv = _dry(RUN_LOCAL, MOE_A2A_MPIRUN=str(mpich))
    assert argv[argv.index(str(mpich)) + 1 : argv.index(PY)] == ["-n", "2"]


def test_real_run_executes_exactly_the_dry_run_command(fake_mpirun: Path, tmp_path: Path) -> None:
    args = ["-n", "3", "--preset", "efa", "--mode", "prefill", "--trace", str(tmp_path / "t" / "x.h5")]
    argv = _dry(RUN_LOCAL, *args, MOE_A2A_MPIRUN=str(fake_mpirun))
    result = _run(RUN_LOCAL, *args, env=_env(MOE_A2A_MPIRUN=str(fake_mpirun)))
    assert result.returncode == 0, result.stderr
    env_words, command = _split_env(argv)
    assert (tmp_path / "argv").read_text().splitlines() == command
    assert (tmp_path / "env").read_text().splitlines() == sorted(env_words)
    assert (tmp_path / "t").is_dir(), "the trace's directory is created before the run"
    assert "running: env FI_PROVIDER=efa" in result.stderr


@pytest.mark.parametrize(
    ("preset", "expected"),
    [
        ("tcp", ["FI_PROVIDER=tcp", "MOE_A2A_PROVIDER=tcp", "FI_TCP_IFACE=lo"]),
        ("shm", ["FI_PROVIDER=shm", "MOE_A2A_PROVIDER=shm"]),
        (
            "efa",
            ["FI_PROVIDER=efa", "MOE_A2A_PROVIDER=efa"]
            + ["FI_EFA_USE_DEVICE_RDMA=1", "FI_EFA_FORK_SAFE=1", "RDMAV_FORK_SAFE=1"]
            + ["FI_EFA_ENABLE_SHM_TRANSFER=0", "MOE_A2A_NUM_NICS=2"],
        ),
        (
            "cx7",
            ["FI_PROVIDER=verbs", "MOE_A2A_PROVIDER=verbs", "FI_VERBS_DEVICE_NAME=mlx5", "NCCL_IB_HCA=mlx5"]
            + ["MOE_A2A_NUM_NICS=1"],
        ),
    ],
)
def test_presets(preset: str, expected: list[str], fake_mpirun: Path) -> None:
    argv = _dry(RUN_LOCAL, "--preset", preset, MOE_A2A_MPIRUN=str(fake_mpirun))
    assert argv[1 : argv.index(str(fake_mpirun))] == expected
    assert argv[argv.index("--provider") + 1] == expected[0].split("=")[1]


def test_preset_keeps_the_callers_values(fake_mpirun: Path) -> None:
    mpirun = str(fake_mpirun)
    argv = _dry(RUN_LOCAL, "--preset", "efa", MOE_A2A_MPIRUN=mpirun, FI_EFA_FORK_SAFE="0")
    assert "FI_EFA_FORK_SAFE=0" in argv and "FI_EFA_FORK_SAFE=1" not in argv
    argv = _dry(RUN_LOCAL, "--preset", "tcp", MOE_A2A_MPIRUN=mpirun, MOE_A2A_TCP_IFACE="ens5")
    assert "FI_TCP_IFACE=ens5" in argv
    ib = {"MOE_A2A_IB_DEVICE": "mlx5_2", "MOE_A2A_IB_IFACE": "ib0"}
    argv = _dry(RUN_LOCAL, "--preset", "cx7", MOE_A2A_MPIRUN=mpirun, **ib)
    assert {"FI_VERBS_DEVICE_NAME=mlx5_2", "FI_VERBS_IFACE=ib0", "NCCL_IB_HCA=mlx5_2"} <= set(argv)
    # The provider follows the script, never a stale FI_PROVIDER of the caller.
    argv = _dry(RUN_LOCAL, "--preset", "shm", MOE_A2A_MPIRUN=mpirun, FI_PROVIDER="sockets")
    assert "FI_PROVIDER=shm" in argv and "FI_PROVIDER=sockets" not in argv


def test_provider_overrides_the_preset(fake_mpirun: Path) -> None:
    env = _env(MOE_A2A_MPIRUN=str(fake_mpirun))
    result = _run(RUN_LOCAL, "--preset", "tcp", "--provider", "shm", "--dry-run", env=env)
    assert result.returncode == 0, result.stderr
    argv = shlex.split(result.stdout)
    assert {"FI_PROVIDER=shm", "MOE_A2A_PROVIDER=shm"} <= set(argv)
    assert argv[argv.index("--provider") + 1] == "shm"
    assert "warning" in result.stderr and "'tcp'" in result.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["-n", "0"], "--ranks: got '0'; expected an integer >= 1"),
        (["--ranks", "two"], "--ranks: got 'two'; expected an integer >= 1"),
        (["--preset", "ib"], "--preset: got 'ib'; expected one of: cx7 efa shm tcp"),
        (["--mode", "serve"], "--mode: got 'serve'; expected one of: decode prefill train"),
        (["--provider", "psm3"], "--provider: got 'psm3'; expected one of: tcp shm efa verbs"),
        (["--model", "gpt"], "--model: got 'gpt'; expected one of: deepseek-v3 kimi-k2 tiny"),
        (["--iters", "0"], "--iters: got '0'; expected an integer >= 1"),
        (["--warmup", "-1"], "--warmup: got '-1'; expected an integer >= 0"),
        (["--ranks-per-node", "x"], "--ranks-per-node: got 'x'; expected an integer >= 1"),
        (["--device", "tpu"], "--device: got 'tpu'; expected one of: cpu cuda"),
        (["--trace", ""], "--trace: got ''; expected a file path"),
        (["--iters"], "--iters: missing value"),
        (["--frobnicate"], "unknown argument '--frobnicate'"),
    ],
)
def test_run_local_rejects_bad_arguments(args: list[str], message: str) -> None:
    result = _run(RUN_LOCAL, *args, "--dry-run") if args[-1] != "--iters" else _run(RUN_LOCAL, *args)
    assert result.returncode == 2
    assert f"run-local.sh: error: {message}" in result.stderr
    assert result.stdout == ""


def test_run_local_needs_a_cli(tmp_path: Path) -> None:
    """No MOE_A2A_PYTHON, no .venv, no moe-a2a on PATH: a real run stops and says what to do."""
    copy = tmp_path / "repo"
    shutil.copytree(JOBS, copy / "jobs")
    env = _env(PATH="/usr/bin:/bin")
    del env["MOE_A2A_PYTHON"]
    result = _run(copy / "jobs" / "run-local.sh", env=env)
    assert result.returncode == 2 and "no moe-a2a command found" in result.stderr
    assert "MOE_A2A_PYTHON" in result.stderr
    bad = _run(copy / "jobs" / "run-local.sh", env=_env(MOE_A2A_PYTHON="/nonexistent/python"))
    assert bad.returncode == 2 and "MOE_A2A_PYTHON: got '/nonexistent/python'" in bad.stderr


# ------------------------------------------------------------------ Slurm scripts

#: What an 8-GPU, 192-CPU node allocation (p5en) sets in the batch script's environment.
P5EN = {
    "SLURM_JOB_ID": "4242",
    "SLURM_JOB_NUM_NODES": "2",
    "SLURM_GPUS_ON_NODE": "8",
    "SLURM_NTASKS_PER_NODE": "8",
    "SLURM_CPUS_ON_NODE": "192",
}


@pytest.mark.parametrize("mode", ["decode", "prefill"])
def test_slurm_dry_run_prints_the_srun_command(mode: str, tmp_path: Path) -> None:
    argv = _dry(SBATCH[mode], "--preset", "efa", SLURM_SUBMIT_DIR=str(tmp_path), **P5EN)
    assert argv == [
        "env", "FI_PROVIDER=efa", "MOE_A2A_PROVIDER=efa", "FI_EFA_USE_DEVICE_RDMA=1",
        "FI_EFA_FORK_SAFE=1", "RDMAV_FORK_SAFE=1", "FI_EFA_ENABLE_SHM_TRANSFER=0", "MOE_A2A_NUM_NICS=2",
        "srun", "--export=ALL", "--kill-on-bad-exit=1", "--nodes=2", "--ntasks=16", "--ntasks-per-node=8",
        "--cpus-per-task=24", "--cpu-bind=cores", "--distribution=block:block",
        "--gpus-per-node=8", "--gpu-bind=none",
        PY, "-m", "moe_a2a.cli", "run", "--mode", mode, "--model", "deepseek-v3", "--provider", "efa",
        "--device", "cuda", "--trace", f"{tmp_path}/traces/{mode}-deepseek-v3-4242.h5",
    ]  # fmt: skip


def test_slurm_cx7_with_options(tmp_path: Path) -> None:
    env = {**P5EN, "SLURM_JOB_NUM_NODES": "4", "MOE_A2A_TRACE_DIR": str(tmp_path / "tr")}
    argv = _dry(
        SBATCH["decode"], "--preset", "cx7", "--model", "kimi-k2", "--iters", "100", "--warmup", "10",
        "--verify", "--srun-mpi", "pmix", "--", "--routing", "skewed", **env,
    )  # fmt: skip
    srun = argv[argv.index("srun") : argv.index(PY)]
    assert srun == [
        "srun", "--export=ALL", "--kill-on-bad-exit=1", "--nodes=4", "--ntasks=32", "--ntasks-per-node=8",
        "--cpus-per-task=24", "--cpu-bind=cores", "--distribution=block:block",
        "--gpus-per-node=8", "--gpu-bind=none", "--mpi=pmix",
    ]  # fmt: skip
    assert argv[argv.index(PY) :] == [
        PY, "-m", "moe_a2a.cli", "run", "--mode", "decode", "--model", "kimi-k2", "--provider", "verbs",
        "--device", "cuda", "--trace", f"{tmp_path}/tr/decode-kimi-k2-4242.h5",
        "--iters", "100", "--warmup", "10", "--verify", "--routing", "skewed",
    ]  # fmt: skip
    assert argv[1:3] == ["FI_PROVIDER=verbs", "MOE_A2A_PROVIDER=verbs"]


def test_slurm_cpu_only_cluster(tmp_path: Path) -> None:
    """sbatch --wrap / salloc on CPU nodes: tcp on the given interface, no GPU options, --device cpu."""
    env = {"SLURM_JOB_ID": "77", "SLURM_JOB_NUM_NODES": "3", "SLURM_NTASKS_PER_NODE": "4",
           "SLURM_CPUS_ON_NODE": "32", "MOE_A2A_TCP_IFACE": "ib0"}  # fmt: skip
    argv = _dry(SBATCH["prefill"], "--cpu", "--preset", "tcp", "--model", "tiny", "--trace", "/t/x.h5", **env)
    assert argv == [
        "env", "FI_PROVIDER=tcp", "MOE_A2A_PROVIDER=tcp", "FI_TCP_IFACE=ib0",
        "srun", "--export=ALL", "--kill-on-bad-exit=1", "--nodes=3", "--ntasks=12", "--ntasks-per-node=4",
        "--cpus-per-task=8", "--cpu-bind=cores", "--distribution=block:block",
        PY, "-m", "moe_a2a.cli", "run", "--mode", "prefill", "--model", "tiny", "--provider", "tcp",
        "--device", "cpu", "--trace", "/t/x.h5",
    ]  # fmt: skip


def test_slurm_tcp_defaults_to_the_default_route_interface() -> None:
    iface = "eth0"
    for line in Path("/proc/net/route").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[1] == "00000000":
            iface = fields[0]
            break
    argv = _dry(SBATCH["decode"], "--preset", "tcp", **P5EN)
    assert f"FI_TCP_IFACE={iface}" in argv
    # One node: the loopback, as on one host.
    argv = _dry(SBATCH["decode"], "--preset", "tcp", **{**P5EN, "SLURM_JOB_NUM_NODES": "1"})
    assert "FI_TCP_IFACE=lo" in argv


def test_slurm_dry_run_outside_slurm() -> None:
    """No allocation: 2 nodes, 8 ranks each, job id 'dryrun', and no CPU count to divide."""
    argv = _dry(SBATCH["decode"])
    assert "--nodes=2" in argv and "--ntasks=16" in argv and not any(w.startswith("--cpus") for w in argv)
    assert argv[-1].endswith("/traces/decode-deepseek-v3-dryrun.h5")


def test_slurm_refuses_shm_across_nodes() -> None:
    result = _run(SBATCH["decode"], "--preset", "shm", "--dry-run", env=_env(**P5EN))
    assert result.returncode == 2
    assert "--preset shm: its provider only reaches ranks on one host, and this job has 2 nodes" in (
        result.stderr
    )
    result = _run(SBATCH["decode"], "--preset", "efa", "--provider", "shm", "--dry-run", env=_env(**P5EN))
    assert result.returncode == 2 and "--provider shm" in result.stderr
    assert _run(SBATCH["decode"], "--preset", "shm", "--nodes", "1", "--dry-run").returncode == 0


def test_slurm_real_run_needs_an_allocation() -> None:
    result = _run(SBATCH["prefill"])
    assert result.returncode == 2
    assert "not inside a Slurm allocation" in result.stderr and "--dry-run" in result.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--nodes", "0"], "--nodes: got '0'; expected an integer >= 1"),
        (["--tasks-per-node", "a"], "--tasks-per-node: got 'a'; expected an integer >= 1"),
        (["--cpus-per-task", "0"], "--cpus-per-task: got '0'; expected an integer >= 1"),
        (["--preset", "ucx"], "--preset: got 'ucx'; expected one of: cx7 efa shm tcp"),
        (["--model", "llama"], "--model: got 'llama'; expected one of: deepseek-v3 kimi-k2 tiny"),
        (["--srun-mpi", "pmix;x"], "--srun-mpi: got 'pmix;x'; expected a Slurm MPI plugin name"),
        (["--mode", "decode"], "unknown argument '--mode'"),
    ],
)
def test_slurm_rejects_bad_arguments(args: list[str], message: str) -> None:
    result = _run(SBATCH["decode"], *args, "--dry-run")
    assert result.returncode == 2
    assert f"decode.sbatch: error: {message}" in result.stderr


def test_slurm_copy_finds_the_repository_through_the_submit_dir(tmp_path: Path) -> None:
    """Slurm runs a copy of the script from its spool directory."""
    spool = tmp_path / "spool" / "job4242"
    spool.mkdir(parents=True)
    shutil.copy(SBATCH["decode"], spool / "slurm_script")
    script = spool / "slurm_script"
    result = _run(script, "--dry-run", env=_env(**P5EN, SLURM_SUBMIT_DIR=str(ROOT)), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert f"{ROOT}/traces/decode-deepseek-v3-4242.h5" in result.stdout
    lost = _run(script, "--dry-run", env=_env(**P5EN, SLURM_SUBMIT_DIR=str(tmp_path)), cwd=tmp_path)
    assert lost.returncode == 2 and "cannot find the moe-a2a repository" in lost.stderr
    wrong = _run(script, "--dry-run", env=_env(**P5EN, MOE_A2A_HOME=str(tmp_path)), cwd=tmp_path)
    assert wrong.returncode == 2 and f"MOE_A2A_HOME: got '{tmp_path}'" in wrong.stderr


def test_slurm_real_run_executes_exactly_the_dry_run_command(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    srun = bin_dir / "srun"
    srun.write_text(f'#!/usr/bin/env bash\nprintf "%s\\n" "$0" "$@" > {tmp_path}/argv\n')
    srun.chmod(0o755)
    env = _env(**P5EN, SLURM_SUBMIT_DIR=str(tmp_path), PATH=f"{bin_dir}:{os.environ['PATH']}")
    dry = _run(SBATCH["decode"], "--preset", "tcp", "--iters", "3", "--dry-run", env=env)
    assert dry.returncode == 0, dry.stderr
    argv = shlex.split(dry.stdout)
    real = _run(SBATCH["decode"], "--preset", "tcp", "--iters", "3", env=env)
    assert real.returncode == 0, real.stderr
    _, command = _split_env(argv)
    launched = (tmp_path / "argv").read_text().splitlines()
    assert command[0] == "srun" and launched[1:] == command[1:]
    assert (tmp_path / "traces").is_dir(), "the trace directory is created before srun"
    assert "job 4242: 2 x 8 ranks, preset tcp" in real.stderr


def _shell_list(name: str) -> list[str]:
    match = re.search(rf"^{name}=\((.*)\)$", (JOBS / "lib.sh").read_text(), re.M)
    assert match, f"jobs/lib.sh: no {name}=(...)"
    return match.group(1).split()


def test_choices_match_the_python_side() -> None:
    """The scripts check --model, --mode and --provider before Python starts; same lists as the CLI."""
    probe = (
        "import json\n"
        "from moe_a2a.layers.presets import PRESETS\n"
        "from moe_a2a.layers.run_args import MODES\n"
        "from moe_a2a.fabric import PROVIDERS\n"
        "print(json.dumps([list(PRESETS), list(MODES), list(PROVIDERS)]))\n"
    )
    # A child process: importing the package must not start MPI in this one.
    result = subprocess.run([PY, "-c", probe], capture_output=True, text=True, timeout=120)
    if result.returncode != 0 and re.search(r"\b(ImportError|ModuleNotFoundError)\b", result.stderr):
        pytest.skip(f"moe_a2a cannot be imported: {result.stderr.strip().splitlines()[-1]}")
    assert result.returncode == 0, result.stderr
    models, modes, providers = json.loads(result.stdout)
    assert _shell_list("MOE_MODELS") == models
    assert _shell_list("MOE_MODES") == modes
    assert _shell_list("MOE_PROVIDERS") == providers


# ------------------------------------------------------------------ docs


def test_docs_explain_every_preset_variable(fake_mpirun: Path) -> None:
    doc = (ROOT / "docs" / "running.md").read_text()
    for preset in PRESETS:
        assert f"`{preset}`" in doc, f"docs/running.md: preset {preset} not described"
        argv = _dry(RUN_LOCAL, "--preset", preset, MOE_A2A_MPIRUN=str(fake_mpirun), MOE_A2A_IB_IFACE="ib0")
        for word in argv[1 : argv.index(str(fake_mpirun))]:
            name = word.split("=", 1)[0]
            assert f"`{name}" in doc, f"docs/running.md does not explain {name} (preset {preset})"


# ------------------------------------------------------------------ end to end


def _driver_import_error() -> str | None:
    """Why `moe_a2a.layers.driver` cannot be imported, or None if it can.

    Checked in a child process: importing the driver may start MPI (mpi4py), which
    must not happen in the pytest process that then launches mpirun.
    """
    probe = (
        "import importlib, sys\n"
        "try:\n"
        "    importlib.import_module('moe_a2a.layers.driver')\n"
        "except ImportError as exc:\n"
        "    print(f'{type(exc).__name__}: {exc}')\n"
        "    sys.exit(3)\n"
    )
    result = subprocess.run([PY, "-c", probe], capture_output=True, text=True, timeout=120)
    if result.returncode == 3:
        return result.stdout.strip() or "ImportError"
    return None


_DRIVER_MISSING = _driver_import_error()


@pytest.mark.timeout(300)
@pytest.mark.skipif(
    _DRIVER_MISSING is not None,
    reason=f"moe_a2a.layers.driver cannot be imported ({_DRIVER_MISSING})",
)
def test_run_local_runs_the_tiny_decode_job() -> None:
    """The local launcher, for real: 2 ranks over tcp on the loopback, tiny decode layer, 3 iterations."""
    command = [str(RUN_LOCAL), *shlex.split("-n 2 --preset tcp --mode decode --model tiny --iters 3")]
    # Own session, so a timeout ends mpirun and every rank, not just the script.
    process = subprocess.Popen(
        command,
        env=_env(),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = process.communicate(timeout=280)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        pytest.fail(f"{shlex.join(command)} did not finish in 280 s; output:\n{output}")
    assert process.returncode == 0, f"{shlex.join(command)} exited {process.returncode}; output:\n{output}"
