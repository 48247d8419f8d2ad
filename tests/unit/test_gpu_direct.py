"""The choice of the rows' path (GPU-direct or staged, moe_a2a.gpu_direct) from the
engines' capabilities, its agreement between ranks, and what a libfabric without
CUDA reports. The GPU-direct runs themselves need a CUDA-enabled libfabric and a GPU
(docs/benchmarks.md); here they skip, saying why."""

from __future__ import annotations

import numpy as np
import pytest

from moe_a2a import FabricError, _core
from moe_a2a.gpu_direct import (
    GPU_DIRECT,
    NO_FABRIC,
    SHM_MIN_WRITE_BYTES,
    STAGED,
    PathChoice,
    agree,
    choose_path,
)

BIG = SHM_MIN_WRITE_BYTES


def caps(provider: str, gpu: bool, why: str = "FI_HMEM, iface CUDA") -> dict[str, object]:
    return {"provider": provider, "gpu_memory": gpu, "gpu_memory_why": why}


@pytest.mark.parametrize(
    ("device", "provider", "nics", "forced", "largest", "path"),
    [
        ("cpu", "tcp", [caps("tcp", False)], None, BIG, STAGED),
        ("cuda", "shm", None, None, BIG, NO_FABRIC),
        ("cuda", "tcp", [caps("tcp;ofi_rxm", False, "no FI_HMEM")], None, BIG, STAGED),
        ("cuda", "efa", [caps("efa", True)], None, 4096, GPU_DIRECT),  # a NIC's DMA: every size
        ("cuda", "efa", [caps("efa", True), caps("efa", False)], None, BIG, STAGED),  # every NIC must
        ("cuda", "efa", [caps("efa", True)], False, BIG, STAGED),
        ("cuda", "shm", [caps("shm", True)], None, BIG, GPU_DIRECT),
        ("cuda", "shm", [caps("shm", True)], None, BIG - 1, STAGED),  # CUDA IPC copies lose below 1 MiB
        ("cuda", "shm", [caps("shm", True)], True, 4096, GPU_DIRECT),
    ],
)
def test_capabilities_choose_the_path(device, provider, nics, forced, largest, path):
    choice = choose_path(device, provider, nics, forced, largest)
    assert choice.path == path
    assert choice.reason


def test_the_shm_threshold_is_a_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    """MOE_A2A_GPU_DIRECT_SHM_MIN_BYTES moves shm's threshold (0: every call GPU-direct); a bad
    value is an error naming it. Other providers take no notice."""
    shm = [caps("shm", True)]
    monkeypatch.setenv("MOE_A2A_GPU_DIRECT_SHM_MIN_BYTES", "0")
    assert choose_path("cuda", "shm", shm, None, 1).path == GPU_DIRECT
    monkeypatch.setenv("MOE_A2A_GPU_DIRECT_SHM_MIN_BYTES", str(4 * BIG))
    staged = choose_path("cuda", "shm", shm, None, BIG)
    assert staged.path == STAGED and f"{4 * BIG} B (MOE_A2A_GPU_DIRECT_SHM_MIN_BYTES" in staged.reason
    assert choose_path("cuda", "efa", [caps("efa", True)], None, 1).path == GPU_DIRECT
    monkeypatch.setenv("MOE_A2A_GPU_DIRECT_SHM_MIN_BYTES", "1MiB")
    with pytest.raises(ValueError, match=r"MOE_A2A_GPU_DIRECT_SHM_MIN_BYTES: got '1MiB'; expected a whole"):
        choose_path("cuda", "shm", shm, None, BIG)


def test_forcing_gpu_direct_without_fi_hmem_names_why():
    with pytest.raises(RuntimeError, match=r"MOE_A2A_GPU_DIRECT=1: provider 'tcp' .*no FI_HMEM"):
        choose_path("cuda", "tcp", [caps("tcp;ofi_rxm", False, "no FI_HMEM")], True, BIG)


