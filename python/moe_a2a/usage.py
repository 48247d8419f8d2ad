"""Usage errors of the `moe-a2a` commands: one line, exit status 2, on every rank alike.

Under mpirun every rank parses the same arguments and finds the same error. Only
rank 0 prints it, as `moe-a2a <cmd>: error: ...`; then the ranks exit together
(mpirun kills the others as soon as one rank exits with a non-zero status, so a
rank that left early could take rank 0 down before it wrote the line).

Imported by the CLI and every subcommand's parser; it imports nothing of moe_a2a,
so it closes no import circle.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import NoReturn

USAGE_ERROR = 2
#: How long a rank waits for the others before it exits with its usage error anyway.
EXIT_TOGETHER_S = 10.0


class UsageError(ValueError):
    """A bad flag or combination of flags: one line on stderr, exit status 2."""


def launcher_rank() -> int:
    """This process's rank from the launcher's environment, before MPI starts (0 if unknown)."""
    for name in ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "SLURM_PROCID"):
        value = os.environ.get(name)
        if value is not None and value.isdigit():
            return int(value)
    return 0


def launcher_size() -> int:
    """The job's size from the launcher's environment (1 if not launched by one)."""
    for name in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS"):
        value = os.environ.get(name)
        if value is not None and value.isdigit():
            return int(value)
    return 1


def exit_together() -> None:
    """Wait until every rank of the job got here (at most EXIT_TOGETHER_S).

    Only when a launcher started several ranks; mpi4py is imported (and MPI started)
    only then. A rank that never arrives ends the wait at the deadline.
    """
    if launcher_size() <= 1:
        return
    try:
        from mpi4py import MPI
    except ImportError:  # no MPI to agree over: rank 0 printed already
        return
    request = MPI.COMM_WORLD.Ibarrier()
    deadline = time.monotonic() + EXIT_TOGETHER_S
    while not request.Test():
        if time.monotonic() > deadline:
            return
        time.sleep(0.001)  # polling the barrier, not waiting for time to pass


def usage_error(prog: str, message: str) -> NoReturn:
    """`prog: error: message` from rank 0; every rank exits with status 2 together."""
    if launcher_rank() == 0:
        print(f"{prog}: error: {message}", file=sys.stderr, flush=True)
    exit_together()
    sys.exit(USAGE_ERROR)


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors and without silent abbreviations (`--iter` is an error).

    Sub-parsers are made with the parent's class, so every subcommand inherits this.
    """

    def __init__(self, *args: object, **kwargs: object) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]

    def error(self, message: str) -> NoReturn:
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction) and message.endswith(
                f"required: {action.dest}"
            ):
                message = f"expected a command: {', '.join(action.choices)}"
        usage_error(self.prog, f"{message} (see {self.prog} --help)")
