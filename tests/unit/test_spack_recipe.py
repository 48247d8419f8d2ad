"""The recipe spack/repo/packages/moe-a2a/package.py, imported with a stub `spack.package`.

The stub records the directives. Checked: the variants and dependencies
docs/spack.md promises, version floors equal to pyproject.toml's, and the CMake
options it passes matching CMakeLists.txt.
"""

from __future__ import annotations

import contextlib
import importlib.util
import re
import sys
import types
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from spack_check import (
    CMAKELISTS,
    RECIPE,
    ROOT,
    SPACK_DOC,
    SpecNode,
    SpecSyntaxError,
    parse_spec,
    read_pyproject,
)

# fmt: off
#: Dependencies of the recipe that docs/spack.md promises.
PROMISED_DEPENDENCIES = (
    "cmake", "python", "py-scikit-build-core", "py-nanobind", "pkgconfig", "libfabric", "rdma-core",
    "mpi", "py-mpi4py", "py-numpy", "py-torch", "py-h5py", "py-tabulate", "py-tqdm", "py-matplotlib", "cuda",
)
# fmt: on


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
    assert licenses == [read_pyproject()["project"]["license"]], licenses
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
    pyproject = read_pyproject()
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
