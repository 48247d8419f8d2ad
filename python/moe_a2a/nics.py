"""Which NICs (libfabric domains) a rank opens: named explicitly, or picked by locality from sysfs.

Explicit: a list of domain names, from `Engine(nics=...)` or `MOE_A2A_NICS`
("a,b" for every rank, or "a,b;c,d;..." with one group per local rank). The
rank uses the first `num_nics` names; a name listed twice opens two endpoints
on that device (how the single-device test machines exercise the multi-NIC
paths).

Automatic: `num_nics` distinct devices, nearest first. On a GPU rank the
distance is the number of PCIe links between the GPU and the NIC (their paths
under /sys/devices); on a CPU rank, whether the NIC sits on the rank's NUMA
node. Devices sysfs knows nothing about (veth, tcp over a bridge) keep the
provider's order; loopback goes last, as it reaches no other host.

Everything reads a sysfs root given as an argument, so the tests run the
selection against recorded topologies (tests/data/sysfs).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

from moe_a2a import switches

ENV = "MOE_A2A_NICS"
_FAR = 1 << 20  # distance of a device without a PCI path
_IFF_LOOPBACK = 0x8


class NicError(ValueError):
    """A NIC selection that cannot be met; the message names what exists."""


@dataclass(frozen=True)
class Device:
    """One domain as the selection sees it."""

    name: str
    pci: str | None  # resolved path under <root>/devices, or None (virtual)
    numa: int | None
    loopback: bool


def parse_spec(spec: str, local_rank: int = 0) -> list[str]:
    """The names `spec` gives the rank at `local_rank`: "a,b" for all, "a,b;c,d" per local rank."""
    groups = [g for g in spec.strip().split(";")]
    if len(groups) > 1 and local_rank >= len(groups):
        raise NicError(
            f"{ENV}: got {spec!r}, {len(groups)} groups; "
            f"expected one per local rank (local rank {local_rank})"
        )
    group = groups[local_rank] if len(groups) > 1 else groups[0]
    names = [n.strip() for n in group.split(",") if n.strip()]
    if not names:
        raise NicError(f"{ENV}: got {spec!r}; expected comma-separated domain names")
    return names


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _device_dir(root: str, domain: str) -> tuple[str | None, bool]:
    """(resolved PCI device dir or None, is loopback) for a domain name.

    efa lists "rdmap79s0-rdm" (RDMA device plus endpoint type), verbs "mlx5_0",
    tcp the network interface.
    """
    base = domain.rsplit("-", 1)[0] if domain.endswith(("-rdm", "-dgrm", "-xrc")) else domain
    for cls in ("infiniband", "net"):
        entry = os.path.join(root, "class", cls, base)
        if not os.path.exists(entry):
            continue
        flags = _read(os.path.join(entry, "flags")) if cls == "net" else None
        loopback = flags is not None and int(flags, 16) & _IFF_LOOPBACK != 0
        link = os.path.join(entry, "device")
        return (os.path.realpath(link) if os.path.exists(link) else None), loopback
    return None, domain == "lo"


def describe(domains: Sequence[str], root: str = "/sys") -> list[Device]:
    """Each domain with its PCI path and NUMA node where sysfs has them."""
    out = []
    for name in domains:
        pci, loopback = _device_dir(root, name)
        numa = None
        if pci is not None:
            node = _read(os.path.join(pci, "numa_node"))
            numa = int(node) if node not in (None, "", "-1") else None
        out.append(Device(name, pci, numa, loopback))
    return out


def gpus(root: str = "/sys") -> list[str]:
    """NVIDIA GPUs' PCI addresses, ascending (the order CUDA_DEVICE_ORDER=PCI_BUS_ID gives)."""
    pci = os.path.join(root, "bus", "pci", "devices")
    found = []
    for addr in sorted(os.listdir(pci)) if os.path.isdir(pci) else []:
        vendor = _read(os.path.join(pci, addr, "vendor"))
        cls = _read(os.path.join(pci, addr, "class")) or ""
        if vendor == "0x10de" and cls.startswith("0x03"):
            found.append(addr)
    return found


def gpu_path(gpu: int | str, root: str = "/sys") -> str:
    """The resolved sysfs path of a GPU given by index (among `gpus`) or PCI address."""
    listed = gpus(root)
    if isinstance(gpu, int):
        if not 0 <= gpu < len(listed):
            raise NicError(f"gpu: got {gpu}; expected an index below {len(listed)} (GPUs in sysfs: {listed})")
        gpu = listed[gpu]
    path = os.path.join(root, "bus", "pci", "devices", gpu.lower())
    if not os.path.exists(path):
        raise NicError(f"gpu: got {gpu!r}; expected a PCI address of a GPU in sysfs: {listed}")
    return os.path.realpath(path)


