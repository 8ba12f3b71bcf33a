"""The product code (``proxy/``, ``preprocessors/``) imports in layers: no module imports, however indirectly,
a module that imports it back, and each part of ``proxy/`` imports only the parts ``MAY_IMPORT`` says it may,
all below it.

Every ``import`` and ``from ... import`` statement of every module counts, wherever it stands: at the top, inside
a function (an import deferred to run time still ties the two modules together, and only hides the cycle from
the reader) and inside ``if TYPE_CHECKING:`` (a type one module names is part of what it depends on; mypy and
the reader follow it like any other). Names imported from a package count as an import of the submodule of
that name where there is one (``from proxy.edge import paths``), else of the package. Importing a module also
runs its packages' ``__init__``, so those count too, except a module's own packages: they are being imported
already when it runs (a package's ``__init__`` that re-exports its submodules is no cycle).
``importlib.import_module`` with a computed name is not seen; the product uses it only for third-party modules
(transformers, numpy, av).

docs/architecture.md's folder table says the same as ``MAY_IMPORT``: ``test_the_architecture_page_tells_the_layers``
reads it back.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from bench.staleness import imports_in, with_packages

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("proxy", "preprocessors")
ARCHITECTURE = ROOT / "docs" / "architecture.md"

# What each part may import of the project, from the bottom layer up: a part is a folder of ``proxy/``, a module at
# its top, or ``preprocessors`` whole (which imports nothing of ``proxy/``: the decode worker processes import it
# alone). Each part's own modules import each other freely. The table is exact: every entry is used.
MAY_IMPORT: dict[str, tuple[str, ...]] = {
    "preprocessors": (),
    "settings": (),
    "payload": ("preprocessors",),
    "admission": ("preprocessors", "settings"),
    "fetch": ("preprocessors", "payload"),
    "ops": ("admission",),
    "edge": ("preprocessors", "settings", "payload"),
    "runtime": ("settings", "edge"),
    "media": ("preprocessors", "settings", "payload", "admission", "fetch", "ops", "edge"),
    "state": ("preprocessors", "settings", "payload", "admission", "fetch", "ops", "edge", "runtime", "media"),
    "exchange": ("payload", "admission", "ops", "edge", "media"),
    "pipeline": ("preprocessors", "payload", "admission", "ops", "edge", "media", "state", "exchange"),
    "admin": ("preprocessors", "ops", "edge", "state"),
    "processes": ("preprocessors", "settings", "admission", "ops", "runtime", "state"),
    "app": ("preprocessors", "settings", "admission", "fetch", "ops", "edge", "runtime", "media", "state",
            "pipeline", "admin", "processes"),
    "serve": ("preprocessors", "settings", "edge", "runtime", "state", "processes", "app"),
    "cli": ("preprocessors", "settings", "runtime", "processes", "app", "serve"),
    "__main__": ("cli",),
}


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


def part_of(module: str) -> str | None:
    """The part of ``MAY_IMPORT`` that ``module`` belongs to; None for the ``proxy`` package itself."""
    names = module.split(".")
    if names[0] == "preprocessors":
        return "preprocessors"
    return names[1] if len(names) > 1 else None


def imports_between_parts(graph: dict[str, set[str]]) -> dict[tuple[str, str], list[str]]:
    """Each (importing part, imported part) pair, with the module imports that make it."""
    between: dict[tuple[str, str], list[str]] = {}
    for module, imported in sorted(graph.items()):
        for target in sorted(imported):
            source_part, target_part = part_of(module), part_of(target)
            if source_part is not None and target_part is not None and source_part != target_part:
                between.setdefault((source_part, target_part), []).append(f"{module} -> {target}")
    return between


def test_may_import_is_layers() -> None:
    """The table itself: every part named, none allowed what imports it back, each listed below the parts that may
    import it."""
    assert find_cycle({part: set(allowed) for part, allowed in MAY_IMPORT.items()}) is None
    order = list(MAY_IMPORT)
    assert all(order.index(below) < order.index(part) for part, allowed in MAY_IMPORT.items() for below in allowed)


def test_each_part_imports_only_what_it_may() -> None:
    between = imports_between_parts(import_graph())
    assert {part for pair in between for part in pair} <= set(MAY_IMPORT)
    upward = [line for (source, target), lines in between.items() if target not in MAY_IMPORT[source] for line in lines]
    assert not upward, "imports MAY_IMPORT does not allow (up the layers, or a new dependency: say so in the table " \
        "and in docs/architecture.md):\n" + "\n".join(upward)
    unused = [f"{part} -> {target}" for part, allowed in MAY_IMPORT.items() for target in allowed
              if (part, target) not in between]
    assert not unused, f"MAY_IMPORT allows what no module imports (keep the table exact): {unused}"


def test_the_product_modules_import_without_a_cycle() -> None:
    graph = import_graph()
    assert "proxy.pipeline" in graph and "preprocessors.base" in graph
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def _part_named(cell: str) -> str:
    """``proxy/edge/`` -> ``edge``, ``proxy/state.py`` -> ``state``, ``preprocessors/`` -> ``preprocessors``."""
    path = cell.strip().strip("`").removesuffix("/").removesuffix(".py")
    return path.removeprefix("proxy/")


def layers_on_the_page(text: str) -> dict[str, tuple[str, ...]]:
    """The folder table of docs/architecture.md's "The layers": each row's part and the parts it may import."""
    section = text.split("## The layers", 1)[1].split("\n## ", 1)[0]
    table: dict[str, tuple[str, ...]] = {}
    for line in section.splitlines():
        cells = line.strip().strip("|").split("|")
        if len(cells) != 3 or not cells[0].strip().startswith("`"):
            continue
        table[_part_named(cells[0])] = tuple(re.findall(r"`([^`]+)`", cells[2]))
    return table


def test_the_architecture_page_tells_the_layers() -> None:
    on_the_page = layers_on_the_page(ARCHITECTURE.read_text())
    assert list(on_the_page) == list(MAY_IMPORT), "docs/architecture.md's folder table names other parts, or in " \
        "another order, than MAY_IMPORT"
    differ = {part: (on_the_page[part], allowed) for part, allowed in MAY_IMPORT.items()
              if set(on_the_page[part]) != set(allowed)}
    assert not differ, f"docs/architecture.md's \"may import\" differs from MAY_IMPORT (page, table): {differ}"
