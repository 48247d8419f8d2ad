"""What CI can check of the Spack support without Spack (it cannot be installed here).

- `spack.yaml` against a JSON Schema that follows Spack's environment schema for
  the sections this project uses. It was written from Spack's own schema modules
  (`lib/spack/spack/schema/`: env.py, merged.py, spec_list.py, definitions.py,
  develop.py, view.py, concretizer.py, packages.py, repos.py, config.py) and
  keeps to what Spack 0.22 through 1.x all accept: the top level allows exactly
  Spack's section names, so a misspelt section fails here as it would in Spack.
- Every spec string (in `spack.yaml` and in the recipe) with a small tokenizer
  that follows the grammar of Spack's `spec_parser.py`: name, `@` versions and
  ranges, `+`/`~`/`-` variants, `key=value`, `^` and `%` dependencies with
  optional `[...]` edge attributes.
- The recipe `spack/repo/packages/moe-a2a/package.py`, imported with a stub
  `spack.package` that records the directives: the variants and dependencies
  docs/spack.md promises, version floors equal to pyproject.toml's, and the CMake
  options it passes matching CMakeLists.txt.

Concretizing the environment needs Spack and a network: see docs/spack.md.
"""

from __future__ import annotations

import contextlib
import importlib.util
import re
import sys
import types
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

if sys.version_info >= (3, 11):
    import tomllib
else:  # pytest itself depends on tomli before Python 3.11
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
SPACK_YAML = ROOT / "spack.yaml"
REPO_DIR = ROOT / "spack" / "repo"
RECIPE = REPO_DIR / "packages" / "moe-a2a" / "package.py"
PYPROJECT = ROOT / "pyproject.toml"
CMAKELISTS = ROOT / "CMakeLists.txt"
SPACK_DOC = ROOT / "docs" / "spack.md"

# fmt: off
#: Root specs spack.yaml must have: the build and run dependencies the issue names.
PROMISED_ROOTS = (
    "moe-a2a", "cmake", "libfabric", "rdma-core", "openmpi", "py-mpi4py", "py-h5py", "py-torch",
    "py-nanobind", "py-scikit-build-core",
)
#: Dependencies of the recipe that docs/spack.md promises.
PROMISED_DEPENDENCIES = (
    "cmake", "python", "py-scikit-build-core", "py-nanobind", "pkgconfig", "libfabric", "rdma-core",
    "mpi", "py-mpi4py", "py-numpy", "py-torch", "py-h5py", "py-tabulate", "py-tqdm", "py-matplotlib", "cuda",
)
# fmt: on


# =============================================================================== schema

_STRINGS = {"type": "array", "items": {"type": "string"}}

#: A list of specs: strings, nulls, or a matrix (spec_list.py).
_SPEC_LIST: dict[str, Any] = {
    "type": "array",
    "items": {
        "anyOf": [
            {"type": "string"},
            {"type": "null"},
            {
                "type": "object",
                "additionalProperties": False,
                "properties": {
                    "matrix": {"type": "array", "items": _STRINGS},
                    "exclude": _STRINGS,
                },
            },
        ]
    },
}

#: packages:<name>:require (packages.py): one spec, or a list of specs / groups.
_REQUIRE = {
    "oneOf": [
        {"type": "string"},
        {
            "type": "array",
            "items": {
                "oneOf": [
                    {"type": "string"},
                    {
                        "type": "object",
                        "additionalProperties": False,
                        "properties": {
                            "one_of": _STRINGS,
                            "any_of": _STRINGS,
                            "spec": {"type": "string"},
                            "message": {"type": "string"},
                            "when": {"type": "string"},
                        },
                    },
                ]
            },
        },
    ]
}

_PREFER = {
    "type": "array",
    "items": {
        "oneOf": [
            {"type": "string"},
            {
                "type": "object",
                "additionalProperties": False,
                "properties": {
                    "spec": {"type": "string"},
                    "message": {"type": "string"},
                    "when": {"type": "string"},
                },
            },
        ]
    },
}

_PERMISSIONS = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "read": {"enum": ["user", "group", "world"]},
        "write": {"enum": ["user", "group", "world"]},
        "group": {"type": "string"},
    },
}

_VARIANTS = {"oneOf": [{"type": "string"}, _STRINGS]}

