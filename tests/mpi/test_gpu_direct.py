"""GPU-direct rows (FI_HMEM, moe_a2a.gpu_direct) across real ranks: dispatch and combine equal
the in-process reference with the device workspace registered with the fabric, and a
registration failure on one rank stages, or with MOE_A2A_GPU_DIRECT=1 fails, every rank
together. They need MOE_A2A_TEST_DEVICE=cuda and a provider that registers CUDA memory (shm
or efa of a CUDA-enabled libfabric); elsewhere they skip and say why."""

from __future__ import annotations

import pytest
from ranks import COMM, DEVICE, RANK, WORLD, device_pytestmark, layouts
from test_a2a import check_round, make_a2a, make_inputs

from moe_a2a.all_to_all import AllToAll

pytestmark = [
    device_pytestmark,
    pytest.mark.skipif(DEVICE != "cuda", reason="GPU-direct is the CUDA path's (MOE_A2A_TEST_DEVICE=cuda)"),
]
REMOTE = [r for r in layouts() if r is not None]  # layouts with fabric peers


def gpu_direct_a2a(monkeypatch: pytest.MonkeyPatch, rpn: int, **overrides: object) -> AllToAll:
    """An instance forced GPU-direct; a skip (on every rank alike) where this job cannot."""
    monkeypatch.setenv("MOE_A2A_GPU_DIRECT", "1")
    try:
        return make_a2a(rpn, **overrides)
    except RuntimeError as e:
        if "MOE_A2A_GPU_DIRECT=1" not in str(e):
            raise
        pytest.skip(f"GPU-direct cannot run in this job: {e}")


# (ranks per node, fabric_rows): rows per node (the default over nodes of 2) land at the forwarder's
# device workspace, where its node peers read them.
MODES = [(rpn, mode) for rpn in REMOTE for mode in (("rank", "node") if rpn > 1 else ("rank",))]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize(("rpn", "mode"), MODES)
@pytest.mark.parametrize("dispatch_dtype", ["bf16", "fp8"])
@pytest.mark.parametrize("max_tokens", [24, 384], ids=["decode", "prefill"])
@pytest.mark.parametrize("split", [False, True], ids=["whole", "halves"])
def test_gpu_direct_rows_equal_the_reference(
    monkeypatch: pytest.MonkeyPatch, rpn: int, mode: str, dispatch_dtype: str, max_tokens: int, split: bool
) -> None:
    overrides = dict(dispatch_dtype=dispatch_dtype, max_tokens=max_tokens, fabric_rows=mode)
    with gpu_direct_a2a(monkeypatch, rpn, **overrides) as a2a:
        assert a2a.rows_path["path"] == "gpu-direct", a2a.rows_path
        for it in range(3):
            check_round(a2a, make_inputs(3100 + it, a2a.cfg), split=split)


@pytest.mark.mpi(min_size=2)
def test_graph_safe_instances_stage(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MOE_A2A_GPU_DIRECT", raising=False)
    with make_a2a(1, graph_safe=True) as a2a:
        assert a2a.rows_path["path"] == "staged" and "graph_safe" in a2a.rows_path["reason"]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("forced", [False, True], ids=["auto", "forced"])
def test_a_registration_failure_on_one_rank_is_every_ranks(
    monkeypatch: pytest.MonkeyPatch, forced: bool
) -> None:
    """Rank 1's registration fails: unforced, every rank stages and the dispatch is still exact;
    forced, every rank raises the same error, and nothing stays registered (a new instance opens)."""
    gpu_direct_a2a(monkeypatch, 1).close()  # skips where GPU-direct cannot run at all
    monkeypatch.setenv("MOE_A2A_GPU_DIRECT", "1" if forced else "")
    if RANK == 1:
        monkeypatch.setenv("MOE_A2A_TEST_FAIL_GPU_REGISTRATION", "1")
    if forced:
        with pytest.raises(RuntimeError, match="rank 1 could not register GPU memory") as info:
            make_a2a(1)
        messages = COMM.allgather(str(info.value))
        assert len(set(messages)) == 1, messages
    else:
        # Rows of 14 KB: a peer's private rows pass shm's 1 MiB rule, so registration is tried.
        with make_a2a(1, max_tokens=256, hidden=7168) as a2a:
            assert a2a.rows_path["path"] == "staged", a2a.rows_path
            assert "failed on rank 1" in a2a.rows_path["reason"], a2a.rows_path
            check_round(a2a, make_inputs(3200, a2a.cfg))
    monkeypatch.delenv("MOE_A2A_TEST_FAIL_GPU_REGISTRATION", raising=False)
    with gpu_direct_a2a(monkeypatch, 1) as a2a:
        assert a2a.rows_path["path"] == "gpu-direct"
        check_round(a2a, make_inputs(3300, a2a.cfg))
    assert WORLD >= 2


@pytest.mark.mpi(min_size=2)
def test_a_node_instance_after_a_gpu_direct_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """A GPU-direct instance closed, then one whose peers share the node, in the same process,
    while another GPU-direct instance keeps the engine (and shm's domain) open, as a server's
    other layers do. shm keeps its CUDA IPC mapping of each peer's registered device workspace
    until the domain closes; were that workspace freed, a new one at the same address would fail
    to open with cudaErrorAlreadyMapped (seen on the H200 with the suite run GPU-direct). So it
    is kept for reuse (`_core.cuda_pooled_workspace_bytes`)."""
    from moe_a2a import _core

    with gpu_direct_a2a(monkeypatch, 1) as keeper:
        for it in range(2):
            with gpu_direct_a2a(monkeypatch, 1) as a2a:
                check_round(a2a, make_inputs(3400 + it, a2a.cfg))
            assert _core.cuda_pooled_workspace_bytes() > 0, "a GPU-direct workspace was freed at close"
            monkeypatch.delenv("MOE_A2A_GPU_DIRECT", raising=False)
            with make_a2a(None) as a2a:
                check_round(a2a, make_inputs(3500 + it, a2a.cfg))
        check_round(keeper, make_inputs(3600, keeper.cfg))
