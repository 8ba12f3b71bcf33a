"""The one runner (``bench.harness``) and the declared scenarios (``bench.scenarios``): every result file is a
scenario's, every bench module's functions are what its scenarios name, a committed result renders to the goals
it holds, and the command line reads knobs as their defaults' types. Each bench stands alone: no bench imports
another, nor starts another's module as a process; what they share lives in ``testkit/``."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench import _results as R
from bench.harness import Scenario, rendered
from bench.scenarios import SCENARIOS

BENCH = Path(__file__).resolve().parents[2] / "bench"
HARNESS = {"bench._results", "bench.report", "bench.staleness", "bench.harness", "bench.scenarios", "bench.__main__"}
TOOLS: set[str] = set()  # modules that write no result (not scenarios): none, they live in testkit


def imported_benches(path: Path) -> set[str]:
    """The ``bench.*`` modules ``path`` imports."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module is not None and node.module.split(".")[0] == "bench":
            found |= {f"bench.{alias.name}" for alias in node.names} if node.module == "bench" else {node.module}
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.startswith("bench.")}
    return found


def imported_modules(tree: ast.Module) -> set[str]:
    return {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names} | {
        node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}


def benches() -> list[Path]:
    return [path for path in BENCH.glob("*.py") if f"bench.{path.stem}" not in HARNESS and path.stem != "__init__"]


def test_no_bench_imports_another_or_runs_one() -> None:
    """Nor does one start a module of ``bench`` as a process (``python -m bench...``): a role they share is
    testkit's, and only the runner runs a benchmark."""
    found = benches()
    assert len(found) > 20
    imports = {path.name: sorted(imported_benches(path) - HARNESS) for path in found}
    assert not {name: modules for name, modules in imports.items() if modules}
    runs = {path.name for path in found if '"-m", "bench' in path.read_text()}
    assert not runs


def test_every_bench_module_is_a_scenario_s_or_a_tool_and_has_no_command_line_of_its_own() -> None:
    modules = {f"bench.{path.stem}" for path in benches()}
    declared = {f"bench.{scenario.module}" for scenario in SCENARIOS}
    assert modules == declared | TOOLS
    for path in benches():
        if f"bench.{path.stem}" in declared:
            tree = ast.parse(path.read_text())
            assert "argparse" not in imported_modules(tree), path.name
            assert not [node for node in tree.body if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test)]


def test_every_result_file_is_a_scenario_s_and_every_scenario_has_its_parts() -> None:
    names = [scenario.name for scenario in SCENARIOS]
    assert len(names) == len(set(names))
    assert {path.stem for path in R.RESULTS.glob("*.json")} == set(names)
    for scenario in SCENARIOS:
        assert all(callable(part) for part in scenario.parts()), scenario.name


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda scenario: scenario.name)
def test_a_committed_result_renders_to_the_goals_it_holds(scenario: Scenario) -> None:
    """``--render``'s path: the goals and the page from the committed data alone, as a fresh run makes them (a page
    titled by the bench module's docstring where its report gives only its tables)."""
    data = json.loads((R.RESULTS / f"{scenario.name}.json").read_text())
    rebuilt, page = rendered(scenario, data)
    rebuilt["goals"] = json.loads(json.dumps(rebuilt["goals"], default=str))
    assert [(g["name"], g["median"], g["met"]) for g in rebuilt["goals"]] == \
        [(g["name"], g["median"], g["met"]) for g in data["goals"]]
    assert page.startswith("# ")


def test_knobs_are_read_as_their_defaults_types() -> None:
    scenario = Scenario("example", "example", {"clients": 4, "seconds": 1.5, "pinned": False, "limits": "2,4"},
                        quick={"clients": 1})
    knobs = scenario.knobs_for(False, {"seconds": "2", "pinned": "on", "limits": "8"}, rounds=5)
    assert (knobs.clients, knobs.seconds, knobs.pinned, knobs.limits, knobs.rounds, knobs.quick, knobs.name) == \
        (4, 2.0, True, "8", 5, False, "example")
    quick = scenario.knobs_for(True, {}, rounds=None)
    assert (quick.clients, quick.rounds, quick.quick) == (1, R.MIN_ROUNDS, True)
    with pytest.raises(SystemExit, match="no knob nope; its knobs: clients, limits, pinned, rounds, seconds"):
        scenario.knobs_for(False, {"nope": "1"}, rounds=None)
    with pytest.raises(SystemExit, match="'maybe' is not on or off"):
        scenario.knobs_for(False, {"pinned": "maybe"}, rounds=None)
    with pytest.raises(SystemExit, match="example has no smoke run"):
        Scenario("example", "example", quick=None).knobs_for(True, {}, rounds=None)


def test_the_command_line_lists_every_scenario_and_refuses_an_unknown_one() -> None:
    listed = subprocess.run([sys.executable, "-m", "bench", "list"], cwd=R.REPO, capture_output=True, text=True,
                            check=True).stdout
    assert [line.split()[0] for line in listed.splitlines()] == [scenario.name for scenario in SCENARIOS]
    refused = subprocess.run([sys.executable, "-m", "bench", "run", "nothing"], cwd=R.REPO, capture_output=True,
                             text=True, check=False)
    assert refused.returncode != 0 and "no scenario nothing" in refused.stderr


def test_a_smoke_run_measures_prints_its_goals_and_writes_nothing() -> None:
    before = {path: path.stat().st_mtime_ns for path in R.RESULTS.iterdir()}
    run = subprocess.run([sys.executable, "-m", "bench", "run", "sniff", "--quick"], cwd=R.REPO, capture_output=True,
                         text=True, check=True)
    assert "goals:" in run.stdout and "hyperscan ms/MiB" in run.stdout
    assert "# The sniff's ways side by side" in run.stdout  # the page, titled by the module's docstring
    assert {path: path.stat().st_mtime_ns for path in R.RESULTS.iterdir()} == before


def test_a_render_rewrites_the_committed_result_unchanged(tmp_path: Path) -> None:
    """The runner's ``--render`` to another path: the goals and the page it writes are those committed."""
    subprocess.run([sys.executable, "-m", "bench", "run", "checkpoints", "--render", "--out", str(tmp_path / "c")],
                   cwd=R.REPO, capture_output=True, check=True)
    assert (tmp_path / "c.md").read_text() == (R.RESULTS / "checkpoints.md").read_text()
    assert json.loads((tmp_path / "c.json").read_text())["goals"] == \
        json.loads((R.RESULTS / "checkpoints.json").read_text())["goals"]
