"""The memory plan (moe_a2a.memory_plan, src/a2a/memory_plan.h) against what the core really takes.

Every byte of a workspace is written, then its resident memory is read from
/proc/self/smaps: the /dev/shm file's pages against the plan's shared bytes,
the anonymous pages against its private bytes. The CUDA figures (device
workspace and scratch) cannot be measured here: no GPU.
"""

from __future__ import annotations

import ctypes
import os
import re
import uuid
from dataclasses import replace

import pytest

from moe_a2a import _core, cli, memory_plan
from moe_a2a.a2a_startup import core_config
from moe_a2a.all_to_all import AllToAll, Config

CFG = Config(max_tokens=512, hidden=1024, num_experts=8, topk=4)


def resident(lo: int, hi: int) -> dict[str, int]:
    """Resident bytes of the mappings that overlap [lo, hi): file-backed (shared) and anonymous."""
    out = {"file": 0, "anon": 0}
    inside, path = False, ""
    with open("/proc/self/smaps") as f:
        for line in f:
            head = re.match(r"^([0-9a-f]+)-([0-9a-f]+) \S+ \S+ \S+ \S+\s*(.*)$", line)
            if head:
                a, b = int(head.group(1), 16), int(head.group(2), 16)
                inside, path = a < hi and b > lo, head.group(3)
            elif inside and line.startswith("Rss:"):
                out["file" if "/dev/shm/" in path else "anon"] += int(line.split()[1]) * 1024
    return out


def within(measured: int, planned: int, tol: float = 0.10) -> bool:
    return abs(measured - planned) <= tol * planned


@pytest.mark.parametrize("share_rows", [True, False])
def test_plan_equals_the_memory_a_touched_workspace_takes(share_rows: bool) -> None:
    cfg = replace(CFG, fabric_rows=CFG.fabric_rows_for(2, 2))  # as AllToAll resolves "auto"
    core = core_config(cfg, 0, 2, 2)
    plan = memory_plan.plan_of(core, cfg, "cpu") if share_rows else memory_plan.plan_of(core, cfg, "cuda")
    ws = _core.Workspace(core, f"/moe-a2a-test-{os.getpid()}-{uuid.uuid4().hex[:8]}", share_rows)
    ws.unlink()
    assert resident(ws.ptr, ws.ptr + ws.size) == {"file": 0, "anon": 0}  # nothing touched yet
    ctypes.memset(ws.ptr, 0, ws.size)  # every row filled: the most a call can touch
    got = resident(ws.ptr, ws.ptr + ws.size)
    assert plan.workspace == ws.size
    assert plan.host_private > 0 if not share_rows else plan.host_private == 0
    assert within(got["file"], plan.host_shared), (got, plan)
    if plan.host_private:
        assert within(got["anon"], plan.host_private), (got, plan)
    assert within(got["file"] + got["anon"], plan.host_shared + plan.host_private), (got, plan)


def test_plan_of_a_real_instance_equals_its_workspace() -> None:
    a2a = AllToAll(CFG)  # one rank: its rows are private memory
    try:
        ws = a2a._setup.workspace
        plan = memory_plan.plan(CFG, 1, 1)
        ctypes.memset(ws.ptr, 0, ws.size)
        got = resident(ws.ptr, ws.ptr + ws.size)
        assert within(got["file"] + got["anon"], plan.host_shared + plan.host_private), (got, plan)
        assert plan.fabric_registered == 0 and plan.peer_mapped == 0  # no remote or same-node peer
        assert (plan.max_recv_tokens, plan.max_private_tokens) == (
            a2a.max_recv_tokens,
            a2a.max_private_tokens,
        )
    finally:
        a2a.close()


def test_plan_by_topology() -> None:
    one_node, two_nodes = memory_plan.plan(CFG, 4, 4), memory_plan.plan(CFG, 4, 2)
    assert one_node.fabric_registered == 0 and two_nodes.fabric_registered == two_nodes.workspace
    assert one_node.peer_mapped == 3 * one_node.workspace and two_nodes.peer_mapped == two_nodes.workspace
    cuda = memory_plan.plan(CFG, 4, 2, device="cuda")
    assert cuda.device_workspace == cuda.workspace and cuda.device_scratch > 0
    # its own workspace, and the head (flags, routing rows) of its one same-node peer's
    assert cuda.workspace < cuda.cuda_pinned < cuda.workspace + cuda.host_shared + 4096
    bigger = memory_plan.plan(Config(max_tokens=1024, hidden=1024, num_experts=8, topk=4), 4, 2)
    assert bigger.workspace > 1.9 * two_nodes.workspace  # the row sections scale with max_tokens


