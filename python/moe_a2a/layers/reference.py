"""The whole MoE layer in one process, in fp32: the ground truth that --verify checks against."""

from __future__ import annotations

import torch

from moe_a2a.layers.experts import dequantize, swiglu
from moe_a2a.layers.weights import MoEWeights
from moe_a2a.reference import quantize_fp8

DISPATCH_DTYPES = ("fp8", "bf16", "fp32")
COMBINE_DTYPES = ("bf16", "fp32")


def dispatched_input(x: torch.Tensor, dispatch_dtype: str) -> torch.Tensor:
    """What the experts see of `x` after dispatch rounds it (fp8 blocks, bf16 or fp32), in fp32.

    fp8 uses the all-to-all's own reference quantisation (docs/protocol.md fixes its
    bits), so the layer and this reference see identical expert inputs.
    """
    if dispatch_dtype == "fp8":
        q, scale = quantize_fp8(x)
        return dequantize(q, scale, torch.float32)
    if dispatch_dtype == "bf16":
        return x.to(torch.bfloat16).float()
    if dispatch_dtype == "fp32":
        return x.float()
    raise ValueError(f"dispatch_dtype: got {dispatch_dtype!r}; expected one of {DISPATCH_DTYPES}")


@torch.no_grad()
def reference_forward(
    x: torch.Tensor,
    weights: MoEWeights,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    dispatch_dtype: str = "fp32",
) -> torch.Tensor:
    """`out[t] = shared(x[t]) + sum_k w[t,k] * expert_{ids[t,k]}(x[t])`, in fp32 `[T, D]`.

    `weights` must hold every expert. Expert inputs are rounded as dispatch rounds
    them (`dispatch_dtype`), so the comparison measures the layer, not the format.
    Each expert is applied to its tokens with plain matmuls: no grouped GEMM, no
    all-to-all, nothing shared with the code under test but the weights.
    """
    if weights.num_local_experts != weights.num_experts:
        raise ValueError(
            f"weights: hold {weights.num_local_experts} of {weights.num_experts} experts; "
            "the reference needs the whole layer"
        )
    T = x.shape[0]
    if topk_ids.shape != topk_weights.shape or topk_ids.dim() != 2 or topk_ids.shape[0] != T:
        raise ValueError(
            f"topk_ids/topk_weights: got shapes {tuple(topk_ids.shape)} and {tuple(topk_weights.shape)}; "
            f"expected both [{T}, topk]"
        )
    if T and (int(topk_ids.min()) < 0 or int(topk_ids.max()) >= weights.num_experts):
        raise ValueError(f"topk_ids: got values outside [0, {weights.num_experts})")
    xr = dispatched_input(x, dispatch_dtype)
    out = torch.zeros(T, weights.hidden, dtype=torch.float32, device=x.device)
    flat_ids = topk_ids.reshape(-1)
    flat_tokens = torch.arange(T, device=x.device).repeat_interleave(topk_ids.shape[1])
    flat_w = topk_weights.reshape(-1).float()
    for e in torch.unique(flat_ids).tolist():
        picks = flat_ids == e
        tokens = flat_tokens[picks]
        y = swiglu(xr[tokens], weights.w1[e].float(), weights.w2[e].float(), weights.w3[e].float())
        out.index_add_(0, tokens, y * flat_w[picks].unsqueeze(1))
    if (shared := weights.shared) is not None:
        out += swiglu(x.float(), shared[0].float(), shared[1].float(), shared[2].float())
    return out


def max_relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """`max |out - ref| / max |ref|`: one number that scale-free tolerances can bound."""
    if out.shape != ref.shape:
        raise ValueError(f"out: got shape {tuple(out.shape)}; expected {tuple(ref.shape)} like the reference")
    if ref.numel() == 0:
        return 0.0
    diff = (out.float() - ref.float()).abs().max().item()
    return diff / max(ref.float().abs().max().item(), 1e-30)


def tolerance(dispatch_dtype: str, combine_dtype: str, weight_dtype: torch.dtype) -> float:
    """Bound on `max_relative_error` for a layer that computes in these formats.

    fp32 throughout leaves only summation order (1e-4 is generous); each bf16 rounding
    (expert input, hidden activations, expert output, combined output) adds about 2^-9
    relative per element, so 2e-2 of the largest value. fp8 adds
    nothing: dispatch and this reference quantise to the same bits.
    """
    if dispatch_dtype == "fp32" and combine_dtype == "fp32" and weight_dtype == torch.float32:
        return 1e-4
    return 2e-2


