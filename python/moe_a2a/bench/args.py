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
