"""The package's modules import each other in one direction only (no import circles).

Reads every `import` of the package's modules, at the top and inside functions,
and looks for circles through the command-line side: `cli`, `usage`,
`trace_tools`, `report`, `bench.*` and the `run` driver's modules.
"""

from __future__ import annotations

import ast
from pathlib import Path

import moe_a2a
from moe_a2a.bench import common

PACKAGE = Path(moe_a2a.__file__).parent
CLI_SIDE = ("moe_a2a.cli", "moe_a2a.usage", "moe_a2a.trace_tools", "moe_a2a.report", "moe_a2a.bench.")
CLI_SIDE += ("moe_a2a.layers.driver", "moe_a2a.layers.run_")


def _module_name(path: Path) -> str:
    parts = ["moe_a2a", *path.relative_to(PACKAGE).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            edges |= {t for t in targets if t in modules and t != name}
        graph[name] = edges
    return graph


def _circles_through(graph: dict[str, set[str]], prefixes: tuple[str, ...]) -> list[list[str]]:
    """Every circle (as a path back to its start) that starts at a module named by `prefixes`."""
    found = []
    for start in sorted(m for m in graph if m.startswith(prefixes)):
        stack, seen = [(start, [start])], set()
        while stack:
            node, path = stack.pop()
            for nxt in graph[node]:
                if nxt == start:
                    found.append([*path, start])
                elif nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, [*path, nxt]))
    return found


def test_no_import_circle_through_the_command_line_side() -> None:
    circles = _circles_through(_import_graph(), CLI_SIDE)
    assert not circles, "import circles: " + "; ".join(" -> ".join(c) for c in circles[:5])


def test_the_graph_sees_lazy_imports() -> None:
    """The check reads imports inside functions too (the CLI's are lazy, for a fast --help)."""
    graph = _import_graph()
    assert "moe_a2a.layers.run_infer" in graph["moe_a2a.layers.driver"]  # imported inside _run
    assert "moe_a2a.bench.common" in graph["moe_a2a.bench.engine_ref"]


def test_elapsed_ns_on_the_host_clock() -> None:
    """Without a CUDA device the one clock is perf_counter: a call's time, and its result."""
    result, ns = common.elapsed_ns(lambda: sum(range(200_000)))
    assert result == sum(range(200_000))
    assert 0 < ns < 5e9


def test_no_import_circle_between_any_modules() -> None:
    """No module of the package reaches itself again through others' imports. The package's
    `__init__` is left out: it re-exports the public names, and `from moe_a2a import _core`
    names the compiled module, not the front end."""
    graph = {m: edges - {"moe_a2a"} for m, edges in _import_graph().items() if m != "moe_a2a"}
    circles = _circles_through(graph, ("moe_a2a.",))
    assert not circles, "import circles: " + "; ".join(" -> ".join(c) for c in circles[:5])
