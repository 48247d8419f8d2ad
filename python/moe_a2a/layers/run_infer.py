"""`moe-a2a run --mode decode|prefill`: the layer's forward pass per iteration, timed and verified.

With `--verify`, rank 0 gathers every rank's tokens, routing and output and checks
them against the whole layer computed in one process.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from moe_a2a import PeerLostError, report
from moe_a2a.layers.presets import MoEShape
from moe_a2a.layers.run_args import PROG, a2a_config
from moe_a2a.layers.run_inputs import generator, random_routing, skewed_popularity
from moe_a2a.layers.run_report import finish, phase_timer, provider_name, record_counts
from moe_a2a.usage import UsageError

if TYPE_CHECKING:
    import torch


def run_inference(
    args: argparse.Namespace, shape: MoEShape, comm: Any, topology: Any, tokens: int, weights: Any
) -> int:
    """Warm-up and measured forward passes; the exit status (1 when --verify failed)."""
    import torch

    from moe_a2a.all_to_all import AllToAll
    from moe_a2a.layers.moe import MoELayer
    from moe_a2a.layers.reference import tolerance
    from moe_a2a.layers.weights import random_weights
    from moe_a2a.trace import TraceRecorder

    rank, world = comm.Get_rank(), comm.Get_size()
    device = args.device
    weight_dtype = torch.bfloat16 if args.weight_dtype == "bf16" else torch.float32
    # Inference: no autograd graph, not even the router's.
    layer = MoELayer(shape, weights, expert_padding=args.expert_padding).eval().requires_grad_(False)
    full = random_weights(shape, args.seed, dtype=weight_dtype) if args.verify and rank == 0 else None
    popularity = None
    if args.routing == "skewed":
        popularity = skewed_popularity(shape.num_experts, args.skew, args.seed)

    try:
        a2a = AllToAll(
            a2a_config(args, shape, tokens),
            comm=comm,
            device=device,
            provider=args.provider,
            ranks_per_node=args.ranks_per_node,
        )
    except ValueError as err:  # configuration checks, made alike on every rank before any exchange
        raise UsageError(str(err)) from None
    provider = provider_name(args)
    recorder = TraceRecorder(args.iters, world, shape.num_experts)
    total_iters = args.warmup + args.iters
    progress = report.progress(total_iters, f"{PROG} {args.mode}", rank=rank, mode=args.progress)
    worst = 0.0
    limit = tolerance(args.dispatch_dtype, args.combine_dtype, weight_dtype)
    failures: list[str] = []
    lost_at: int | None = None  # --on-peer-loss mask: the step at which a rank was lost
    try:
        while a2a.epoch < total_iters:  # one dispatch a step; after a loss every survivor resumes alike
            step = a2a.epoch
            it = step - args.warmup  # measured iteration index, negative during warm-up
            gen = generator(args.seed, "tokens", rank, step)
            x = torch.randn(tokens, shape.hidden, generator=gen).to(device=device, dtype=weight_dtype)
            if args.routing == "router":
                topk_ids, topk_weights = layer.route(x)
            else:
                topk_ids, topk_weights = random_routing(
                    tokens, shape.num_experts, shape.topk, gen, popularity
                )
                topk_ids, topk_weights = topk_ids.to(device), topk_weights.to(device)
            # Start together, so each phase measures the layer and not the ranks' skew. Not with
            # --on-peer-loss mask: a rank lost while the others wait in it would hold them forever.
            if args.on_peer_loss == "stop":
                comm.Barrier()
            timer = phase_timer(recorder, it, device) if it >= 0 and lost_at is None else None
            try:
                out = layer.forward(x, a2a, topk_ids, topk_weights, timer=timer)
            except PeerLostError:  # --on-peer-loss mask: this step's tokens got no output
                lost_at = step if lost_at is None else lost_at
                continue
            if it >= 0 and lost_at is None:
                record_counts(recorder, it, layer, a2a)
                if args.verify:
                    rel_err = _verify(comm, full, x, topk_ids, topk_weights, out, args.dispatch_dtype)
                    if rank == 0:
                        worst = max(worst, rel_err)
                        if rel_err > limit:
                            failures.append(f"iteration {it}: max relative error {rel_err:.3g}")
            progress.update()
    except BaseException:
        # No collective close here: the peers may sit in another collective. main()
        # aborts the job, which releases everything.
        progress.close()
        raise
    progress.close()
    rows_path = a2a.rows_path
    if lost_at is not None:
        _served_through_a_loss(args, a2a, rank, lost_at, total_iters)
    a2a.close()

    footer = []
    if args.verify:
        footer.append(
            f"verify: {'FAILED' if failures else 'OK'}: max relative error {worst:.3g} (limit {limit:g}) "
            f"over {args.iters} iterations x {world} ranks"
        )
        footer += [f"  {f}" for f in failures[:5]]
    if args.on_peer_loss == "mask":
        footer.append("on peer loss: mask; no rank was lost (0 calls ran masked)")
    return finish(comm, recorder, args, shape, tokens, topology, provider, footer, bool(failures), rows_path)


def _served_through_a_loss(args: argparse.Namespace, a2a: Any, rank: int, lost_at: int, total: int) -> None:
    """Each survivor's own summary, then the end of the process: the job's summary, and MPI's
    finalisation, are collectives that would wait for the lost rank."""
    import os
    import sys

    print(
        f"{PROG} {args.mode}: rank {rank}: rank(s) {list(a2a.masked_ranks)} lost at step {lost_at}; "
        f"{a2a.masked_calls} of {total} calls ran masked; the job's summary (a collective) is skipped",
        flush=True,
    )
    a2a.close()
    sys.stderr.flush()
    os._exit(0)


def _verify(
    comm: Any,
    full: Any,
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    out: torch.Tensor,
    dispatch_dtype: str,
) -> float:
    """Gather every rank's tokens, routing and output on rank 0; its max relative error there."""
    import torch

    from moe_a2a.layers.reference import max_relative_error, reference_forward

    parts = comm.gather(tuple(t.cpu() for t in (x, topk_ids, topk_weights, out)), root=0)
    if parts is None:
        return 0.0
    xs, ids, ws, outs = (torch.cat([p[i] for p in parts]) for i in range(4))
    ref = reference_forward(xs, full, ids, ws, dispatch_dtype)
    return max_relative_error(outs, ref)
