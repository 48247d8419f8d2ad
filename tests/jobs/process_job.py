"""Run by test_process.py: ranks over torch.distributed (gloo), one process each.

Not under mpirun, which forwards the harness's signals to every rank and ends
the job when one rank ends. Environment: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT.

`interrupt PROVIDER RPN`: 3 ranks. Ranks 0 and 1 call dispatch while rank 2
does not (it waits for a line on stdin). The harness sends SIGUSR1 to rank 1,
whose handler tries to close the instance in the middle of the call and prints
`handler: ...`; then SIGINT to rank 0 once its main thread sleeps in the
call's wait; then releases rank 2. Each rank prints `raised NAME at T:
MESSAGE` (T: time.monotonic()) for its call, then `next NAME` for its next call.

`fork PROVIDER RPN`: 2 ranks run ROUNDS rounds, each checked against the
reference; in the middle rank 0 forks a child that calls dispatch, closes the
instance and drops it. The child prints `child raised NAME after S s: MESSAGE`.
"""

from __future__ import annotations

import gc
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

from moe_a2a import AllToAll, Config
from moe_a2a.reference import combine_reference, dispatch_reference

mode, provider, rpn_arg = sys.argv[1:4]
rpn = None if rpn_arg == "none" else int(rpn_arg)
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
TOKENS, HIDDEN, TOPK = 8, 64, 2
cfg = Config(
    max_tokens=TOKENS,
    hidden=HIDDEN,
    num_experts=2 * world,
    topk=TOPK,
    dispatch_dtype="fp32",
    combine_dtype="fp32",
    timeout_s=30.0,
)
a2a = AllToAll(cfg, dist.group.WORLD, provider=provider, ranks_per_node=rpn, abort_on_error=False)


def inputs(round_: int, r: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rank r's tokens, ids and weights of a round: every rank can compute every rank's."""
    g = torch.Generator().manual_seed(1000 * round_ + r)
    x = torch.randn(TOKENS, HIDDEN, generator=g)
    ids = torch.stack([torch.randperm(cfg.num_experts, generator=g)[:TOPK] for _ in range(TOKENS)])
    return x, ids.to(torch.int32), torch.rand(TOKENS, TOPK, generator=g)


def exact_round(round_: int) -> None:
    """One dispatch + combine, each held against the reference."""
    every = [inputs(round_, r) for r in range(world)]
    x, ids, w = every[rank]
    d = a2a.dispatch(x, ids, w)
    ref = dispatch_reference([e[0] for e in every], [e[1] for e in every], cfg.num_experts, "fp32")
    assert torch.equal(d.expert_x, ref[rank].expert_x), f"round {round_}: dispatch differs"
    out = a2a.combine(2 * d.expert_x, d)
    want = combine_reference([2 * r.expert_x for r in ref], ref, [e[2] for e in every], "fp32")[rank]
    torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6, msg=f"round {round_}: combine differs")


def say(text: str) -> None:
    print(text, flush=True)


def close_in_handler(*_: object) -> None:
    try:
        a2a.close()
        say("handler: closed")
    except RuntimeError as exc:
        say(f"handler: {exc}")


def interrupt() -> None:
    signal.signal(signal.SIGUSR1, close_in_handler)
    exact_round(0)
    dist.barrier()
    x, ids, w = inputs(1, rank)
    if rank == world - 1:
        sys.stdin.readline()  # the others have raised
    else:
        say("calling")
    try:
        a2a.dispatch(x, ids, w)
        say("raised nothing")
    except BaseException as exc:  # KeyboardInterrupt on rank 0
        say(f"raised {type(exc).__name__} at {time.monotonic():.3f}: {exc}")
    try:
        a2a.dispatch(x, ids, w)
    except RuntimeError as exc:
        say(f"next {type(exc).__name__}: {exc}")
    a2a.close()  # it failed: no waiting for peers


def fork() -> None:
    rounds = 6
    for i in range(rounds):
        if i == rounds // 2 and rank == 0:
            child = os.fork()
            if child == 0:
                x, ids, w = inputs(i, rank)
                started = time.monotonic()
                try:
                    a2a.dispatch(x, ids, w)
                    say("child raised nothing")
                except BaseException as exc:
                    say(f"child raised {type(exc).__name__} after {time.monotonic() - started:.3f} s: {exc}")
                a2a.close()
                globals().pop("a2a")
                gc.collect()
                sys.exit(0)  # the interpreter's own teardown, with the inherited objects in it
            _, status = os.waitpid(child, 0)
            say(f"child exit {os.waitstatus_to_exitcode(status)}")
        exact_round(i)
    say(f"rounds {rounds} exact")
    a2a.close()


{"interrupt": interrupt, "fork": fork}[mode]()
sys.stdout.flush()
os._exit(0)  # no collective teardown after a failure