def vm_size() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))


def test_plan_resolves_auto_as_the_instance_does() -> None:
    """The default's plan is that of the mode the instance would run (rows per node need more
    device scratch: the node's entries and staged outputs)."""
    plans = {m: memory_plan.plan(replace(CFG, fabric_rows=m), 8, 2, device="cuda") for m in ("rank", "node")}
    assert plans["node"] != plans["rank"]
    assert memory_plan.plan(CFG, 8, 2, device="cuda") == plans["node"]
    assert memory_plan.plan(CFG, 8, 2, device="cuda", graph_safe=True) == plans["rank"]
    with pytest.raises(ValueError, match="graph_safe: got 1; expected True or False"):
        memory_plan.plan(CFG, 8, 2, graph_safe=1)  # type: ignore[arg-type]


def test_a_configuration_that_cannot_fit_is_refused_before_anything_is_allocated() -> None:
    absurd = Config(max_tokens=100_000_000, hidden=7168, num_experts=8, topk=8)
    before = vm_size()
    with pytest.raises(memory_plan.MemoryPlanError) as err:
        AllToAll(absurd)
    message = str(err.value)
    need = memory_plan.plan(absurd, 1, 1).host_total
    assert f"needs {memory_plan.size_text(need)} of host memory per node" in message, message
    assert "is available (MemAvailable)" in message and "max_tokens=100000000" in message, message
    assert vm_size() - before < 1 << 30  # refused, not mapped


def test_check_fits_names_the_size_and_what_is_free() -> None:
    plan = memory_plan.plan(CFG, 4, 2, device="cuda")
    roomy = 1 << 40
    memory_plan.check_fits(plan, memory_plan.Free(host=roomy, shm=roomy, gpu=roomy))
    cases = [
        (memory_plan.Free(host=1 << 20, shm=roomy, gpu=roomy), "of host memory per node (2 ranks x"),
        (memory_plan.Free(host=roomy, shm=4096, gpu=roomy), "of /dev/shm per node"),
        (memory_plan.Free(host=roomy, shm=roomy, gpu=1 << 20), "of GPU memory per rank; 1.00 MiB is free"),
    ]
    for free, expected in cases:
        with pytest.raises(memory_plan.MemoryPlanError, match=re.escape(expected)):
            memory_plan.check_fits(plan, free)


def test_plan_command_prints_each_part(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["plan", "--model", "tiny", "--ranks", "4", "--ranks-per-node", "2"]) == 0
    out = capsys.readouterr().out
    tiny = Config(max_tokens=16, hidden=256, num_experts=16, topk=4, dispatch_dtype="fp8")
    plan = memory_plan.plan(tiny, 4, 2)
    assert "tiny: hidden 256, 16 experts, top-4; 16 tokens per rank" in out, out
    assert "4 ranks, 2 per node" in out
    shared = next(line for line in out.splitlines() if "workspace, shared (/dev/shm)" in line)
    assert memory_plan.size_text(plan.host_shared) in shared, out
    total = next(line for line in out.splitlines() if "host total" in line)
    assert memory_plan.size_text(plan.host_total) in total and "x 2 ranks per node" in total, out
    assert "fits here: yes" in out, out


def test_plan_command_says_what_does_not_fit(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["plan", "--model", "tiny", "--ranks", "2", "--tokens", "100000000"]) == 0
    out = capsys.readouterr().out
    assert "fits here: no: memory: this configuration needs" in out, out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--ranks", "3"], "num_experts: got 256, which is not divisible by the world size 3"),
        (["--ranks", "8", "--ranks-per-node", "3"], "--ranks-per-node: got 3; expected a divisor"),
        (["--max-recv-tokens", "0"], "--max-recv-tokens: got 0"),
        (["--model", "gpt"], "--model: unknown preset 'gpt'"),
    ],
)
def test_plan_command_usage_errors(capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main(["plan", *argv])
    assert exit_.value.code == 2
    assert f"moe-a2a plan: error: {message}" in capsys.readouterr().err
