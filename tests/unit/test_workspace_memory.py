"""A workspace's memory: rows private where no same-node peer reads them, the control sections always shared.

Same-node peers map a rank's workspace by name and write its flags, routing
rows, abort records and routing stamps; on the CPU backend they also read its
rows. With share_rows=False (the CUDA backend, ranks without same-node peers)
the row sections are private anonymous memory (huge pages where the kernel
gives them), so a peer's mapping must see every control byte and none of the
rows. Checked here through the segment's file in /dev/shm, as a peer maps it.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import uuid

import numpy as np
import pytest

from moe_a2a import _core


def config() -> _core.A2AConfig:
    c = _core.A2AConfig()
    c.rank, c.world, c.ranks_per_node = 0, 2, 2
    c.max_tokens, c.hidden, c.num_experts, c.topk = 256, 1024, 8, 4
    c.max_private_tokens, c.max_recv_tokens = 64, 2048
    return c


def ours_and_peers(share_rows: bool) -> tuple[np.ndarray, np.ndarray, object]:
    """Our view of a new workspace and a peer's (the segment's file mapped as map_node maps it)."""
    name = f"/moe-a2a-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    ws = _core.Workspace(config(), name, share_rows)
    fd = os.open(f"/dev/shm{name}", os.O_RDWR)
    try:
        peer = mmap.mmap(fd, ws.size, mmap.MAP_SHARED)
    finally:
        os.close(fd)
    ws.unlink()
    ours = np.ctypeslib.as_array((ctypes.c_uint8 * ws.size).from_address(ws.ptr))
    return ours, np.frombuffer(peer, np.uint8), ws


@pytest.mark.parametrize("share_rows", [True, False])
def test_control_sections_are_shared_and_rows_only_when_asked(share_rows: bool) -> None:
    ours, peer, ws = ours_and_peers(share_rows)
    assert not ours.any() and not peer.any()  # both start zeroed
    head = [0, ws.routing_offset, ws.routing_offset + 100]  # flags, routing rows
    tail = [ws.size - 1, ws.size - 600]  # routing stamps, abort records
    middle = ws.size // 2  # deep in the rows
    for i in (*head, *tail, middle):
        ours[i] = 7
    assert [int(peer[i]) for i in (*head, *tail)] == [7] * (len(head) + len(tail))
    assert int(peer[middle]) == (7 if share_rows else 0)
    peer[head[0]] = 9  # and the other way: a peer's flag store reaches us
    assert int(ours[head[0]]) == 9
