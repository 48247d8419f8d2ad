"""Pure logic of the transfer engine, without MPI: address and region blobs,
sharding of writes across NICs, immediates, and the errors of opening a provider.

"""

from __future__ import annotations

import ctypes
import itertools
import os
import random
import struct
from pathlib import Path
from typing import Any

import pytest

# libfabric reads its environment once per process: bind tcp to loopback before
# the first engine opens, as moe_a2a.fabric does for single-host jobs.
os.environ.setdefault("FI_TCP_IFACE", "lo")

from moe_a2a import FabricError, _core  # noqa: E402

SPLIT_ALIGN = 4096  # kSplitAlign in src/fabric/sharding.h
REPO = Path(__file__).resolve().parents[2]

# ---------------------------------------------------------------- address blobs


@pytest.mark.parametrize(
    ("provider", "nics"),
    [
        ("tcp", [b"\x02\x00\x30\x39\x7f\x00\x00\x01"]),
        ("shm", [b"fi_shm://1234", b"fi_shm://1235"]),
        ("efa", [bytes(range(256)), b"", b"\x00" * 32]),
        ("verbs;ofi_rxm", []),
    ],
)
def test_address_blob_round_trip(provider: str, nics: list[bytes]) -> None:
    blob = _core.encode_address(provider, nics)
    assert isinstance(blob, bytes)
    assert _core.decode_address(blob) == (provider, nics)


def test_address_blob_every_truncation_is_rejected() -> None:
    blob = _core.encode_address("tcp", [b"abcdef", b"\x01\x02"])
    for cut in range(len(blob)):
        with pytest.raises(FabricError, match="truncated"):
            _core.decode_address(blob[:cut])


def test_address_blob_trailing_bytes_are_rejected() -> None:
    blob = _core.encode_address("tcp", [b"abcdef"])
    with pytest.raises(FabricError, match="1 trailing bytes"):
        _core.decode_address(blob + b"\x00")


@pytest.mark.parametrize(
    "foreign",
    [b"XXXX" + bytes(20), b"not an address at all", bytes(8), b"\xff" * 16],
    ids=["bad-magic", "text", "zeros", "ones"],
)
def test_address_blob_foreign_bytes_are_rejected(foreign: bytes) -> None:
    with pytest.raises(FabricError, match="not a moe-a2a fabric address"):
        _core.decode_address(foreign)


def test_region_descriptor_is_not_an_address() -> None:
    engine = _core.TransferEngine(0, 2, "tcp")
    buf = bytearray(4096)
    region = engine.register_region(_address_of(buf), len(buf))
    with pytest.raises(FabricError, match="not a moe-a2a fabric address"):
        _core.decode_address(engine.region_descriptor(region))


# ---------------------------------------------------------------- region descriptors


def _address_of(buf: bytearray) -> int:
    import ctypes

    return ctypes.addressof((ctypes.c_char * len(buf)).from_buffer(buf))


def test_a_region_is_released_without_a_group() -> None:
    """What a start-up that failed before making its peer group releases."""
    engine = _core.TransferEngine(0, 2, "tcp")
    buf = bytearray(4096)
    region = engine.register_region(_address_of(buf), len(buf))
    engine.release(region, None)
    with pytest.raises(FabricError, match=f"unknown local region {region.value} \\(released\\)"):
        engine.region_descriptor(region)
    with pytest.raises(FabricError, match="released"):
        engine.release(region, None)


