"""Combine error of fabric_rows "expert", "rank" and "node" against an fp64 reference
(docs/protocol.md, "Rows per destination rank" and "... node"): worst and mean absolute error per
element, for bf16 and fp32 combine rows; every rank its own node unless --ranks-per-node.

The numbers come from moe_a2a.reference.combine_reference, which tests/protocol holds equal to the
CPU backend bit for bit in both modes. Usage: python tools/fabric_rows_error.py [--tokens 128]
"""

from __future__ import annotations

import argparse

import torch

from moe_a2a.reference import combine_reference, dispatch_reference


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=128, help="tokens per rank")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--ranks-per-node", type=int, default=1, help="ranks of one node (mode node sums per node)"
    )
    a = ap.parse_args()
    g = torch.Generator().manual_seed(a.seed)
    n = a.ranks
    xs = [torch.randn(a.tokens, a.hidden, generator=g).to(torch.bfloat16) for _ in range(n)]
    draw = lambda: torch.randperm(a.experts, generator=g)[: a.topk]  # noqa: E731
    ids = [torch.stack([draw() for _ in range(a.tokens)]) for _ in range(n)]
    # Router-like weights: positive, summing to one per token.
    weights = [torch.softmax(torch.randn(a.tokens, a.topk, generator=g), dim=1) for _ in range(n)]
    ref = dispatch_reference(xs, ids, a.experts, "bf16")
    f32 = [torch.randn(d.expert_x.shape, generator=g) * 2 for d in ref]
    rpn = a.ranks_per_node
    layout = "each its own node" if rpn == 1 else f"{n // rpn} nodes of {rpn}"
    print(f"{n} ranks ({layout}), {a.tokens} tokens each, hidden {a.hidden}, ", end="")
    print(f"{a.experts} experts, top-{a.topk}")
    print("| expert outputs | combine_dtype | fabric_rows | worst abs error | mean abs error ", end="")
    print("| worst / max abs(out) |")
    print("|---|---|---|---|---|---|")
    for y_dtype in (torch.bfloat16, torch.float32):  # a bf16 model's experts, or an fp32 one's
        ys = [y.to(y_dtype) for y in f32]
        exact = [torch.zeros(a.tokens, a.hidden, dtype=torch.float64) for _ in range(n)]
        for r, d in enumerate(ref):
            for row, (s, t, k) in enumerate(d.origin.tolist()):
                if s >= 0:
                    exact[s][t] += weights[s][t, k].double() * ys[r][row].double()
        scale = max(float(e.abs().max()) for e in exact)
        for dtype in ("bf16", "fp32"):
            for mode in ("expert", "rank", "node") if rpn > 1 else ("expert", "rank"):
                outs = combine_reference(ys, ref, weights, dtype, mode, rpn)
                pairs = zip(outs, exact, strict=True)
                err = torch.cat([(o.double() - e).abs().reshape(-1) for o, e in pairs])
                worst, mean = float(err.max()), float(err.mean())
                name = str(y_dtype).removeprefix("torch.")
                print(f"| {name} | {dtype} | {mode} | {worst:.3e} | {mean:.3e} | {worst / scale:.3e} |")


if __name__ == "__main__":
    main()
