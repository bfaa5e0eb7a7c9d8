"""No import circle anywhere in the project: every import counts, at module level, inside functions
(lazy) and under ``TYPE_CHECKING``. A circle hidden behind a lazy import still ties two modules into
one idea; the layers of docs/architecture.md hold only while the graph has none.

The graph is built from the sources (``ast``), so the test needs none of the optional installs."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("aiokv", "benchmarks", "examples")


def _modules() -> dict[str, Path]:
    """Every module of the project's packages, by dotted name (a package by its ``__init__``)."""
    found: dict[str, Path] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _imported(name: str, path: Path, modules: dict[str, Path]) -> Iterator[str]:
    """The project modules ``name`` (at ``path``) imports anywhere in its source."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                source = ".".join([*base, *([node.module] if node.module else [])])
            else:
                source = node.module or ""
            # ``from pkg import sub`` imports the submodule ``pkg.sub``; any other name, ``pkg`` itself.
            targets = [
                f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules else source
                for alias in node.names
            ]
        else:
            continue
        for target in targets:
            # ``import a.b.c`` runs ``a.b.c``; the nearest project module is the one that counts.
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                yield target


def _import_graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: set(_imported(name, path, modules)) for name, path in modules.items()}


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    circles.append(sorted(component))
    return circles


def test_the_project_has_no_import_circle() -> None:
    graph = _import_graph()
    assert len(graph) > 100  # the walk found the project, not an empty folder
    circles = _circles(graph)
    assert not circles, "modules importing each other (directly or through others): " + "; ".join(
        " <-> ".join(circle) for circle in circles
    )


def test_the_vllm_integration_sides_import_only_shared_data() -> None:
    """The scheduler's modules never import the workers' and the other way round; the shared data
    (``common``) imports neither side; only the connector facade sees both."""
    graph = _import_graph()
    prefix = "aiokv.integrations.vllm."
    sides = {"scheduler_side": "worker_side", "worker_side": "scheduler_side", "common": None}
    crossings = []
    for name, imports in graph.items():
        if not name.startswith(prefix):
            continue
        part = name[len(prefix) :].split(".")[0]
        if part not in sides:
            continue
        forbidden = {sides[part]} if sides[part] else {"scheduler_side", "worker_side", "connector"}
        crossings += [
            f"{name} -> {target}"
            for target in imports
            if target.startswith(prefix) and target[len(prefix) :].split(".")[0] in forbidden
        ]
    assert not crossings, crossings


@pytest.mark.parametrize(
    ("graph", "expected"),
    [
        ({"a": {"b"}, "b": {"c"}, "c": set()}, []),
        ({"a": {"b"}, "b": {"a"}, "c": {"a"}}, [["a", "b"]]),
        ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"d"}}, [["a", "b", "c"]]),
    ],
)
def test_the_circle_finder_finds_circles(graph: dict[str, set[str]], expected: list[list[str]]) -> None:
    assert _circles(graph) == expected


def test_lazy_and_type_checking_imports_count(tmp_path: Path) -> None:
    """An import inside a function or under ``TYPE_CHECKING`` is an edge like any other."""
    modules = {"pkg": tmp_path / "__init__.py", "pkg.a": tmp_path / "a.py", "pkg.b": tmp_path / "b.py"}
    modules["pkg.a"].write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import X\n")
    modules["pkg.b"].write_text("def f():\n    from pkg import a\n    return a\n")
    modules["pkg"].write_text("")
    assert set(_imported("pkg.a", modules["pkg.a"], modules)) == {"pkg.b"}
    assert set(_imported("pkg.b", modules["pkg.b"], modules)) == {"pkg.a"}
