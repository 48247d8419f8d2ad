"""The public dispatch and combine stay small; the training extras travel in one RowRequest."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch

from moe_a2a.all_to_all import AllToAll, RowRequest

TRAINING_FIELDS = {
    "in_place",
    "row_weights",
    "row_scale",
    "row_dot",
    "row_values",
    "values_out",
}


def public_parameters(method: object) -> list[str]:
    return [p for p in inspect.signature(method).parameters if p != "self"]  # type: ignore[arg-type]


def test_public_calls_take_what_a_user_needs() -> None:
    dispatch, combine = public_parameters(AllToAll.dispatch), public_parameters(AllToAll.combine)
    assert dispatch == [
        "x", "topk_ids", "topk_weights", "send", "recv", "handle", "routing", "keep_routing", "dequantize"
    ]  # fmt: skip
    assert combine == ["y", "d", "send", "recv", "handle", "weighted"]
    assert not TRAINING_FIELDS & {*dispatch, *combine}, "a training extra leaked into the public API"


def test_the_request_is_frozen_plain_data() -> None:
    fields = {f.name: f.type for f in dataclasses.fields(RowRequest)}
    assert set(fields) == TRAINING_FIELDS
    request = RowRequest(row_weights=True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        request.row_weights = False  # type: ignore[misc]
    # Every field is a tensor, a bool or a dtype (what an operator schema can carry).
    assert all(any(t in str(kind) for t in ("Tensor", "bool", "dtype")) for kind in fields.values()), fields


def test_each_call_kind_refuses_the_others_fields() -> None:
    ones = torch.ones(2)
    with pytest.raises(ValueError, match="dispatch: row_values, values_out belong to the other call kind"):
        RowRequest(row_values=ones, values_out=ones).check_for("dispatch")
    with pytest.raises(ValueError, match="combine: row_weights, row_scale belong to the other call kind"):
        RowRequest(row_weights=True, row_scale=ones).check_for("combine")
    RowRequest(in_place=True, row_weights=True, row_scale=ones).check_for("dispatch")
    RowRequest(in_place=True, row_values=ones, values_out=ones).check_for("combine")
