"""The `moe-a2a` command: run, bench, trace, cleanup, info.

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
    return 0


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

    from moe_a2a import cleanup

    cleanup.add_parser(sub)

    info = sub.add_parser("info", help="what this build and machine offer")
    info.set_defaults(func=_info)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
