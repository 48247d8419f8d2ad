"""Issue 32: on_peer_loss="mask" keeps serving through a lost rank (docs/reliability.md,
"Mask and continue"). Four ranks over torch.distributed on one host (peer_loss_job.py); ranks are
SIGKILLed in the middle of a loop of decode-sized calls."""

from __future__ import annotations

import glob
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("peer_loss_job.py")
WORLD = 4
CALLS = 30
DONE = r"done: (\d+) calls checked, (\d+) masked, masked \(([0-9, ]*)\).*?fds \+(-?\d+), /dev/shm \+(-?\d+)"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _launch(
    args: list[str], extra_env: dict[str, str] | None = None
) -> tuple[list[subprocess.Popen[str]], list[str]]:
    """WORLD ranks of `python args` over torch.distributed; their processes and outputs."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_"))} | (extra_env or {})
    env |= {"WORLD_SIZE": str(WORLD), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
    env["MOE_A2A_ABORT_ON_ERROR"] = "0"
    procs = [
        subprocess.Popen(
            [sys.executable, *args],
            env=env | {"RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(WORLD)
    ]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=200)[0])
    except subprocess.TimeoutExpired:
        hung = _stacks(procs, outs)
        pytest.fail(f"the job hung: each rank's output, the stacks of those still running\n{hung}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return procs, outs


def _stacks(procs: list[subprocess.Popen[str]], outs: list[str]) -> str:
    """Each rank's output (`outs`: those read already); a rank still running first dumps its
    threads' stacks (SIGUSR1, faulthandler in peer_loss_job.py) and is then killed."""
    for p in procs[len(outs) :]:
        if p.poll() is None:
            p.send_signal(signal.SIGUSR1)
    time.sleep(2.0)
    texts = [*outs]
    for p in procs[len(outs) :]:
        if p.poll() is None:
            p.kill()
        texts.append(p.communicate()[0])
    ranks = enumerate(zip(procs, texts, strict=True))
    return "\n".join(f"== rank {r} (rc {p.returncode})\n{t}" for r, (p, t) in ranks)


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "provider,kills,extra,rpn",
    [
        ("tcp", "3:8", "", 0),  # one loss mid-dispatch
        ("shm", "3:8,1:15", "", 0),  # two losses, one after the other
        ("tcp", "1:8,3:8", "renormalize", 0),  # two at once: survivors see them in either order
        # Two virtual nodes of 2: a loss on each node, the second leaving one survivor per node,
        # which agree over their control connection and reach each other over the fabric.
        ("tcp", "3:8,1:15", "", 2),
    ],
)
def test_survivors_mask_the_lost_ranks_and_go_on(provider: str, kills: str, extra: str, rpn: int) -> None:
    procs, outs = _launch(
        [str(SCRIPT), provider, str(CALLS), kills] + ([extra] if extra else []),
        {"RANKS_PER_NODE": str(rpn)} if rpn else None,
    )
    killed = {int(r): int(c) for r, c in (k.split(":") for k in kills.split(","))}
    text = "\n".join(outs)
    kill_times = {int(m[1]): float(m[2]) for m in re.finditer(r"rank (\d+) killed at ([0-9.]+)", text)}
    assert set(kill_times) == set(killed), text
    for r, (p, out) in enumerate(zip(procs, outs, strict=True)):
        if r in killed:
            assert p.returncode == -9, f"rank {r} was not killed (rc {p.returncode})\n{out}"
            continue
        assert p.returncode == 0, f"rank {r} rc {p.returncode}\n{out}"
        done = re.search(DONE, out)
        assert done, out
        masked = tuple(int(x) for x in done[3].split(",") if x.strip())
        assert masked == tuple(sorted(killed)), out
        # Every call but the one (or, for losses at different calls, ones) each loss failed; across
        # nodes a survivor a call behind the others when a loss comes also skips that call.
        skipped = len(killed) if rpn else 0
        assert int(done[1]) >= CALLS - len(set(killed.values())) - skipped, out
        assert int(done[2]) >= CALLS - max(killed.values()) - 2 - skipped, out
        assert int(done[4]) <= 0 and int(done[5]) <= 0, f"file descriptors or /dev/shm files grew\n{out}"
        # From each kill to this survivor's first call that masks it: within a second.
        for m in re.finditer(r"first call with \(([0-9, ]*)\) masked done at ([0-9.]+)", out):
            lost = [int(x) for x in m[1].split(",") if x.strip()]
            newest = max(kill_times[x] for x in lost)
            took = float(m[2]) - newest
            print(f"\nrank {r}: served with {lost} masked {took:.3f} s after the kill")
            assert took < 1.0, f"rank {r} served masked {took:.2f} s after the kill\n{out}"


