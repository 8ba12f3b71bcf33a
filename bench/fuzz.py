"""The fuzzing properties of ``tests/proxy/test_app_fuzz.py`` with a large budget, to find what CI's small one misses.

Same strategies and properties (``testkit/fuzzing/``), run in rounds with fresh random seeds until each
property has run ``--examples`` inputs or its share of ``--minutes`` is spent. Unlike CI, a failure whose
signature is already known (kept in ``tests/fuzz_corpus/`` or found earlier in this run) does not stop the
search: it is counted and the round goes on, so the budget goes to finding *new* faults. A new fault is
shrunk by hypothesis and its minimal input written to the corpus (``--no-save`` to keep the corpus as is).

Prints per property: inputs run (examples and shrink steps), distinct failures (new / known), time; writes
``bench/results/fuzz.md`` and ``fuzz.json`` with the commit, the machine and the corpus size.

    python -m bench run fuzz [--set KNOB=VALUE] [--rounds N] [--quick]
    python -m bench list fuzz   # the knobs and their defaults
    python -m bench list fuzz   # the knobs and their defaults

Run it from the repository root (``-m``: ``testkit.fuzzing`` is imported as a package, no ``sys.path`` edits).
Traffic goes only to 127.0.0.1: the proxy and the scripted upstream it starts itself.
"""

from __future__ import annotations

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


def measure(knobs: R.Knobs) -> dict[str, Any]:
    names = [n.strip() for n in knobs.properties.split(",") if n.strip()] or list(PROPERTIES)
    unknown = [n for n in names if n not in PROPERTIES]
    if unknown:
        raise SystemExit(f"unknown properties {unknown}; known: {', '.join(PROPERTIES)}")
    seed_used = knobs.seed if knobs.seed >= 0 else random.SystemRandom().getrandbits(32)
    rng = random.Random(seed_used)
    deadline = time.perf_counter() + knobs.minutes * 60 if knobs.minutes else None
    logging.getLogger().addHandler(logging.NullHandler())  # no tracebacks on stderr; the fault log still sees them
    outcomes = []
    stamp = R.stamp("fuzz.py", WHAT)
    print(f"{'property':<15} {'inputs':>8} {'new':>4} {'known':>6} {'time s':>8}")
    for i, name in enumerate(names):
        # An equal share of what is left: time a fast property did not need goes to the ones after it.
        share = None if deadline is None else max(0.0, deadline - time.perf_counter()) / (len(names) - i)
        outcome = run_property(name, knobs.examples, share, rng, knobs.save)
        outcomes.append(outcome)
        print(f"{name:<15} {outcome.inputs:>8} {len(outcome.new):>4} {len(outcome.known_hits):>6} "
              f"{outcome.seconds:>8.1f}", flush=True)
        for signature, note in outcome.new.items():
            print(f"    new: {signature}: {note[:200]}")
    return stamp | {
        "host": machine(), "budget": {"examples": knobs.examples, "minutes": knobs.minutes}, "seed": seed_used,
        "corpus_size": len(corpus_files()),
        "properties": [{"name": o.name, "inputs": o.inputs, "rounds": o.rounds, "seconds": round(o.seconds, 1),
                        "failures": len(o.new) + len(o.known_hits), "new_failures": o.new,
                        "known_failures_hit": o.known_hits, "saved": o.saved} for o in outcomes],
    }


def goals(data: dict[str, Any]) -> list[R.Goal]:
    properties = data["properties"]
    return [R.goal("new faults found", [len(p["new_failures"]) for p in properties], "= 0", lambda v: v == 0,
                   over="properties", met_on="every"),
            R.goal("inputs run", [p["inputs"] for p in properties], over="properties")]


def report(data: dict[str, Any]) -> str:
    budget = data["budget"]
    lines = [
        f"Budget {budget['examples']} inputs per property"
        + (f" or {budget['minutes']} min in all" if budget["minutes"] else "") + f"; seed {data['seed']}.", "",
        ("Inputs run include hypothesis' shrink steps. A failure is one distinct fault signature; *known* ones "
         "were already in `tests/fuzz_corpus/` (or found earlier in the run) and are only counted."), "",
        "| property | inputs run | failures (new / known) | time (s) | what it checks |",
        "| --- | ---: | ---: | ---: | --- |",
    ]
    for p in data["properties"]:
        lines.append(f"| {p['name']} | {p['inputs']} | {len(p['new_failures'])} / {len(p['known_failures_hit'])} | "
                     f"{p['seconds']:.1f} | {PROPERTIES[p['name']].summary} |")
    lines += ["", f"Corpus after the run: {data['corpus_size']} files.", ""]
    for p in data["properties"]:
        for signature, note in p["new_failures"].items():
            lines.append(f"- **new** `{p['name']}` `{signature}`: {note[:300]}")
        for signature, hits in p["known_failures_hit"].items():
            lines.append(f"- known `{p['name']}` `{signature}`: hit by {hits} inputs")
    return "\n".join(lines) + "\n"
