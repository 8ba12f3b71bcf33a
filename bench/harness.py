"""The one runner: every benchmark is a declared ``Scenario`` (``bench.scenarios``), run with one command line.

    python -m bench list                           # every scenario, its knobs, whether its result is stale
    python -m bench run checkpoints                # measure, print the goals and the table, write the result
    python -m bench run default_limit --set clients=8 --set limits=2,auto --rounds 3
    python -m bench run startup --quick            # the smoke run: proves it runs, writes nothing
    python -m bench run checkpoints --render       # rebuild the .md (and the goals) from the committed .json
    python -m bench stale                          # run every scenario whose result is stale, then the report
    python -m bench quick                          # smoke-run every scenario, write nothing
    python -m bench report                         # every result's page and goals (as --render), docs/benchmarks.md
                                                   # and the README's figures, from the results

A scenario names its result file, the bench module that measures it and that module's **knobs** with their
defaults (the type of the default is the knob's type); ``--set knob=value`` changes one, ``--rounds`` is the knob
every scenario has. A bench module provides three functions, and nothing else runs it:

* ``measure(knobs) -> data``: the stamped measurement (``_results.stamp``);
* ``goals(data) -> list[Goal]``: its goals, from the data alone (so ``--render`` rebuilds them);
* ``report(data) -> str``: its Markdown table.

The runner adds the goals to the data, prints them and the table, and writes ``bench/results/<name>.json`` and
``.md`` (or ``--out PATH`` without suffix). A smoke run (``--quick``: the scenario's ``quick`` knobs) writes only
with ``--out``. Scenarios marked ``vllm`` start the real vLLM of ``tests/e2e`` (``bash tests/e2e/setup_vllm.sh``
first); those marked with a core count need that many usable cores: a smaller machine skips them in ``stale`` and
``quick`` and keeps their last result. Scenarios run one at a time: they measure a shared machine, and two at
once would measure each other.
"""

from __future__ import annotations

import argparse
import importlib
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench import _results as R
from bench._results import Knobs


@dataclass(frozen=True)
class Scenario:
    """One result file and how it is measured."""

    name: str  # bench/results/<name>.json and .md
    module: str  # bench.<module>: measure, goals, report
    knobs: Mapping[str, Any] = field(default_factory=dict)  # its settings and their defaults
    quick: Mapping[str, Any] | None = field(default_factory=dict)  # the smoke run's knobs; None: it has none
    vllm: bool = False  # starts the real vLLM of tests/e2e
    cores: int = 1  # the usable cores its goals need
    notes: str = ""
    functions: tuple[str, str, str] = ("measure", "goals", "report")  # the module's, by name

    def parts(self) -> tuple[Callable[[Knobs], dict[str, Any]], Callable[[dict[str, Any]], list[R.Goal]],
                             Callable[[dict[str, Any]], str]]:
        """The module's measure, goals and report."""
        bench = importlib.import_module(f"bench.{self.module}")
        measure, goals, report = (getattr(bench, name) for name in self.functions)
        return measure, goals, report

    def knobs_for(self, quick: bool, changes: Mapping[str, str], rounds: int | None) -> Knobs:
        """The knobs of one run: the defaults, the smoke run's where ``quick``, then ``changes`` (text, read as
        the default's type) and ``rounds``."""
        values: dict[str, Any] = {"rounds": R.MIN_ROUNDS} | dict(self.knobs)
        if quick:
            if self.quick is None:
                raise SystemExit(f"{self.name} has no smoke run")
            values |= dict(self.quick)
        unknown = set(changes) - set(values)
        if unknown:
            raise SystemExit(f"{self.name} has no knob {', '.join(sorted(unknown))}; its knobs: "
                             f"{', '.join(sorted(values))}")
        values |= {name: _parsed(text, values[name]) for name, text in changes.items()}
        if rounds is not None:
            values["rounds"] = rounds
        return Knobs(**values, quick=quick, name=self.name)


def _parsed(text: str, default: Any) -> Any:
    if isinstance(default, bool):
        if text.lower() not in ("on", "off", "true", "false", "1", "0", "yes", "no"):
            raise SystemExit(f"{text!r} is not on or off")
        return text.lower() in ("on", "true", "1", "yes")
    if isinstance(default, int):
        return int(text)
    if isinstance(default, float):
        return float(text)
    return text


def run(scenario: Scenario, knobs: Knobs, *, out: Path | None, render: bool) -> None:
    """Measure (or, with ``render``, read the committed result), then print and write as the docstring says."""
    measure, _goals, _report = scenario.parts()
    # Through JSON first, as it is written: the page a fresh run prints is the one a --render rebuilds.
    if render:
        measured = json.loads((R.RESULTS / f"{scenario.name}.json").read_text())
    else:
        knobs_run = {name: value for name, value in vars(knobs).items() if name not in ("quick", "name")}
        measured = json.loads(json.dumps(measure(knobs) | {"knobs": knobs_run}, default=str))
    data, md = rendered(scenario, measured)
    R.print_goals(data["goals"])
    print(md)
    if out is not None or not knobs.quick:
        R.write(scenario.name, data, md, out=out)


