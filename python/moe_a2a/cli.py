"""The `moe-a2a` command: run, bench, trace, info.

Each subcommand lives in its own module, which registers its parser through
`add_parser(subparsers)` and sets `func`; heavy imports stay inside those
modules so `moe-a2a --help` is instant.
"""

from __future__ import annotations

import argparse
import sys


def _info(args: argparse.Namespace) -> int:
    from moe_a2a import __version__, _core

    print(f"moe-a2a {__version__}")
    print("libfabric providers:", ", ".join(_core.libfabric_providers()) or "none")
    print("CUDA kernels built:", getattr(_core, "HAVE_CUDA", False))
    _info_nics(args)
    return 0


def _info_nics(args: argparse.Namespace) -> None:
    """Each provider's devices (libfabric domains) and the ones a rank would open."""
    import os

    from moe_a2a import _core, nics

    num = nics.num_nics_default(args.num_nics)
    explicit = nics.explicit_from_env(args.local_rank)
    gpus = nics.gpus(args.sysfs)
    print(f"NICs (libfabric domains), and the {num} a rank opens (--num-nics, MOE_A2A_NUM_NICS):")
    from moe_a2a.fabric import PROVIDERS

    for name in [args.provider] if args.provider else PROVIDERS:
        domains = _core.libfabric_domains(name)
        if not domains:
            continue
        print(f"  {name}: {', '.join(domains)}")
        ranks: list[tuple[str, int | None]] = [("CPU rank", None)]
        ranks += [(f"GPU {g} ({a})", g) for g, a in enumerate(gpus)]
        for label, gpu in ranks:
            try:
                sel = nics.select(domains, num, explicit=explicit, gpu=gpu, root=args.sysfs, provider=name)
                print(f"    {label}: {', '.join(sel.names)} ({sel.how})")
            except nics.NicError as e:
                print(f"    {label}: {e}")
    if os.environ.get(nics.ENV):
        print(f"  (named by {nics.ENV}={os.environ[nics.ENV]!r}, local rank {args.local_rank})")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moe-a2a", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    from moe_a2a.layers import driver

    driver.add_parser(sub)

    bench = sub.add_parser("bench", help="benchmarks (run under mpirun)")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    from moe_a2a.bench import a2a as bench_a2a
    from moe_a2a.bench import fabric as bench_fabric

    bench_fabric.add_parser(bench_sub)
    bench_a2a.add_parser(bench_sub)

    from moe_a2a import trace_tools

    trace_tools.add_parser(sub)

    info = sub.add_parser("info", help="what this build and machine offer")
    info.add_argument("--provider", help="only this provider (default: every provider offered)")
    info.add_argument(
        "--num-nics", type=int, default=None, help="NICs per rank (default MOE_A2A_NUM_NICS, else 1)"
    )
    info.add_argument("--local-rank", type=int, default=0, help="which group of MOE_A2A_NICS to show")
    info.add_argument("--sysfs", default="/sys", help="sysfs root to read the topology from")
    info.set_defaults(func=_info)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
