"""Ranks on emulated hosts (tools/testbed.py): NIC choice, rate over two NICs, a2a against the reference.

Needs root and network namespaces; skips with the reason elsewhere. Run:
    python -m pytest -q -rs tests/testbed
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
import testbed  # noqa: E402

RANK = str(Path(__file__).with_name("rank.py"))
RATE_MBIT = 30
RATE_BYTES = 4 << 20  # per peer: with two peers, about 2.2 s through one 30 mbit NIC
RUN_S = 240

_why = testbed.unavailable()
pytestmark = pytest.mark.skipif(_why is not None, reason=f"testbed: {_why}")


def run_ranks(
    bed: testbed.Testbed,
    tmp: Path,
    scenario: str,
    names: str,
    env: dict[str, str] | None = None,
    killed: int | None = None,
    **args: object,
) -> list[dict]:
    """Every rank of the testbed, on its host (`env`: more variables for each); returns each
    rank's JSON report (rank order); fails with the ranks' output. Rank `killed` is expected to
    end by SIGKILL (its report written before)."""
    world = bed.ranks
    procs, logs = [], []
    for r in range(world):
        log = open(tmp / f"{scenario}-{r}.log", "w")  # noqa: SIM115 (closed below, after the ranks end)
        logs.append(log)
        argv = [sys.executable, RANK, scenario, str(tmp / f"{scenario}-{r}.json")]
        argv += [f"{k}={v}" for k, v in args.items()]
        rank_env = bed.rank_env(r, world, {"MOE_A2A_NICS": names, **(env or {})})
        procs.append(bed.popen(bed.host_of(r), argv, rank_env, stdout=log, stderr=subprocess.STDOUT))
    try:
        codes = [p.wait(timeout=RUN_S) for p in procs]
    except subprocess.TimeoutExpired:
        codes = [None] * world
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for log in logs:
            log.close()
    expected = [-signal.SIGKILL if r == killed else 0 for r in range(world)]
    if codes != expected:
        text = "\n".join(
            f"--- rank {h}\n" + (tmp / f"{scenario}-{h}.log").read_text()[-3000:] for h in range(world)
        )
        timed_out = f"(None: timed out after {RUN_S} s)"
        pytest.fail(f"{scenario}: exit codes {codes}, expected {expected} {timed_out}\n{text}")
    return [json.loads((tmp / f"{scenario}-{h}.json").read_text()) for h in range(world)]


@pytest.fixture(scope="module")
def bed3() -> Iterator[testbed.Testbed]:
    """Three hosts, no rate limit."""
    with testbed.Testbed(3) as bed:
        yield bed


@pytest.fixture(scope="module")
def bed3_limited() -> Iterator[testbed.Testbed]:
    """Three hosts whose NICs each send at RATE_MBIT."""
    with testbed.Testbed(3, rate=f"{RATE_MBIT}mbit") as bed:
        yield bed


def _tx(bed: testbed.Testbed, host: int) -> dict[str, int]:
    return {name: c["tx"] for name, c in bed.counters(host).items()}


@pytest.mark.parametrize(
    ("nics", "used", "unused"), [("va2", ["va2"], ["va1"]), ("va1,va2", ["va1", "va2"], [])]
)
def test_traffic_leaves_through_the_named_nics(
    bed3: testbed.Testbed, tmp_path: Path, nics: str, used: list[str], unused: list[str]
) -> None:
    size = 2 << 20
    before = _tx(bed3, 0)
    reports = run_ranks(bed3, tmp_path, "send", nics, bytes=size, nics=len(used), split=1 << 30)
    after = _tx(bed3, 0)
    sent = {n: after[n] - before[n] for n in ("va1", "va2", "vm")}
    assert reports[0]["nics"] == used
    # peers are sharded over the NICs: with two, each carries one peer's write
    per_nic = size * 2 // len(used)
    for n in used:
        assert sent[n] >= per_nic, f"{n} sent {sent[n]} bytes; expected at least {per_nic}: {sent}"
    for n in unused:
        assert sent[n] < 64 << 10, f"{n} sent {sent[n]} bytes though only {used} were named: {sent}"


def test_write_split_across_nics_lands_whole(bed3: testbed.Testbed, tmp_path: Path) -> None:
    before = _tx(bed3, 0)
    # every write above 64 KiB is split over both NICs; the receivers check every byte
    run_ranks(bed3, tmp_path, "send", "va1,va2", bytes=3 << 20, nics=2, split=64 << 10)
    after = _tx(bed3, 0)
    for n in ("va1", "va2"):
        assert after[n] - before[n] >= (3 << 20) * 2 // 2 * 0.9, f"{n}: {after[n] - before[n]} bytes"


def _twice_one(one: dict, two: dict, what: str, two_label: str) -> None:
    """Print both rates and check: one NIC near its tbf rate, two at about twice that."""
    rate = {k: r["bytes"] * 8 / r["seconds"] / 1e6 for k, r in (("one", one), ("two", two))}
    print(f"\ntestbed: tbf {RATE_MBIT} mbit per NIC, {what}: "
          f"one NIC {rate['one']:.1f} mbit/s ({one['seconds']:.2f} s), "
          f"{two_label} {rate['two']:.1f} mbit/s ({two['seconds']:.2f} s), "
          f"ratio {rate['two'] / rate['one']:.2f}")  # fmt: skip
    assert 0.7 * RATE_MBIT < rate["one"] <= 1.05 * RATE_MBIT, rate
    assert 1.6 < rate["two"] / rate["one"] < 2.3, rate


def test_two_rate_limited_nics_move_twice_one(bed3_limited: testbed.Testbed, tmp_path: Path) -> None:
    one = run_ranks(bed3_limited, tmp_path, "send", "va1", bytes=RATE_BYTES, nics=1, split=1 << 30)[0]
    two = run_ranks(bed3_limited, tmp_path, "send", "va1,va2", bytes=RATE_BYTES, nics=2, split=1 << 30)[0]
    _twice_one(one, two, f"{one['bytes']} bytes from host 0 to 2 peers", "two NICs")


def test_one_write_split_over_two_limited_nics_moves_twice_one(
    bed3_limited: testbed.Testbed, tmp_path: Path
) -> None:
    """The pieces of one split write run on both NICs at once (each carries the immediate):
    before, the piece with the immediate waited for the others, so one write used one NIC at a time."""
    args = dict(bytes=RATE_BYTES, to=1)
    one = run_ranks(bed3_limited, tmp_path, "send", "va1", nics=1, split=1 << 30, **args)[0]
    two = run_ranks(bed3_limited, tmp_path, "send", "va1,va2", nics=2, split=64 << 10, **args)[0]
    _twice_one(one, two, f"one write of {RATE_BYTES} bytes from host 0 to host 1", "split over two")


def test_a2a_over_two_rate_limited_nics(bed3_limited: testbed.Testbed, tmp_path: Path) -> None:
    """Dispatch + combine across emulated hosts, one and two NICs, against the NICs' own rate.

    Every copy goes to another host, so each rank's payload leaves through its
    NICs: with one NIC both peers share `va1`; with two, one peer each. A step is
    bound by the busiest rank's egress; the rate here is a rank's payload over
    its own time, so framing and the small routing and barrier messages count
    against it.
    """
    shape = {"tokens": 256, "hidden": 2048, "steps": 3}
    results = {}
    for label, names in (("one", "va1"), ("two", "va1,va2")):
        before = [_tx(bed3_limited, h) for h in range(3)]
        reports = run_ranks(bed3_limited, tmp_path, "a2a_rate", names, nics=len(names.split(",")), **shape)
        after = [_tx(bed3_limited, h) for h in range(3)]
        wire = [{n: after[h][n] - before[h][n] for n in ("va1", "va2")} for h in range(3)]
        mbit = [r["bytes"] * 8 / r["seconds"] / 1e6 for r in reports]
        results[label] = {"mbit": min(mbit), "seconds": max(r["seconds"] for r in reports), "wire": wire}
        if label == "one":
            for h in range(3):  # nothing left through the NIC that was not named
                assert after[h]["va2"] - before[h]["va2"] < 64 << 10, (h, after[h], before[h])
    one, two = results["one"], results["two"]
    print(f"\ntestbed a2a: tbf {RATE_MBIT} mbit per NIC, {shape}: one NIC {one['mbit']:.1f} mbit/s "
          f"({one['seconds']:.2f} s), two NICs {two['mbit']:.1f} mbit/s ({two['seconds']:.2f} s), "
          f"ratio {two['mbit'] / one['mbit']:.2f}; wire bytes {one['wire']} / {two['wire']}")  # fmt: skip
    assert 0.6 * RATE_MBIT < one["mbit"] <= 1.05 * RATE_MBIT, results
    # Faster than one NIC, but under both NICs' limit: a step's phases follow one another,
    # and small messages (routing rows, barriers) queue behind rows in a NIC's one tbf
    # queue. The bound is the limit, not the one-NIC run's rate, which host load can lower.
    assert 1.3 < two["mbit"] / one["mbit"], results
    assert two["mbit"] < 2 * RATE_MBIT, results


def test_a_killed_rank_on_another_host_is_noticed_at_once(bed3: testbed.Testbed, tmp_path: Path) -> None:
    """Rank 2 is SIGKILLed while ranks 0 and 1, on other hosts, wait for its rows with nothing in
    flight to it (no write can fail): the engine's control connection to it ends, and both raise
    within a second naming it, with timeout_s at 120 s."""
    reports = run_ranks(bed3, tmp_path, "death", "va1", killed=2, victim=2, at=3)
    killed_at = reports[2]["killed_at"]
    late = [r["noticed_at"] - killed_at for r in reports[:2]]
    print(f"\ntestbed: rank 2 killed; noticed by ranks 0 and 1 after {late[0]:.3f} s and {late[1]:.3f} s")
    for r in reports[:2]:
        assert r["call"] == 3, r
        assert "peer 2 (on another host) is gone: its control connection closed" in r["error"], r
    assert all(0 <= t < 1.0 for t in late), late


def test_survivors_on_other_hosts_mask_a_killed_rank_and_go_on(bed3: testbed.Testbed, tmp_path: Path) -> None:
    """on_peer_loss="mask" across hosts: rank 2 is SIGKILLed in call 4 after sending its rows;
    ranks 0 and 1, each on its own host, agree over their control connection, mask it, and
    every later call equals the reference with rank 2's experts masked, the first within a
    second of the kill."""
    calls = 12
    reports = run_ranks(bed3, tmp_path, "mask", "va1", killed=2, victim=2, at=4, calls=calls)
    killed_at = reports[2]["killed_at"]
    late = [r["first_masked_at"] - killed_at for r in reports[:2]]
    print(f"\ntestbed: rank 2 killed; ranks 0 and 1 served masked after {late[0]:.3f} s and {late[1]:.3f} s")
    for r in reports[:2]:
        assert r["masked"] == [2], r
        # The loss fails call 4, or call 3 on a survivor whose last rows from rank 2 never came.
        assert r["checked"] == calls - 1 and r["masked_calls"] in (calls - 1 - 4, calls - 4), r
    assert all(0 <= t < 1.0 for t in late), late


def test_a_replacement_on_its_host_rejoins_the_survivors_on_theirs(
    bed3: testbed.Testbed, tmp_path: Path
) -> None:
    """Rank 2 SIGKILLed in call 3, masked by ranks 0 and 1; a replacement started in rank 2's
    namespace as soon as it is gone meets them in rank 0's TCPStore at call 8 (a rejoin across
    hosts), and every later call of all three equals the full reference."""
    calls, key = 14, f"tb{os.getpid()}"
    env = {"MOE_A2A_NICS": "va1", "MOE_A2A_REJOIN_STORE": f"{bed3.address(0, 0)}:{bed3.port}"}
    argv = [
        sys.executable,
        RANK,
        "mask",
        "",
        "victim=2",
        "at=3",
        f"calls={calls}",
        "rejoin_at=8",
        f"key={key}",
    ]
    procs, logs = {}, {}

    def start(name: str, rank: int, extra: dict[str, str]) -> None:
        logs[name] = open(tmp_path / f"mask-{name}.log", "w")  # noqa: SIM115 (closed below)
        out = str(tmp_path / f"mask-{name}.json")
        procs[name] = bed3.popen(
            bed3.host_of(rank), [*argv[:3], out, *argv[4:]], bed3.rank_env(rank, None, env | extra),
            stdout=logs[name], stderr=subprocess.STDOUT,
        )  # fmt: skip

    for r in range(3):
        start(str(r), r, {})
    try:
        deadline = time.monotonic() + RUN_S
        while time.monotonic() < deadline and any(p.poll() is None for p in procs.values()):
            if procs["2"].poll() is not None and "2'" not in procs:
                start("2'", 2, {"REPLACEMENT_KEY": key})
            time.sleep(0.05)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
        for log in logs.values():
            log.close()
    text = "\n".join(f"--- {n}\n" + (tmp_path / f"mask-{n}.log").read_text()[-3000:] for n in procs)
    assert [procs[n].returncode for n in ("0", "1", "2", "2'")] == [0, 0, -signal.SIGKILL, 0], text
    reports = {n: json.loads((tmp_path / f"mask-{n}.json").read_text()) for n in ("0", "1", "2'")}
    for n in ("0", "1"):
        r = reports[n]
        assert r["masked"] == [] and r["checked"] == calls - 1 and r["masked_calls"] in (4, 5), reports
    joined = reports["2'"]
    assert joined["joined_at"] == 8 and joined["checked"] == calls - 8, reports
    print(
        f"\ntestbed: survivors' rejoin calls {reports['0']['rejoin_s']:.3f} s and "
        f"{reports['1']['rejoin_s']:.3f} s "
        f"(waiting for the replacement's start-up); the replacement from the meeting to its instance "
        f"built {joined['join_s']:.3f} s"
    )


def test_dispatch_combine_across_hosts_equals_reference(bed3: testbed.Testbed, tmp_path: Path) -> None:
    reports = run_ranks(bed3, tmp_path, "a2a", "va1,va2", nics=2, rounds=2)
    assert [r["rounds"] for r in reports] == [2, 2, 2]


def test_dispatch_combine_in_slices_across_hosts_equals_reference(
    bed3: testbed.Testbed, tmp_path: Path
) -> None:
    """Every peer's rows in writes of about two rows (MOE_A2A_SLICE_BYTES), peers over two NICs."""
    reports = run_ranks(
        bed3, tmp_path, "a2a", "va1,va2", env={"MOE_A2A_SLICE_BYTES": "400"}, nics=2, rounds=3
    )
    assert [r["rounds"] for r in reports] == [3, 3, 3]