def rendered(scenario: Scenario, data: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """A result's data with its goals, and its page, as the scenario's ``goals`` and ``report`` make them of
    the data now."""
    _measure, goals, report = scenario.parts()
    data = data | {"goals": goals(data)}
    doc = importlib.import_module(f"bench.{scenario.module}").__doc__ or scenario.name
    return data, R.page(doc, data, report(data))


def is_stale(scenario: Scenario) -> bool:
    from bench.report import freshness

    path = R.RESULTS / f"{scenario.name}.json"
    return not path.exists() or freshness(json.loads(path.read_text()))[0]


def _by_name(names: Sequence[str]) -> list[Scenario]:
    from bench.scenarios import SCENARIOS

    known = {scenario.name: scenario for scenario in SCENARIOS}
    unknown = [name for name in names if name not in known]
    if unknown:
        raise SystemExit(f"no scenario {', '.join(unknown)}; `python -m bench list` lists them")
    return [known[name] for name in names] if names else list(SCENARIOS)


def _each(scenarios: Sequence[Scenario], quick: bool, vllm: bool) -> int:
    """Run each scenario in a process of its own (what one leaves behind never reaches the next)."""
    failed = []
    with tempfile.TemporaryDirectory(prefix="bench-") as scratch:
        for scenario in scenarios:
            if quick and scenario.quick is None:
                print(f"== {scenario.name}: no smoke run, skipped", flush=True)
                continue
            if scenario.vllm and not vllm:
                continue
            if scenario.cores > R.usable_cores():
                print(f"== {scenario.name}: needs {scenario.cores} usable cores, this machine has "
                      f"{R.usable_cores()}: skipped (`python -m bench run {scenario.name}` on one that has them)",
                      flush=True)
                continue
            argv = [sys.executable, "-m", "bench", "run", scenario.name]
            argv += ["--quick", "--out", str(Path(scratch) / scenario.name)] if quick else []
            print(f"== {' '.join(argv[1:])}", flush=True)
            started = time.monotonic()
            code = subprocess.run(argv, cwd=R.REPO, check=False).returncode
            print(f"== {scenario.name}: exit {code} after {time.monotonic() - started:.0f} s", flush=True)
            if code:
                failed.append(scenario.name)
    if failed:
        print(f"failed: {', '.join(failed)}")
    return 1 if failed else 0


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n")[0])
    commands = ap.add_subparsers(dest="command", required=True)
    listing = commands.add_parser("list", help="every scenario, its knobs and whether its result is stale")
    listing.add_argument("names", nargs="*")
    one = commands.add_parser("run", help="run one scenario")
    one.add_argument("name")
    one.add_argument("--set", action="append", default=[], metavar="KNOB=VALUE", help="change one knob")
    one.add_argument("--rounds", type=int, default=None)
    one.add_argument("--quick", action="store_true", help="the smoke run: writes only with --out")
    one.add_argument("--render", action="store_true", help="rebuild the .md and the goals from the committed .json")
    one.add_argument("--out", type=Path, default=None, help="the result's path without suffix")
    for name, what in (("stale", "run every scenario whose result is stale, then the report"),
                       ("quick", "smoke-run every scenario (or those named); writes nothing")):
        many = commands.add_parser(name, help=what)
        many.add_argument("names", nargs="*")
        many.add_argument("--no-vllm", action="store_true", help="skip the scenarios that start a real vLLM")
    page = commands.add_parser("report", help="regenerate docs/benchmarks.md and the README's figures")
    page.add_argument("--check", action="store_true", help="only compare; exit 1 when a generated file differs")
    args = ap.parse_args(argv)
    if args.command == "report":
        from bench import report

        return report.sync(args.check)
    if args.command == "list":
        for scenario in _by_name(args.names):
            knobs = " ".join(f"{name}={value}" for name, value in scenario.knobs.items())
            needs = (["vllm"] if scenario.vllm else []) + ([f"{scenario.cores} cores"] if scenario.cores > 1 else [])
            print(f"{scenario.name:16} {'stale' if is_stale(scenario) else 'fresh':5}  {knobs}"
                  f"{'  [' + ', '.join(needs) + ']' if needs else ''}"
                  f"{'  (' + scenario.notes + ')' if scenario.notes else ''}")
        return 0
    if args.command == "run":
        (scenario,) = _by_name([args.name])
        changes = dict(change.split("=", 1) for change in args.set)
        run(scenario, scenario.knobs_for(args.quick, changes, args.rounds), out=args.out, render=args.render)
        return 0
    scenarios = _by_name(args.names)
    if args.command == "stale":
        scenarios = [scenario for scenario in scenarios if is_stale(scenario)]
    code = _each(scenarios, quick=args.command == "quick", vllm=not args.no_vllm)
    if args.command == "stale":
        from bench import report

        report.sync(check=False)
    return code