def reference_train_step(
    x: torch.Tensor,
    weights: MoEWeights,
    topk_ids: torch.Tensor,
    target: torch.Tensor,
    *,
    topk_weights: torch.Tensor | None = None,
    score_func: str = "softmax",
    norm_topk: bool = True,
    route_scale: float = 1.0,
    dispatch_dtype: str = "fp32",
) -> tuple[float, dict[str, torch.Tensor]]:
    """The training loss of the whole layer and its gradients, by plain autograd in fp32.

    `loss = mean((layer(x) - target)^2)` over every token and feature. The experts
    are the given `topk_ids`; their weights are the router's scores of those experts
    (normalised and scaled as the router does), so the gate gets its gradient,
    unless `topk_weights` are given (then they are constants and the gate gets none).
    Expert inputs are rounded as dispatch rounds them, with the straight-through
    gradient. Returns the loss and the gradients keyed by MoELayer's parameter names
    (routed experts whole, `[E, ...]`) and `x`; a parameter that gets no gradient is
    absent.
    """
    if weights.num_local_experts != weights.num_experts:
        raise ValueError(
            f"weights: hold {weights.num_local_experts} of {weights.num_experts} experts; "
            "the reference needs the whole layer"
        )

    def leaf(t: torch.Tensor) -> torch.Tensor:
        return t.detach().to(torch.float32).clone().requires_grad_(True)

    params = {
        "router.gate.weight": leaf(weights.gate),
        "routed_experts.inner_experts.w1_EFD": leaf(weights.w1),
        "routed_experts.inner_experts.w2_EDF": leaf(weights.w2),
        "routed_experts.inner_experts.w3_EFD": leaf(weights.w3),
    }
    if (shared := weights.shared) is not None:
        params.update(
            {
                "shared_experts.w1.weight": leaf(shared[0]),
                "shared_experts.w2.weight": leaf(shared[1]),
                "shared_experts.w3.weight": leaf(shared[2]),
            }
        )
    xf = leaf(x)
    gate = params["router.gate.weight"]
    if topk_weights is None:
        logits = xf @ gate.t()
        scores = torch.softmax(logits, dim=-1) if score_func == "softmax" else torch.sigmoid(logits)
        w = scores.gather(1, topk_ids)
        if norm_topk:
            w = w / w.sum(dim=-1, keepdim=True).clamp_min(1e-20)
        w = w * route_scale
    else:
        w = topk_weights.detach().float()
    rounded = dispatched_input(xf.detach(), dispatch_dtype)
    xr = xf + (rounded - xf.detach())  # straight-through: the rounding's gradient is the identity
    T = x.shape[0]
    out = torch.zeros(T, weights.hidden, dtype=torch.float32, device=x.device)
    flat_ids = topk_ids.reshape(-1)
    flat_tokens = torch.arange(T, device=x.device).repeat_interleave(topk_ids.shape[1])
    flat_w = w.reshape(-1)
    w1, w2, w3 = (params[f"routed_experts.inner_experts.{n}"] for n in ("w1_EFD", "w2_EDF", "w3_EFD"))
    for e in torch.unique(flat_ids).tolist():
        picks = flat_ids == e
        tokens = flat_tokens[picks]
        y = swiglu(xr[tokens], w1[e], w2[e], w3[e])
        out = out.index_add(0, tokens, y * flat_w[picks].unsqueeze(1))
    if weights.has_shared:
        out = out + swiglu(
            xf,
            params["shared_experts.w1.weight"],
            params["shared_experts.w2.weight"],
            params["shared_experts.w3.weight"],
        )
    loss = (out - target.float()).square().mean()
    loss.backward()
    grads = {name: p.grad for name, p in params.items() if p is not None and p.grad is not None}
    if xf.grad is not None:
        grads["x"] = xf.grad
    return float(loss.detach()), grads


def grad_tolerance(
    dispatch_dtype: str, combine_dtype: str, weight_dtype: torch.dtype, grad_dtype: str
) -> float:
    """Bound on `max_relative_error` of the loss and of each gradient in `--mode train`.

    fp32 throughout leaves summation order (1e-3: gradients sum over many more
    terms than outputs). Otherwise every bf16 rounding of the forward (as in
    `tolerance`) and of the backward (output gradient, row gradients, bf16 weight
    gradients, the sum over ranks) adds up: 5e-2 of the largest value.
    """
    if (
        dispatch_dtype == "fp32"
        and combine_dtype == "fp32"
        and weight_dtype == torch.float32
        and grad_dtype == "fp32"
    ):
        return 1e-3
    return 5e-2