@pytest.mark.timeout(240)
@pytest.mark.skipif(
    os.environ.get("MOE_A2A_TEST_DEVICE") != "cuda",
    reason="CUDA graphs: run with MOE_A2A_TEST_DEVICE=cuda on a GPU (tools/gpu/run_cuda_tests.sh peerloss)",
)
def test_a_graph_captured_before_a_loss_is_refused_and_captured_again() -> None:
    """Every call a CUDA graph replay (graph_safe=True), rank 3 gone at call 8: the survivors learn
    of it at check() (their kernels' deadline), mask it, find the old graph's replay refused
    (StaleGraphError: nothing done) and capture the step again; every checked call equals the
    reference, masked after the loss."""
    procs, outs = _launch([str(SCRIPT), "shm", str(CALLS), "3:8"], {"PEER_LOSS_GRAPH": "1"})
    assert procs[3].returncode == -9, outs[3]
    for r in range(3):
        assert procs[r].returncode == 0, outs[r]
        assert "stale replay refused: " in outs[r] and "capture the step again" in outs[r], outs[r]
        done = re.search(DONE, outs[r])
        assert done and done[3].strip(" ,") == "3", outs[r]
        assert int(done[1]) >= CALLS - 1 and int(done[2]) >= CALLS - 10, outs[r]


@pytest.mark.timeout(240)
def test_the_decode_layer_differs_from_the_full_model_only_where_routed_to_a_lost_expert() -> None:
    """peer_loss_layer_job.py: MoELayer's decode forward (fp32) on 4 ranks, rank 3 killed at step 4:
    each survivor's output equals the whole layer with rank 3's experts weighted 0, and after the
    loss tokens with no expert on rank 3 equal the full model's."""
    procs, outs = _launch([str(Path(__file__).with_name("peer_loss_layer_job.py"))])
    assert procs[3].returncode == -9, outs[3]
    for r in range(3):
        assert procs[r].returncode == 0, outs[r]
        found = re.search(
            r"masked steps (\d+) untouched tokens equal True changed tokens (\d+) masked \(3,\)", outs[r]
        )
        assert found and int(found[1]) >= 6 and int(found[2]) > 0, outs[r]


