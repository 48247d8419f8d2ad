"""Whole rounds in one process, writes landing in the order the fabric is told, results exact."""

from __future__ import annotations

import pytest
from world import make_inputs


@pytest.mark.parametrize(("size", "rpn"), [(2, 1), (3, 1), (4, 2)])
def test_rounds_equal_the_reference(make_world, size: int, rpn: int) -> None:
    w = make_world(size, ranks_per_node=rpn)
    for seed in range(3):
        inp = make_inputs(seed, w.cfg, size)
        w.check(inp, w.run(lambda r, inp=inp: r.round(inp)))
