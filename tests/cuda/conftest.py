"""CUDA tests: where no GPU or no CUDA build is, they are skipped and the header says why."""

from __future__ import annotations

import pytest
from local_world import cuda_unavailable_reason


def pytest_report_header(config: pytest.Config) -> list[str]:
    reason = cuda_unavailable_reason()
    return [f"moe-a2a CUDA tests: {'skipped: ' + reason if reason else 'running'}"]
