"""Emulated hosts on one machine: network namespaces with two "NICs" each.

    with Testbed(hosts=3, rate="30mbit") as bed:
        procs = [bed.popen(h, ["python", "rank.py"], env) for h in range(3)]

Layout (addresses exist only inside the namespaces made here):

    <prefix>sw              bridges brm, br1, br2 (no addresses)
    <prefix>h<i>  vm  10.77.0.<i+1>/24  -> brm   management: the launcher's rendezvous
                  va1 10.77.1.<i+1>/24  -> br1   NIC 1 (tbf-limited where `rate` is given)
                  va2 10.77.2.<i+1>/24  -> br2   NIC 2

Each rank runs under `ip netns exec <ns> unshare --uts`, with the namespace's
name as host name, so the bootstrap sees one rank per host. Ranks rendezvous
over torch.distributed (gloo) on `vm`, so no launcher traffic needs a path out
of the namespaces. Everything is deleted on exit, at interpreter exit (atexit),
and namespaces a crashed run left behind are removed by prefix first.

    python tools/testbed.py check     # can this machine make namespaces? (exit 0 / 1)
    python tools/testbed.py cleanup   # delete namespaces left by earlier runs
"""

from __future__ import annotations

import atexit
import os
import subprocess
import sys
from collections.abc import Sequence

PREFIX = "ma2a-tb-"
MASTER_PORT = 29577


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True, timeout=30)


