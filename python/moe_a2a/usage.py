"""Usage errors of the `moe-a2a` commands: one line, exit status 2, on every rank alike.

Under mpirun every rank parses the same arguments and finds the same error. Only
rank 0 prints it, as `moe-a2a <cmd>: error: ...`.

Imported by the CLI and every subcommand's parser; it imports nothing of moe_a2a,
so it closes no import circle.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import NoReturn

USAGE_ERROR = 2


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


def usage_error(prog: str, message: str) -> NoReturn:
    """`prog: error: message` from rank 0; every rank exits with status 2 together."""
    if launcher_rank() == 0:
        print(f"{prog}: error: {message}", file=sys.stderr, flush=True)
    sys.exit(USAGE_ERROR)


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors and without silent abbreviations (`--iter` is an error).

    Sub-parsers are made with the parent's class, so every subcommand inherits this.
    """

    def __init__(self, *args: object, **kwargs: object) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]

    def error(self, message: str) -> NoReturn:
        if launcher_rank() == 0:
            self.print_usage(sys.stderr)
        usage_error(self.prog, message)
