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

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from moe_a2a.integrations import titan_losses

pytest.importorskip("torchtitan.trainer", reason="TorchTitan 0.3.0 is not installed")
pytest.importorskip("tokenizers", reason="tokenizers (a TorchTitan dependency) is not installed")

# |ours - reference| / |reference - initial| per weight after 6 AdamW steps. Observed at
# most 0.17 (the routed experts: AdamW normalises each element's step, so bf16 rounding
# of small gradients shows); a weight that got no gradient here scores 1.0.
WEIGHT_TOL = 0.35


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A tiny BPE tokenizer and a JSON-lines text dataset (the docs' write_tiny_assets)."""
    from moe_a2a.integrations.torchtitan_configs import write_tiny_assets

    return write_tiny_assets(tmp_path_factory.mktemp("titan_assets"))


def _run(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """A titan_losses step; a failed or timed-out run fails the test with its log."""
    try:
        return fn(*args, **kwargs)
    except titan_losses.RunError as err:
        pytest.fail(str(err))


def weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a TorchTitan (DCP) model checkpoint, read in this process."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(checkpoint, checkpoint.with_suffix(".pt"))
    state = torch.load(checkpoint.with_suffix(".pt"), weights_only=True)
    return {k: v.float() for k, v in state.items() if isinstance(v, torch.Tensor)}


@pytest.mark.timeout(3 * titan_losses.RUN_TIMEOUT_S + 60)
def test_titan_trainer_with_moe_a2a_follows_its_all_to_all(assets: tuple[Path, Path], tmp_path: Path) -> None:
    # One initial model for both runs, the commands of `python -m moe_a2a.integrations.titan_losses`.
    seed = _run(titan_losses.seed_checkpoint, assets, tmp_path / "seed")
    ours_log = _run(titan_losses.train_ours, 2, assets, tmp_path / "ours", seed)
    ref_log = _run(titan_losses.train, titan_losses.REFERENCE, 2, assets, tmp_path / "reference", seed)
    # moe-a2a really carried the tokens (its dispatcher opened over both ranks), and not in the reference
    assert "moe-a2a: expert parallelism over 2 ranks on cpu" in ours_log, ours_log[-3000:]
    assert "moe-a2a:" not in ref_log
    assert "torch.distributed is already initialized" in ours_log  # TorchTitan took the launcher's group

    ours, ref = _run(titan_losses.losses, ours_log), _run(titan_losses.losses, ref_log)
    assert ref[-1] < ref[0], f"the reference did not train: {ref}"
    curves = titan_losses.Curves(2, ours, ref, 0.0, 0.0)
    absolute, relative = curves.largest_difference()
    assert relative <= titan_losses.LOSS_TOL, f"loss curves differ (relative {relative:.2e}): {ours} vs {ref}"
    table = titan_losses.format_table([curves]).splitlines()
    assert table[0] == "| step | 2 ranks, moe-a2a | 2 ranks, AllToAll |"
    assert table[2 + titan_losses.STEPS - 1] == f"| {titan_losses.STEPS} | {ours[-1]:.5f} | {ref[-1]:.5f} |"
    print("\n".join(table))  # the docs' table at 2 ranks, as this run logged it

    # The loss barely depends on the routed experts in 6 steps (the run passes it with
    # their gradients cut off), so every trained weight is compared too.
    init = weights(seed)
    final = f"step-{titan_losses.STEPS}"
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
