"""What the Spack tests share: the files they read, the environment, and a spec-string checker.

The checker is a small tokenizer that follows the grammar of Spack's
`spec_parser.py`: name, `@` versions and ranges, `+`/`~`/`-` variants,
`key=value`, `^` and `%` dependencies with optional `[...]` edge attributes.
Spack cannot be installed where CI runs; docs/spack.md says what these tests
check instead (test_spack_schema, test_spack_specs, test_spack_env,
test_spack_recipe).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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


def load_env() -> dict[str, Any]:
    """spack.yaml, parsed."""
    with SPACK_YAML.open() as f:
        return yaml.safe_load(f)


def read_pyproject() -> dict[str, Any]:
    return tomllib.loads(PYPROJECT.read_text())


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


def spec_strings(env: dict[str, Any]) -> Iterator[tuple[str, str]]:
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