@pytest.mark.parametrize("router", ["softmax", "node-limited"])
def test_torchtitan_moe_trains_across_hosts_as_in_one_process(
    bed3: testbed.Testbed, tmp_path: Path, router: str
) -> None:
    """TorchTitan's MoE with moe-a2a's dispatcher, peers over two NICs: every gradient and
    20 SGD steps' losses against the whole module in one process (tests/titan_case.py)."""
    pytest.importorskip("torchtitan.models.common.moe", reason="TorchTitan 0.3.0 is not installed")
    before = [_tx(bed3, h) for h in range(3)]
    reports = run_ranks(bed3, tmp_path, "titan", "va1,va2", router=router, seed=7, steps=20, nics=2)
    sent = [{nic: n - before[h][nic] for nic, n in _tx(bed3, h).items()} for h in range(3)]
    assert all(s["va1"] > 0 and s["va2"] > 0 for s in sent), sent  # each host's peers over both NICs
    assert [len(r["losses"]) for r in reports] == [21] * 3
    assert reports[0]["losses"] == reports[1]["losses"] == reports[2]["losses"]  # one global loss
    assert [r["tokens"] > 0 for r in reports] == [True, True, False]  # the last host has none


def test_cleanup_removes_stale_namespaces() -> None:
    prefix = f"{testbed.PREFIX}stale{os.getpid()}-"
    subprocess.run(["ip", "netns", "add", f"{prefix}x"], check=True)
    assert testbed.cleanup_stale(prefix) == [f"{prefix}x"]
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert prefix not in listed


