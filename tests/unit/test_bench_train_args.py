"""`bench a2a --train`'s flags: bad values give an error that names the flag."""

from __future__ import annotations

import argparse

import pytest

pytest.importorskip("torch")

from moe_a2a.bench import a2a, train  # noqa: E402


def parse(extra: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="moe-a2a bench")
    a2a.add_parser(parser.add_subparsers())
    return parser.parse_args(["a2a", "--train", *extra])


def test_defaults_are_the_deepseek_v3_training_shape() -> None:
    shape = train.check_args(parse([]), world=4)
    assert shape == dict(tokens=4096, hidden=7168, num_experts=256, topk=8)


def test_shape_flags_shrink_it() -> None:
    args = parse(["--tokens", "16", "--hidden", "128", "--num-experts", "6", "--topk", "2"])
    assert train.check_args(args, world=3) == dict(tokens=16, hidden=128, num_experts=6, topk=2)


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--tokens", "0"], "--tokens"),
        (["--hidden", "-3"], "--hidden"),
        (["--num-experts", "x"], "--num-experts"),
        (["--topk", "0"], "--topk"),
        (["--iters", "0"], "--iters"),
        (["--warmup", "-1"], "--warmup"),
        (["--dispatch-dtype", "fp16"], "--dispatch-dtype"),
        (["--grad-dtype", "fp8"], "--grad-dtype"),
        (["--gpu-busy-us", "0"], "--gpu-busy-us"),
    ],
)
def test_argparse_refuses_bad_values(
    flags: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        parse(flags)
    assert f"argument {named}" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "world", "named"),
    [
        (["--num-experts", "10"], 4, "--num-experts: got 10"),
        (["--num-experts", "4", "--topk", "5"], 2, "--topk: got 5"),
        (["--mode", "decode"], 1, "--mode: got 'decode'"),
        (["--baseline", "gloo"], 2, "--baseline: got 'gloo'"),
        (["--gpu-busy-us", "300"], 1, "--gpu-busy-us: got 300; it needs --device cuda"),
    ],
)
def test_check_args_names_the_flag(flags: list[str], world: int, named: str) -> None:
    with pytest.raises(train.TrainArgumentError, match="^" + named):
        train.check_args(parse(flags), world)


def test_compile_needs_a_warm_up_call_and_train() -> None:
    with pytest.raises(train.TrainArgumentError, match=r"^--warmup: got 0; --compile needs 1 or more"):
        train.check_args(parse(["--compile", "--warmup", "0"]), world=1)
    assert train.check_args(parse(["--compile", "--warmup", "1"]), world=1)["tokens"] == 4096
    parser = argparse.ArgumentParser(prog="moe-a2a bench")
    a2a.add_parser(parser.add_subparsers())
    from moe_a2a.usage import UsageError

    with pytest.raises(UsageError, match=r"^--compile: only used with --train"):
        a2a.main(parser.parse_args(["a2a", "--compile"]))


def test_gpu_busy_is_for_train_on_cuda() -> None:
    args = parse(["--gpu-busy-us", "300", "--device", "cuda"])
    assert args.gpu_busy_us == 300 and train.check_args(args, world=1)["tokens"] == 4096
    parser = argparse.ArgumentParser(prog="moe-a2a bench")
    a2a.add_parser(parser.add_subparsers())
    from moe_a2a.usage import UsageError

    with pytest.raises(UsageError, match=r"^--gpu-busy-us: only used with --train"):
        a2a.main(parser.parse_args(["a2a", "--gpu-busy-us", "300"]))
