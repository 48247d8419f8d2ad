"""Run TorchTitan's own trainer (`torchtitan.train.main`) where it cannot start by itself.

    torchrun --nproc-per-node 2 -m moe_a2a.integrations.torchtitan_train \\
        --module moe_a2a.integrations.torchtitan_configs --config deepseek_v3_debugmodel_cpu ...

Every argument goes to TorchTitan unchanged, with one default added: without
`--dump-folder`, TorchTitan's checkpoints, logs and traces go to `out/torchtitan`
(TorchTitan's own default, `./outputs`, would litter the working directory; `out/`
is ignored by git). Before TorchTitan is imported this sets only what TorchTitan
0.3.0 cannot find on its own (see docs/training.md):

- **The device on a machine without an accelerator.** TorchTitan binds
  `device_type = _get_available_device_type() or "cuda"` at import and has no flag
  for the CPU. Here, where no accelerator is found, it is "cpu" instead, with
  `torch.cpu` completed by the few calls TorchTitan's memory monitor makes
  (`CpuDevice`). TorchTitan then initialises gloo, its backend for "cpu". Where
  an accelerator is found nothing changes.
- **`torch.distributed.set_timeout`**, which TorchTitan calls after the first step
  and which torch 2.13 and 2.11 lack; it is torch's own `_set_pg_timeout`.
- **The process group, where `MOE_A2A_TORCHTITAN_BACKEND` names a backend.**
  TorchTitan picks NCCL for CUDA, and NCCL refuses two ranks on one GPU; with
  `gloo` this starts the group first, and TorchTitan then uses it as it finds it.
"""

from __future__ import annotations

import os
import sys
import types
from datetime import timedelta

import torch

from moe_a2a import switches

# TorchTitan's own default (comm.init_timeout_seconds); it sets the train timeout after step 1.
INIT_TIMEOUT = timedelta(seconds=300)


class _Properties:
    """What TorchTitan reads of a device's properties: its memory."""

    def __init__(self) -> None:
        self.total_memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        self.name = "cpu"


def cpu_device_module() -> types.ModuleType:
    """`torch.cpu` plus the calls TorchTitan's device-memory monitor makes (no CPU memory stats: -1)."""
    mod = types.ModuleType("moe_a2a_cpu_device")
    mod.__dict__.update({k: v for k, v in vars(torch.cpu).items() if not k.startswith("__")})
    mod.__dict__.update(
        get_device_name=lambda device=None: "cpu",
        get_device_properties=lambda device=None: _Properties(),
        memory_stats=lambda device=None: {},
        reset_peak_memory_stats=lambda device=None: None,
        empty_cache=lambda: None,
        # TorchTitan passes it to barrier(device_ids=[...]), which takes integers.
        current_device=lambda: 0,
    )
    return mod


def prepare() -> str:
    """Set what TorchTitan needs before its modules bind it; return the device type it will use."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    if not hasattr(dist, "set_timeout"):
        dist.set_timeout = distributed_c10d._set_pg_timeout  # type: ignore[attr-defined]
    already = [m for m in sys.modules if m.startswith("torchtitan.") and m != "torchtitan.tools.utils"]
    if already:
        raise RuntimeError(
            f"moe_a2a.integrations.torchtitan_train: TorchTitan modules were imported before it ran "
            f"({', '.join(sorted(already)[:3])}...); they bound TorchTitan's device already"
        )
    import torchtitan.tools.utils as titan_utils

    if torch._utils._get_available_device_type() is None:
        titan_utils.device_type, titan_utils.device_module = "cpu", cpu_device_module()
    backend = switches.get("MOE_A2A_TORCHTITAN_BACKEND")
    if backend is not None and not dist.is_initialized():
        dist.init_process_group(backend, timeout=INIT_TIMEOUT)
    return str(titan_utils.device_type)


def unbound(device_type: str) -> list[str]:
    """TorchTitan modules that bound another device type than `device_type` (none, if prepare() ran first)."""
    return sorted(
        name
        for name, mod in list(sys.modules.items())
        if name.startswith("torchtitan") and getattr(mod, "device_type", device_type) != device_type
    )


PROG = "python -m moe_a2a.integrations.torchtitan_train"
OUR_CONFIGS = "moe_a2a.integrations.torchtitan_configs"
EXAMPLE = f"--module {OUR_CONFIGS} --config deepseek_v3_debugmodel_cpu"
HELP = f"""usage: {PROG} --module MODULE --config CONFIG [TorchTitan's flags ...]

Run TorchTitan's own trainer (torchtitan.train.main), under torchrun or mpirun,
where it cannot start by itself (no accelerator, an older torch, gloo on one GPU:
docs/training.md). Every argument goes to TorchTitan unchanged.

  --module MODULE  a module of config functions; moe-a2a's: {OUR_CONFIGS}
  --config CONFIG  one of its config functions; moe-a2a's: {{configs}}
  --dump-folder DIR  TorchTitan's outputs (default here: out/torchtitan)

example: torchrun --nproc-per-node 2 -m moe_a2a.integrations.torchtitan_train {EXAMPLE}
TorchTitan's own flags: {PROG} --module MODULE --config CONFIG --help
"""


def config_functions() -> list[str]:
    """The config functions of moe-a2a's config module: its public functions that take no argument.

    Read from its source: importing it imports TorchTitan, which must wait for prepare().
    """
    import ast
    from pathlib import Path

    tree = ast.parse((Path(__file__).with_name("torchtitan_configs.py")).read_text())
    return [
        node.name
        for node in tree.body
        if isinstance(node, ast.FunctionDef) and not node.name.startswith("_") and not node.args.args
    ]


def _flag(argv: list[str], name: str) -> str | None:
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


def check_args(argv: list[str]) -> str | None:
    """What is wrong with --module and --config (one line), or None; TorchTitan checks the rest."""
    module, config = _flag(argv, "--module"), _flag(argv, "--config")
    if module is None:
        return f"--module: missing; expected a module of config functions, e.g. {EXAMPLE}"
    if config is None:
        return f"--config: missing; expected one of {module}'s config functions"
    if module == OUR_CONFIGS and config not in config_functions():
        return f"--config: got {config!r}; expected one of {', '.join(config_functions())}"
    return None


DUMP_FOLDER = "out/torchtitan"


def with_dump_folder(argv: list[str]) -> list[str]:
    """`argv`, with `--dump-folder DUMP_FOLDER` added where it names no dump folder."""
    if any(a.split("=", 1)[0] in ("--dump-folder", "--dump_folder") for a in argv):
        return argv
    return [*argv, "--dump-folder", DUMP_FOLDER]


def main() -> None:
    argv = sys.argv[1:]
    if _flag(argv, "--module") is None and any(a in ("-h", "--help") for a in argv):
        print(HELP.format(configs=", ".join(config_functions())), end="")
        sys.exit(0)
    problem = check_args(argv)
    if problem is not None:
        from moe_a2a.usage import usage_error

        usage_error(PROG, problem)
    sys.argv[1:] = with_dump_folder(argv)
    device_type = prepare()
    from torchtitan.train import main as titan_main

    stale = unbound(device_type)
    if stale:
        raise RuntimeError(
            f"moe_a2a.integrations.torchtitan_train: {', '.join(stale)} bound a device type other than "
            f"{device_type!r}; this TorchTitan binds its device elsewhere than torchtitan.tools.utils"
        )
    titan_main()


if __name__ == "__main__":
    main()
