"""The product code (``proxy/``, ``preprocessors/``) imports in layers: no module imports, however indirectly,
a module that imports it back.

Every ``import`` and ``from ... import`` statement of every module counts, wherever it stands: at the top, inside
a function (an import deferred to run time still ties the two modules together, and only hides the cycle from
the reader) and inside ``if TYPE_CHECKING:`` (a type one module names is part of what it depends on; mypy and
the reader follow it like any other). Names imported from a package count as an import of the submodule of
that name where there is one (``from proxy.edge import paths``), else of the package. Importing a module also
runs its packages' ``__init__``, so those count too, except a module's own packages: they are being imported
already when it runs (a package's ``__init__`` that re-exports its submodules is no cycle).
``importlib.import_module`` with a computed name is not seen; the product uses it only for third-party modules
(transformers, numpy, av).
"""

from __future__ import annotations

import ast
from pathlib import Path

from bench.staleness import imports_in, with_packages

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("proxy", "preprocessors")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(path): path for package in PACKAGES for path in sorted((ROOT / package).rglob("*.py"))}


def _imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The modules of ours that module ``name`` imports, less its own packages."""
    tree = ast.parse(path.read_text(), str(path))
    return imports_in(tree, name, path.name == "__init__.py", known) - set(with_packages(name, known))


def import_graph() -> dict[str, set[str]]:
    known = _modules()
    return {name: _imports(name, path, known) for name, path in known.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as the modules along it, the first repeated at the end; None when there is none."""
    done: set[str] = set()
    for start in sorted(graph):
        if start in done:
            continue
        path: list[str] = []
        on_path: dict[str, int] = {}
        stack: list[tuple[str, list[str]]] = [(start, sorted(graph[start]))]
        path.append(start)
        on_path[start] = 0
        while stack:
            node, todo = stack[-1]
            if not todo:
                stack.pop()
                path.pop()
                del on_path[node]
                done.add(node)
                continue
            nxt = todo.pop(0)
            if nxt in on_path:
                return [*path[on_path[nxt]:], nxt]
            if nxt in done or nxt not in graph:
                continue
            on_path[nxt] = len(path)
            path.append(nxt)
            stack.append((nxt, sorted(graph[nxt])))
    return None


def test_find_cycle_names_the_modules_along_a_cycle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_the_product_modules_import_without_a_cycle() -> None:
    graph = import_graph()
    assert "proxy.pipeline" in graph and "preprocessors.base" in graph
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])
