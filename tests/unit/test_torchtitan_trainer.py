"""TorchTitan's own trainer with moe-a2a's dispatcher, launched as a user would, on the CPU.

`torchrun --nproc-per-node 2 -m moe_a2a.integrations.torchtitan_train` runs TorchTitan's
`torchtitan.train` (its Trainer.Config, AdamW, cross-entropy loss, HF text data loader)
on its DeepSeek-V3 debug model with expert parallelism over both ranks. The same run
with TorchTitan's own AllToAllTokenDispatcher is the reference, from the same seed
checkpoint: the two loss curves must agree, and so must every weight of the final
checkpoints. The tokenizer and the text are built here (TorchTitan's test assets are
not in its wheel, and there is no internet).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("torchtitan.trainer", reason="TorchTitan 0.3.0 is not installed")
pytest.importorskip("tokenizers", reason="tokenizers (a TorchTitan dependency) is not installed")

STEPS = 6
# Observed: |ours - reference| <= 1e-3 over 6 steps, losses 4.5..8.1 (bf16 FSDP
# compute; moe-a2a sums a token's expert rows in fp32, TorchTitan in bf16).
LOSS_TOL = 5e-3  # relative to the reference's loss
# |ours - reference| / |reference - initial| per weight after 6 AdamW steps. Observed at
# most 0.17 (the routed experts: AdamW normalises each element's step, so bf16 rounding
# of small gradients shows); a weight that got no gradient here scores 1.0.
WEIGHT_TOL = 0.35
# One torchrun, start-up included: about 30 s on an idle 2-core machine, over 100 s at a
# load average of 35. The test's own limit is above its three runs' so a slow run fails
# as a timed-out torchrun, with its log, not as pytest-timeout's alarm.
RUN_TIMEOUT_S = 200


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A tiny BPE tokenizer and a JSON-lines text dataset (the docs' write_tiny_assets)."""
    from moe_a2a.integrations.torchtitan_configs import write_tiny_assets

    return write_tiny_assets(tmp_path_factory.mktemp("titan_assets"))