def test_region_descriptor_round_trip_and_errors() -> None:
    engine = _core.TransferEngine(0, 2, "tcp")
    buf = bytearray(65536)
    region = engine.register_region(_address_of(buf), len(buf))
    desc = engine.region_descriptor(region)
    first = engine.add_remote_region(1, desc)
    second = engine.add_remote_region(1, desc)
    assert isinstance(first, _core.RemoteRegion) and second.value == first.value + 1  # ids count up
    assert second != first and len({first, second, _core.RemoteRegion(first.value)}) == 2
    for cut in (0, 3, len(desc) // 2, len(desc) - 1):
        with pytest.raises(FabricError, match=r"region descriptor from rank 1: truncated"):
            engine.add_remote_region(1, desc[:cut])
    with pytest.raises(FabricError, match="not a moe-a2a region descriptor"):
        engine.add_remote_region(1, engine.address())
    with pytest.raises(FabricError, match="trailing bytes"):
        engine.add_remote_region(1, desc + b"\x00")
    with pytest.raises(FabricError, match=r"peer 2 is out of range \[0, 2\)"):
        engine.add_remote_region(2, desc)


def _region_keys(desc: bytes) -> list[int]:
    """The NIC keys of a region descriptor (src/fabric/wire.h: magic, length, count, then base and key)."""
    (count,) = struct.unpack_from("<I", desc, 12)
    return [struct.unpack_from("<QQ", desc, 16 + 16 * i)[1] for i in range(count)]


@pytest.mark.parametrize("provider", ["tcp", "shm"])
def test_region_keys_are_not_guessable(provider: str) -> None:
    """Where we pick the keys, they are random: a key is all it takes to write into the region."""
    if provider not in _core.libfabric_providers():
        pytest.skip(f"libfabric here offers no {provider} provider")
    bufs = [bytearray(4096) for _ in range(4)]
    engine = _core.TransferEngine(0, 2, provider)
    keys = [
        key
        for buf in bufs
        for key in _region_keys(engine.region_descriptor(engine.register_region(_address_of(buf), len(buf))))
    ]
    assert len(set(keys)) == len(keys), keys
    # Counting keys (the old 1, 2, 3, ...) are small and a step apart; 64 random bits are neither.
    assert all(key >= 1 << 20 for key in keys), keys
    assert sorted(b - a for a, b in itertools.pairwise(sorted(keys)))[0] > 1, keys


def test_region_descriptor_with_other_nic_count_is_rejected() -> None:
    two = _core.TransferEngine(0, 2, "tcp", 2)
    one = _core.TransferEngine(0, 2, "tcp", 1)
    buf = bytearray(4096)
    desc = two.region_descriptor(two.register_region(_address_of(buf), len(buf)))
    with pytest.raises(FabricError, match=r"has 2 NIC key\(s\); expected 1"):
        one.add_remote_region(1, desc)


def test_register_empty_region_is_rejected() -> None:
    engine = _core.TransferEngine(0, 1, "tcp")
    with pytest.raises(FabricError, match="cannot register an empty region"):
        engine.register_region(0, 4096)
    buf = bytearray(16)
    with pytest.raises(FabricError, match="length=0"):
        engine.register_region(_address_of(buf), 0)


def test_connect_checks_addresses() -> None:
    engine = _core.TransferEngine(0, 2, "tcp")
    with pytest.raises(FabricError, match="connect got 1 addresses for a world of 2"):
        engine.connect([engine.address()])
    other = _core.encode_address("shm", [b"x"])
    with pytest.raises(FabricError, match=r"cannot talk to rank 1, which uses provider 'shm' with 1 NIC"):
        engine.connect([engine.address(), other])
    with pytest.raises(FabricError, match="address of rank 1: truncated"):
        engine.connect([engine.address(), engine.address()[:5]])


# ---------------------------------------------------------------- sharding


def _split(peer: int, length: int, num_nics: int, threshold: int) -> list[tuple[int, int, int]]:
    return [tuple(p) for p in _core.split_write(peer, length, num_nics, threshold)]


def _split_cases() -> list[tuple[int, int, int, int]]:
    rng = random.Random(1234)
    cases = [
        (peer, length, nics, threshold)
        for peer in (0, 1, 5)
        for nics in (1, 2, 3, 4, 16)
        for threshold in (0, 1, 65536, 1 << 20)
        for length in (0, 1, 4095, 4096, 4097, 65535, 65536, 65537, 3 * 4096 + 1, 1 << 20, (1 << 20) + 3)
    ]
    cases += [
        (
            rng.randrange(64),
            rng.randrange(1 << 24),
            rng.randrange(1, 9),
            rng.choice([0, 4096, 65536, 1 << 20]),
        )
        for _ in range(500)
    ]
    return cases


def test_split_write_pieces_tile_the_write() -> None:
    for peer, length, nics, threshold in _split_cases():
        pieces = _split(peer, length, nics, threshold)
        case = f"peer={peer} length={length} num_nics={nics} threshold={threshold}: {pieces}"
        assert pieces, case
        assert sum(p[2] for p in pieces) == length, case
        offset = 0
        for _, start, size in pieces:  # contiguous, in order, from 0
            assert start == offset, case
            offset += size
        assert all(0 <= nic < nics for nic, _, _ in pieces), case
        assert len({nic for nic, _, _ in pieces}) == len(pieces), f"two pieces on one NIC: {case}"
        if length > 0:
            assert all(size > 0 for _, _, size in pieces), f"empty piece: {case}"


def test_split_write_pieces_are_aligned() -> None:
    for peer, length, nics, threshold in _split_cases():
        pieces = _split(peer, length, nics, threshold)
        case = f"peer={peer} length={length} num_nics={nics} threshold={threshold}: {pieces}"
        assert all(start % SPLIT_ALIGN == 0 for _, start, _ in pieces), case
        # Every piece but the last has the same, aligned size; the last one takes the rest,
        # which exceeds the others by less than num_nics alignments (the chunk is
        # length // num_nics rounded down to the alignment).
        sizes = [size for _, _, size in pieces]
        if len(sizes) > 1:
            assert len(set(sizes[:-1])) == 1 and sizes[0] % SPLIT_ALIGN == 0, case
            assert sizes[0] <= sizes[-1] < sizes[0] + nics * SPLIT_ALIGN, case


def test_split_write_one_piece_below_threshold_or_with_one_nic() -> None:
    for peer, length, nics, threshold in _split_cases():
        if nics == 1 or length < threshold or length < SPLIT_ALIGN * nics:
            assert _split(peer, length, nics, threshold) == [(peer % nics, 0, length)], (peer, length, nics)


def test_split_write_uses_several_nics_at_threshold() -> None:
    for nics in (2, 3, 4, 8):
        threshold = 65536
        for length in (threshold, threshold + 1, 1 << 20, (1 << 20) + 12345):
            pieces = _split(3, length, nics, threshold)
            # Exactly one per NIC: the receiver counts a split write as num_nics pieces.
            assert len(pieces) == nics, (length, nics, pieces)
            # The first piece goes to the peer's own NIC; the others rotate from there.
            assert [nic for nic, _, _ in pieces] == [(3 + i) % nics for i in range(len(pieces))]
        # A length that divides evenly gives one equal piece per NIC.
        even = SPLIT_ALIGN * nics * 16
        assert _split(0, even, nics, threshold) == [(i, i * even // nics, even // nics) for i in range(nics)]


def test_nic_for_peer_shards_peers_round_robin() -> None:
    for nics in (1, 2, 3, 8):
        owners = [_core.nic_for_peer(peer, nics) for peer in range(64)]
        assert owners == [peer % nics for peer in range(64)]
        # Every NIC serves an equal share (within one) of the peers.
        counts = [owners.count(n) for n in range(nics)]
        assert max(counts) - min(counts) <= 1


def test_peer_slots_spread_every_ranks_peers_over_its_nics() -> None:
    # Egress: each rank's peers; ingress: the writes that reach each rank, on the NIC
    # index the sender chose (a write lands on the receiver's NIC of the same index).
    for world, nics in itertools.product(range(2, 17), (1, 2, 3, 4)):

        def nic(src: int, dst: int, world: int = world, nics: int = nics) -> int:
            return _core.nic_for_peer(_core.peer_slot(src, dst, world), nics)

        for rank in range(world):
            out = [nic(rank, p) for p in range(world) if p != rank]
            inc = [nic(s, rank) for s in range(world) if s != rank]
            for load in (out, inc):
                counts = [load.count(n) for n in range(nics)]
                assert max(counts) - min(counts) <= 1, (world, nics, rank, out, inc)
    # The case the testbed found: 3 ranks, 2 NICs; rank 1's peers 0 and 2 shared NIC 0
    assert sorted(_core.nic_for_peer(_core.peer_slot(1, p, 3), 2) for p in (0, 2)) == [0, 1]


def test_rail_slots_spread_each_ranks_and_each_nodes_rails_over_the_nics() -> None:
    """Rows per node write only to the peers of our local index on other nodes: by rail_slot a
    rank's rails, the rails reaching a rank, and all rails out of one node each spread within
    one over the NICs; by plain distance they may all share one."""
    for nodes, per_node, nics in itertools.product(range(2, 9), (1, 2, 3, 4, 8), (1, 2, 4, 8)):
        world = nodes * per_node

        def nic(src: int, dst: int, world: int = world, per_node: int = per_node, nics: int = nics) -> int:
            return _core.nic_for_peer(_core.rail_slot(src, dst, world, per_node), nics)

        def rails(rank: int, world: int = world, per_node: int = per_node) -> list[int]:
            return [
                p
                for p in range(world)
                if p // per_node != rank // per_node and p % per_node == rank % per_node
            ]

        for rank in range(world):
            for load in ([nic(rank, p) for p in rails(rank)], [nic(p, rank) for p in rails(rank)]):
                counts = [load.count(n) for n in range(nics)]
                assert max(counts) - min(counts) <= 1, (nodes, per_node, nics, rank, load)
        for node in range(nodes):
            load = [nic(r, p) for r in range(node * per_node, (node + 1) * per_node) for p in rails(r)]
            counts = [load.count(n) for n in range(nics)]
            assert max(counts) - min(counts) <= 1, (nodes, per_node, nics, node, load)
    # What the testbed found: 4 hosts x 2 ranks, 2 NICs; plain distances put every rail on NIC 1.
    assert {_core.nic_for_peer(_core.peer_slot(r, r + d, 8), 2) for r in (0, 1) for d in (2, 4, 6)} == {1}
    node = [_core.nic_for_peer(_core.rail_slot(r, r + d, 8, 2), 2) for r in (0, 1) for d in (2, 4, 6)]
    assert sorted(node) == [0, 0, 0, 1, 1, 1]


def test_nic_for_peer_agrees_with_unsplit_writes() -> None:
    for peer, nics in itertools.product(range(10), (1, 2, 4)):
        assert _split(peer, 100, nics, 1 << 20) == [(_core.nic_for_peer(peer, nics), 0, 100)]


# ---------------------------------------------------------------- immediates


@pytest.mark.parametrize(("tag", "peer"), [(0, 0), (7, 3), (0xFFFF, 0x7FFF), (1, 32767), (0x1234, 0x2BCD)])
def test_make_imm_packs_tag_and_sender(tag: int, peer: int) -> None:
    imm = _core.make_imm(tag, peer)
    assert imm >> 16 == tag
    assert imm & 0x7FFF == peer
    assert imm & _core.IMM_PIECE_BIT == 0  # the bit between them marks pieces of split writes
    assert _core.IMM_PIECE_BIT == 1 << 15 and _core.MAX_RANKS == 1 << 15
    assert 0 <= imm < 1 << 32


# ---------------------------------------------------------------- providers


def test_unknown_provider_names_it_and_lists_the_offered_ones() -> None:
    offered = _core.libfabric_providers()
    assert "tcp" in offered and "shm" in offered, offered
    with pytest.raises(FabricError) as info:
        _core.TransferEngine(0, 1, "no-such-provider")
    message = str(info.value)
    assert "'no-such-provider' is not available" in message
    assert "providers offered here: " + ", ".join(offered) in message


@pytest.mark.parametrize("name", ["efa", "verbs"])
def test_hardware_provider_without_device_fails_clearly(name: str) -> None:
    if name in _core.libfabric_providers():
        pytest.skip(f"libfabric offers {name} on this machine: there is a device")
    with pytest.raises(FabricError, match=rf"libfabric provider '{name}' is not available on this machine"):
        _core.TransferEngine(0, 1, name)


@pytest.mark.parametrize(
    ("rank", "world", "num_nics", "message"),
    [
        (0, 0, 1, r"world size 0 is outside \[1, 32768\]"),
        (0, 32769, 1, r"world size 32769 is outside \[1, 32768\]"),
        (2, 2, 1, r"rank 2 is outside \[0, 2\)"),
        (-1, 2, 1, r"rank -1 is outside \[0, 2\)"),
        (0, 1, 0, "num_nics is 0; expected 1 to 16"),
        (0, 1, 17, "num_nics is 17; expected 1 to 16"),
    ],
)
def test_engine_arguments_are_checked(rank: int, world: int, num_nics: int, message: str) -> None:
    with pytest.raises(FabricError, match=message):
        _core.TransferEngine(rank, world, "tcp", num_nics)


def test_python_engine_checks_num_nics() -> None:
    from moe_a2a.bootstrap import Bootstrap, _layout
    from moe_a2a.fabric import Engine

    class OneRank(Bootstrap):
        """One rank without MPI: an MPI_Init here would break the mpirun of later tests."""

        def __init__(self) -> None:
            self.topology, self.single_host = _layout(0, 1, ["here"], None), True

        def allgather(self, blob: bytes) -> list[bytes]:
            return [blob]

    with pytest.raises(ValueError, match="num_nics: got 0; expected a positive integer"):
        Engine(OneRank(), "tcp", num_nics=0)


# ---------------------------------------------------------------- benchmark helpers


@pytest.mark.parametrize(
    ("text", "size"), [("4096", 4096), ("1K", 1024), ("64KiB", 65536), ("4m", 4 << 20), (" 3 MB ", 3 << 20)]
)
def test_bench_parse_size(text: str, size: int) -> None:
    from moe_a2a.bench.fabric import parse_size

    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "0", "-1K", "1.5K", "4X", "K"])
def test_bench_parse_size_rejects(text: str) -> None:
    import argparse

    from moe_a2a.bench.fabric import parse_size

    with pytest.raises(argparse.ArgumentTypeError, match=f"got {text!r}; expected a"):
        parse_size(text)


def test_bench_parse_sizes_sorts_and_dedups() -> None:
    from moe_a2a.bench.fabric import DEFAULT_SIZES, parse_sizes

    assert parse_sizes("4K,1K,4096,1M") == [1024, 4096, 1 << 20]
    assert DEFAULT_SIZES == [1 << 10, 1 << 12, 1 << 14, 1 << 16, 1 << 18, 1 << 20, 1 << 22]


def test_bench_summary_takes_the_slowest_rank() -> None:
    import numpy as np

    from moe_a2a.bench.fabric import format_table, summarize

    # Two ranks, four iterations: per iteration the slower rank counts.
    fabric = np.array([[1e-6, 2e-6, 3e-6, 4e-6], [4e-6, 1e-6, 1e-6, 1e-6]])
    mpi = np.full((2, 4), 10e-6)
    row = summarize(1000, 3, fabric, mpi)  # slowest per iteration: 4, 2, 3, 4 us
    assert row.moe_a2a_p50_us == pytest.approx(3.5)
    assert row.baseline_p50_us == pytest.approx(10.0)
    assert row.ratio == pytest.approx(10 / 3.5)  # baseline / moe-a2a: above 1, moe-a2a is faster
    assert row.moe_a2a_gbps == pytest.approx(2 * 1000 / 3.5e-6 / 1e9)
    table = format_table([row]).splitlines()
    assert len(table) == 3 and table[0].count("|") == table[1].count("|") == table[2].count("|") == 9
    head = [c.strip() for c in table[0].strip("|").split("|")]
    assert head == [
        "size per peer",
        "moe-a2a p50 (us)",
        "moe-a2a p90 (us)",
        "baseline p50 (us)",
        "baseline p90 (us)",
        "baseline/moe-a2a",
        "moe-a2a GB/s",
        "baseline GB/s",
    ]
    assert [c.strip() for c in table[2].strip("|").split("|")][:2] == ["1000 B", "3.5"]


def test_write_before_connect_is_a_clear_error() -> None:
    """An engine that has not exchanged addresses yet refuses to write, and says why."""
    engine = _core.TransferEngine(0, 2, "tcp")
    buf = bytearray(64)
    region = engine.register_region(ctypes.addressof((ctypes.c_char * 64).from_buffer(buf)), 64)
    with pytest.raises(FabricError, match="not connected: connect"):
        engine.write(region, 0, 8, _core.RemoteRegion(0), 0, 1)


# ---------------------------------------------------------------- pieces, handles, backends


def test_pieces_of_a_split_write_count_as_one_write() -> None:
    """Each piece carries the immediate; a write counts once all num_nics pieces are in, in any order."""
    imm = _core.make_imm(77, 5)
    piece = imm | _core.IMM_PIECE_BIT
    counters = _core.ImmCounters(3)
    counters.add(piece)
    counters.add(piece)
    assert counters.count(imm) == 0, "two of three pieces are not a write"
    assert not counters.wait(imm, 1, 0.01)
    counters.add(piece)
    assert counters.count(imm) == 1
    counters.add(imm)  # a write that was not split counts whole
    assert counters.count(imm) == 2
    assert counters.count(_core.make_imm(77, 6)) == 0 and counters.count(piece) == 0
    assert counters.wait(imm, 2, 0.01)
    assert counters.count(imm) == 0
    one_nic = _core.ImmCounters(1)
    one_nic.add(imm)
    assert one_nic.count(imm) == 1


def test_handles_are_typed() -> None:
    assert _core.Region(3) == _core.Region(3) and _core.Region(3) != _core.Region(4)
    assert _core.Region(3) != _core.RemoteRegion(3)  # kinds never compare equal
    assert repr(_core.Group(7)) == "Group(7)" and _core.Group(7).value == 7
    assert len({_core.Region(1), _core.Region(1), _core.Region(2)}) == 2
    engine = _core.TransferEngine(0, 2, "tcp")
    buf = bytearray(64)
    region = engine.register_region(_address_of(buf), len(buf))
    assert isinstance(region, _core.Region)
    with pytest.raises(TypeError):
        engine.region_descriptor(region.value)  # a bare integer is no longer a region
    with pytest.raises(TypeError):
        engine.write(region, 0, 8, region, 0, 1)  # a local region where a remote one belongs


def test_cuda_registration_says_what_it_would_need() -> None:
    engine = _core.TransferEngine(0, 1, "tcp")
    buf = bytearray(4096)
    with pytest.raises(FabricError) as info:
        engine.register_region(_address_of(buf), len(buf), "cuda", 0)
    message = str(info.value)
    assert "registering CUDA device memory is not possible here" in message
    assert "FI_HMEM" in message and "MOE_A2A_GPU_DIRECT=0" in message
    assert engine.capabilities(0)["gpu_memory"] is False
    with pytest.raises(FabricError, match="kind: got 'gpu'; expected 'host' or 'cuda'"):
        engine.register_region(_address_of(buf), len(buf), "gpu")
    engine.register_region(_address_of(buf), len(buf), "host")  # the failed ones left nothing behind


def test_backend_factory_names_what_is_built() -> None:
    assert _core.backend_names() == ["libfabric"]
    assert _core.TransferEngine(0, 1, "tcp", backend="libfabric").backend == "libfabric"
    with pytest.raises(FabricError, match="backend 'ibverbs': a direct libibverbs RC backend is planned"):
        _core.TransferEngine(0, 1, "tcp", backend="ibverbs")
    with pytest.raises(FabricError, match="got 'nope'; expected one of the backends built: 'libfabric'"):
        _core.TransferEngine(0, 1, "tcp", backend="nope")


@pytest.mark.parametrize("provider", ["tcp", "shm"])
def test_backend_reports_capabilities(provider: str) -> None:
    caps = _core.backend_capabilities(provider)
    assert caps["backend"] == "libfabric" and caps["provider"].split(";")[0] == provider
    assert caps["device"] in _core.libfabric_domains(provider)
    assert caps["gpu_memory"] is False
    assert caps["imm_bytes"] >= 4 and caps["max_message_size"] >= 1 << 20
    assert caps["max_in_flight"] >= 1 and caps["inject_size"] >= 0
    assert isinstance(caps["ordered_writes"], bool) and isinstance(caps["blocking_wait"], bool)
    engine = _core.TransferEngine(0, 1, provider)
    assert engine.capabilities(0) == caps
    with pytest.raises(FabricError, match=r"capabilities: nic 1 is out of range \[0, 1\)"):
        engine.capabilities(1)


def _pair(
    provider: str, num_nics: int, threshold: int, size: int
) -> tuple[list[Any], list[bytearray], list[Any]]:
    """Ranks 0 and 1 of a world of 2 in this process: engines, receive buffers, [regions, groups]."""
    names = [_core.libfabric_domains(provider)[0]] * num_nics
    engines = [_core.TransferEngine(r, 2, provider, num_nics, threshold, names) for r in range(2)]
    addresses = [e.address() for e in engines]
    for e in engines:
        e.connect(addresses)
    bufs = [bytearray(size) for _ in range(2)]
    regions = [e.register_region(_address_of(b), size) for e, b in zip(engines, bufs, strict=True)]
    descs = [e.region_descriptor(r) for e, r in zip(engines, regions, strict=True)]
    remotes = [e.add_remote_region(1 - r, descs[1 - r]) for r, e in enumerate(engines)]
    groups = [e.create_group([1 - r], [remotes[r]]) for r, e in enumerate(engines)]
    return engines, bufs, [regions, groups]


@pytest.mark.parametrize("provider", ["tcp", "shm"])
def test_posting_writes_allocates_nothing_once_groups_are_registered(provider: str) -> None:
    """Scatters and barriers of a registered group grow no queue: the requests were built at registration."""
    engines, bufs, (regions, groups) = _pair(provider, 1, 1 << 20, 8192)
    tag = 900

    def round_(i: int) -> None:
        for r, e in enumerate(engines):
            bufs[r][0:8] = struct.pack("<Q", i * 2 + r)
            e.scatter(groups[r], regions[r], [_core.ScatterItem(0, 0, 8, 4096)], tag)
        for r, e in enumerate(engines):
            e.wait_imm(tag, 1 - r, 1, 30.0)
            assert struct.unpack_from("<Q", bufs[r], 4096)[0] == i * 2 + 1 - r
            e.wait_tx(30.0)

    for i in range(20):  # warm-up: the worker sizes its own queue on its first turns
        round_(i)
    before = [e.hot_path_allocations for e in engines]
    for i in range(20, 520):
        round_(i)
    assert [e.hot_path_allocations for e in engines] == before
    assert before == [0, 0], "the queues were sized at registration"
    assert all(e.tx_completed == e.tx_submitted == 520 for e in engines)


def test_split_write_pieces_each_carry_the_immediate_and_land_independently() -> None:
    """Two NICs: a split write is handed over as two pieces at once, and each arrives with the immediate."""
    threshold = 64 * 1024
    size = 4 * threshold
    engines, bufs, (regions, groups) = _pair("tcp", 2, threshold, 2 * size)
    sender, receiver = engines
    bufs[0][:size] = random.Random(5).randbytes(size)
    tag = 901
    sender.scatter(groups[0], regions[0], [_core.ScatterItem(0, 0, size, size)], tag)
    assert sender.tx_submitted == 2, "both pieces are queued at once, none waits for the other"
    receiver.wait_imm(tag, 0, 1, 30.0)
    assert bytes(bufs[1][size:]) == bytes(bufs[0][:size])
    assert [receiver.arrivals(nic) for nic in range(2)] == [1, 1], "every piece brought the immediate"
    assert receiver.imm_count(tag, 0) == 0
    sender.wait_tx(30.0)
    assert sender.tx_completed == 2


_PEER = """
import ctypes, pickle, sys, time
from moe_a2a import _core
e = _core.TransferEngine(1, 2, "tcp")
buf = bytearray(8192)
region = e.register_region(ctypes.addressof((ctypes.c_char * 8192).from_buffer(buf)), 8192)
sys.stdout.buffer.write(pickle.dumps((e.address(), e.region_descriptor(region))))
sys.stdout.flush()
e.connect([pickle.load(sys.stdin.buffer), e.address()])
time.sleep(600)
"""


# A replacement of rank 1: as _PEER, then it waits for one write with immediate tag 903 from
# rank 0 and prints the 8 bytes it brought.
_REPLACEMENT = _PEER.replace(
    "time.sleep(600)",
    "e.wait_imm(903, 0, 1, 30.0)\nsys.stdout.buffer.write(bytes(buf[:8]))\nsys.stdout.flush()",
)


def test_a_forgiven_peer_fails_the_engine_no_more() -> None:
    """tcp: a peer process is SIGKILLed and writes to it fail the engine; once every survivor has
    masked that peer (forgive_peer), the engine is healthy again, the failed writes count as
    done, and later writes to it fail nothing (moe_a2a.masking). Then a replacement process
    takes rank 1 (moe_a2a.rejoin): reconnect_peer sends our writes to its address, and its
    failures would count again."""
    import pickle
    import subprocess
    import sys
    import time

    # Writes in flight when the peer dies fail; libfabric 1.17's tcp may instead keep writes
    # posted after it is gone queued for ever, never failing them (the peer watch's sockets
    # notice such a loss). So 4 MiB writes are on the wire when the peer is killed.
    big = 4 << 20
    peer_src = _PEER.replace("8192", str(2 * big))
    peer = subprocess.Popen([sys.executable, "-c", peer_src], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert peer.stdout is not None and peer.stdin is not None
        address, desc = pickle.load(peer.stdout)
        engine = _core.TransferEngine(0, 2, "tcp")
        buf = bytearray(2 * big)
        region = engine.register_region(_address_of(buf), len(buf))
        pickle.dump(engine.address(), peer.stdin)
        peer.stdin.flush()
        engine.connect([engine.address(), address])
        group = engine.create_group([1], [engine.add_remote_region(1, desc)])
        engine.scatter(group, region, [_core.ScatterItem(0, 0, 8, 4096)], 902)
        engine.wait_tx(30.0)
        for _ in range(8):
            engine.scatter(group, region, [_core.ScatterItem(0, 0, big, big)], 902)
    finally:
        peer.kill()
        peer.wait()
    deadline = time.monotonic() + 20
    while not engine.error and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "to peer 1" in engine.error, engine.error
    with pytest.raises(FabricError, match="to peer 1"):
        engine.wait_tx(1.0)
    engine.forgive_peer(1)
    assert engine.error == ""
    engine.wait_tx(10.0)  # every write, the failed ones included, counts as done
    for _ in range(5):  # later failures of the forgiven peer fail nothing
        engine.scatter(group, region, [_core.ScatterItem(0, 0, 8, 4096)], 902)
    engine.wait_tx(10.0)
    assert engine.error == "" and engine.tx_completed == engine.tx_submitted
    with pytest.raises(FabricError, match=r"forgive_peer: peer 2 is out of range"):
        engine.forgive_peer(2)
    other = _core.encode_address("shm", [b"x"])
    with pytest.raises(FabricError, match=r"cannot talk to rank 1's replacement, which uses provider 'shm'"):
        engine.reconnect_peer(1, other)
    with pytest.raises(FabricError, match=r"reconnect_peer: peer 2 is out of range"):
        engine.reconnect_peer(2, engine.address())
    replacement = subprocess.Popen(
        [sys.executable, "-c", _REPLACEMENT], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    try:
        assert replacement.stdout is not None and replacement.stdin is not None
        address, desc = pickle.load(replacement.stdout)
        pickle.dump(engine.address(), replacement.stdin)
        replacement.stdin.flush()
        engine.reconnect_peer(1, address)
        engine.reconnect_peer(1, address)  # the same address again: nothing (another instance's rejoin)
        group = engine.create_group([1], [engine.add_remote_region(1, desc)])
        buf[4096 : 4096 + 8] = b"rejoined"
        engine.scatter(group, region, [_core.ScatterItem(0, 4096, 8, 0)], 903)
        engine.wait_tx(10.0)
        assert replacement.stdout.read(8) == b"rejoined"
        assert replacement.wait(30) == 0
    finally:
        if replacement.poll() is None:
            replacement.kill()
            replacement.wait()
    assert engine.error == ""
