"""`moe-a2a run --mode train`: forward, backward and an optimizer step per iteration.

With `--verify`, rank 0 checks the loss and every gradient against plain autograd
over the whole layer (`reference_train_step`).
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any

from moe_a2a import report
from moe_a2a.layers.presets import MoEShape
from moe_a2a.layers.run_args import PROG, a2a_config
from moe_a2a.layers.run_inputs import generator, random_routing, skewed_popularity
from moe_a2a.layers.run_report import finish, no_phase, phase_timer, provider_name, record_counts
from moe_a2a.usage import UsageError

if TYPE_CHECKING:
    import torch


ROUTED = "routed_experts."  # parameter names of this rank's experts; the rest is replicated


def run_training(
    args: argparse.Namespace, shape: MoEShape, comm: Any, topology: Any, tokens: int, weights: Any
) -> int:
    """`--mode train`: forward, backward and an optimizer step of the layer per iteration.

    The loss is the mean squared error against a fixed random linear teacher of the
    tokens (new tokens every iteration, the same teacher on every rank), so it falls
    as the layer learns. Each rank holds its experts; the router and shared expert
    are replicated, so their gradients are summed over ranks before the step, as data
    parallelism over the expert-parallel group would.
    """
    trainer = _Trainer(args, shape, comm, tokens, weights)
    provider = provider_name(args)
    total_iters = args.warmup + args.iters
    progress = report.progress(total_iters, f"{PROG} {args.mode}", rank=trainer.rank, mode=args.progress)
    try:
        for step in range(total_iters):
            global_loss = trainer.step(step)
            if trainer.rank == 0:
                tag = " (warm-up)" if step < args.warmup else ""
                # tqdm.write: the line goes above the bar instead of through it.
                progress.write(
                    f"{PROG}: step {step + 1}/{total_iters}{tag}: loss {global_loss:.6g}", sys.stdout
                )
            trainer.verify_step(step)
            progress.update()
    except BaseException:
        progress.close()  # no collective close: main() aborts the job (see driver._run)
        raise
    progress.close()
    rows_path = trainer.ep.forward_a2a.rows_path
    trainer.ep.close()
    return finish(
        comm,
        trainer.recorder,
        args,
        shape,
        tokens,
        topology,
        provider,
        trainer.footer(),
        bool(trainer.failures),
        rows_path,
    )


class _Trainer:
    """The layer, its ExpertParallel and optimizer, and what the steps found."""

    def __init__(
        self, args: argparse.Namespace, shape: MoEShape, comm: Any, tokens: int, weights: Any
    ) -> None:
        import torch

        from moe_a2a.autograd import ExpertParallel
        from moe_a2a.layers.moe import MoELayer
        from moe_a2a.layers.reference import grad_tolerance
        from moe_a2a.trace import TRAIN_PHASES, TraceRecorder

        self.args, self.shape, self.comm, self.tokens = args, shape, comm, tokens
        self.rank, self.world = comm.Get_rank(), comm.Get_size()
        self.weight_dtype = torch.bfloat16 if args.weight_dtype == "bf16" else torch.float32
        self.layer = MoELayer(
            shape, weights, expert_padding=args.expert_padding, load_balance_coeff=args.load_balance_coeff
        ).train()
        try:
            self.ep = ExpertParallel(
                a2a_config(args, shape, tokens),
                comm=comm,
                device=args.device,
                provider=args.provider,
                ranks_per_node=args.ranks_per_node,
                grad_dtype=args.grad_dtype,
            )
        except ValueError as err:  # configuration checks, made alike on every rank before any exchange
            raise UsageError(str(err)) from None
        self.replicated = [p for n, p in self.layer.named_parameters() if not n.startswith(ROUTED)]
        optimizer_cls = torch.optim.AdamW if args.optimizer == "adamw" else torch.optim.SGD
        self.optimizer = optimizer_cls(self.layer.parameters(), lr=args.lr)
        self.popularity = None
        if args.routing == "skewed":
            self.popularity = skewed_popularity(shape.num_experts, args.skew, args.seed)
        D = shape.hidden
        self.teacher = (torch.randn(D, D, generator=generator(args.seed, "teacher")) * D**-0.5).to(
            args.device
        )
        self.recorder = TraceRecorder(args.iters, self.world, shape.num_experts, phases=TRAIN_PHASES)
        self.limit = grad_tolerance(
            args.dispatch_dtype, args.combine_dtype, self.weight_dtype, args.grad_dtype
        )
        self.failures: list[str] = []
        self.worst: dict[str, float] = {}
        self.losses: list[float] = []
        self._check: tuple[Any, ...] | None = None  # what verify_step needs of the last step

    def _inputs(self, step: int) -> tuple[torch.Tensor, torch.Tensor, Any, Any]:
        """This step's tokens, targets and (unless the router routes) routing."""
        import torch

        args, device = self.args, self.args.device
        gen = generator(args.seed, "tokens", self.rank, step)
        x = (
            torch.randn(self.tokens, self.shape.hidden, generator=gen)
            .to(device=device, dtype=self.weight_dtype)
            .requires_grad_(True)
        )
        target = x.detach().float() @ self.teacher
        if args.routing == "router":
            return x, target, None, None
        ids, weights = random_routing(
            self.tokens, self.shape.num_experts, self.shape.topk, gen, self.popularity
        )
        return x, target, ids.to(device), weights.to(device)

    def step(self, step: int) -> float:
        """One training step; the loss summed over ranks."""
        args, layer, comm = self.args, self.layer, self.comm
        it = step - args.warmup
        x, target, topk_ids, topk_weights = self._inputs(step)
        checking = args.verify and it >= 0
        before = {n: p.detach().clone() for n, p in layer.named_parameters()} if checking else None
        comm.Barrier()
        timer = phase_timer(self.recorder, it, args.device) if it >= 0 else None
        phase = timer or no_phase
        if args.routing == "router":
            # Recomputed every step from the current gate; differentiable w.r.t. it.
            topk_ids, topk_weights = layer.route(x)
        out = layer(x, self.ep, topk_ids, topk_weights, timer=timer)
        if it >= 0:
            record_counts(self.recorder, it, layer, self.ep.forward_a2a)
        loss = (out.float() - target).square().sum() / (self.world * self.tokens * self.shape.hidden)
        loss.backward()
        with phase("grad_allreduce"):
            _allreduce_grads(comm, self.replicated)
        grads = (
            {n: None if p.grad is None else p.grad.clone() for n, p in layer.named_parameters()}
            if checking
            else None
        )
        with phase("optimizer"):
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        if args.load_balance_coeff is not None:
            layer.update_expert_bias(all_reduce=lambda t: _allreduce_sum(comm, t))
        global_loss = float(comm.allreduce(float(loss.detach())))
        self.losses.append(global_loss)
        routed_weights = None if args.routing == "router" else topk_weights
        self._check = (before, grads, x, topk_ids, routed_weights, target, global_loss) if checking else None
        return global_loss

    def verify_step(self, step: int) -> None:
        """With --verify, check the last measured step against the reference on rank 0."""
        if self._check is None:
            return
        before, grads, x, topk_ids, topk_weights, target, loss = self._check
        found = _verify_train(
            self.comm, self.args, self.shape, before, grads, x, topk_ids, topk_weights, target, loss,
            self.limit, self.worst,
        )  # fmt: skip
        self.failures += [f"iteration {step - self.args.warmup}: {f}" for f in found]

    def footer(self) -> list[str]:
        """The lines under the summary table: the loss, and what --verify found."""
        losses, args = self.losses, self.args
        lines = [f"loss: {losses[0]:.6g} at step 1, {losses[-1]:.6g} at step {len(losses)}"]
        if args.verify:
            worst_s = ", ".join(f"{k} {v:.3g}" for k, v in self.worst.items())
            lines.append(
                f"verify: {'FAILED' if self.failures else 'OK'}: loss and gradients over {args.iters} "
                f"iterations x {self.world} ranks (limit {self.limit:g}); max relative errors: {worst_s}"
            )
            lines += [f"  {f}" for f in self.failures[:10]]
        return lines


