"""``bench.all`` runs each benchmark as a process of its own, and each stands alone: no bench imports another.
What they share lives in ``testkit/``, what every bench writes in ``bench/_results.py``, the page in
``bench/report.py``."""

from __future__ import annotations

import ast
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"
SHARED = {"bench._results", "bench.report", "bench.staleness", "bench.all"}  # the harness, not benches


def imported_benches(path: Path) -> set[str]:
    """The ``bench.*`` modules ``path`` imports."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module is not None and node.module.split(".")[0] == "bench":
            found |= {f"bench.{alias.name}" for alias in node.names} if node.module == "bench" else {node.module}
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.startswith("bench.")}
    return found


def test_no_bench_imports_another_or_runs_one() -> None:
    """Nor does one start another's module as a process (``python -m bench.x``): a role they share is testkit's."""
    benches = [path for path in BENCH.glob("*.py") if f"bench.{path.stem}" not in SHARED and path.stem != "__init__"]
    assert len(benches) > 20
    imports = {path.name: sorted(imported_benches(path) - SHARED) for path in benches}
    assert not {name: found for name, found in imports.items() if found}
    names = {f"bench.{path.stem}" for path in benches}
    runs = {path.name: sorted(name for name in names - {f"bench.{path.stem}"}
                              if f'"{name}"' in path.read_text()) for path in benches}
    assert not {name: found for name, found in runs.items() if found}
