"""Writes the synthetic sysfs trees the NIC selection tests read (tests/unit/test_nics.py).

Only what moe_a2a.nics reads: PCI devices (vendor, class, numa_node) nested
under their root complex and PCIe switch the way /sys/devices nests them,
/sys/bus/pci/devices links, /sys/class/{infiniband,net}/<name>/device links
and NUMA nodes' cpulists. Rerun after changing it:
    python tests/data/sysfs/make_trees.py
"""

from __future__ import annotations

import os
import shutil

HERE = os.path.dirname(os.path.abspath(__file__))
NVIDIA_H200 = ("0x10de", "0x030200")
EFA = ("0x1d0f", "0x020000")
CX7 = ("0x15b3", "0x020700")
ENA = ("0x1d0f", "0x020000")


class Tree:
    def __init__(self, name: str) -> None:
        self.root = os.path.join(HERE, name)
        shutil.rmtree(self.root, ignore_errors=True)
        os.makedirs(self.root)

    def pci(self, chain: list[str], kind: tuple[str, str], numa: int) -> str:
        """A device at the end of `chain` (root complex, bridges..., device); returns its sysfs path."""
        path = os.path.join(self.root, "devices", *chain)
        os.makedirs(path, exist_ok=True)
        for name, value in (("vendor", kind[0]), ("class", kind[1]), ("numa_node", str(numa))):
            with open(os.path.join(path, name), "w") as f:
                f.write(value + "\n")
        self._link(os.path.join("bus", "pci", "devices", chain[-1]), path)
        return path

    def cls(self, cls: str, name: str, device: str, flags: str | None = None) -> None:
        entry = os.path.join(self.root, "class", cls, name)
        os.makedirs(entry, exist_ok=True)
        self._link(os.path.join("class", cls, name, "device"), device)
        if flags is not None:
            with open(os.path.join(entry, "flags"), "w") as f:
                f.write(flags + "\n")

    def node(self, n: int, cpus: str) -> None:
        path = os.path.join(self.root, "devices", "system", "node", f"node{n}")
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, "cpulist"), "w") as f:
            f.write(cpus + "\n")

    def _link(self, rel: str, target: str) -> None:
        link = os.path.join(self.root, rel)
        os.makedirs(os.path.dirname(link), exist_ok=True)
        os.symlink(os.path.relpath(target, os.path.dirname(link)), link)


def p5en() -> None:
    """8 GPUs, 16 EFA: each GPU shares a PCIe switch with two EFAs; GPUs 0-3 on NUMA node 0."""
    t = Tree("p5en")
    t.node(0, "0-47,96-143")
    t.node(1, "48-95,144-191")
    for g in range(8):
        numa = g // 4
        rc = f"pci0000:{0x10 * (g + 1):02x}"
        up = f"0000:{0x10 * (g + 1):02x}:01.0"
        bus = 0x10 * (g + 1) + 1
        sw = f"0000:{bus:02x}:00.0"
        ports = [f"0000:{bus + 1:02x}:{p:02x}.0" for p in range(3)]
        t.pci([rc, up, sw, ports[0], f"0000:{bus + 2:02x}:00.0"], NVIDIA_H200, numa)
        for e in range(2):
            nic_bus = bus + 3 + e
            dev = t.pci([rc, up, sw, ports[1 + e], f"0000:{nic_bus:02x}:00.0"], EFA, numa)
            t.cls("infiniband", f"rdmap{nic_bus}s0", dev)
    ena = t.pci(["pci0000:00", "0000:00:05.0"], ENA, 0)
    t.cls("net", "enp0s5", ena, "0x1003")


def cx7() -> None:
    """8 GPUs, 8 ConnectX-7 1:1 behind a switch each, plus two storage CX7 on the root complex."""
    t = Tree("cx7")
    t.node(0, "0-55,112-167")
    t.node(1, "56-111,168-223")
    for g in range(8):
        numa = g // 4
        rc = f"pci0000:{0x18 + 0x20 * g:02x}"
        bus = 0x18 + 0x20 * g + 1
        up = f"0000:{bus - 1:02x}:01.0"
        sw = f"0000:{bus:02x}:00.0"
        t.pci([rc, up, sw, f"0000:{bus + 1:02x}:00.0", f"0000:{bus + 2:02x}:00.0"], NVIDIA_H200, numa)
        dev = t.pci([rc, up, sw, f"0000:{bus + 1:02x}:01.0", f"0000:{bus + 3:02x}:00.0"], CX7, numa)
        t.cls("infiniband", f"mlx5_{g}", dev)
    for s, numa in ((8, 0), (9, 1)):
        dev = t.pci([f"pci0000:{0xF0 + s:02x}", f"0000:{0xF0 + s:02x}:00.0"], CX7, numa)
        t.cls("infiniband", f"mlx5_{s}", dev)
    lo = os.path.join(t.root, "class", "net", "lo")
    os.makedirs(lo)
    with open(os.path.join(lo, "flags"), "w") as f:
        f.write("0x9\n")


if __name__ == "__main__":
    p5en()
    cx7()
