"""argparse types shared by the benchmarks; errors name what was got and what was expected."""

from __future__ import annotations

import argparse
from collections.abc import Callable


def int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: an integer no smaller than `minimum`."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = minimum - 1
        if value < minimum:
            raise argparse.ArgumentTypeError(f"got {text!r}; expected an integer >= {minimum}")
        return value

    return parse


def positive_seconds(text: str) -> float:
    """An argparse type: a positive number of seconds."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:  # also rejects nan
        raise argparse.ArgumentTypeError(f"got {text!r}; expected a positive number of seconds")
    return value


# --rows-path (the per-phase CUDA benchmark): the value of MOE_A2A_GPU_DIRECT that forces each path.
ROWS_PATHS = {"staged": "0", "gpu-direct": "1"}


def rows_paths(text: str) -> list[str]:
    """An argparse type: distinct names of ROWS_PATHS, comma-separated, in the order given."""
    paths = [p.strip() for p in text.split(",")]
    if any(p not in ROWS_PATHS for p in paths) or len(set(paths)) != len(paths):
        raise argparse.ArgumentTypeError(
            f"got {text!r}; expected distinct paths of {list(ROWS_PATHS)}, comma-separated"
        )
    return paths
