"""The fuzzing properties of ``tests/proxy/test_app_fuzz.py`` with a large budget, to find what CI's small one misses.

Same strategies and properties (``testkit/fuzzing/``), run in rounds with fresh random seeds until each
property has run ``--examples`` inputs or its share of ``--minutes`` is spent. Unlike CI, a failure whose
signature is already known (kept in ``tests/fuzz_corpus/`` or found earlier in this run) does not stop the
search: it is counted and the round goes on, so the budget goes to finding *new* faults. A new fault is
shrunk by hypothesis and its minimal input written to the corpus (``--no-save`` to keep the corpus as is).

Prints per property: inputs run (examples and shrink steps), distinct failures (new / known), time; writes
``bench/results/fuzz.md`` and ``fuzz.json`` with the commit, the machine and the corpus size.

    python -m bench.fuzz [--examples 5000] [--minutes 10] [--properties http_paths,pure_base64] [--seed N]

Run it from the repository root (``-m``: ``testkit.fuzzing`` is imported as a package, no ``sys.path`` edits).
Traffic goes only to 127.0.0.1: the proxy and the scripted upstream it starts itself.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import platform
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from hypothesis import HealthCheck, given, seed, settings

from bench import _results as R
from testkit.fuzzing.corpus import Tally, corpus_files, corpus_signatures, keep_failures, signature_of
from testkit.fuzzing.faults import FaultLog, Harness
from testkit.fuzzing.properties import PROPERTIES, strategy_for
from testkit.servers import start_proxy_server, start_upstream

RESULTS = Path(__file__).resolve().parent / "results"


@dataclass
class Outcome:
    """One property's run, as printed and written."""

    name: str
    inputs: int = 0
    rounds: int = 0
    seconds: float = 0.0
    new: dict[str, str] = field(default_factory=dict)  # signature -> note of the minimal example
    known_hits: dict[str, int] = field(default_factory=dict)  # known signature -> inputs that hit it again
    saved: list[str] = field(default_factory=list)


class _Known(Exception):
    """Never raised out of a round: marks a failure already on record."""


def _round(prop_name: str, run_one: Callable[[Any], None], examples: int, round_seed: int, known: set[str],
           outcome: Outcome, tally: Tally, save: bool) -> None:
    """One hypothesis run of up to ``examples`` inputs; a known failure is swallowed, a new one shrunk."""

    @seed(round_seed)
    @settings(max_examples=examples, deadline=None, database=None, derandomize=False, print_blob=True,
              report_multiple_bugs=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                     HealthCheck.large_base_example, HealthCheck.filter_too_much])
    @given(case=strategy_for(prop_name))
    def search(case: Any) -> None:
        try:
            with keep_failures(prop_name, case, tally, save=save):
                try:
                    run_one(case)
                except AssertionError as exc:
                    signature = signature_of(exc)
                    if signature in known:
                        outcome.known_hits[signature] = outcome.known_hits.get(signature, 0) + 1
                        raise _Known() from None
                    raise
        except _Known:
            return

    try:
        search()
    except Exception as exc:
        logging.getLogger("bench.fuzz").debug("round ended with %r", exc)


def run_property(name: str, examples: int, seconds: float | None, rng: random.Random, save: bool) -> Outcome:
    """Rounds of up to 500 examples until ``examples`` inputs ran or ``seconds`` passed."""
    prop = PROPERTIES[name]
    outcome = Outcome(name)
    known = {signature for (p, signature) in corpus_signatures() if p == name}
    tally = Tally()
    loop = asyncio.new_event_loop()
    closers: list[Callable[[], Any]] = []
    faults = FaultLog()
    run_one: Callable[[Any], None]
    if prop.kind == "http":
        upstream = loop.run_until_complete(start_upstream())
        proxy, stop_proxy = loop.run_until_complete(start_proxy_server(upstream.url, **prop.env))
        session = loop.run_until_complete(_session())
        harness = Harness(proxy.url, upstream, session, faults)
        assert upstream.server is not None
        closers += [session.close, stop_proxy, upstream.server.close]

        def run_one(case: Any) -> None:
            loop.run_until_complete(prop.check(harness, case))
    else:
        run_one = prop.check
    started = time.perf_counter()
    try:
        with faults.installed():
            while tally.inputs < examples and (seconds is None or time.perf_counter() - started < seconds):
                before = set(tally.failures)
                _round(name, run_one, min(500, examples - tally.inputs), rng.getrandbits(64), known, outcome,
                       tally, save)
                outcome.rounds += 1
                for signature in set(tally.failures) - before:
                    known.add(signature)  # found in this round: from now on only counted
                    outcome.new[signature] = tally.failures[signature]
    finally:
        for close in closers:
            loop.run_until_complete(close())
        loop.close()
    outcome.inputs = tally.inputs
    outcome.saved = tally.saved
    outcome.seconds = time.perf_counter() - started
    return outcome