_COMMON_PACKAGE_KEYS: dict[str, Any] = {
    "require": _REQUIRE,
    "prefer": _PREFER,
    "conflict": _PREFER,
    "buildable": {"type": "boolean"},
    "permissions": _PERMISSIONS,
    "package_attributes": {"type": "object"},
    "variants": _VARIANTS,
}

_PACKAGES = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "all": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                **_COMMON_PACKAGE_KEYS,
                "target": _STRINGS,
                "compiler": _STRINGS,
                "providers": {
                    "type": "object",
                    "additionalProperties": False,
                    "patternProperties": {r"^\w[\w-]*$": _STRINGS},
                },
            },
        }
    },
    "patternProperties": {
        r"^(?!all$)\w[\w-]*$": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                **_COMMON_PACKAGE_KEYS,
                "version": {"type": "array", "items": {"type": ["string", "number"]}},
                "externals": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "required": ["spec"],
                        "properties": {
                            "spec": {"type": "string"},
                            "prefix": {"type": "string"},
                            "modules": _STRINGS,
                            "extra_attributes": {"type": "object"},
                        },
                    },
                },
            },
        }
    },
}

_CONCRETIZER = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "reuse": {"oneOf": [{"type": "boolean"}, {"enum": ["dependencies"]}, {"type": "object"}]},
        "unify": {"oneOf": [{"type": "boolean"}, {"enum": ["when_possible"]}]},
        "enable_node_namespace": {"type": "boolean"},
        "targets": {
            "type": "object",
            "properties": {
                "host_compatible": {"type": "boolean"},
                "granularity": {"enum": ["generic", "microarchitectures"]},
            },
        },
        "duplicates": {
            "type": "object",
            "properties": {"strategy": {"enum": ["none", "minimal", "full"]}},
        },
        "splice": {"type": "object"},
        "static_analysis": {"type": "boolean"},
        "timeout": {"type": "integer", "minimum": 0},
        "error_on_timeout": {"type": "boolean"},
        "os_compatible": {"type": "object"},
    },
}

_VIEW = {
    "anyOf": [
        {"type": "boolean"},
        {"type": "string"},
        {
            "type": "object",
            "additionalProperties": {
                "type": "object",
                "required": ["root"],
                "additionalProperties": False,
                "properties": {
                    "root": {"type": "string"},
                    "link": {"enum": ["roots", "all", "run"]},
                    "link_type": {"enum": ["symlink", "hardlink", "copy"]},
                    "select": _STRINGS,
                    "exclude": _STRINGS,
                    "projections": {"type": "object"},
                },
            },
        },
    ]
}

#: repos: a list of paths (every version), or namespace -> path (Spack 1.x).
_REPOS = {
    "anyOf": [
        _STRINGS,
        {"type": "object", "additionalProperties": {"type": ["string", "object"]}},
    ]
}

_DEVELOP = {
    "type": "object",
    "additionalProperties": False,
    "patternProperties": {
        r"^\w[\w-]*$": {
            "type": "object",
            "additionalProperties": False,
            "required": ["spec"],
            "properties": {"spec": {"type": "string"}, "path": {"type": "string"}},
        }
    },
}

_DEFINITIONS = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {"when": {"type": "string"}},
        "additionalProperties": _SPEC_LIST,
        "minProperties": 1,
    },
}

# Spack's config.yaml keys (schema/config.py).
# fmt: off
_CONFIG_KEYS = [
    "shared_linking", "install_tree", "install_hash_length", "build_stage", "test_stage", "stage_name",
    "extensions", "template_dirs", "license_dir", "source_cache", "misc_cache", "environments_root",
    "connect_timeout", "verify_ssl", "ssl_certs", "suppress_gpg_warnings", "debug", "checksum",
    "deprecated", "locks", "dirty", "build_language", "build_jobs", "concurrent_packages", "ccache",
    "db_lock_timeout", "package_lock_timeout", "allow_sgid", "install_status", "binary_index_ttl",
    "flags", "aliases", "url_fetch_method", "additional_external_search_paths",
]
# fmt: on