def _ns_exec(ns: str, *cmd: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return _ip("netns", "exec", ns, *cmd, check=check)


def cleanup_stale(prefix: str = PREFIX) -> list[str]:
    """Delete every namespace whose name starts with `prefix`; returns their names."""
    listed = _ip("netns", "list", check=False).stdout.split("\n")
    gone = [line.split()[0] for line in listed if line.startswith(prefix)]
    for ns in gone:
        _ip("netns", "del", ns, check=False)
    return gone


def unavailable() -> str | None:
    """Why namespaces cannot be made here, or None when they can."""
    if os.geteuid() != 0:
        return "needs root (ip netns add)"
    probe = f"{PREFIX}probe{os.getpid()}"
    try:
        made = _ip("netns", "add", probe, check=False)
        if made.returncode != 0:
            return f"ip netns add failed: {made.stderr.strip()}"
        veth = _ns_exec(probe, "ip", "link", "add", "pa", "type", "veth", "peer", "name", "pb", check=False)
        if veth.returncode != 0:
            return f"veth pairs are not allowed: {veth.stderr.strip()}"
        tbf = _ns_exec(probe, "tc", "qdisc", "add", "dev", "pa", "root", "tbf", "rate", "1mbit",
                       "burst", "32kbit", "latency", "100ms", check=False)  # fmt: skip
        if tbf.returncode != 0:
            return f"tc tbf is not allowed: {tbf.stderr.strip()}"
    except (OSError, subprocess.SubprocessError) as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        _ip("netns", "del", probe, check=False)
    return None


class Testbed:
    """N emulated hosts, each with a management veth and two NIC veths to per-plane bridges."""

    NICS = ("va1", "va2")

    def __init__(self, hosts: int, rate: str | None = None, prefix: str = PREFIX) -> None:
        if not isinstance(hosts, int) or not 1 <= hosts <= 200:
            raise ValueError(f"hosts: got {hosts!r}; expected an integer in [1, 200]")
        self.hosts = hosts
        self.rate = rate
        self.prefix = prefix
        self.switch = f"{prefix}sw"
        self.namespaces = [f"{prefix}h{i}" for i in range(hosts)]
        self._up = False

    def address(self, host: int, plane: int) -> str:
        """Plane 0 is management, 1 and 2 the NICs."""
        return f"10.77.{plane}.{host + 1}"

    def __enter__(self) -> Testbed:
        cleanup_stale(self.prefix)
        atexit.register(self.close)
        self._up = True
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _build(self) -> None:
        sw = self.switch
        _ip("netns", "add", sw)
        for br in ("brm", "br1", "br2"):
            _ns_exec(sw, "ip", "link", "add", br, "type", "bridge")
            _ns_exec(sw, "ip", "link", "set", br, "up")
        for i, ns in enumerate(self.namespaces):
            _ip("netns", "add", ns)
            # No IPv6: router solicitations would add bytes to the counters the tests read.
            _ns_exec(ns, "sysctl", "-q", "-w", "net.ipv6.conf.all.disable_ipv6=1")
            _ns_exec(ns, "sysctl", "-q", "-w", "net.ipv6.conf.default.disable_ipv6=1")
            _ns_exec(ns, "ip", "link", "set", "lo", "up")
            for plane, (dev, br) in enumerate((("vm", "brm"), ("va1", "br1"), ("va2", "br2"))):
                far = f"s{i}p{plane}"  # the switch's end
                _ns_exec(ns, "ip", "link", "add", dev, "type", "veth", "peer", "name", far)
                _ns_exec(ns, "ip", "link", "set", far, "netns", sw)
                _ns_exec(sw, "ip", "link", "set", far, "master", br)
                _ns_exec(sw, "ip", "link", "set", far, "up")
                _ns_exec(ns, "ip", "addr", "add", f"{self.address(i, plane)}/24", "dev", dev)
                _ns_exec(ns, "ip", "link", "set", dev, "up")
                if plane > 0 and self.rate:
                    # Egress of the host's NIC: what one host can send through it.
                    _ns_exec(ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", self.rate,
                             "burst", "64kbit", "latency", "400ms")  # fmt: skip

    def close(self) -> None:
        if not self._up:
            return
        self._up = False
        for ns in [*self.namespaces, self.switch]:
            _ip("netns", "del", ns, check=False)

    def counters(self, host: int) -> dict[str, dict[str, int]]:
        """tx/rx bytes of each interface of a host, read from /sys/class/net inside its namespace."""
        script = (
            "for d in /sys/class/net/*; do "
            'echo "${d##*/} $(cat $d/statistics/tx_bytes) $(cat $d/statistics/rx_bytes)"; done'
        )
        out = _ns_exec(self.namespaces[host], "sh", "-c", script).stdout
        return {
            name: {"tx": int(tx), "rx": int(rx)}
            for name, tx, rx in (line.split() for line in out.splitlines() if line.strip())
        }

    def rank_env(self, host: int, world: int, extra: dict[str, str] | None = None) -> dict[str, str]:
        """Environment for the rank on `host`: torch rendezvous over the management plane."""
        env = dict(os.environ)
        env.update(
            RANK=str(host),
            WORLD_SIZE=str(world),
            MASTER_ADDR=self.address(0, 0),
            MASTER_PORT=str(MASTER_PORT),
            GLOO_SOCKET_IFNAME="vm",
            MOE_A2A_PROVIDER="tcp",
        )
        for name in ("FI_TCP_IFACE", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK"):
            env.pop(name, None)
        env.update(extra or {})
        return env

    def popen(
        self, host: int, argv: Sequence[str], env: dict[str, str], **kw: object
    ) -> subprocess.Popen[str]:
        """Start `argv` inside the host's namespace, with the namespace's name as host name."""
        ns = self.namespaces[host]
        # A host name per namespace: the bootstrap then sees one rank per host.
        uts = ["unshare", "--uts", "sh", "-c", f'hostname {ns} && exec "$@"', "sh"]
        wrapped = ["ip", "netns", "exec", ns, *uts, *argv]
        return subprocess.Popen(wrapped, env=env, text=True, **kw)  # type: ignore[call-overload]


def main(argv: list[str]) -> int:
    if argv[1:] == ["check"]:
        why = unavailable()
        print(why or "namespaces, veth pairs and tbf work here")
        return 1 if why else 0
    if argv[1:] == ["cleanup"]:
        print("deleted:", " ".join(cleanup_stale()) or "nothing")
        return 0
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
