"""`moe-a2a run`: a full MoE layer per rank over the all-to-all, timed, traced, verified.

Run under `mpirun -n N` or `srun`. Every rank makes only its own experts (random,
one expert at a time from `--seed`, so all ranks agree on the whole layer), draws
new tokens and routing every iteration, and runs the layer with the shared expert
between the two halves of dispatch. Rank 0 prints a progress bar for long runs and
a summary table at the end; `--trace` writes the HDF5 trace; `--verify` checks every
measured iteration against the whole layer computed in one process on rank 0.

`--mode train` trains the layer instead (forward, backward, optimizer step over
`moe_a2a.autograd.ExpertParallel`); `--verify` then checks the loss and every
gradient against plain autograd over the whole layer on rank 0.

torch and mpi4py are imported inside `main`, so that `moe-a2a --help` stays instant
and argument errors are reported before MPI starts.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from moe_a2a.layers.presets import MoEShape
from moe_a2a.layers.run_args import (
    PROG,
    add_arguments,
    check_trace_path,
    token_mode,
    validate_args,
    verify_bytes,
)
from moe_a2a.usage import UsageError, usage_error


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the `run` subcommand to the `moe-a2a` sub-parsers; its `func` is `main`."""
    p = subparsers.add_parser(
        "run",
        help="run an MoE layer over the all-to-all (under mpirun/srun)",
        description="Run a full MoE layer per rank (router, dispatch, shared expert, grouped "
        "experts, combine) under mpirun or srun, and print a summary of phase times. "
        "Shape flags override the preset's values.",
        epilog="example: mpirun -n 4 moe-a2a run --model tiny --verify --trace run.h5",
    )
    add_arguments(p)
    p.set_defaults(func=main)
    return p


def main(args: argparse.Namespace) -> int:
    """Entry point of `moe-a2a run`; returns the exit status (0 ok, 1 verify failed).

    A usage error, found alike on every rank before any collective step, ends
    every rank with status 2 (moe_a2a.usage).
    """
    try:
        shape = validate_args(args)
    except UsageError as err:
        usage_error(PROG, str(err))

    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    try:
        return _run(args, shape, comm)
    except UsageError as err:
        usage_error(PROG, str(err))
    except Exception as err:
        # One failing rank would leave the others waiting in a collective: end the job.
        import traceback

        from moe_a2a.all_to_all import CapacityError

        if not isinstance(err, CapacityError):  # a capacity error is the user's, and says it all
            traceback.print_exc()
        print(
            f"{PROG}: rank {comm.Get_rank()}: error: {_for_the_cli(err)}; aborting the job",
            file=sys.stderr,
            flush=True,
        )
        comm.Abort(1)
        return 1


def _for_the_cli(err: Exception) -> str:
    """The error's message, naming the command line's flag where the library names a Config field."""
    return str(err).replace("raise max_recv_tokens in Config", "raise --max-recv-tokens")


def _run(args: argparse.Namespace, shape: MoEShape, comm: Any) -> int:
    """Checks that need the world size, the device and topology, then the mode's driver."""
    import torch

    from moe_a2a.bootstrap import Bootstrap
    from moe_a2a.layers.run_infer import run_inference
    from moe_a2a.layers.run_train import run_training
    from moe_a2a.layers.weights import local_experts, random_weights

    rank, world = comm.Get_rank(), comm.Get_size()
    _check_world(args, shape, world)
    if args.trace:
        _check_trace(comm, args.trace)
    if args.device == "cuda":
        _set_cuda_device(rank)
    try:
        topology = Bootstrap(comm, args.ranks_per_node).topology
    except ValueError as err:  # same host list on every rank, so every rank refuses alike
        raise UsageError(f"--ranks-per-node: {err}") from None
    if args.device == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        # Ranks of one host share its cores: torch's default (every core per rank)
        # oversubscribes them and makes each rank's compute phases slower.
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        torch.set_num_threads(max(1, cores // topology.local_size))
    if args.max_nodes is not None:
        shape = _node_limited(args, shape, topology.num_nodes)
    tokens = shape.tokens(token_mode(args.mode))
    weight_dtype = torch.bfloat16 if args.weight_dtype == "bf16" else torch.float32
    weights = random_weights(
        shape,
        args.seed,
        local_experts(shape.num_experts, rank, world),
        dtype=weight_dtype,
        device=args.device,
    )
    drive = run_training if args.mode == "train" else run_inference
    return drive(args, shape, comm, topology, tokens, weights)


def _check_world(args: argparse.Namespace, shape: MoEShape, world: int) -> None:
    """The checks that need the world size or the device; alike on every rank."""
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: this torch build or machine has no CUDA device")
    if shape.num_experts % world:
        raise UsageError(
            f"--num-experts: got {shape.num_experts}, not divisible by the {world} ranks; "
            "every rank must host the same number of experts"
        )
    if args.verify:
        need = verify_bytes(shape, args.weight_dtype)
        if need > args.verify_max_gib * 2**30:
            raise UsageError(
                f"--verify: the whole layer's weights need {need / 2**30:.1f} GiB on rank 0 "
                f"({shape.num_experts} experts x 3 x {shape.expert_hidden} x {shape.hidden} "
                f"{args.weight_dtype}), "
                f"above --verify-max-gib {args.verify_max_gib:g}; raise the limit or shrink the layer "
                "(--num-experts, --expert-hidden, --hidden)"
            )


def _check_trace(comm: Any, path: str) -> None:
    """Rank 0 writes the trace, so rank 0 checks the path; every rank then refuses alike."""
    problem = None
    if comm.Get_rank() == 0:
        try:
            check_trace_path(path)
        except UsageError as err:
            problem = str(err)
    problem = comm.bcast(problem, root=0)
    if problem is not None:
        raise UsageError(problem)


def _set_cuda_device(rank: int) -> None:
    """The launcher's node-local rank (torchrun, Open MPI, Slurm), else block placement."""
    import torch

    local = next(
        (
            os.environ[v]
            for v in ("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID")
            if v in os.environ
        ),
        None,
    )
    torch.cuda.set_device((int(local) if local is not None else rank) % torch.cuda.device_count())


def _node_limited(args: argparse.Namespace, shape: MoEShape, num_nodes: int) -> MoEShape:
    """The shape with --max-nodes's node-limited routing."""
    from moe_a2a.layers.router import node_limited

    if shape.num_experts % num_nodes:
        raise UsageError(
            f"--max-nodes: {shape.num_experts} experts do not split evenly over {num_nodes} nodes"
        )
    try:
        return node_limited(shape, num_nodes, args.max_nodes)
    except ValueError as err:
        raise UsageError(f"--max-nodes {args.max_nodes}: {err}") from None