async def _session() -> aiohttp.ClientSession:
    return aiohttp.ClientSession()


def machine() -> dict[str, Any]:
    return {"platform": platform.platform(), "machine": platform.machine(), "processor": platform.processor(),
            "python": platform.python_version(), "cpu_count": os.cpu_count(),
            "loadavg": os.getloadavg() if hasattr(os, "getloadavg") else None}


WHAT = "hypothesis over every dialect, data URLs, base64, splice and paths, with a large budget"


def write_results(outcomes: list[Outcome], args: argparse.Namespace, seed_used: int,
                  stamp: dict[str, Any]) -> None:
    RESULTS.mkdir(exist_ok=True)
    corpus = len(corpus_files())
    report = stamp | {
        "goals": [R.goal("new faults found", [len(o.new) for o in outcomes], "= 0", lambda v: v == 0,
                         over="properties", met_on="every"),
                  R.goal("inputs run", [o.inputs for o in outcomes], over="properties")],
        "host": machine(), "budget": {"examples": args.examples, "minutes": args.minutes}, "seed": seed_used,
        "corpus_size": corpus,
        "properties": [{"name": o.name, "inputs": o.inputs, "rounds": o.rounds, "seconds": round(o.seconds, 1),
                        "failures": len(o.new) + len(o.known_hits), "new_failures": o.new,
                        "known_failures_hit": o.known_hits, "saved": o.saved} for o in outcomes],
    }
    lines = [
        "# Fuzzing (bench/fuzz.py)", "",
        f"Budget {args.examples} inputs per property"
        + (f" or {args.minutes} min in all" if args.minutes else "") + f"; seed {seed_used}.", "",
        ("Inputs run include hypothesis' shrink steps. A failure is one distinct fault signature; *known* ones "
         "were already in `tests/fuzz_corpus/` (or found earlier in the run) and are only counted."), "",
        "| property | inputs run | failures (new / known) | time (s) | what it checks |",
        "| --- | ---: | ---: | ---: | --- |",
    ]
    for o in outcomes:
        lines.append(f"| {o.name} | {o.inputs} | {len(o.new)} / {len(o.known_hits)} | {o.seconds:.1f} | "
                     f"{PROPERTIES[o.name].summary} |")
    lines += ["", f"Corpus after the run: {corpus} files.", ""]
    for o in outcomes:
        for signature, note in o.new.items():
            lines.append(f"- **new** `{o.name}` `{signature}`: {note[:300]}")
        for signature, hits in o.known_hits.items():
            lines.append(f"- known `{o.name}` `{signature}`: hit by {hits} inputs")
    R.print_goals(report["goals"])
    R.write("fuzz", report, "\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--examples", type=int, default=5000, help="inputs per property (default 5000)")
    parser.add_argument("--minutes", type=float, default=0, help="wall-clock budget for all properties (0 = none)")
    parser.add_argument("--properties", default=",".join(PROPERTIES), help="comma-separated subset")
    parser.add_argument("--seed", type=int, default=None, help="seed of the round seeds (default: random)")
    parser.add_argument("--no-save", action="store_true", help="do not write new failures to tests/fuzz_corpus/")
    args = parser.parse_args()
    names = [n.strip() for n in args.properties.split(",") if n.strip()]
    unknown = [n for n in names if n not in PROPERTIES]
    if unknown:
        parser.error(f"unknown properties {unknown}; known: {', '.join(PROPERTIES)}")
    seed_used = args.seed if args.seed is not None else random.SystemRandom().getrandbits(32)
    rng = random.Random(seed_used)
    deadline = time.perf_counter() + args.minutes * 60 if args.minutes else None
    logging.getLogger().addHandler(logging.NullHandler())  # no tracebacks on stderr; the fault log still sees them
    outcomes = []
    stamp = R.stamp("fuzz.py", WHAT)
    print(f"{'property':<15} {'inputs':>8} {'new':>4} {'known':>6} {'time s':>8}")
    for i, name in enumerate(names):
        # An equal share of what is left: time a fast property did not need goes to the ones after it.
        share = None if deadline is None else max(0.0, deadline - time.perf_counter()) / (len(names) - i)
        outcome = run_property(name, args.examples, share, rng, not args.no_save)
        outcomes.append(outcome)
        print(f"{name:<15} {outcome.inputs:>8} {len(outcome.new):>4} {len(outcome.known_hits):>6} "
              f"{outcome.seconds:>8.1f}", flush=True)
        for signature, note in outcome.new.items():
            print(f"    new: {signature}: {note[:200]}")
    write_results(outcomes, args, seed_used, stamp)
    print(f"corpus: {len(corpus_files())} files; results in {RESULTS / 'fuzz.md'}")


if __name__ == "__main__":
    main()
