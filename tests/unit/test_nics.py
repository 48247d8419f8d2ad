"""NIC selection (moe_a2a.nics) against recorded sysfs topologies (tests/data/sysfs)."""

from __future__ import annotations

import os

import pytest

from moe_a2a import nics

DATA = os.path.join(os.path.dirname(__file__), "..", "data", "sysfs")
P5EN = os.path.join(DATA, "p5en")
CX7 = os.path.join(DATA, "cx7")
# efa's domain names, in the (bus) order libfabric lists them
P5EN_EFA = [f"rdmap{0x10 * (g + 1) + 4 + e}s0-rdm" for g in range(8) for e in range(2)]
CX7_VERBS = [f"mlx5_{i}" for i in range(10)]


def test_p5en_each_gpu_gets_the_two_efa_on_its_switch() -> None:
    picked = [nics.select(P5EN_EFA, 2, gpu=g, root=P5EN).names for g in range(8)]
    assert picked == [P5EN_EFA[2 * g : 2 * g + 2] for g in range(8)]
    assert len({n for pair in picked for n in pair}) == 16


def test_p5en_gpu_by_pci_address_and_beyond_its_switch() -> None:
    gpus = nics.gpus(P5EN)
    assert len(gpus) == 8
    assert nics.select(P5EN_EFA, 2, gpu=gpus[5], root=P5EN).names == P5EN_EFA[10:12]
    # a third NIC comes from the GPU's NUMA node (GPUs 4-7 and their EFA are on node 1)
    third = nics.select(P5EN_EFA, 3, gpu=5, root=P5EN).names[2]
    assert third == P5EN_EFA[8]


def test_cx7_one_nic_per_gpu_not_the_storage_ones() -> None:
    for g in range(8):
        assert nics.select(CX7_VERBS, 1, gpu=g, root=CX7).names == [f"mlx5_{g}"]


def test_cpu_rank_picks_by_numa_node() -> None:
    node1 = set(range(48, 96))
    assert nics.cpu_numa_node(P5EN, node1) == 1
    sel = nics.select(P5EN_EFA, 2, cpus=node1, root=P5EN)
    assert sel.names == P5EN_EFA[8:10] and sel.how == "on NUMA node 1"
    assert nics.select(CX7_VERBS, 2, cpus={0, 1}, root=CX7).names == ["mlx5_0", "mlx5_1"]


def test_virtual_devices_keep_provider_order_loopback_last(tmp_path: str) -> None:
    sel = nics.select(["lo", "va1", "va2"], 2, root=str(tmp_path))
    assert sel.names == ["va1", "va2"] and sel.how == "provider order"
    assert nics.select(["lo", "eth9"], 2, root=CX7).names == ["eth9", "lo"]  # CX7's lo has IFF_LOOPBACK


def test_more_nics_than_exist_names_what_exists() -> None:
    expected = r"num_nics: got 17; provider 'efa' offers 16 device\(s\): rdmap20s0-rdm, "
    with pytest.raises(nics.NicError, match=expected):
        nics.select(P5EN_EFA, 17, gpu=0, root=P5EN, provider="efa")


def test_unknown_name_names_what_exists() -> None:
    expected = r"nics: got \['mlx5_0', 'mlx5_42'\]; mlx5_42 not offered .*mlx5_9"
    with pytest.raises(nics.NicError, match=expected):
        nics.select(CX7_VERBS, 1, explicit=["mlx5_0", "mlx5_42"], root=CX7)
    with pytest.raises(nics.NicError, match=r"num_nics: got 3; the named NICs are only \['va1', 'va2'\]"):
        nics.select(["va1", "va2"], 3, explicit=["va1", "va2"])
    with pytest.raises(nics.NicError, match=r"gpu: got 9; expected an index below 8"):
        nics.select(P5EN_EFA, 1, gpu=9, root=P5EN)


def test_explicit_names_first_k_and_repeats() -> None:
    assert nics.select(["lo"], 2, explicit=["lo", "lo"]).names == ["lo", "lo"]
    assert nics.select(CX7_VERBS, 1, explicit=["mlx5_3", "mlx5_2"]).names == ["mlx5_3"]


def test_parse_spec() -> None:
    assert nics.parse_spec("va1, va2") == ["va1", "va2"]
    assert nics.parse_spec("a,b;c,d", local_rank=1) == ["c", "d"]
    assert nics.parse_spec("a,b", local_rank=5) == ["a", "b"]
    with pytest.raises(nics.NicError, match="2 groups; expected one per local rank"):
        nics.parse_spec("a;b", local_rank=2)
    with pytest.raises(nics.NicError, match="expected comma-separated domain names"):
        nics.parse_spec(" , ")


def test_num_nics_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MOE_A2A_NUM_NICS", raising=False)
    assert nics.num_nics_default(None) == 1
    monkeypatch.setenv("MOE_A2A_NUM_NICS", "2")
    assert (nics.num_nics_default(None), nics.num_nics_default(3)) == (2, 3)
    monkeypatch.setenv("MOE_A2A_NUM_NICS", "two")
    with pytest.raises(nics.NicError, match="MOE_A2A_NUM_NICS: got 'two'"):
        nics.num_nics_default(None)
