"""The in-process world's fixture: every World a test made is closed after it."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from world import World  # noqa: E402


@pytest.fixture
def make_world() -> Iterator[Any]:
    made: list[World] = []

    def make(size: int, **kwargs: Any) -> World:
        w = World(size, **kwargs)
        made.append(w)
        return w

    yield make
    for w in made:
        w.close()
