"""Spack spec strings: the checker (spack_check.parse_spec) itself, and every spec string of spack.yaml."""

from __future__ import annotations

from typing import Any

import pytest
from spack_check import SpecSyntaxError, load_env, parse_spec, spec_strings


@pytest.fixture(scope="module")
def env() -> dict[str, Any]:
    return load_env()


@pytest.mark.parametrize(
    "text",
    [
        "moe-a2a",
        "moe-a2a +efa +verbs",
        "moe-a2a@=0.1.0",
        "libfabric@1.17: fabrics=efa,rxm,shm,tcp,verbs",
        "py-torch@2.4:+cuda cuda_arch=90",
        "foo@1.2:1.4,2.0:",
        "foo@:2",
        "+cuda cuda_arch=90",
        "~cuda",
        "~mpi",
        "py-h5py@3.8: ~mpi",
        "hdf5 ^openmpi@4.1: %gcc@12",
        "hdf5 ^[virtuals=mpi] openmpi",
        "hdf5 %c,cxx=gcc",
        "builtin.zlib",
        "foo cflags='-O3 -g'",
        "foo@git.main=1.0",
        "foo ++shared target=x86_64_v3",
    ],
)
def test_spec_checker_accepts_valid_specs(text: str) -> None:
    parse_spec(text)


@pytest.mark.parametrize(
    "text",
    [
        "",
        "libfabric@",
        "foo@1.2::",
        "foo@1.2@1.3",
        "+",
        "foo bar",
        "foo ^",
        "^foo",
        "foo ^+bar",
        "py-torch +cuda=",
        "foo;rm -rf /",
        "foo fabrics=",
        "foo ^[virtuals mpi] openmpi",
    ],
)
def test_spec_checker_rejects_invalid_specs(text: str) -> None:
    with pytest.raises(SpecSyntaxError):
        parse_spec(text)


def test_every_spec_string_of_spack_yaml_parses(env: dict[str, Any]) -> None:
    defined = {name for d in env["spack"].get("definitions", []) for name in d if name != "when"}
    problems = []
    checked = 0
    for where, text in spec_strings(env):
        if text.startswith("$"):
            if text.lstrip("$^%").strip("{}") not in defined:
                problems.append(f"{where}: {text!r} names no definition (defined: {sorted(defined)})")
            continue
        try:
            parse_spec(text)
            checked += 1
        except SpecSyntaxError as exc:
            problems.append(f"{where}: {exc}")
    assert not problems, "\n".join(problems)
    assert checked >= 10, f"only {checked} spec strings found: is the walker out of date?"