# fmt: off
#: The other sections Spack accepts in an environment (merged.py), checked by name only.
_OTHER_SECTIONS = (
    "bootstrap", "cdash", "ci", "compilers", "container", "mirrors", "modules", "upstreams",
    "toolchains", "env_vars",
)
# fmt: on

#: The `spack:` mapping of an environment file (env.py = merged.py sections + env-only ones).
SPACK_ENV_SCHEMA: dict[str, Any] = {
    "$schema": "http://json-schema.org/draft-07/schema#",
    "title": "Spack environment file, the sections moe-a2a uses (after Spack's schema/env.py)",
    "type": "object",
    "additionalProperties": False,
    "required": ["spack"],
    "properties": {
        "spack": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                # checked in depth: what this project's spack.yaml uses or is likely to
                "specs": _SPEC_LIST,
                "definitions": _DEFINITIONS,
                "view": _VIEW,
                "concretizer": _CONCRETIZER,
                "packages": _PACKAGES,
                "repos": _REPOS,
                "develop": _DEVELOP,
                "include": _STRINGS,
                "include_concrete": _STRINGS,
                "config": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {key: {} for key in _CONFIG_KEYS},
                },
                # the other configuration sections Spack accepts here, by name only
                **{section: {"type": "object"} for section in _OTHER_SECTIONS},
            },
        }
    },
}


def _schema_errors(document: Any) -> list[str]:
    validator = jsonschema.Draft7Validator(SPACK_ENV_SCHEMA)
    return [
        f"spack.yaml: {'/'.join(str(p) for p in error.absolute_path) or '(top)'}: {error.message}"
        for error in sorted(validator.iter_errors(document), key=lambda e: list(map(str, e.path)))
    ]


@pytest.fixture(scope="module")
def env() -> dict[str, Any]:
    with SPACK_YAML.open() as f:
        return yaml.safe_load(f)


def test_schema_itself_is_valid() -> None:
    jsonschema.Draft7Validator.check_schema(SPACK_ENV_SCHEMA)


def test_spack_yaml_matches_the_environment_schema(env: dict[str, Any]) -> None:
    errors = _schema_errors(env)
    assert not errors, "\n".join(errors)


@pytest.mark.parametrize(
    ("mutate", "what"),
    [
        (lambda s: s.update(spec=s.pop("specs")), "misspelt section 'spec'"),
        (lambda s: s["concretizer"].update(unify="yes"), "unify must be a boolean or when_possible"),
        (lambda s: s.update(view={"default": {"link": "roots"}}), "a view needs a root"),
        (lambda s: s["develop"]["moe-a2a"].pop("spec"), "a develop entry needs a spec"),
        (lambda s: s["packages"].update(libfabric={"varients": "fabrics=efa"}), "unknown package key"),
        (lambda s: s["specs"].append({"matrix": "moe-a2a"}), "a matrix is a list of lists"),
        (lambda s: s.update(repos="spack/repo"), "repos is a list or a mapping"),
    ],
)
def test_schema_rejects_broken_environments(env: dict[str, Any], mutate: Any, what: str) -> None:
    """The schema is strict enough to catch the mistakes people make in spack.yaml."""
    import copy

    broken = copy.deepcopy(env)
    mutate(broken["spack"])
    assert _schema_errors(broken), f"schema accepted: {what}"


# =============================================================================== spec syntax


class SpecSyntaxError(ValueError):
    pass


_ID = r"[A-Za-z0-9_][A-Za-z0-9_-]*"
_NAME = rf"{_ID}(?:\.{_ID})*"
_VERSION = r"=?[A-Za-z0-9_][A-Za-z0-9_.-]*"
_VERSION_ITEM = rf"(?:(?:{_VERSION})?:(?:{_VERSION})?|{_VERSION})"
_GIT_VERSION = rf"(?:git\.[A-Za-z0-9_][A-Za-z0-9_./-]*|[0-9a-fA-F]{{40}})(?:={_VERSION})?"
# Bare values are stricter than Spack's (no '=', '%', '^', '~'): anything odd must be quoted.
_VALUE = r"(?:[A-Za-z0-9_.,:+*/-]+|'[^']*'|\"[^\"]*\")"
_VIRTUAL_ASSIGNMENT = rf"{_ID}(?:,{_ID})*={_NAME}"