def pci_distance(a: str, b: str) -> int:
    """PCIe links between two devices: steps up from each to their common ancestor."""
    pa, pb = a.split(os.sep), b.split(os.sep)
    common = 0
    while common < min(len(pa), len(pb)) and pa[common] == pb[common]:
        common += 1
    return len(pa) + len(pb) - 2 * common


def cpu_numa_node(root: str = "/sys", cpus: set[int] | None = None) -> int | None:
    """The NUMA node holding most of `cpus` (default: this process's affinity)."""
    cpus = cpus if cpus is not None else os.sched_getaffinity(0)
    base = os.path.join(root, "devices", "system", "node")
    best, best_count = None, 0
    for entry in sorted(os.listdir(base)) if os.path.isdir(base) else []:
        if not entry.startswith("node") or not entry[4:].isdigit():
            continue
        listed = _read(os.path.join(base, entry, "cpulist")) or ""
        count = len(cpus & _parse_cpulist(listed))
        if count > best_count:
            best, best_count = int(entry[4:]), count
    return best


def _parse_cpulist(text: str) -> set[int]:
    out: set[int] = set()
    for part in filter(None, text.split(",")):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


@dataclass(frozen=True)
class Selection:
    names: list[str]
    how: str  # for `moe-a2a info` and error messages


def select(
    domains: Sequence[str],
    num_nics: int,
    *,
    explicit: Sequence[str] | None = None,
    gpu: int | str | None = None,
    root: str = "/sys",
    cpus: set[int] | None = None,
    provider: str = "",
) -> Selection:
    """The `num_nics` domains a rank opens, out of those the provider lists (`domains`)."""
    offered = ", ".join(domains) or "none"
    of = f"provider {provider!r}" if provider else "the provider"
    if not isinstance(num_nics, int) or num_nics < 1:
        raise NicError(f"num_nics: got {num_nics!r}; expected a positive integer")
    if explicit is not None:
        names = list(explicit)
        unknown = [n for n in names if n not in domains]
        if unknown:
            raise NicError(
                f"nics: got {names}; {', '.join(unknown)} not offered by {of}; domains offered: {offered}"
            )
        if len(names) < num_nics:
            raise NicError(f"num_nics: got {num_nics}; the named NICs are only {names}")
        return Selection(names[:num_nics], "named")
    if num_nics > len(domains):
        raise NicError(f"num_nics: got {num_nics}; {of} offers {len(domains)} device(s): {offered}")
    devices = describe(domains, root)
    if gpu is not None:
        there = gpu_path(gpu, root)
        gpu_numa = _read(os.path.join(there, "numa_node"))
        how = f"nearest to GPU {gpu} by PCIe"

        # Across root complexes the path distance is the same for every NIC:
        # then one on the GPU's NUMA node is nearer.
        def key(i: int) -> tuple[int, int, int, int]:
            d = devices[i]
            far = pci_distance(there, d.pci) if d.pci else _FAR
            return (d.loopback, far, str(d.numa) != gpu_numa, i)
    else:
        node = cpu_numa_node(root, cpus)
        how = f"on NUMA node {node}" if node is not None else "provider order"

        def key(i: int) -> tuple[int, int, int, int]:
            d = devices[i]
            return (d.loopback, 0, 0 if node is not None and d.numa == node else 1, i)

    order = sorted(range(len(devices)), key=key)
    if all(devices[i].pci is None for i in order):
        how = "provider order"
    return Selection([devices[i].name for i in order[:num_nics]], how)


def num_nics_default(num_nics: int | None) -> int:
    """`num_nics` where given, else `MOE_A2A_NUM_NICS` (set by the job presets), else 1."""
    if num_nics is not None:
        return num_nics
    try:
        return int(switches.get("MOE_A2A_NUM_NICS"))
    except ValueError as e:
        raise NicError(str(e)) from None


def explicit_from_env(local_rank: int) -> list[str] | None:
    spec = switches.get(ENV) or ""
    return parse_spec(spec, local_rank) if spec.strip() else None


def current_gpu_address() -> str | None:
    """The PCI address of torch's current CUDA device, where torch reports it."""
    import torch

    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    if not hasattr(props, "pci_bus_id"):
        return None
    domain = getattr(props, "pci_domain_id", 0)
    device = getattr(props, "pci_device_id", 0)  # torch's stub names pci_bus_id only
    return f"{domain:04x}:{props.pci_bus_id:02x}:{device:02x}.0"