def _allreduce_sum(comm: Any, t: torch.Tensor) -> torch.Tensor:
    """The sum of `t` over ranks (in fp32), in t's dtype and device."""
    import torch
    from mpi4py import MPI

    buf = t.detach().to("cpu", torch.float32).contiguous().numpy().copy()
    comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
    return torch.from_numpy(buf).to(device=t.device, dtype=t.dtype)


def _allreduce_grads(comm: Any, params: list[Any]) -> None:
    """Sum the replicated parameters' gradients over ranks, in one collective.

    A missing gradient counts as zeros, so every rank takes part alike.
    """
    import torch

    if not params:
        return
    flat = torch.cat(
        [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).float() for p in params]
    )
    total = _allreduce_sum(comm, flat)
    offset = 0
    for p in params:
        n = p.numel()
        p.grad = total[offset : offset + n].view_as(p).to(p.dtype)
        offset += n


def _cpu(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach().cpu()


def _verify_train(
    comm: Any,
    args: argparse.Namespace,
    shape: MoEShape,
    before: dict[str, Any],
    grads: dict[str, Any],
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor | None,
    target: torch.Tensor,
    loss: float,
    limit: float,
    worst: dict[str, float],
) -> list[str]:
    """Check the loss and every gradient against `reference_train_step` on rank 0.

    Gathers the tokens, routing, targets, the weights the forward used and the
    gradients of every rank. Returns what failed (rank 0; empty elsewhere); `worst`
    collects the largest error per name.
    """
    import torch

    from moe_a2a.layers.reference import reference_train_step
    from moe_a2a.layers.weights import MoEWeights

    cpu = _cpu
    routed = [n for n in before if n.startswith(ROUTED)]
    local = {
        "x": cpu(x),
        "x_grad": cpu(x.grad),
        "ids": cpu(topk_ids),
        "weights": cpu(topk_weights),
        "target": cpu(target),
        "experts": {n: cpu(before[n]) for n in routed},
        "grads": {n: cpu(grads[n]) for n in routed},
    }
    parts = comm.gather(local, root=0)
    if parts is None:
        return []

    def cat(key: str) -> torch.Tensor:
        return torch.cat([p[key] for p in parts])

    def cat_named(key: str, name: str) -> torch.Tensor | None:
        got = [p[key][name] for p in parts]
        if all(g is None for g in got):
            return None
        ref = next(g for g in got if g is not None)
        return torch.cat([torch.zeros_like(ref) if g is None else g for g in got])

    def whole(name: str) -> torch.Tensor | None:
        return cpu(before.get(name))

    def needed(t: torch.Tensor | None) -> torch.Tensor:
        assert t is not None  # the router and the routed experts are always there
        return t

    inner = "routed_experts.inner_experts."
    full = MoEWeights(
        gate=needed(whole("router.gate.weight")),
        w1=needed(cat_named("experts", inner + "w1_EFD")),
        w2=needed(cat_named("experts", inner + "w2_EDF")),
        w3=needed(cat_named("experts", inner + "w3_EFD")),
        shared_w1=whole("shared_experts.w1.weight"),
        shared_w2=whole("shared_experts.w2.weight"),
        shared_w3=whole("shared_experts.w3.weight"),
    )
    ref_loss, ref_grads = reference_train_step(
        cat("x"),
        full,
        cat("ids"),
        cat("target"),
        topk_weights=None if topk_weights is None else cat("weights"),
        score_func=shape.score_func,
        norm_topk=shape.norm_topk,
        route_scale=shape.route_scale,
        dispatch_dtype=args.dispatch_dtype,
    )
    run_grads: dict[str, torch.Tensor | None] = {n: cpu(g) for n, g in grads.items() if n not in routed}
    run_grads.update({n: cat_named("grads", n) for n in routed})
    x_grads = [p["x_grad"] for p in parts]
    run_grads["x"] = None if any(g is None for g in x_grads) else torch.cat(x_grads)
    return _compare(loss, ref_loss, run_grads, ref_grads, limit, worst)


def _compare(
    loss: float,
    ref_loss: float,
    run_grads: dict[str, torch.Tensor | None],
    ref_grads: dict[str, torch.Tensor],
    limit: float,
    worst: dict[str, float],
) -> list[str]:
    """What differs between the run's loss and gradients and the reference's, beyond `limit`."""
    from moe_a2a.layers.reference import max_relative_error

    found = []
    loss_err = abs(loss - ref_loss) / max(abs(ref_loss), 1e-30)
    worst["loss"] = max(worst.get("loss", 0.0), loss_err)
    if loss_err > limit:
        found.append(
            f"loss {loss:.6g}, reference {ref_loss:.6g}: relative error {loss_err:.3g} (limit {limit:g})"
        )
    for name in [*run_grads, *(n for n in ref_grads if n not in run_grads)]:
        label = "the input x" if name == "x" else name
        ref, got = ref_grads.get(name), run_grads.get(name)
        ref_max = 0.0 if ref is None else float(ref.abs().max())
        got_max = 0.0 if got is None else float(got.float().abs().max())
        if ref_max == 0.0:
            if got_max > 0.0:
                found.append(f"gradient of {label}: max |grad| {got_max:.3g} where the reference has none")
            continue
        if got_max == 0.0:
            what = "None" if got is None else "all zero"
            found.append(f"gradient of {label}: {what} here, the reference's has max |grad| {ref_max:.3g}")
            worst[name] = float("inf")
            continue
        assert got is not None and ref is not None  # both have a nonzero maximum
        err = max_relative_error(got, ref)
        worst[name] = max(worst.get(name, 0.0), err)
        if err > limit:
            found.append(f"gradient of {label}: max relative error {err:.3g} (limit {limit:g})")
    return found