_TOKENS = [
    ("WS", r"\s+"),
    # ^[virtuals=mpi] / %[deptypes=build] edge attributes, then the node
    ("EDGE", rf"(?:\^|%%?)\[(?P<edge>[^\]]*)\](?:\s*(?P<edge_assign>{_VIRTUAL_ASSIGNMENT}))?"),
    # ^name, %name, %c,cxx=gcc (a virtual assigned to a package)
    ("DEP", rf"(?:\^|%%?)(?:\s*(?P<dep_assign>{_VIRTUAL_ASSIGNMENT}))?"),
    ("VERSION", rf"@\s*(?:{_GIT_VERSION}|{_VERSION_ITEM}(?:\s*,\s*{_VERSION_ITEM})*)"),
    ("BOOL", rf"(?:\+\+|~~|--|[+~-])\s*{_ID}"),
    ("KEY_VALUE", rf"{_ID}:?==?{_VALUE}"),
    ("NAME", rf"{_NAME}|\*"),
]
_TOKENIZER = re.compile("|".join(f"(?P<{kind}>{rx})" for kind, rx in _TOKENS))


@dataclass
class SpecNode:
    name: str | None = None
    version: str | None = None
    attributes: list[str] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return self.name is None and self.version is None and not self.attributes


def _fail(text: str, pos: int, why: str) -> SpecSyntaxError:
    return SpecSyntaxError(f"{why}\n  {text}\n  {' ' * pos}^")


def parse_spec(text: str) -> list[SpecNode]:
    """Check one spec string; returns its nodes (root first). Raises SpecSyntaxError."""
    if not isinstance(text, str) or not text.strip():
        raise SpecSyntaxError(f"expected a spec string, got {text!r}")
    nodes = [SpecNode()]
    pos = 0
    while pos < len(text):
        match = _TOKENIZER.match(text, pos)
        if match is None or match.end() == pos:
            raise _fail(text, pos, "unexpected character")
        kind, value, start, pos = match.lastgroup, match.group(), match.start(), match.end()
        node = nodes[-1]
        if kind == "WS":
            continue
        if kind in ("EDGE", "DEP"):
            if node.empty:
                raise _fail(text, start, "a dependency sigil must follow a package or its attributes")
            if kind == "EDGE":
                for item in filter(None, (s.strip() for s in match.group("edge").split())):
                    if not re.fullmatch(rf"{_ID}={_VALUE}", item):
                        raise _fail(text, start, f"bad edge attribute {item!r}")
            assigned = match.group("edge_assign") or match.group("dep_assign")
            new = SpecNode()
            if assigned:
                new.name = assigned.split("=", 1)[1]
            nodes.append(new)
        elif kind == "NAME":
            if not node.empty:
                raise _fail(text, start, "a name must come first in its node (two specs in one string?)")
            node.name = value
        elif kind == "VERSION":
            if node.version is not None:
                raise _fail(text, start, "a node has at most one version constraint")
            node.version = value
        else:  # BOOL, KEY_VALUE
            node.attributes.append(value)
    if nodes[-1].empty:
        raise _fail(text, len(text), "the spec ends with a dependency sigil and no package")
    for node in nodes[1:]:
        if node.name is None:
            raise SpecSyntaxError(f"a dependency without a package name in {text!r}")
    return nodes


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


