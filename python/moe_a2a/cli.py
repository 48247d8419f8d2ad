"""The `moe-a2a` command: run, bench, trace, cleanup, info.

Each subcommand lives in its own module, which registers its parser through
`add_parser(subparsers)` and sets `func`; heavy imports stay inside those
modules so `moe-a2a --help` is instant.

Under mpirun every rank parses the same arguments: a usage error is one line,
`moe-a2a <cmd>: error: ...`, printed by rank 0 alone, and every rank exits with
status 2 together (moe_a2a.usage).
"""

from __future__ import annotations

import argparse
import os
import sys

from moe_a2a.usage import Parser, UsageError, usage_error


def _gpu_line() -> str:
    from moe_a2a import _core

    if not getattr(_core, "HAVE_CUDA", False):
        return "no: moe_a2a._core was built without the CUDA kernels (no nvcc at build time)"
    from moe_a2a.backends.cuda import cuda_available

    reason = cuda_available()
    if reason is not None:
        return f"no: {reason}"
    import torch

    names = sorted({torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())})
    return f"yes: {torch.cuda.device_count()} x {', '.join(names)} (torch {torch.__version__})"


def _info(args: argparse.Namespace) -> int:
    from moe_a2a import __version__, _core

    print(f"moe-a2a {__version__}")
    print("libfabric providers:", ", ".join(_core.libfabric_providers()) or "none")
    built = ", ".join(_core.backend_names())
    print(f"transport backends built: {built} (ibverbs: not built, docs/transport.md)")
    print("CUDA kernels built:", "yes" if getattr(_core, "HAVE_CUDA", False) else "no")
    print("GPU usable (device='cuda'):", _gpu_line())
    _info_nics(args)
    _print_switches(args.all)
    return 0


def _test_only(name: str, read_by: str) -> bool:
    return read_by == "tests" or name.startswith("MOE_A2A_TEST_")


def _print_switches(show_all: bool) -> None:
    """The environment switches, who reads them, their values now (moe_a2a.switches), wrapped
    to the terminal; the test harness's own only with --all."""
    import shutil

    from moe_a2a import switches
    from moe_a2a.report import table

    rows = [row for row in switches.table() if show_all or not _test_only(row[0], row[1])]
    hidden = len(switches.table()) - len(rows)
    print(
        "environment switches (docs/running.md)"
        + (f"; {hidden} for tests only: --all" if hidden else "")
        + ":"
    )
    width = shutil.get_terminal_size().columns
    print(table(["switch", "read by", "value now", "what it does"], rows, width=width))


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
        print(f"    capabilities ({domains[0]}): {_capabilities_line(name, domains[0])}")
        print(f"    a CUDA rank's rows with fabric peers: {_rows_path_line(name, domains[0])}")
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


def _capabilities_line(provider: str, domain: str) -> str:
    """What the backend reports for one device: GPU memory, ordering, sizes (src/fabric/backend.h)."""
    from moe_a2a import FabricError, _core

    try:
        c = _core.backend_capabilities(provider, domain)
    except FabricError as e:
        return f"could not open it: {e}"

    def size(n: int) -> str:
        return "unlimited" if n >= 1 << 63 else f"{n} B"

    return (
        f"backend {c['backend']} ({c['provider']}), GPU memory registration "
        f"{'yes' if c['gpu_memory'] else 'no (host memory only)'} ({c['gpu_memory_why']}), ordered writes "
        f"{'yes' if c['ordered_writes'] else 'no'}, max message {size(c['max_message_size'])}, "
        f"inject {size(c['inject_size'])}, immediate {c['imm_bytes']} B, "
        f"{c['max_in_flight']} writes in flight, {'blocking' if c['blocking_wait'] else 'polled'} completions"
    )


def _rows_path_line(provider: str, domain: str) -> str:
    """The path a CUDA rank would take over this provider, and why (moe_a2a.gpu_direct); the
    largest write is taken as a prefill's (at least the shm threshold), where only the capability decides."""
    from moe_a2a import FabricError, _core, gpu_direct, switches

    forced = switches.get("MOE_A2A_GPU_DIRECT")
    try:
        c = _core.backend_capabilities(provider, domain, gpu_memory=forced is not False)
        largest = max(gpu_direct.SHM_MIN_WRITE_BYTES, gpu_direct.shm_min_write_bytes())
        choice = gpu_direct.choose_path("cuda", provider, [c], forced, largest)
    except (FabricError, RuntimeError) as e:
        return f"cannot tell: {e}"
    shm_note = (
        " (shm reports FI_HMEM even where its libfabric has no CUDA: registering GPU memory decides, and a "
        f"failure stages; staged where a call's largest write is under {gpu_direct.shm_min_write_bytes()} B)"
        if c["provider"] == "shm" and choice.path == gpu_direct.GPU_DIRECT
        else ""
    )
    return f"{choice.path}: {choice.reason}{shm_note}"


