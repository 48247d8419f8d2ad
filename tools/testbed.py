"""Emulated hosts on one machine: network namespaces with two "NICs" each.

    with Testbed(hosts=3, rate="30mbit") as bed:
        procs = [bed.popen(h, ["python", "rank.py"], bed.rank_env(h, 3)) for h in range(3)]

Layout (addresses exist only inside the namespaces made here):

    <prefix>sw              bridges brm, br1, br2 (no addresses)
    <prefix>h<i>  vm  10.77.0.<i+1>/24  -> brm   management: the launcher's rendezvous
                  va1 10.77.1.<i+1>/24  -> br1   NIC 1 (tbf-limited where `rate` is given)
                  va2 10.77.2.<i+1>/24  -> br2   NIC 2

Each rank runs under `ip netns exec <ns> unshare --uts`, with the namespace's
name as host name: the ranks of one host (`ranks_per_host`, default 1) share
its namespace, NICs, host name and /dev/shm, so the bootstrap puts them on one
node. Ranks rendezvous over torch.distributed (gloo) on `vm`, at a port of the
run's own. Every run has a prefix of its own (`ma2a-tb-<pid>-<n>-` in a
process, `ma2a-tb-<name>-` from `up`), so runs on one machine leave each other
alone. Everything is deleted on exit and at interpreter exit (atexit);
entering first removes what runs whose process is gone left behind.

    python tools/testbed.py --help
    python tools/testbed.py check                                 # can this machine make namespaces?
    python tools/testbed.py up --hosts 2 --ranks-per-host 2       # testbed "tb", kept until `down`
    python tools/testbed.py exec 1 -- hostname                    # a command in host 1
    python tools/testbed.py exec --rank 3 1 -- python rank.py     # with rank 3's rendezvous variables
    python tools/testbed.py down                                  # delete it
    python tools/testbed.py cleanup [--all]                       # leftovers of dead runs (--all: every run)
"""

from __future__ import annotations

import argparse
import atexit
import itertools
import json
import os
import re
import subprocess
import sys
import zlib
from collections.abc import Sequence

PREFIX = "ma2a-tb-"
STATE_DIR = "/run/ma2a-testbed"  # what `up` made, for `exec` and `down`
NAME = re.compile(r"^[a-z][a-z0-9]{0,15}$")  # `up` names; never all digits, as process-owned prefixes are
_runs = itertools.count()


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True, timeout=30)


