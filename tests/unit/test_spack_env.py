"""spack.yaml: the packages it promises, its MOE_A2A_FABRIC and MOE_A2A_CUDA switches, this checkout."""

from __future__ import annotations

import re
from typing import Any

import pytest
import yaml
from spack_check import (
    RECIPE,
    REPO_DIR,
    SPACK_YAML,
    SpecNode,
    load_env,
    parse_spec,
    read_pyproject,
    spec_strings,
)

# fmt: off
#: Root specs spack.yaml must have: the build and run dependencies the issue names.
PROMISED_ROOTS = (
    "moe-a2a", "cmake", "libfabric", "rdma-core", "openmpi", "py-mpi4py", "py-h5py", "py-torch",
    "py-nanobind", "py-scikit-build-core",
)
# fmt: on


@pytest.fixture(scope="module")
def env() -> dict[str, Any]:
    return load_env()


def test_environment_lists_the_promised_packages(env: dict[str, Any]) -> None:
    """The build and run dependencies the issue names are roots of the environment."""
    roots: dict[str, list[SpecNode]] = {}
    for _, text in spec_strings(env):
        if not text.startswith("$"):
            node = parse_spec(text)[0]
            if node.name:
                roots.setdefault(node.name, []).append(node)
    for name in PROMISED_ROOTS:
        assert name in roots, f"spack.yaml: no root spec for {name}"
    # Over all MOE_A2A_FABRIC choices; each choice's own fabrics: test_fabric_is_a_switch_of_the_environment.
    fabrics = {
        f
        for node in roots["libfabric"]
        for a in node.attributes
        if a.startswith("fabrics=")
        for f in a.split("=", 1)[1].split(",")
    }
    assert fabrics >= {"efa", "tcp", "shm", "verbs", "rxm"}, fabrics


def _chosen(env: dict[str, Any], name: str, environ: dict[str, str]) -> list[list[str]]:
    """The lists definition `name` gets under `environ` (`when` evaluated with eval(), as Spack does)."""
    return [
        d[name]
        for d in env["spack"]["definitions"]
        if name in d and eval(d.get("when", "True"), {"env": environ, "re": re})
    ]


@pytest.mark.parametrize(
    ("value", "variants", "libfabric", "rdma_core"),
    [
        (None, {"~efa", "~verbs"}, {"rxm", "shm", "tcp"}, False),
        ("cpu", {"~efa", "~verbs"}, {"rxm", "shm", "tcp"}, False),
        ("efa", {"+efa", "~verbs"}, {"efa", "rxm", "shm", "tcp"}, False),
        ("cx7", {"~efa", "+verbs"}, {"rxm", "shm", "tcp", "verbs"}, True),
    ],
)
def test_fabric_is_a_switch_of_the_environment(
    env: dict[str, Any], value: str | None, variants: set[str], libfabric: set[str], rdma_core: bool
) -> None:
    """MOE_A2A_FABRIC picks EFA, CX7 or CPU without editing spack.yaml; unset is CPU (no RDMA libraries)."""
    environ = {} if value is None else {"MOE_A2A_FABRIC": value}
    fabric, libs = _chosen(env, "fabric", environ), _chosen(env, "fabric_libs", environ)
    assert len(fabric) == 1 and len(libs) == 1, (value, fabric, libs)
    assert set(parse_spec(fabric[0][0])[0].attributes) == variants
    nodes = [parse_spec(text)[0] for text in libs[0]]
    (lf,) = [n for n in nodes if n.name == "libfabric"]
    fabrics = next(a for a in lf.attributes if a.startswith("fabrics="))
    assert set(fabrics.split("=", 1)[1].split(",")) == libfabric
    assert any(n.name == "rdma-core" for n in nodes) == rdma_core
    assert not _chosen(env, "fabric", {"MOE_A2A_FABRIC": "no-such-fabric"})
    matrix = next(s["matrix"] for s in env["spack"]["specs"] if isinstance(s, dict))
    assert ["$fabric"] in matrix and "$fabric_libs" in env["spack"]["specs"]
    # moe-a2a's own row names no fabric: the definition is the one place.
    moe_row = next(row for row in matrix if row[0].startswith("moe-a2a"))
    assert moe_row == ["moe-a2a"], moe_row


def test_cuda_is_a_switch_of_the_environment(env: dict[str, Any]) -> None:
    """MOE_A2A_CUDA=1 selects +cuda; otherwise ~cuda (the definitions' `when`, evaluated as Spack does)."""
    for value, expected in (("1", "+cuda"), ("0", "~cuda"), (None, "~cuda")):
        environ = {} if value is None else {"MOE_A2A_CUDA": value}
        chosen = [
            spec
            for d in env["spack"]["definitions"]
            # Spack evaluates `when` with eval() too, with `env` bound to os.environ.
            if "accelerator" in d and eval(d.get("when", "True"), {"env": environ, "re": re})
            for spec in d["accelerator"]
        ]
        assert len(chosen) == 1 and chosen[0].startswith(expected), (value, chosen)
    matrix = next(s["matrix"] for s in env["spack"]["specs"] if isinstance(s, dict))
    assert ["$accelerator"] in matrix and any(row[0].startswith("moe-a2a") for row in matrix)


def test_environment_points_at_this_checkout(env: dict[str, Any]) -> None:
    spack = env["spack"]
    repos = spack["repos"]
    paths = repos if isinstance(repos, list) else list(repos.values())
    assert "$env/spack/repo" in paths, repos
    assert (REPO_DIR / "repo.yaml").is_file() and RECIPE.is_file()
    develop = spack["develop"]["moe-a2a"]
    assert (SPACK_YAML.parent / develop["path"] / "pyproject.toml").is_file()
    node = parse_spec(develop["spec"])[0]
    project_version = read_pyproject()["project"]["version"]
    assert node.name == "moe-a2a" and node.version == f"@={project_version}", (
        f"develop spec {develop['spec']!r}: expected moe-a2a@={project_version} (pyproject.toml)"
    )


def test_repo_yaml() -> None:
    with (REPO_DIR / "repo.yaml").open() as f:
        repo = yaml.safe_load(f)["repo"]
    assert re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", repo["namespace"]), repo
    # Package API v1 layout: packages/<package-name>/package.py
    assert "api" not in repo or repo["api"].startswith("v1."), repo
    names = [p.parent.name for p in (REPO_DIR / "packages").glob("*/package.py")]
    assert names == ["moe-a2a"], names
