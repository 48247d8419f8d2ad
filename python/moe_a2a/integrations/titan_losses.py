"""TorchTitan's trainer with moe-a2a's dispatcher against its own all-to-all: the loss table.

    python -m moe_a2a.integrations.titan_losses --ranks 2 4 --out out/titan-losses
    python -m moe_a2a.integrations.titan_losses --ranks 2 --compile   # moe-a2a's blocks compiled

For each rank count: one seed checkpoint (TorchTitan's, one rank), then 6 steps of
the DeepSeek-V3 debug model on the CPU from it under torchrun, once with moe-a2a's
dispatcher and once with TorchTitan's `AllToAllTokenDispatcher` over gloo, and the
loss TorchTitan logged at every step as a Markdown table; with `--compile`, moe-a2a's
run compiles each block as `--compile.enable` does (against the same eager reference).
The trainer test
(tests/unit/test_torchtitan_trainer.py) runs the same commands at 2 ranks.

The two columns agree to within `LOSS_TOL` of the loss, not to the last digit: the
compute is bf16 (FSDP's mixed precision) and moe-a2a sums a token's expert rows in
fp32 where TorchTitan sums them in bf16, so the last digits of each step's loss
differ by rounding, and the rounding carries into the next steps.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

STEPS = 6
LOSS_TOL = 5e-3  # relative to the reference's loss; observed at most 1e-3 over 6 steps
OURS = "deepseek_v3_debugmodel_cpu"
REFERENCE = "deepseek_v3_debugmodel_cpu_titan"
# One torchrun, start-up included: about 30 s on an idle 2-core machine, over 100 s at a load average of 35.
RUN_TIMEOUT_S = 200


class RunError(RuntimeError):
    """A training run that failed or ran past its time; the message ends with its log."""


def torchrun(
    config: str,
    nproc: int,
    assets: tuple[Path, Path],
    out: Path,
    *args: str,
    env: dict[str, str] | None = None,
) -> str:
    """One TorchTitan training run on the CPU; its rank-0 log."""
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
    out.mkdir(parents=True, exist_ok=True)
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
            raise RunError(f"{' '.join(cmd)} ran past {RUN_TIMEOUT_S} s:\n{log[-6000:]}") from None
    if p.returncode != 0:
        raise RunError(f"{' '.join(cmd)} failed ({p.returncode}):\n{log[-6000:]}")
    return log


def seed_checkpoint(assets: tuple[Path, Path], out: Path) -> Path:
    """TorchTitan's seed checkpoint (one rank, as it requires): one initial model for every run."""
    torchrun(REFERENCE, 1, assets, out, "--checkpoint.create-seed-checkpoint")
    return out / "checkpoint" / "step-0"


def train(
    config: str, nproc: int, assets: tuple[Path, Path], out: Path, seed: Path, *extra: str, **env: str
) -> str:
    """STEPS steps from the seed checkpoint; the model is saved at the last step. Its log."""
    args = ("--training.steps", str(STEPS), "--checkpoint.initial-load-path", str(seed), *extra)
    return torchrun(config, nproc, assets, out, *args, env=env)


def train_ours(nproc: int, assets: tuple[Path, Path], out: Path, seed: Path, compile: bool = False) -> str:
    """moe-a2a's dispatcher; its gloo group started in the launcher, as on one GPU shared by two ranks.
    `compile`: every block compiled (`--compile.enable`, which needs activation checkpointing off)."""
    extra = ("--compile.enable", "activation-checkpoint:none") if compile else ()
    return train(OURS, nproc, assets, out, seed, *extra, MOE_A2A_TORCHTITAN_BACKEND="gloo")


def losses(log: str) -> list[float]:
    """The loss of every step TorchTitan logged, in order (`step:  3  loss:  5.17610 ...`)."""
    steps = [(int(s), float(v)) for s, v in re.findall(r"step:\s+(\d+)\s+loss:\s+([-0-9.e+]+)", log)]
    if [s for s, _ in steps] != list(range(1, STEPS + 1)):
        raise RunError(f"steps logged: {steps}\n{log[-3000:]}")
    return [v for _, v in steps]


@dataclass(frozen=True)
class Curves:
    """One rank count's loss curves and wall times (start-up included)."""

    ranks: int
    ours: list[float]
    reference: list[float]
    ours_s: float
    reference_s: float
    compiled: bool = False  # moe-a2a's blocks under torch.compile

    def largest_difference(self) -> tuple[float, float]:
        """The largest |ours - reference| over the steps, absolute and relative to the reference."""
        pairs = list(zip(self.ours, self.reference, strict=True))
        worst = max(pairs, key=lambda p: abs(p[0] - p[1]))
        return abs(worst[0] - worst[1]), abs(worst[0] - worst[1]) / abs(worst[1])


def curves(nproc: int, assets: tuple[Path, Path], work: Path, compile: bool = False) -> Curves:
    """Both dispatchers at `nproc` ranks from one seed checkpoint (`compile`: moe-a2a's compiled)."""
    seed = seed_checkpoint(assets, work / f"seed-{nproc}")
    start = time.monotonic()
    ours = losses(
        train_ours(nproc, assets, work / f"ours-{nproc}{'-compiled' if compile else ''}", seed, compile)
    )
    middle = time.monotonic()
    ref = losses(train(REFERENCE, nproc, assets, work / f"reference-{nproc}", seed))
    return Curves(nproc, ours, ref, middle - start, time.monotonic() - middle, compile)


def format_table(results: list[Curves]) -> str:
    """The loss TorchTitan logs at each step, per rank count and dispatcher (Markdown)."""
    head = ["step"]
    for c in results:
        head += [f"{c.ranks} ranks, moe-a2a{' compiled' if c.compiled else ''}", f"{c.ranks} ranks, AllToAll"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for step in range(STEPS):
        cells = [str(step + 1)] + [f"{v[step]:.5f}" for c in results for v in (c.ours, c.reference)]
        lines.append("| " + " | ".join(cells) + " |")
    diff = ["largest difference"]
    for c in results:
        absolute, relative = c.largest_difference()
        diff += [f"{absolute:.1e} ({relative:.0e} of the loss)", ""]
    wall = ["wall time, start-up included"] + [
        f"{t:.0f} s" for c in results for t in (c.ours_s, c.reference_s)
    ]
    lines += ["| " + " | ".join(row) + " |" for row in (diff, wall)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from moe_a2a.integrations.torchtitan_configs import write_tiny_assets
    from moe_a2a.usage import Parser

    parser = Parser(prog="python -m moe_a2a.integrations.titan_losses", description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4], metavar="N", help="(default: 2 4)")
    parser.add_argument("--out", default="out/titan-losses", metavar="DIR", help="(default: %(default)s)")
    parser.add_argument(
        "--compile", action="store_true", help="moe-a2a's run compiles every block (--compile.enable)"
    )
    args = parser.parse_args(argv)
    work = Path(args.out).resolve()
    assets = write_tiny_assets(work / "assets")
    results = [curves(n, assets, work, args.compile) for n in args.ranks]
    print(format_table(results))
    bad = [c.ranks for c in results if c.largest_difference()[1] > LOSS_TOL]
    if bad:
        print(
            f"error: the curves differ by more than {LOSS_TOL:g} of the loss at {bad} ranks", file=sys.stderr
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