def _rank_pid(launcher: int, rank: int) -> int | None:
    """The pid of MPI rank `rank`, a child of `launcher` (mpirun starts a host's ranks itself),
    once it has mapped every workspace of its node (its AllToAll is built); None until then."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
            if parent != launcher:
                continue
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = f.read().split(b"\0")
            with open(f"/proc/{entry}/maps") as f:
                mapped = sum("/dev/shm/moe-a2a-" in line for line in f)
        except OSError:
            continue
        if f"OMPI_COMM_WORLD_RANK={rank}".encode() in env and mapped >= WORLD:
            return int(entry)
    return None


@pytest.mark.timeout(240)
def test_moe_a2a_run_decode_serves_through_a_lost_rank() -> None:
    """`moe-a2a run --mode decode --on-peer-loss mask` under mpirun --enable-recovery, rank 3
    SIGKILLed while it serves: every survivor finishes and says how many calls ran masked."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_"))}
    run = ["moe-a2a", "run", "--mode", "decode", "--on-peer-loss", "mask", "--iters", "3000", "--warmup", "0"]
    mpirun = ["mpirun", "--allow-run-as-root", "--oversubscribe", "--enable-recovery", "-n", str(WORLD)]
    job = subprocess.Popen(
        [*mpirun, *run], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        deadline = time.monotonic() + 120
        victim = None
        while victim is None and time.monotonic() < deadline and job.poll() is None:
            victim = _rank_pid(job.pid, 3)
            time.sleep(0.1)
        assert victim is not None, "rank 3 never built its AllToAll"
        time.sleep(1.0)  # well inside the 3000 steps
        os.kill(victim, signal.SIGKILL)
        out = job.communicate(timeout=200)[0]
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode == 0, out
    lines = re.findall(r"rank (\d): rank\(s\) \[3\] lost at step (\d+); (\d+) of 3000 calls ran masked", out)
    assert sorted(int(r) for r, _, _ in lines) == [0, 1, 2], out
    for _, at, masked in lines:
        assert int(masked) >= 3000 - int(at) - 2 and int(masked) > 0, out


def _launch_with_replacements(
    tmp_path: Path,
    kills: dict[int, int],
    rejoins: dict[int, tuple[int, str]],
    bad: bool = False,
    across_nodes: bool = False,
    replacement_env: dict[str, str] | None = None,
    layers: int = 1,
) -> tuple[dict[str, subprocess.Popen[bytes]], dict[str, str], str]:
    """WORLD ranks of peer_loss_job.py over torch.distributed and a launcher that starts rank
    r's replacement (named "r'") once r is gone, with key rejoins[r][1] (`bad`: with another
    hidden size); the survivors call rejoin at call rejoins[r][0]. `across_nodes`: two virtual
    nodes of 2, meeting in rank 0's TCPStore (torch.distributed's) instead of /dev/shm files.
    Processes, outputs, all text."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_"))}
    port = str(_free_port())
    env |= {"WORLD_SIZE": str(WORLD), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
    if across_nodes:
        env |= {"RANKS_PER_NODE": "2", "MOE_A2A_REJOIN_STORE": f"127.0.0.1:{port}"}
    env |= {"MOE_A2A_ABORT_ON_ERROR": "0", "REJOIN_AT": ",".join(f"{s}:{k}" for s, k in rejoins.values())}
    env |= {"LAYERS": str(layers)}
    args = [sys.executable, str(SCRIPT), "tcp", str(CALLS), ",".join(f"{r}:{c}" for r, c in kills.items())]

    def start(name: str, extra: dict[str, str]) -> tuple[subprocess.Popen[bytes], Path]:
        log = tmp_path / f"{name}.log"
        with open(log, "wb") as f:
            return subprocess.Popen(args, env=env | extra, stdout=f, stderr=subprocess.STDOUT), log

    procs = {str(r): start(f"rank{r}", {"RANK": str(r)}) for r in range(WORLD)}
    deadline = time.monotonic() + 240
    try:
        while time.monotonic() < deadline and any(p.poll() is None for p, _ in procs.values()):
            for r, (_, key) in rejoins.items():
                if procs[str(r)][0].poll() is not None and f"{r}'" not in procs:
                    extra = {"RANK": str(r), "REPLACEMENT_KEY": key, "REPLACEMENT_BAD": str(int(bad))}
                    extra |= replacement_env or {}
                    procs[f"{r}'"] = start(f"rank{r}-replacement", extra)
            time.sleep(0.05)
    finally:
        for p, _ in procs.values():
            if p.poll() is None:
                p.kill()
    outs = {name: log.read_text() for name, (_, log) in procs.items()}
    text = "\n\n".join(f"== {name}\n{out}" for name, out in outs.items())
    return {name: p for name, (p, _) in procs.items()}, outs, text


@pytest.mark.timeout(300)
@pytest.mark.parametrize("across_nodes", [False, True], ids=["one-node", "two-nodes"])
def test_replacements_rejoin_and_the_full_set_resumes(tmp_path: Path, across_nodes: bool) -> None:
    """Rank 3 killed at call 6, its replacement rejoins at call 12; rank 1 killed at call 18, its
    replacement rejoins at call 24 (docs/peer-loss.md, "Rejoin"). Every call of every process,
    replacements included, equals the reference: masked while a rank is lost, full after. Across
    two virtual nodes each loss leaves the other node's ranks to mask it over the fabric, and the
    meeting is in a TCPStore."""
    key = f"t{os.getpid()}{'-n' if across_nodes else ''}"  # unique to the job: never another's files
    procs, outs, text = _launch_with_replacements(
        tmp_path,
        {3: 6, 1: 18},
        {3: (12, f"{key}-a"), 1: (24, f"{key}-b")},
        across_nodes=across_nodes,
        layers=2,
    )
    for name, p in procs.items():
        if name in ("3", "1"):
            assert p.returncode == -9, text
            continue
        assert p.returncode == 0, text
        done = re.search(DONE, outs[name])
        assert done and done[3].strip() == "", text  # nobody masked at the end
        # Across nodes the current meeting's TCPStore connections stay open with its instance (one
        # per participant; the store's host, rank 0, serves the others'): bounded, not per rejoin;
        # each of the two instances has its own meeting.
        fds_limit = 3 * 2 if across_nodes else 0
        assert int(done[4]) <= fds_limit and int(done[5]) <= 0, f"{name}: fds or /dev/shm grew\n{text}"
        assert "reopen refused: reopen: this instance was built by a rejoin" in outs[name], text
        # A second instance on the engine (a model's next layer) lost and got back the same ranks.
        layer = re.search(r"layers: (\d+) calls checked, masked \[\(\)\]", outs[name])
        assert layer and int(layer[1]) >= int(re.search(DONE, outs[name])[1]) - 3, text  # type: ignore[index]
        # Memory: the old instances' workspaces are unmapped (the new ones replace them).
        assert re.search(r"workspace mappings \+0\b", outs[name]), f"{name}: workspace mappings grew\n{text}"
    # A loss fails the call of the layer that saw it first, and a step whose first layer's call
    # failed skips the second layer's: 1 or 2 calls of the two layers per loss. Which layer sees
    # it is timing across nodes (a survivor whose first layer's call needed nothing from the dead
    # rank goes on to the second layer's), where a survivor a call behind the others when a loss
    # comes also skips that call. Across nodes a loss can also come between calls (the dead rank's
    # connection closed before the next dispatch): that dispatch fails before it starts and runs
    # again at the same epoch ("the dispatch of epoch E failed ... after epoch E"), losing nothing.
    # The survivors of both losses count every call but those; the replacements every call from
    # the one they joined at (rank 3's but the second loss's).
    skipped = 2 if across_nodes else 0

    def lost(name: str, calls: int) -> int:
        first, second = re.search(DONE, outs[name]), re.search(r"layers: (\d+) calls checked", outs[name])
        assert first and second, text
        assert calls - 2 - skipped <= int(first[1]) <= calls, text
        return 2 * calls - int(first[1]) - int(second[1])

    def retried(name: str) -> int:
        seen = re.finditer(
            r"masked \(\d+,\) at [0-9.]+ resume (\d+): .*? the dispatch of epoch (\d+) failed", outs[name]
        )
        return sum(m[1] == m[2] for m in seen)

    assert 2 - retried("0") <= lost("0", CALLS) <= 2 * (2 + skipped), text
    assert 1 - retried("3'") <= lost("3'", CALLS - 12) <= 2 * (1 + skipped // 2), text
    assert int(re.search(DONE, outs["1'"])[1]) == CALLS - 24, text  # type: ignore[index]
    # The survivors wait in rejoin() for the replacement to start: Python and torch (the CPU
    # machine's goal: 5 s), and on a GPU its CUDA context too (4.0-5.1 s on the H200).
    most = 15.0 if os.environ.get("MOE_A2A_TEST_DEVICE") == "cuda" else 5.0
    for name in ("0", "2"):
        took = [float(t) for t in re.findall(r"rejoined \(\d+,\) in ([0-9.]+) s", outs[name])]
        assert len(took) == 2 and max(took) < most, text
        # The survivors registered and connected nothing of their own anew.
        assert len(re.findall(r"kept its workspace, engine and region: True", outs[name])) == 2, text
    assert not glob.glob(f"/dev/shm/moe-a2a-rejoin-{key}-*"), text


def _assert_refused_and_served_masked(
    procs: dict[str, subprocess.Popen[bytes]],
    outs: dict[str, str],
    text: str,
    key: str,
    replacement_says: str,
    survivors_say: str | None = None,
) -> None:
    """Rank 3 killed, its replacement failed saying `replacement_says`, every survivor's rejoin
    refused saying `survivors_say` (default the same), and every survivor finished every call
    but the failed one with rank 3 masked; no rejoin file left."""
    assert procs["3"].returncode == -9, text
    assert procs["3'"].returncode not in (0, None) and replacement_says in outs["3'"], text
    for name in ("0", "1", "2"):
        assert procs[name].returncode == 0, text
        assert re.search(rf"rejoin refused: .*{survivors_say or replacement_says}", outs[name]), text
        done = re.search(DONE, outs[name])
        assert done and done[3].strip(" ,") == "3" and int(done[1]) == CALLS - 1, text
    assert not glob.glob(f"/dev/shm/moe-a2a-rejoin-{key}-*"), text


@pytest.mark.timeout(300)
def test_a_replacement_with_another_configuration_is_refused_and_the_survivors_serve_on(
    tmp_path: Path,
) -> None:
    """The replacement of rank 3 passes another hidden size: its constructor and every
    survivor's rejoin fail naming it, and the survivors finish every call with rank 3 masked."""
    key = f"t{os.getpid()}-c"
    procs, outs, text = _launch_with_replacements(tmp_path, {3: 6}, {3: (12, key)}, bad=True)
    _assert_refused_and_served_masked(procs, outs, text, key, "hidden")


@pytest.mark.timeout(300)
def test_a_replacement_that_fails_late_leaves_the_survivors_serving_masked(tmp_path: Path) -> None:
    """Rank 3's replacement fails in the backend's start, after the survivors connected its
    address, added its region and mapped its segment: every survivor's rejoin raises, re-arms its
    masked instance, and every later call still equals the masked reference."""
    key = f"t{os.getpid()}-l"
    cuda = os.environ.get("MOE_A2A_TEST_DEVICE") == "cuda"
    step = "opening the node's GPU memory" if cuda else "starting the cpu backend"
    procs, outs, text = _launch_with_replacements(
        tmp_path, {3: 6}, {3: (12, key)}, replacement_env={"MOE_A2A_TEST_FAIL_STEP": step}
    )
    _assert_refused_and_served_masked(procs, outs, text, key, "MOE_A2A_TEST_FAIL_STEP", step)


@pytest.mark.timeout(240)
def test_a_replacement_started_outside_mpirun_rejoins_an_mpirun_job(tmp_path: Path) -> None:
    """Under `mpirun --enable-recovery` rank 3 dies at call 6; its replacement, a plain process
    outside the MPI job (no MPI_Init), rejoins at call 12 and all four finish unmasked."""
    key = f"m{os.getpid()}"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_"))}
    env |= {"MOE_A2A_ABORT_ON_ERROR": "0", "REJOIN_AT": f"12:{key}"}
    args = [sys.executable, str(SCRIPT), "tcp", str(CALLS), "3:6"]
    mpirun = ["mpirun", "--allow-run-as-root", "--oversubscribe", "--enable-recovery", "-n", str(WORLD)]
    log = tmp_path / "mpirun.log"
    with open(log, "wb") as f:
        job = subprocess.Popen([*mpirun, *args], env=env, stdout=f, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while "rank 3 killed" not in log.read_text() and time.monotonic() < deadline and job.poll() is None:
            time.sleep(0.05)
        extra = {"RANK": "3", "WORLD_SIZE": str(WORLD), "REPLACEMENT_KEY": key}
        replaced = subprocess.run(args, env=env | extra, capture_output=True, text=True, timeout=120)
        job.wait(timeout=120)
    finally:
        if job.poll() is None:
            job.kill()
    out = log.read_text()
    assert replaced.returncode == 0, f"{replaced.stdout}{replaced.stderr}\n{out}"
    assert re.search(r"rank 3 done: 18 calls checked, 0 masked, masked \(\)", replaced.stdout), (
        replaced.stdout
    )
    for r in range(3):
        assert re.search(rf"rank {r} done: {CALLS - 1} calls checked, \d+ masked, masked \(\)", out), out
    assert job.returncode == 0, out
