"""`moe-a2a plan`: the memory one rank takes (moe_a2a.memory_plan), printed for a model preset."""

from __future__ import annotations

import argparse
from typing import Any

from moe_a2a.a2a_types import DEVICES
from moe_a2a.memory_plan import SHM_DIR, Free, MemoryPlanError, check_fits, free_memory, plan, size_text
from moe_a2a.report import table
from moe_a2a.usage import UsageError


def add_parser(sub: Any) -> None:
    from moe_a2a.layers.presets import PRESETS

    p = sub.add_parser(
        "plan",
        help="memory per rank of a configuration, before it is allocated",
        description="Memory one rank of an AllToAll takes for a model preset, world size and ranks "
        "per node, by part (host and GPU, shared and private, registered), and whether the node's "
        "ranks fit in what this machine has free. Nothing is allocated.",
        epilog="example: moe-a2a plan --model deepseek-v3 --mode prefill --ranks 16 --ranks-per-node 8",
    )
    p.add_argument(
        "--model",
        default="deepseek-v3",
        metavar="PRESET",
        help=f"model preset: {', '.join(PRESETS)} (default: %(default)s)",
    )
    p.add_argument(
        "--mode",
        choices=("decode", "prefill"),
        default="decode",
        help="token count of the preset (default: %(default)s)",
    )
    p.add_argument(
        "--tokens",
        type=int,
        metavar="T",
        help="tokens per rank, max_tokens (default: the preset's for --mode)",
    )
    p.add_argument("--ranks", type=int, default=8, metavar="N", help="world size (default: %(default)s)")
    p.add_argument(
        "--ranks-per-node", type=int, metavar="N", help="ranks per node (default: --ranks, one node)"
    )
    p.add_argument("--device", choices=DEVICES, default="cpu", help="backend (default: %(default)s)")
    p.add_argument(
        "--dispatch-dtype", choices=("fp8", "bf16", "fp32"), default="fp8", help="(default: %(default)s)"
    )
    p.add_argument("--combine-dtype", choices=("bf16", "fp32"), default="bf16", help="(default: %(default)s)")
    p.add_argument("--expert-padding", type=int, default=1, metavar="N", help="(default: %(default)s)")
    p.add_argument("--max-private-tokens", type=int, metavar="N", help="(default: AllToAll's)")
    p.add_argument("--max-recv-tokens", type=int, metavar="N", help="(default: AllToAll's, the worst case)")
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    from moe_a2a.layers.presets import get_preset
    from moe_a2a.layers.run_args import a2a_config

    try:
        shape = get_preset(args.model)
        tokens = args.tokens if args.tokens is not None else shape.tokens(args.mode)
        cfg = a2a_config(args, shape, tokens)
        p = plan(cfg, args.ranks, args.ranks_per_node, args.device)
    except ValueError as err:
        raise UsageError(_flag_names(str(err))) from None
    print(
        f"{args.model}: hidden {shape.hidden}, {shape.num_experts} experts, top-{shape.topk}; "
        f"{tokens} tokens per rank, {args.dispatch_dtype} dispatch, {args.combine_dtype} combine, "
        f"device {args.device}"
    )
    print(
        f"{p.world_size} ranks, {p.ranks_per_node} per node: up to {p.max_recv_tokens} rows received "
        f"(max_recv_tokens), {p.max_private_tokens} private rows per peer"
    )
    print(table(["per rank", "bytes", "where"], p.rows()))
    try:
        free = free_memory(args.device)
        check_fits(p, free)
        unknown = (
            "; GPU not checked: no CUDA device here" if args.device == "cuda" and free.gpu is None else ""
        )
        print(f"fits here: yes ({_free_text(free)}{unknown})")
    except MemoryPlanError as err:
        print(f"fits here: no: {err}")
    return 0


def _free_text(free: Free) -> str:
    parts = [
        f"{what} {size_text(n)} free"
        for what, n in (("host", free.host), (SHM_DIR, free.shm), ("GPU", free.gpu))
        if n is not None
    ]
    return ", ".join(parts)


def _flag_names(message: str) -> str:
    """Config's argument names as this command's flags."""
    for name, flag in (
        ("max_tokens", "--tokens"),
        ("max_recv_tokens", "--max-recv-tokens"),
        ("max_private_tokens", "--max-private-tokens"),
        ("expert_padding", "--expert-padding"),
        ("world_size", "--ranks"),
        ("ranks_per_node", "--ranks-per-node"),
    ):
        if message.startswith(f"{name}:") or message.startswith(f"{name} "):
            return flag + message[len(name) :]
    return message