def test_ranks_agree_on_one_path():
    direct, staged = PathChoice(GPU_DIRECT, "FI_HMEM"), PathChoice(STAGED, "no FI_HMEM")
    assert agree([direct, direct], None) == direct
    both = agree([direct, staged, direct], None)  # one rank cannot: every rank stages
    assert both.path == STAGED and "rank 1" in both.reason
    with pytest.raises(RuntimeError, match="rank 1 cannot take the GPU-direct path"):
        agree([direct, staged], True)


def test_a_libfabric_without_cuda_falls_back_to_host_memory():
    """tcp never offers FI_HMEM, nor does a libfabric built without CUDA (Debian's): asked for
    it, the engine opens anyway, says why, and refuses CUDA memory naming provider, region and size."""
    c = _core.backend_capabilities("tcp", gpu_memory=True)
    assert not c["gpu_memory"] and "FI_HMEM" in c["gpu_memory_why"]
    assert choose_path("cuda", "tcp", [c], None, BIG).path == STAGED
    engine = _core.TransferEngine(0, 1, "tcp", gpu_memory=True)
    buf = np.zeros(4096, dtype=np.uint8)
    with pytest.raises(
        FabricError, match=r"provider 'tcp'.*the device workspace \(4096 bytes of CUDA memory"
    ):
        engine.register_region(buf.ctypes.data, buf.nbytes, "cuda", 0, "the device workspace")
    engine.register_region(buf.ctypes.data, buf.nbytes)  # host memory still registers


def test_shm_offers_gpu_memory_only_with_a_cuda_libfabric():
    if "shm" not in _core.libfabric_providers():
        pytest.skip("libfabric offers no shm provider here")
    c = _core.backend_capabilities("shm", gpu_memory=True)
    if not c["gpu_memory"]:
        pytest.skip(f"GPU-direct over shm needs a CUDA-enabled libfabric and a GPU: {c['gpu_memory_why']}")
    assert "FI_HMEM_DEVICE_ONLY" in c["gpu_memory_why"]


def test_graph_safe_instances_stage():
    """Captured kernels wait for landed rows on the GPU, where GPU-direct needs the host."""
    choice = choose_path("cuda", "shm", [caps("shm", True)], None, BIG, graph_safe=True)
    assert choice.path == STAGED and "graph_safe" in choice.reason
    with pytest.raises(RuntimeError, match="MOE_A2A_GPU_DIRECT=1: graph_safe=True"):
        choose_path("cuda", "efa", [caps("efa", True)], True, BIG, graph_safe=True)


@pytest.mark.parametrize("provider", ["tcp", "shm"])
def test_an_engine_asking_for_gpu_memory_still_moves_host_memory(provider):
    """A CUDA rank's engine (FI_HMEM asked for, taken where offered) writes host memory as
    before: the routing rows, flags and the staged path's rows."""
    if provider not in _core.libfabric_providers():
        pytest.skip(f"libfabric offers no {provider} provider here")
    engines = [_core.TransferEngine(r, 2, provider, gpu_memory=True) for r in range(2)]
    addresses = [e.address() for e in engines]
    for e in engines:
        e.connect(addresses)
    bufs = [np.zeros(8192, dtype=np.uint8) for _ in range(2)]
    regions = [e.register_region(b.ctypes.data, b.nbytes) for e, b in zip(engines, bufs, strict=True)]
    descs = [e.region_descriptor(r) for e, r in zip(engines, regions, strict=True)]
    remotes = [e.add_remote_region(1 - r, descs[1 - r]) for r, e in enumerate(engines)]
    groups = [e.create_group([1 - r], [remotes[r]]) for r, e in enumerate(engines)]
    for r, e in enumerate(engines):
        bufs[r][:8] = 10 + r
        e.scatter(groups[r], regions[r], [_core.ScatterItem(0, 0, 8, 4096)], 901)
    for r, e in enumerate(engines):
        e.wait_imm(901, 1 - r, 1, 30.0)
        assert (bufs[r][4096:4104] == 11 - r).all()
        e.wait_tx(30.0)
    for r, e in enumerate(engines):
        e.release(regions[r], groups[r])