def _ns_exec(ns: str, *cmd: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return _ip("netns", "exec", ns, *cmd, check=check)


def _namespaces() -> list[str]:
    listed = _ip("netns", "list", check=False).stdout.split("\n")
    return [line.split()[0] for line in listed if line.strip()]


def cleanup_stale(prefix: str = PREFIX) -> list[str]:
    """Delete every namespace whose name starts with `prefix`; returns their names."""
    gone = [ns for ns in _namespaces() if ns.startswith(prefix)]
    for ns in gone:
        _ip("netns", "del", ns, check=False)
    return gone


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def cleanup_dead() -> list[str]:
    """Delete the namespaces of in-process runs (`<PREFIX><pid>-`) whose process is gone."""
    owned = re.compile(re.escape(PREFIX) + r"(\d+)-")
    gone = []
    for ns in _namespaces():
        m = owned.match(ns)
        if m and not _alive(int(m.group(1))):
            _ip("netns", "del", ns, check=False)
            gone.append(ns)
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
    """N emulated hosts, each with a management veth and two NIC veths to per-plane bridges,
    and `ranks_per_host` ranks each (rank r on host r // ranks_per_host)."""

    NICS = ("va1", "va2")

    def __init__(
        self,
        hosts: int,
        rate: str | None = None,
        prefix: str | None = None,
        ranks_per_host: int = 1,
        port: int | None = None,
    ) -> None:
        if not isinstance(hosts, int) or not 1 <= hosts <= 200:
            raise ValueError(f"hosts: got {hosts!r}; expected an integer in [1, 200]")
        if not isinstance(ranks_per_host, int) or not 1 <= ranks_per_host <= 64:
            raise ValueError(f"ranks_per_host: got {ranks_per_host!r}; expected an integer in [1, 64]")
        self.hosts = hosts
        self.ranks_per_host = ranks_per_host
        self.rate = rate
        self.prefix = prefix if prefix is not None else f"{PREFIX}{os.getpid()}-{next(_runs)}-"
        # The rendezvous port, the run's own: two launches in one testbed do not meet by accident.
        self.port = port if port is not None else 20000 + zlib.crc32(self.prefix.encode()) % 20000
        self.switch = f"{self.prefix}sw"
        self.namespaces = [f"{self.prefix}h{i}" for i in range(hosts)]
        self._up = False

    @property
    def ranks(self) -> int:
        return self.hosts * self.ranks_per_host

    def host_of(self, rank: int) -> int:
        if not 0 <= rank < self.ranks:
            raise ValueError(f"rank: got {rank}; expected one in [0, {self.ranks})")
        return rank // self.ranks_per_host

    def address(self, host: int, plane: int) -> str:
        """Plane 0 is management, 1 and 2 the NICs."""
        return f"10.77.{plane}.{host + 1}"

    def __enter__(self) -> Testbed:
        return self.up(keep=False)

    def up(self, keep: bool) -> Testbed:
        """Build the hosts; `keep`: leave them up after this process ends (`down` deletes them)."""
        cleanup_dead()
        taken = [ns for ns in _namespaces() if ns.startswith(self.prefix)]
        if taken:
            raise RuntimeError(
                f"testbed: namespaces {' '.join(taken)} exist already (another run's prefix "
                f"{self.prefix!r}); delete them with `tools/testbed.py down` or `cleanup --all`"
            )
        if not keep:
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
        self.delete()

    def delete(self) -> list[str]:
        """Delete this testbed's namespaces (with their veths and qdiscs); returns those that existed."""
        existing = set(_namespaces())
        mine = [ns for ns in [*self.namespaces, self.switch] if ns in existing]
        for ns in mine:
            _ip("netns", "del", ns, check=False)
        return mine

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

    def rank_env(
        self, rank: int, world: int | None = None, extra: dict[str, str] | None = None
    ) -> dict[str, str]:
        """Environment for rank `rank` (of `world`, default every rank of the testbed): torch
        rendezvous over the management plane at host 0, and its place on its host."""
        world = self.ranks if world is None else world
        env = dict(os.environ)
        env.update(
            RANK=str(rank),
            WORLD_SIZE=str(world),
            LOCAL_RANK=str(rank % self.ranks_per_host),
            LOCAL_WORLD_SIZE=str(self.ranks_per_host),
            MASTER_ADDR=self.address(0, 0),
            MASTER_PORT=str(self.port),
            GLOO_SOCKET_IFNAME="vm",
            MOE_A2A_PROVIDER="tcp",
        )
        for name in ("FI_TCP_IFACE", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK"):
            env.pop(name, None)
        env.update(extra or {})
        return env

    def wrap(self, host: int, argv: Sequence[str]) -> list[str]:
        """`argv` run inside the host's namespace, with the namespace's name as host name."""
        ns = self.namespaces[host]
        # A host name per namespace: the bootstrap puts the ranks of one host on one node.
        uts = ["unshare", "--uts", "sh", "-c", f'hostname {ns} && exec "$@"', "sh"]
        return ["ip", "netns", "exec", ns, *uts, *argv]

    def popen(
        self, host: int, argv: Sequence[str], env: dict[str, str], **kw: object
    ) -> subprocess.Popen[str]:
        """Start `argv` inside the host's namespace."""
        return subprocess.Popen(self.wrap(host, argv), env=env, text=True, **kw)  # type: ignore[call-overload]

    # -- kept testbeds (`up` / `exec` / `down`) ------------------------------------------------

    @staticmethod
    def state_path(name: str) -> str:
        return os.path.join(STATE_DIR, f"{name}.json")

    def save(self, name: str) -> None:
        os.makedirs(STATE_DIR, exist_ok=True)
        state = {"hosts": self.hosts, "ranks_per_host": self.ranks_per_host, "rate": self.rate,
                 "prefix": self.prefix, "port": self.port}  # fmt: skip
        with open(self.state_path(name), "w") as f:
            json.dump(state, f)

    @classmethod
    def attach(cls, name: str) -> Testbed:
        """The testbed `up --name NAME` left up (not deleted when this process ends)."""
        try:
            with open(cls.state_path(name)) as f:
                state = json.load(f)
        except FileNotFoundError:
            raise RuntimeError(
                f"testbed {name!r} is not up (no {cls.state_path(name)}); start it with `up`"
            ) from None
        return cls(state["hosts"], state["rate"], state["prefix"], state["ranks_per_host"], state["port"])


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="testbed.py",
        description="Emulated hosts on one machine (network namespaces, two NICs each): bring "
        "them up, run commands in them, tear them down. Needs root.",
        epilog="example: testbed.py up --hosts 2 --ranks-per-host 2 && testbed.py exec 1 -- hostname "
        "&& testbed.py down",
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    sub.add_parser("check", help="whether this machine can make namespaces, veth pairs and tbf (exit 0 / 1)")
    clean = sub.add_parser("cleanup", help="delete namespaces that runs whose process is gone left")
    clean.add_argument("--all", action="store_true", help=f"every run's ({PREFIX}*), `up` ones too")

    def named(q: argparse.ArgumentParser) -> None:
        q.add_argument("--name", default="tb", help="which kept testbed (default: %(default)s)")

    up = sub.add_parser("up", help="bring a testbed up and keep it until `down`")
    named(up)
    up.add_argument("--hosts", type=int, default=2, help="emulated hosts (default: %(default)s)")
    up.add_argument("--ranks-per-host", type=int, default=1, help="ranks per host (default: %(default)s)")
    up.add_argument("--rate", help="tbf rate of each NIC's egress, e.g. 30mbit (default: none)")
    run = sub.add_parser("exec", help="run a command inside one host: exec HOST -- CMD ...")
    named(run)
    run.add_argument("--rank", type=int, help="set this rank's rendezvous variables (RANK, MASTER_ADDR, ...)")
    run.add_argument("host", type=int, metavar="HOST", help="host index, from 0")
    run.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- CMD", help="the command and its arguments")
    down = sub.add_parser("down", help="delete a kept testbed")
    named(down)
    return p


def _cli_up(args: argparse.Namespace) -> int:
    if not NAME.match(args.name):
        raise ValueError(
            f"--name: got {args.name!r}; expected a lower-case letter, then up to 15 letters or digits"
        )
    if os.path.exists(Testbed.state_path(args.name)):
        raise RuntimeError(f"testbed {args.name!r} is up already; `down --name {args.name}` first")
    bed = Testbed(args.hosts, args.rate, f"{PREFIX}{args.name}-", args.ranks_per_host).up(keep=True)
    bed.save(args.name)
    print(f"testbed {args.name!r}: {bed.hosts} hosts x {bed.ranks_per_host} ranks, namespaces "
          f"{' '.join(bed.namespaces)}; rendezvous {bed.address(0, 0)}:{bed.port}")  # fmt: skip
    me = f"{sys.argv[0]} {{}} --name {args.name}"
    print(f"  run in host 0: {me.format('exec')} 0 -- CMD ...; delete: {me.format('down')}")
    return 0


def _cli_exec(args: argparse.Namespace) -> int:
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        raise ValueError("exec: no command; expected exec HOST -- CMD ...")
    bed = Testbed.attach(args.name)
    if not 0 <= args.host < bed.hosts:
        raise ValueError(f"HOST: got {args.host}; testbed {args.name!r} has hosts 0 to {bed.hosts - 1}")
    if bed.namespaces[args.host] not in _namespaces():
        raise RuntimeError(
            f"testbed {args.name!r}: namespace {bed.namespaces[args.host]} is gone; `down`, then `up`"
        )
    env = dict(os.environ)
    if args.rank is not None:
        if bed.host_of(args.rank) != args.host:
            raise ValueError(
                f"--rank: rank {args.rank} lives on host {bed.host_of(args.rank)}, not {args.host}"
            )
        env = bed.rank_env(args.rank)
    return subprocess.run(bed.wrap(args.host, cmd), env=env).returncode


def _cli_down(args: argparse.Namespace) -> int:
    bed = Testbed.attach(args.name)
    gone = bed.delete()
    os.remove(Testbed.state_path(args.name))
    print(f"testbed {args.name!r}: deleted {' '.join(gone) or 'nothing (its namespaces were gone)'}")
    return 0


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv[1:])
    try:
        if args.command == "check":
            why = unavailable()
            print(why or "namespaces, veth pairs and tbf work here")
            return 1 if why else 0
        if args.command == "cleanup":
            gone = cleanup_stale() if args.all else cleanup_dead()
            if args.all and os.path.isdir(STATE_DIR):
                for name in os.listdir(STATE_DIR):
                    os.remove(os.path.join(STATE_DIR, name))
            print("deleted:", " ".join(gone) or "nothing")
            return 0
        return {"up": _cli_up, "exec": _cli_exec, "down": _cli_down}[args.command](args)
    except (ValueError, RuntimeError, subprocess.SubprocessError) as err:
        print(f"testbed.py {args.command}: error: {err}", file=sys.stderr)
        return 2 if isinstance(err, ValueError) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
