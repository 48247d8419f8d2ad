"""The compiled path's operators (moe_a2a.compiled_ops): autograd passes through them in the
dispatcher, so the two with a gradient refuse a call that autograd would record, rather than
lose the gradient; through their autograd.Functions they run without grad."""

from __future__ import annotations

import pytest
import torch

from moe_a2a import compiled_ops


def test_operators_with_a_gradient_refuse_inputs_that_require_grad() -> None:
    x = torch.randn(4, 8, requires_grad=True)
    w = torch.rand(4, 2)
    key = inst = torch.tensor(0)
    with pytest.raises(RuntimeError, match=r"moe_a2a::dispatch_rows: called directly.*dispatch_rows_op"):
        torch.ops.moe_a2a.dispatch_rows.default(x, w, key, inst, 4)
    with pytest.raises(RuntimeError, match=r"moe_a2a::combine: called directly.*combine_op"):
        torch.ops.moe_a2a.combine.default(x, w[:, 0], key, inst, 4, torch.bfloat16, True, True)


def test_without_grad_the_operator_runs_its_kernel() -> None:
    """No gradient needed: past the check, to the instance lookup (none is open here)."""
    x = torch.randn(4, 8, requires_grad=True)
    with torch.no_grad(), pytest.raises(RuntimeError, match="ExpertParallel #123456 is closed"):
        torch.ops.moe_a2a.dispatch_rows.default(x, torch.rand(4, 2), torch.tensor(0), torch.tensor(123456), 4)
    with pytest.raises(RuntimeError, match="ExpertParallel #123456 is closed"):  # through the Function
        compiled_ops.dispatch_rows_op(x, torch.rand(4, 2), torch.tensor(0), torch.tensor(123456), 4)
