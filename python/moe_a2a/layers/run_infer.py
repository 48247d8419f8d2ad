"""`moe-a2a run --mode decode|prefill`: the layer's forward pass per iteration, timed and verified.

With `--verify`, rank 0 gathers every rank's tokens, routing and output and checks
them against the whole layer computed in one process.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from moe_a2a import report
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
    try:
        for step in range(total_iters):
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
            # Start together, so each phase measures the layer and not the ranks' skew.
            comm.Barrier()
            timer = phase_timer(recorder, it, device) if it >= 0 else None
            out = layer.forward(x, a2a, topk_ids, topk_weights, timer=timer)
            if it >= 0:
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
    a2a.close()

    footer = []
    if args.verify:
        footer.append(
            f"verify: {'FAILED' if failures else 'OK'}: max relative error {worst:.3g} (limit {limit:g}) "
            f"over {args.iters} iterations x {world} ranks"
        )
        footer += [f"  {f}" for f in failures[:5]]
    return finish(comm, recorder, args, shape, tokens, topology, provider, footer, bool(failures), rows_path)


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