def _spec_strings(env: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(where, spec) for every spec string of the environment; `$name` references excluded."""
    spack = env["spack"]

    def spec_list(where: str, items: list[Any]) -> Iterator[tuple[str, str]]:
        for i, item in enumerate(items):
            if isinstance(item, str):
                yield f"{where}[{i}]", item
            elif isinstance(item, dict):
                for j, row in enumerate(item.get("matrix", [])):
                    for k, s in enumerate(row):
                        yield f"{where}[{i}].matrix[{j}][{k}]", s
                for j, s in enumerate(item.get("exclude", [])):
                    yield f"{where}[{i}].exclude[{j}]", s

    yield from spec_list("specs", spack.get("specs", []))
    for i, definition in enumerate(spack.get("definitions", [])):
        for name, items in definition.items():
            if name != "when":
                yield from spec_list(f"definitions[{i}].{name}", items)
    for pkg, conf in spack.get("packages", {}).items():
        require = conf.get("require", [])
        for i, req in enumerate([require] if isinstance(require, str) else require):
            if isinstance(req, str):
                yield f"packages.{pkg}.require[{i}]", req
            else:
                for key in ("spec", "when"):
                    if key in req:
                        yield f"packages.{pkg}.require[{i}].{key}", req[key]
                for key in ("one_of", "any_of"):
                    for j, s in enumerate(req.get(key, [])):
                        yield f"packages.{pkg}.require[{i}].{key}[{j}]", s
        for key in ("prefer", "conflict"):
            for i, item in enumerate(conf.get(key, [])):
                yield f"packages.{pkg}.{key}[{i}]", item if isinstance(item, str) else item["spec"]
        for virtual, providers in conf.get("providers", {}).items():
            for i, s in enumerate(providers):
                yield f"packages.{pkg}.providers.{virtual}[{i}]", s
        for i, external in enumerate(conf.get("externals", [])):
            yield f"packages.{pkg}.externals[{i}].spec", external["spec"]
    for name, entry in spack.get("develop", {}).items():
        yield f"develop.{name}.spec", entry["spec"]


def test_every_spec_string_of_spack_yaml_parses(env: dict[str, Any]) -> None:
    defined = {name for d in env["spack"].get("definitions", []) for name in d if name != "when"}
    problems = []
    checked = 0
    for where, text in _spec_strings(env):
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


def test_environment_lists_the_promised_packages(env: dict[str, Any]) -> None:
    """The build and run dependencies the issue names are roots of the environment."""
    roots: dict[str, list[SpecNode]] = {}
    for _, text in _spec_strings(env):
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
    project_version = tomllib.loads(PYPROJECT.read_text())["project"]["version"]
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


# =============================================================================== recipe


@dataclass
class Directive:
    kind: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    when: tuple[str, ...]

    @property
    def condition(self) -> str | None:
        """The `when` of the directive: its own and the enclosing `with when(...)`, joined."""
        parts = [*self.when, *([self.kwargs["when"]] if "when" in self.kwargs else [])]
        return " ".join(parts) or None


# fmt: off
#: Directives the stub records (the recipe may use any of them).
_DIRECTIVES = (
    "version", "variant", "depends_on", "conflicts", "license", "maintainers", "extends", "requires",
    "provides", "patch", "resource", "build_system",
)
# fmt: on


def _stub_spack_package(record: list[Directive]) -> types.ModuleType:
    """A fake `spack.package`: base classes and directives that only record what they are given."""
    module = types.ModuleType("spack.package")
    when_stack: list[str] = []

    def directive(kind: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> None:
            record.append(Directive(kind, args, kwargs, tuple(when_stack)))

        return call

    @contextlib.contextmanager
    def when(condition: str) -> Iterator[None]:
        record.append(Directive("when", (condition,), {}, tuple(when_stack)))
        when_stack.append(condition)
        try:
            yield
        finally:
            when_stack.pop()

    class PythonPackage:
        pass

    class CudaPackage:
        cuda_arch_values = ("70", "80", "90", "100")

    names = {"PythonPackage": PythonPackage, "CudaPackage": CudaPackage, "when": when}
    for kind in _DIRECTIVES:
        names[kind] = directive(kind)
    for name, value in names.items():
        setattr(module, name, value)
    module.__all__ = list(names)
    return module


@pytest.fixture(scope="module")
def recipe() -> tuple[type, list[Directive], types.ModuleType]:
    record: list[Directive] = []
    stub = _stub_spack_package(record)
    spack_module = types.ModuleType("spack")
    spack_module.package = stub  # type: ignore[attr-defined]
    saved = {name: sys.modules.get(name) for name in ("spack", "spack.package")}
    sys.modules["spack"], sys.modules["spack.package"] = spack_module, stub
    try:
        spec = importlib.util.spec_from_file_location("spack_recipe_moe_a2a", RECIPE)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        for name, old in saved.items():
            if old is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = old
    # Spack's rule for the class name: capitalise the parts of the package name.
    class_name = "".join(part.capitalize() for part in re.split(r"[-_]+", RECIPE.parent.name))
    assert hasattr(module, class_name), f"{RECIPE}: expected a class named {class_name}"
    return getattr(module, class_name), record, stub


def _depends(record: list[Directive]) -> list[tuple[SpecNode, Directive]]:
    return [(parse_spec(d.args[0])[0], d) for d in record if d.kind == "depends_on"]


def test_recipe_spec_strings_parse(recipe: tuple[type, list[Directive], types.ModuleType]) -> None:
    _, record, _ = recipe
    problems = []
    for d in record:
        texts = [d.args[0]] if d.kind in ("depends_on", "conflicts", "when") else []
        texts += [d.kwargs["when"]] if "when" in d.kwargs else []
        for text in texts:
            try:
                parse_spec(text)
            except SpecSyntaxError as exc:
                problems.append(f"{d.kind}{d.args}: {exc}")
    assert not problems, "\n".join(problems)


def test_recipe_build_system_and_variants(recipe: tuple[type, list[Directive], types.ModuleType]) -> None:
    cls, record, stub = recipe
    assert issubclass(cls, stub.PythonPackage), "scikit-build-core projects install through pip"
    assert issubclass(cls, stub.CudaPackage), "the cuda variant (and cuda_arch) come from CudaPackage"
    variants = {d.args[0]: d.kwargs for d in record if d.kind == "variant"}
    assert variants.keys() >= {"efa", "verbs", "plot"}, variants
    # A site without that NIC must not get the provider, or rdma-core, by default.
    for name in ("efa", "verbs"):
        assert variants[name].get("default") is False, f"variant {name}: expected default=False"
    for name, kwargs in variants.items():
        assert kwargs.get("description"), f"variant {name}: needs a description"
    assert any(d.kind == "conflicts" and d.args[0] == "cuda_arch=none" for d in record)


def test_recipe_metadata(recipe: tuple[type, list[Directive], types.ModuleType]) -> None:
    """homepage and git name this checkout (the project has no public address); a `main` version."""
    cls, record, _ = recipe
    assert cls.homepage == f"file://{ROOT}/README.md" and (ROOT / "README.md").is_file()
    assert cls.git == f"file://{ROOT}" and (ROOT / ".git").exists()
    versions = {d.args[0]: d.kwargs for d in record if d.kind == "version"}
    assert versions.get("main") == {"branch": "main"}, versions
    licenses = [d.args[0] for d in record if d.kind == "license"]
    assert licenses == [tomllib.loads(PYPROJECT.read_text())["project"]["license"]], licenses
    assert (ROOT / "LICENSE").is_file()


def test_recipe_dependencies(recipe: tuple[type, list[Directive], types.ModuleType]) -> None:
    _, record, _ = recipe
    deps = _depends(record)
    by_name: dict[str, list[tuple[SpecNode, Directive]]] = {}
    for node, d in deps:
        by_name.setdefault(node.name or "", []).append((node, d))
    promised = PROMISED_DEPENDENCIES
    missing = [name for name in promised if name not in by_name]
    assert not missing, f"recipe: no depends_on for {missing}"

    def fabrics(condition: str | None) -> set[str]:
        values: set[str] = set()
        for node, d in by_name["libfabric"]:
            if d.condition == condition:
                for attr in node.attributes:
                    if attr.startswith("fabrics="):
                        values |= set(attr.split("=", 1)[1].split(","))
        return values

    assert fabrics(None) >= {"tcp", "rxm", "shm"}, "tcp and shm (and rxm under tcp) are always needed"
    assert "efa" in fabrics("+efa") and "verbs" in fabrics("+verbs")
    assert all(d.condition == "+cuda" for _, d in by_name["cuda"]), "cuda only with +cuda"
    assert any("+cuda" in n.attributes for n, d in by_name["libfabric"] if d.condition == "+cuda")
    assert any("+cuda" in n.attributes for n, d in by_name["py-torch"] if d.condition == "+cuda")
    for name in ("cmake", "py-scikit-build-core", "py-nanobind", "pkgconfig"):
        assert all(d.kwargs.get("type") == "build" for _, d in by_name[name]), f"{name}: a build dependency"
    assert any("+pyproject" in n.attributes for n, _ in by_name["py-scikit-build-core"])


def _floor(node: SpecNode) -> str | None:
    """'@1.17:' -> '1.17' (the lower bound of an open range)."""
    match = re.fullmatch(r"@([0-9][0-9A-Za-z.]*):", node.version or "")
    return match.group(1) if match else None


def test_recipe_version_floors_follow_pyproject(
    recipe: tuple[type, list[Directive], types.ModuleType],
) -> None:
    """The recipe asks for the versions pyproject.toml asks pip for: one source of truth, two spellings."""
    _, record, _ = recipe
    pyproject = tomllib.loads(PYPROJECT.read_text())
    wanted: dict[str, str] = {}
    for requirement in pyproject["build-system"]["requires"] + pyproject["project"]["dependencies"]:
        match = re.fullmatch(r"([A-Za-z0-9_.-]+)\s*>=\s*([0-9.]+)", requirement)
        assert match, f"pyproject.toml: {requirement!r}: expected NAME>=VERSION"
        wanted["py-" + match.group(1).lower().replace("_", "-")] = match.group(2)
    wanted["python"] = pyproject["project"]["requires-python"].removeprefix(">=")
    wanted["cmake"] = pyproject["tool"]["scikit-build"]["cmake"]["version"].removeprefix(">=")
    floors = {node.name: _floor(node) for node, d in _depends(record) if d.condition is None}
    mismatched = {
        name: (floors.get(name), version) for name, version in wanted.items() if floors.get(name) != version
    }
    assert not mismatched, f"recipe floor vs pyproject.toml: {mismatched}"
    # The [plot] extra is the recipe's +plot variant.
    (plot,) = pyproject["project"]["optional-dependencies"]["plot"]
    match = re.fullmatch(r"([A-Za-z0-9_.-]+)\s*>=\s*([0-9.]+)", plot)
    assert match, plot
    conditional = {(n.name, d.condition): _floor(n) for n, d in _depends(record)}
    assert conditional.get((f"py-{match.group(1)}", "+plot")) == match.group(2), conditional


class _FakeSpec:
    """Just enough of a concrete Spec for config_settings()."""

    def __init__(self, cuda: bool, archs: tuple[str, ...] = ()) -> None:
        self._cuda = cuda
        self.variants = {"cuda_arch": types.SimpleNamespace(value=archs or ("none",))}

    def satisfies(self, constraint: str) -> bool:
        assert constraint in ("+cuda", "~cuda"), f"unexpected constraint {constraint!r}"
        return self._cuda == (constraint == "+cuda")

    def __getitem__(self, name: str) -> Any:
        assert name == "cuda"
        return types.SimpleNamespace(
            prefix=types.SimpleNamespace(bin=types.SimpleNamespace(nvcc="/cuda/bin/nvcc"))
        )


def test_recipe_passes_cmake_options_of_cmakelists(
    recipe: tuple[type, list[Directive], types.ModuleType],
) -> None:
    cls, _, _ = recipe
    package = cls.__new__(cls)
    gpu = package.config_settings(_FakeSpec(True, ("90", "100")), "/prefix")
    assert gpu["cmake.define.MOE_A2A_CUDA"] == "ON"
    assert gpu["cmake.define.MOE_A2A_CUDA_ARCHITECTURES"] == "90;100"
    assert gpu["cmake.define.CMAKE_CUDA_COMPILER"] == "/cuda/bin/nvcc"
    cpu = package.config_settings(_FakeSpec(False), "/prefix")
    assert cpu["cmake.define.MOE_A2A_CUDA"] == "OFF" and "cmake.define.CMAKE_CUDA_COMPILER" not in cpu
    cmakelists = CMAKELISTS.read_text()
    for key in {**gpu, **cpu}:
        if key.startswith("cmake.define.MOE_A2A_"):
            option = key.removeprefix("cmake.define.")
            assert re.search(rf"\b(option|set)\({option}\b", cmakelists), f"CMakeLists.txt has no {option}"


def test_docs_describe_the_recipe(recipe: tuple[type, list[Directive], types.ModuleType]) -> None:
    _, record, _ = recipe
    doc = SPACK_DOC.read_text()
    switches = ["cuda", "cuda_arch", "MOE_A2A_CUDA", "MOE_A2A_FABRIC"]
    for name in [d.args[0] for d in record if d.kind == "variant"] + switches:
        assert f"`{name}" in doc or f"+{name}" in doc, f"docs/spack.md does not mention {name}"
