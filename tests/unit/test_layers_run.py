"""`moe-a2a run`, the layer's driver, without MPI: flags, memory estimate, random routing, summary."""

from __future__ import annotations

import argparse

import numpy as np
import pytest
import torch
from test_layers import gen

from moe_a2a.layers import driver, run_args, run_inputs, run_report
from moe_a2a.layers.presets import PRESETS, get_preset
from moe_a2a.usage import UsageError


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="moe-a2a")
    driver.add_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["run", *argv])


def test_run_with_an_unknown_preset_prints_one_line_and_fails(capsys: pytest.CaptureFixture[str]) -> None:
    args = parse("--model", "llama-moe")
    assert args.func is driver.main
    with pytest.raises(SystemExit) as exc:
        driver.main(args)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("moe-a2a run: error: --model: ")
    assert "unknown preset 'llama-moe'" in err and all(name in err for name in PRESETS)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--iters", "0"], "--iters: got 0"),
        (["--topk", "40"], "topk: got 40"),
        (["--num-experts", "10"], None),  # accepted: tiny's 4 groups no longer divide, grouping is dropped
        (["--skew", "2"], "--skew: applies to --routing skewed"),
        (["--max-nodes", "1"], "--max-nodes: limits the router's choice"),
    ],
)
def test_run_flags_are_validated_before_mpi(argv: list[str], message: str | None) -> None:
    args = parse("--model", "tiny", *argv)
    if message is None:
        shape = run_args.validate_args(args)
        assert (shape.num_experts, shape.num_groups) == (10, 1)
    else:
        with pytest.raises(UsageError, match=message):
            run_args.validate_args(args)


def test_shape_flags_override_the_preset() -> None:
    shape = run_args.validate_args(
        parse(
            "--model",
            "deepseek-v3",
            "--mode",
            "prefill",
            "--hidden",
            "512",
            "--expert-hidden",
            "64",
            "--tokens",
            "33",
            "--num-groups",
            "4",
        )
    )
    dims = (shape.hidden, shape.expert_hidden, shape.num_experts, shape.tokens("prefill"))
    assert dims == (512, 64, 256, 33)
    assert (shape.num_groups, shape.topk_groups) == (4, 4)


def test_verify_memory_estimate_refuses_the_full_deepseek_layer() -> None:
    need = run_args.verify_bytes(get_preset("deepseek-v3"), "bf16")
    assert need > 21 * 2**30  # 256 x 3 x 2048 x 7168 bf16 is 21 GiB, plus router and shared
    assert run_args.verify_bytes(get_preset("tiny"), "bf16") < 16 * 2**20


def test_random_routing_is_distinct_in_range_and_skewed_on_demand() -> None:
    ids, w = run_inputs.random_routing(500, 16, 4, gen(24))
    assert ids.shape == (500, 4) and ids.min() >= 0 and ids.max() < 16
    assert all(len(set(row)) == 4 for row in ids.tolist())
    torch.testing.assert_close(w.sum(-1), torch.ones(500))
    popularity = run_inputs.skewed_popularity(16, 1.5, seed=3)
    hot = int(popularity.argmax())
    skewed, _ = run_inputs.random_routing(500, 16, 4, gen(25), popularity)
    uniform_counts = torch.bincount(ids.flatten(), minlength=16)
    skewed_counts = torch.bincount(skewed.flatten(), minlength=16)
    assert int(skewed_counts[hot]) > 450  # the hottest expert is in nearly every token's top-4
    assert int(skewed_counts.min()) < int(uniform_counts.min()) / 2
    assert torch.equal(run_inputs.skewed_popularity(16, 1.5, seed=3), popularity)  # same on every rank


def test_summary_takes_the_slowest_rank_per_iteration() -> None:
    from moe_a2a.trace import PHASES, RunTrace

    ranks, iters = 2, 5
    start = np.zeros((ranks, iters, len(PHASES)), dtype=np.int64)
    end = np.zeros_like(start)
    for p in range(len(PHASES)):
        start[:, :, p] = 1_000 * p * 10
        end[:, :, p] = start[:, :, p] + 1_000 * (p + 1)  # phase p lasts (p+1) us on rank 0
    end[1, :, 0] += 4_000  # rank 1's dispatch_send takes 5 us
    trace = RunTrace(
        config={},
        environment={},
        hosts=["a", "a"],
        start_ns=start,
        end_ns=end,
        tokens_per_expert=np.ones((iters, 4), dtype=np.int64),
        bytes_per_peer=np.zeros((ranks, iters, ranks, 2), dtype=np.int64),
    )
    rows, tokens_per_s = run_report.summary_rows(trace, tokens_per_iter=100)
    table = {r[0]: r[1:] for r in rows}
    assert table["dispatch_send"][0] == pytest.approx(5.0) and table["experts"][0] == pytest.approx(4.0)
    layer_us = 50 + 6  # last phase starts at 50 us and lasts 6 us
    assert table["layer"][0] == pytest.approx(layer_us)
    assert tokens_per_s == pytest.approx(100 / (layer_us * 1e-6))
    text = run_report.format_summary(trace, 100, ["head"], ["foot"])
    assert text.startswith("head") and text.endswith("foot") and "tokens/s" in text
