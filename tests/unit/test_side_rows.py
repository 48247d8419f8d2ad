"""The side channel's Triton kernels (moe_a2a.kernels.side_rows) against their torch forms, bit for bit.

Here they run in Triton's interpreter on the CPU: the test below reruns this
module in a child with TRITON_INTERPRET=1 (which must be set before any kernel
is defined). On a GPU machine `MOE_A2A_TEST_DEVICE=cuda` runs the same
cases compiled (tools/gpu/run_cuda_tests.sh, kernels stage).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from moe_a2a.kernels import side_rows as sr

DEVICE = os.environ.get("MOE_A2A_TEST_DEVICE", "cpu")
KERNELS_RUN = os.environ.get("TRITON_INTERPRET") == "1" or DEVICE == "cuda"
needs_kernels = pytest.mark.skipif(
    not KERNELS_RUN or sr.triton is None,
    reason="runs in the interpreted child (TRITON_INTERPRET=1) or with MOE_A2A_TEST_DEVICE=cuda",
)


@pytest.mark.skipif(KERNELS_RUN, reason="this is the child, or a GPU run")
def test_kernels_in_the_interpreter() -> None:
    if sr.triton is None:
        pytest.skip("Triton is not installed")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and "failed" not in run.stdout, run.stdout[-2000:]


def ids_of(tokens: int, k: int, g: torch.Generator, repeat: bool) -> torch.Tensor:
    if tokens == 0:
        return torch.zeros(0, k, dtype=torch.int64)
    ids = torch.stack([torch.randperm(max(64, k), generator=g)[:k] for _ in range(tokens)])
    if repeat:
        ids[tokens // 2, k - 1] = ids[tokens // 2, 0]
    return ids


@needs_kernels
@pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("weights_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 1), (5, 3), (70, 8), (33, 16), (9, 20), (0, 4)])
@pytest.mark.parametrize("repeat", [False, True])
def test_pack(
    ids_dtype: torch.dtype, weights_dtype: torch.dtype, shape: tuple[int, int], repeat: bool
) -> None:
    tokens, k = shape
    repeat = repeat and tokens > 0 and k > 1
    g = torch.Generator().manual_seed(tokens * 100 + k)
    ids = ids_of(tokens, k, g, repeat).to(ids_dtype).to(DEVICE)
    weights = torch.rand(tokens, k, generator=g).to(weights_dtype).to(DEVICE)
    flags = [torch.full((1,), 3, dtype=torch.int64, device=DEVICE) for _ in range(2)]
    want = sr.pack_side_rows_torch(ids, weights, flags[0], 7)
    got = sr._launch_pack(ids, weights, flags[1], 7)
    assert got.dtype == torch.float32 and torch.equal(got, want)
    assert int(flags[1]) == int(flags[0]) == (7 if repeat else 3), "the flag names the call only on a repeat"


@needs_kernels
@pytest.mark.parametrize(
    "local,padding,first,k",
    [(1, 1, 0, 1), (8, 1, 8, 3), (8, 4, 0, 3), (24, 2, 48, 8), (256, 1, 0, 8), (5, 128, 10, 4), (3, 1, 0, 2)],
)
@pytest.mark.parametrize("with_side", [False, True])
def test_route(local: int, padding: int, first: int, k: int, with_side: bool) -> None:
    g = torch.Generator().manual_seed(local * 10 + padding)
    counts = torch.randint(0, 9, (local,), generator=g, dtype=torch.int32)
    counts[0] = 0  # an expert with no rows
    if local == 3:
        counts.zero_()  # no rows at all
    rows = int(((counts.long() + padding - 1) // padding * padding).sum())
    side = None
    if with_side:
        # Each real row's ids name its expert once; padding rows hold whatever was there,
        # here the ids of other rows' experts too.
        side = torch.randn(rows, 2 * k, generator=g)
        expert = sr.route_rows_torch(counts, padding, rows, first, None).expert
        for r in range(rows):
            side[r, k + int(torch.randint(0, k, (1,), generator=g))] = float(expert[r] + first)
        side = side.to(DEVICE)
    want = sr.route_rows_torch(counts.to(DEVICE), padding, rows, first, side)
    got = sr._launch_route(counts.to(DEVICE), padding, rows, first, side)
    for name in ("expert", "real", "k", "weight"):
        a, b = getattr(want, name), getattr(got, name)
        assert (a is None) == (b is None), name
        if a is not None:
            assert a.dtype == b.dtype and torch.equal(a, b), f"{name} differs"