def _check_provider(args: argparse.Namespace) -> None:
    """Refuse, before MPI starts, a provider libfabric does not offer here at all.

    Without this every rank would fail alike inside its run, each with a
    traceback, and the job would end in MPI_Abort.
    """
    provider = getattr(args, "provider", None)
    if not provider or provider == "auto":
        return
    from moe_a2a import _core

    offered = _core.libfabric_providers()
    # libfabric names layered providers "core;utility" (e.g. "tcp;ofi_rxm").
    if any(provider in (name, name.split(";")[0]) for name in offered):
        return
    usage_error(
        command_prog(args),
        f"--provider: got {provider!r}, which libfabric does not offer on this machine; "
        f"expected auto or one of: {', '.join(sorted({n.split(';')[0] for n in offered})) or 'none'}",
    )


def build_parser() -> argparse.ArgumentParser:
    from moe_a2a import __version__

    parser = Parser(prog="moe-a2a", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    from moe_a2a.layers import driver

    driver.add_parser(sub)

    bench = sub.add_parser(
        "bench",
        help="benchmarks (run under mpirun)",
        description="Benchmarks, run under mpirun: the transfer engine against MPI (fabric), "
        "dispatch and combine against a baseline (a2a).",
    )
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    from moe_a2a.bench import a2a as bench_a2a
    from moe_a2a.bench import fabric as bench_fabric

    bench_fabric.add_parser(bench_sub)
    bench_a2a.add_parser(bench_sub)

    from moe_a2a import trace_tools

    trace_tools.add_parser(sub)

    from moe_a2a import cleanup

    cleanup.add_parser(sub)

    from moe_a2a import plan_cli

    plan_cli.add_parser(sub)

    info = sub.add_parser(
        "info",
        help="what this build and machine offer",
        description="The build (libfabric providers, backends, CUDA), whether a GPU is usable, the NICs "
        "a rank would open, and the environment switches.",
    )
    info.add_argument(
        "--provider", metavar="PROVIDER", help="only this provider (default: every provider offered)"
    )
    info.add_argument(
        "--num-nics",
        type=int,
        default=None,
        metavar="N",
        help="NICs per rank (default MOE_A2A_NUM_NICS, else 1)",
    )
    info.add_argument(
        "--local-rank", type=int, default=0, metavar="N", help="which group of MOE_A2A_NICS to show"
    )
    info.add_argument("--sysfs", default="/sys", metavar="DIR", help="sysfs root to read the topology from")
    info.add_argument("--all", action="store_true", help="also the switches only the tests read")
    info.set_defaults(func=_info)
    return parser


def command_prog(args: argparse.Namespace) -> str:
    """The command line's name for errors: `moe-a2a run`, `moe-a2a bench a2a`, ..."""
    words = ["moe-a2a", getattr(args, "command", None)]
    words += [getattr(args, "bench", None), getattr(args, "trace_command", None)]
    return " ".join(w for w in words if w)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    prog = command_prog(args)
    if unknown:
        usage_error(prog, f"unrecognized arguments: {' '.join(unknown)} (see {prog} --help)")
    _check_provider(args)
    try:
        return int(args.func(args) or 0)
    except UsageError as err:  # found alike on every rank
        usage_error(prog, str(err))
    except SystemExit as exc:
        if not isinstance(exc.code, str):
            raise
        # `raise SystemExit("...")`: a usage error every rank finds alike.
        usage_error(prog, exc.code)
    except KeyboardInterrupt:  # Ctrl-C where the command kept no partial results to show
        print(f"{prog}: interrupted", file=sys.stderr, flush=True)
        return 130  # 128 + SIGINT
    except BrokenPipeError:
        # The reader went away (`moe-a2a trace compare ... | head`): stop quietly, and
        # point stdout at /dev/null so the interpreter's final flush does not complain.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, what a shell tool killed by the pipe reports


if __name__ == "__main__":
    sys.exit(main())
