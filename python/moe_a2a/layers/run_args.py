"""`moe-a2a run`'s flags: the parser and the checks that need no MPI.

Every rank parses and checks the same flags, so every rank finds the same error
(moe_a2a.usage prints it once and ends the ranks together).
"""

from __future__ import annotations

import argparse
import os
import tempfile
from typing import Any

from moe_a2a import report
from moe_a2a.layers.presets import PRESETS, SCORE_FUNCS, MoEShape, get_preset
from moe_a2a.usage import UsageError

MODES = ("decode", "prefill", "train")
OPTIMIZERS = ("adamw", "sgd")
GRAD_DTYPES = ("bf16", "fp32")
ROUTINGS = ("random", "skewed", "router")
DISPATCH_DTYPES = ("fp8", "bf16", "fp32")
COMBINE_DTYPES = ("bf16", "fp32")
WEIGHT_DTYPES = ("bf16", "fp32")
PROG = "moe-a2a run"


# --------------------------------------------------------------------------- parser


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Every flag of `moe-a2a run`, in its groups."""
    _add_run_group(p.add_argument_group("run"))
    _add_train_group(p.add_argument_group("training (--mode train)"))
    _add_shape_group(p.add_argument_group("model shape (default: the preset's)"))
    _add_a2a_group(p.add_argument_group("all-to-all"))


def _add_run_group(run: Any) -> None:
    run.add_argument(
        "--mode",
        choices=MODES,
        default="decode",
        help="token counts of decode or prefill, or train: forward, backward and an optimizer "
        "step per iteration, with prefill's token count (default: %(default)s)",
    )
    # Not `choices`: an unknown preset gets one line naming it and the valid ones.
    run.add_argument(
        "--model",
        default="tiny",
        metavar="PRESET",
        help=f"model preset: {', '.join(PRESETS)} (default: %(default)s, as jobs/run-local.sh)",
    )
    run.add_argument(
        "--iters", type=int, default=20, metavar="N", help="measured iterations (default: %(default)s)"
    )
    run.add_argument(
        "--warmup",
        type=int,
        default=3,
        metavar="N",
        help="warm-up iterations, not measured (default: %(default)s)",
    )
    run.add_argument(
        "--seed",
        type=int,
        default=0,
        metavar="N",
        help="seed of weights, tokens and routing (default: %(default)s)",
    )
    run.add_argument(
        "--routing",
        choices=ROUTINGS,
        help="new routing every iteration: uniform random experts, skewed towards a few hot "
        "experts (--skew), or the layer's router on random tokens (default: router with "
        "--mode train, so the gate trains; random otherwise)",
    )
    run.add_argument(
        "--skew",
        type=float,
        default=1.0,
        metavar="S",
        help="with --routing skewed: the i-th hottest expert is picked in proportion to 1/i^S "
        "(default: %(default)s; 0 is uniform)",
    )
    run.add_argument(
        "--verify",
        action="store_true",
        help="check every measured output against a single-process reference of the whole layer on rank 0",
    )
    run.add_argument(
        "--verify-max-gib",
        type=float,
        default=8.0,
        metavar="GIB",
        help="--verify refuses when the whole layer's weights exceed this on rank 0 (default: %(default)s)",
    )
    run.add_argument("--trace", metavar="PATH", help="write an HDF5 trace of the run (from rank 0)")
    run.add_argument(
        "--on-peer-loss",
        choices=("stop", "mask"),
        default="stop",
        help="a rank whose process dies: every rank stops (default), or the survivors keep serving "
        "without its experts (--mode decode or prefill, CPU, one node; under a launcher that keeps "
        "them, such as mpirun --enable-recovery; docs/peer-loss.md)",
    )
    report.add_progress_argument(run)


def _add_train_group(train: Any) -> None:
    train.add_argument("--optimizer", choices=OPTIMIZERS, help="torch.optim.AdamW or SGD (default: adamw)")
    train.add_argument("--lr", type=float, metavar="X", help="learning rate (default: 1e-3)")
    train.add_argument(
        "--grad-dtype",
        choices=GRAD_DTYPES,
        help="what gradients travel in through the all-to-all (default: bf16)",
    )
    train.add_argument(
        "--load-balance-coeff",
        type=float,
        metavar="X",
        help="auxiliary-loss-free load balancing: after each step, expert_bias += X * "
        "sign(mean load - load), load counted over all ranks (default: off)",
    )


def _add_shape_group(dims: Any) -> None:
    dims.add_argument("--hidden", type=int, metavar="D", help="model hidden size")
    dims.add_argument("--num-experts", type=int, metavar="E", help="routed experts")
    dims.add_argument("--topk", type=int, metavar="K", help="experts per token")
    dims.add_argument("--expert-hidden", type=int, metavar="F", help="hidden size of each routed expert")
    dims.add_argument("--num-shared-experts", type=int, metavar="N", help="shared experts (0: none)")
    dims.add_argument("--score-func", choices=SCORE_FUNCS, help="router scores")
    dims.add_argument("--num-groups", type=int, metavar="G", help="expert groups of group-limited routing")
    dims.add_argument("--topk-groups", type=int, metavar="G", help="groups each token may use")
    dims.add_argument(
        "--max-nodes",
        type=int,
        metavar="M",
        help="node-limited routing (with --routing "
        "router): each token uses experts of at most M nodes; replaces the groups",
    )
    dims.add_argument("--route-scale", type=float, metavar="X", help="factor on the chosen routing weights")
    dims.add_argument(
        "--tokens",
        type=int,
        metavar="T",
        help="tokens per rank (default: the preset's for "
        "--mode; 128 decode and 4096 prefill on the real models)",
    )


def _add_a2a_group(a2a: Any) -> None:
    a2a.add_argument(
        "--dispatch-dtype",
        choices=DISPATCH_DTYPES,
        default="fp8",
        help="dispatch payload (default: %(default)s)",
    )
    a2a.add_argument(
        "--combine-dtype",
        choices=COMBINE_DTYPES,
        default="bf16",
        help="combine payload (default: %(default)s)",
    )
    a2a.add_argument(
        "--weight-dtype",
        choices=WEIGHT_DTYPES,
        default="bf16",
        help="expert weights and activations (default: %(default)s)",
    )
    a2a.add_argument(
        "--expert-padding",
        type=int,
        default=1,
        metavar="N",
        help="pad each expert's rows to a multiple of N (default: %(default)s)",
    )
    a2a.add_argument(
        "--max-private-tokens",
        type=int,
        metavar="N",
        help="private slots per sender (default: the library's)",
    )
    a2a.add_argument(
        "--max-recv-tokens",
        type=int,
        metavar="N",
        help="most token copies a rank may receive (default: the worst case)",
    )
    a2a.add_argument(
        "--provider",
        default="auto",
        metavar="PROVIDER",
        help="libfabric provider: auto, tcp, shm, efa, verbs (default: %(default)s)",
    )
    a2a.add_argument(
        "--ranks-per-node",
        type=int,
        metavar="N",
        help="group consecutive ranks into virtual nodes of N (default: by host)",
    )
    # cpu by default: AllToAll runs dispatch/combine on the CPU only so far.
    a2a.add_argument(
        "--device", choices=("cpu", "cuda"), default="cpu", help="where the layer runs (default: %(default)s)"
    )


# --------------------------------------------------------------------------- arguments


def _positive(args: argparse.Namespace, name: str, minimum: int = 1) -> None:
    value = getattr(args, name.replace("-", "_"))
    if value is not None and value < minimum:
        raise UsageError(f"--{name}: got {value}; expected an integer >= {minimum}")


def resolve_shape(args: argparse.Namespace) -> MoEShape:
    """The preset with every dimension flag applied; UsageError names the bad flag."""
    try:
        shape = get_preset(args.model)
    except ValueError as err:
        raise UsageError(str(err)) from None
    for name in (
        "hidden",
        "num-experts",
        "topk",
        "expert-hidden",
        "num-groups",
        "topk-groups",
        "tokens",
        "max-nodes",
    ):
        _positive(args, name)
    _positive(args, "num-shared-experts", 0)
    if args.route_scale is not None and not args.route_scale > 0:
        raise UsageError(f"--route-scale: got {args.route_scale}; expected a positive number")
    changes: dict[str, Any] = {
        "hidden": args.hidden,
        "num_experts": args.num_experts,
        "topk": args.topk,
        "expert_hidden": args.expert_hidden,
        "num_shared_experts": args.num_shared_experts,
        "score_func": args.score_func,
        "num_groups": args.num_groups,
        "topk_groups": args.topk_groups,
        "route_scale": args.route_scale,
    }
    if args.num_experts is not None and args.num_groups is None and args.num_experts % shape.num_groups:
        # The preset's groups no longer divide the new expert count: drop the group limit.
        changes.update(num_groups=1, topk_groups=1)
    if changes["num_groups"] is not None and args.topk_groups is None:
        changes["topk_groups"] = min(shape.topk_groups, changes["num_groups"])
    if args.tokens is not None:
        changes[f"{token_mode(args.mode)}_tokens"] = args.tokens
    try:
        return shape.replace(**changes)
    except ValueError as err:
        raise UsageError(f"--model {args.model} with the given flags: {err}") from None


def token_mode(mode: str) -> str:
    """Whose token count a mode uses: training steps are prefill-sized."""
    return "prefill" if mode == "train" else mode


TRAIN_FLAGS = ("optimizer", "lr", "grad-dtype", "load-balance-coeff")


def validate_args(args: argparse.Namespace) -> MoEShape:
    """Check every flag that needs no MPI; returns the model shape.

    Fills in the defaults that depend on the mode (routing, and the training flags).
    """
    if args.routing is None:
        args.routing = "router" if args.mode == "train" else "random"
    if args.mode != "train":
        for name in TRAIN_FLAGS:
            if getattr(args, name.replace("-", "_")) is not None:
                raise UsageError(f"--{name}: applies to --mode train, got --mode {args.mode}")
    else:
        args.optimizer = args.optimizer or "adamw"
        args.grad_dtype = args.grad_dtype or "bf16"
        args.lr = 1e-3 if args.lr is None else args.lr
        if not args.lr > 0:
            raise UsageError(f"--lr: got {args.lr}; expected a positive number")
        if args.load_balance_coeff is not None and not args.load_balance_coeff > 0:
            raise UsageError(
                f"--load-balance-coeff: got {args.load_balance_coeff}; expected a positive number"
            )
    shape = resolve_shape(args)
    _positive(args, "iters")
    _positive(args, "warmup", 0)
    _positive(args, "expert-padding")
    _positive(args, "max-private-tokens", 0)
    _positive(args, "max-recv-tokens")
    _positive(args, "ranks-per-node")
    if not args.skew >= 0:
        raise UsageError(f"--skew: got {args.skew}; expected a number >= 0")
    if not args.verify_max_gib > 0:
        raise UsageError(f"--verify-max-gib: got {args.verify_max_gib}; expected a positive number")
    if args.routing != "router" and args.max_nodes is not None:
        raise UsageError("--max-nodes: limits the router's choice; use it with --routing router")
    if args.on_peer_loss == "mask" and (args.mode == "train" or args.verify or args.trace):
        what = "--mode train" if args.mode == "train" else "--verify" if args.verify else "--trace"
        raise UsageError(
            f"--on-peer-loss mask: serving only, without {what} (its collectives would wait for a lost rank)"
        )
    if args.routing != "skewed" and args.skew != 1.0:
        raise UsageError(f"--skew: applies to --routing skewed, got --routing {args.routing}")
    return shape


def check_trace_path(path: str) -> None:
    """Refuse a --trace path the run could not write at its end (one line naming it).

    Makes the folder (as `trace plot -o` does) and creates and removes a file in it:
    writing is the one test every file system and permission scheme answers alike.
    """
    if os.path.isdir(path):
        raise UsageError(f"--trace: got {path}, a folder; expected the path of a file to write")
    folder = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as err:
        raise UsageError(f"--trace: cannot make the folder {folder} ({err.strerror})") from None
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".moe-a2a-trace-probe-"):
            pass
    except OSError as err:
        raise UsageError(f"--trace: cannot write in the folder {folder} ({err.strerror})") from None


def verify_bytes(shape: MoEShape, weight_dtype: str) -> int:
    """Bytes rank 0 holds for --verify: the whole layer's weights."""
    import torch

    from moe_a2a.layers.weights import full_layer_nbytes

    return full_layer_nbytes(shape, torch.bfloat16 if weight_dtype == "bf16" else torch.float32)


def a2a_config(args: argparse.Namespace, shape: MoEShape, tokens: int) -> Any:
    """The all-to-all's Config for this run's shape, payloads and capacity flags."""
    from moe_a2a.all_to_all import Config

    return Config(
        max_tokens=tokens,
        hidden=shape.hidden,
        num_experts=shape.num_experts,
        topk=shape.topk,
        dispatch_dtype=args.dispatch_dtype,
        combine_dtype=args.combine_dtype,
        expert_padding=args.expert_padding,
        max_private_tokens=args.max_private_tokens,
        max_recv_tokens=args.max_recv_tokens,
        on_peer_loss=getattr(args, "on_peer_loss", "stop"),
    )