def test_failure_inside_still_tears_down() -> None:
    prefix = f"{testbed.PREFIX}fail{os.getpid()}-"
    with pytest.raises(RuntimeError, match="boom"), testbed.Testbed(1, prefix=prefix):
        raise RuntimeError("boom")
    assert prefix not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


@pytest.mark.parametrize("teardown", ["1", "0"])
def test_a_rank_whose_script_ends_fails_no_slower_peer(
    bed3_limited: testbed.Testbed, tmp_path: Path, teardown: str
) -> None:
    """Rank 1's script ends right after its last call, whose 3.7 MB of combine rows to rank 0 are
    still queued for its 30 mbit NIC (a second's worth). At exit its engine hands them to the
    kernel and says goodbye on its control connections (moe_a2a.fabric); without the interpreter's
    teardown (`teardown` "0") the process then ends at once, its control connection before the
    rows land. Rank 0's call must still complete with every row, and rank 2's too. The rows go in
    64 KiB writes: rank 0 waits for a peer that left while its writes keep landing."""
    env = {"MOE_A2A_SLICE_BYTES": str(64 << 10)}
    shape = {"tokens": 256, "hidden": 7168}
    reports = run_ranks(bed3_limited, tmp_path, "finish", "va1", env, teardown=teardown, **shape)
    print(f"\ntestbed: rank 1 left; rank 0's last call took {reports[0]['seconds']:.3f} s")
    assert reports[0]["error"] is None and reports[0]["equal"], reports[0]
    assert reports[2]["error"] is None and reports[2]["equal"], reports[2]