def torchrun(
    config: str,
    nproc: int,
    assets: tuple[Path, Path],
    out: Path,
    *args: str,
    env: dict[str, str] | None = None,
) -> str:
    """One TorchTitan training run; its rank-0 log. Fails the test with the log if it fails."""
    tok_dir, data = assets
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
        "--local-ranks-filter=0",
        "-m", "moe_a2a.integrations.torchtitan_train",
        "--module", "moe_a2a.integrations.torchtitan_configs", "--config", config,
        "--hf-assets-path", str(tok_dir), "--dataloader.dataset-path", str(data),
        "--training.seq-len", "64", "--training.local-batch-size", "2", "--debug.seed", "0",
        "--parallelism.expert-parallel-degree", str(nproc),
        "--comm.init-timeout-seconds", "120", "--comm.train-timeout-seconds", "60",
        "--checkpoint.enable", "--checkpoint.last-save-model-only",
        "--metrics.disable-color-printing", "--dump-folder", str(out), *args,
    ]  # fmt: skip
    # CPU only, also on a GPU machine (where NCCL would refuse two ranks on one GPU).
    environ = {k: v for k, v in os.environ.items() if k != "MOE_A2A_TORCHTITAN_BACKEND"}
    environ |= {"CUDA_VISIBLE_DEVICES": ""} | (env or {})
    with subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=out.parent, env=environ
    ) as p:
        try:
            log, _ = p.communicate(timeout=RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            # SIGTERM: torchrun then ends its ranks (each in a session of its own); a SIGKILL
            # would leave them running.
            p.terminate()
            try:
                log, _ = p.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
                log, _ = p.communicate(timeout=60)
            pytest.fail(f"{' '.join(cmd)} ran past {RUN_TIMEOUT_S} s:\n{log[-6000:]}")
    assert p.returncode == 0, f"{' '.join(cmd)} failed ({p.returncode}):\n{log[-6000:]}"
    return log


def train(config: str, nproc: int, assets: tuple[Path, Path], out: Path, seed: Path, **env: str) -> str:
    """STEPS steps from the seed checkpoint; the model is saved at the last step."""
    args = ("--training.steps", str(STEPS), "--checkpoint.initial-load-path", str(seed))
    return torchrun(config, nproc, assets, out, *args, env=env)


def losses(log: str) -> list[float]:
    """The loss of every step TorchTitan logged, in order (`step:  3  loss:  5.17610 ...`)."""
    steps = [(int(s), float(v)) for s, v in re.findall(r"step:\s+(\d+)\s+loss:\s+([-0-9.e+]+)", log)]
    assert [s for s, _ in steps] == list(range(1, STEPS + 1)), f"steps logged: {steps}\n{log[-3000:]}"
    return [v for _, v in steps]


def weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a TorchTitan (DCP) model checkpoint, read in this process."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(checkpoint, checkpoint.with_suffix(".pt"))
    state = torch.load(checkpoint.with_suffix(".pt"), weights_only=True)
    return {k: v.float() for k, v in state.items() if isinstance(v, torch.Tensor)}


@pytest.mark.timeout(3 * RUN_TIMEOUT_S + 60)
def test_titan_trainer_with_moe_a2a_follows_its_all_to_all(assets: tuple[Path, Path], tmp_path: Path) -> None:
    # One initial model for both runs: TorchTitan's seed checkpoint (one rank, as it requires).
    seed_run = ("deepseek_v3_debugmodel_cpu_titan", 1, assets, tmp_path / "seed")
    torchrun(*seed_run, "--checkpoint.create-seed-checkpoint")
    seed = tmp_path / "seed" / "checkpoint" / "step-0"
    # Ours starts its gloo group in the launcher, as on one GPU shared by two ranks (docs/training.md).
    ours_log = train(
        "deepseek_v3_debugmodel_cpu", 2, assets, tmp_path / "ours", seed, MOE_A2A_TORCHTITAN_BACKEND="gloo"
    )
    ref_log = train("deepseek_v3_debugmodel_cpu_titan", 2, assets, tmp_path / "reference", seed)
    # moe-a2a really carried the tokens (its dispatcher opened over both ranks), and not in the reference
    assert "moe-a2a: expert parallelism over 2 ranks on cpu" in ours_log, ours_log[-3000:]
    assert "moe-a2a:" not in ref_log
    assert "torch.distributed is already initialized" in ours_log  # TorchTitan took the launcher's group

    ours, ref = losses(ours_log), losses(ref_log)
    assert ref[-1] < ref[0], f"the reference did not train: {ref}"
    diffs = [abs(a - b) / max(1.0, abs(b)) for a, b in zip(ours, ref, strict=True)]
    assert max(diffs) <= LOSS_TOL, f"loss curves differ (relative {max(diffs):.2e}): {ours} vs {ref}"

    # The loss barely depends on the routed experts in 6 steps (the run passes it with
    # their gradients cut off), so every trained weight is compared too.
    init = weights(seed)
    final = f"step-{STEPS}"
    mine, want = (weights(tmp_path / run / "checkpoint" / final) for run in ("ours", "reference"))
    assert set(mine) == set(want) == set(init)
    off = {}
    for name in want:
        moved, apart = float((want[name] - init[name]).norm()), float((mine[name] - want[name]).norm())
        off[name] = apart / moved if moved > 0 else (0.0 if apart == 0 else float("inf"))
    worst = sorted(off.items(), key=lambda kv: -kv[1])[:6]
    assert worst[0][1] <= WEIGHT_TOL, f"|ours - reference| / |reference's change|, worst: {worst}"
    trained = [n for n in want if not torch.equal(want[n], init[n])]
    assert any("routed_experts" in n for n in trained) and any("router.gate" in n for n in trained)


def _trainer(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "moe_a2a.integrations.torchtitan_train", *argv],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_trainer_help_and_bad_config_are_plain_lines() -> None:
    """`--help` alone is a help text (TorchTitan's parser wants --module first); a wrong --config
    of moe-a2a's module names its configs only, not its helper functions; no tracebacks."""
    from moe_a2a.integrations import torchtitan_configs, torchtitan_train

    configs = torchtitan_train.config_functions()
    assert configs == [
        "deepseek_v3_debugmodel",
        "deepseek_v3_debugmodel_gloo",
        "deepseek_v3_debugmodel_cpu",
        "deepseek_v3_debugmodel_cpu_titan",
    ]
    assert all(callable(getattr(torchtitan_configs, name)) for name in configs)
    done = _trainer("--help")
    assert done.returncode == 0 and "--module MODULE" in done.stdout and ", ".join(configs) in done.stdout
    assert done.stderr == ""
    done = _trainer("--module", torchtitan_train.OUR_CONFIGS, "--config", "use_moe_a2a")
    assert done.returncode == 2
    assert done.stderr == (
        f"{torchtitan_train.PROG}: error: --config: got 'use_moe_a2a'; expected one of {', '.join(configs)}\n"
    )
    done = _trainer("--config", "deepseek_v3_debugmodel_cpu")
    assert done.returncode == 2 and done.stderr.startswith(
        f"{torchtitan_train.PROG}: error: --module: missing"
    )


def test_trainer_outputs_go_under_out_unless_a_dump_folder_is_named() -> None:
    """TorchTitan's default `./outputs` would land untracked in the repository; ours is out/."""
    from moe_a2a.integrations.torchtitan_train import DUMP_FOLDER, with_dump_folder

    assert DUMP_FOLDER == "out/torchtitan"
    assert with_dump_folder(["--config", "x"]) == ["--config", "x", "--dump-folder", "out/torchtitan"]
    for named in (["--dump-folder", "/tmp/t"], ["--dump-folder=/tmp/t"], ["--dump_folder", "/tmp/t"]):
        assert with_dump_folder(["--config", "x", *named]) == ["--config", "x", *named]
