"""The fuzzing properties of ``tests/proxy/test_app_fuzz.py`` with a large budget, to find what CI's small one misses.

Same strategies and properties (``testkit/fuzzing/``), run in rounds with fresh random seeds until each
property has run ``examples`` inputs or its share of ``minutes`` is spent (knobs). Unlike CI, a failure whose
signature is already known (kept in ``tests/fuzz_corpus/`` or found earlier in this run) does not stop the
search: it is counted and the round goes on, so the budget goes to finding *new* faults. A new fault is
shrunk by hypothesis and its minimal input written to the corpus (``--set save=off`` to keep the corpus as is).

Prints per property: inputs run (examples and shrink steps), distinct failures (new / known), time; writes
``bench/results/fuzz.md`` and ``fuzz.json`` with the commit, the machine and the corpus size.

    python -m bench run fuzz [--set KNOB=VALUE] [--rounds N] [--quick]
    python -m bench list fuzz   # the knobs and their defaults

The search is ``testkit.fuzzing.search``. Traffic goes only to 127.0.0.1: the proxy and the scripted upstream
it starts itself.
"""

from __future__ import annotations

import logging
import os
import platform
import random
from typing import Any

from bench import _results as R
from testkit.fuzzing.corpus import corpus_files
from testkit.fuzzing.properties import PROPERTIES
from testkit.fuzzing.search import search

WHAT = "hypothesis over every dialect, data URLs, base64, splice and paths, with a large budget"


def measure(knobs: R.Knobs) -> dict[str, Any]:
    names = [n.strip() for n in knobs.properties.split(",") if n.strip()] or list(PROPERTIES)
    unknown = [n for n in names if n not in PROPERTIES]
    if unknown:
        raise SystemExit(f"unknown properties {unknown}; known: {', '.join(PROPERTIES)}")
    seed_used = knobs.seed if knobs.seed >= 0 else random.SystemRandom().getrandbits(32)
    logging.getLogger().addHandler(logging.NullHandler())  # no tracebacks on stderr; the fault log still sees them
    stamp = R.stamp("fuzz.py", WHAT)
    outcomes = search(names, knobs.examples, knobs.minutes, random.Random(seed_used), knobs.save)
    host = {"platform": platform.platform(), "machine": platform.machine(), "processor": platform.processor(),
            "python": platform.python_version(), "cpu_count": os.cpu_count(),
            "loadavg": os.getloadavg() if hasattr(os, "getloadavg") else None}
    return stamp | {"host": host, "budget": {"examples": knobs.examples, "minutes": knobs.minutes},
                    "seed": seed_used, "corpus_size": len(corpus_files()),
                    "properties": [outcome.record() for outcome in outcomes]}


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
        *(f"| {p['name']} | {p['inputs']} | {len(p['new_failures'])} / {len(p['known_failures_hit'])} | "
          f"{p['seconds']:.1f} | {PROPERTIES[p['name']].summary} |" for p in data["properties"]),
        "", f"Corpus after the run: {data['corpus_size']} files.", "",
    ]
    for p in data["properties"]:
        lines += [f"- **new** `{p['name']}` `{signature}`: {note[:300]}"
                  for signature, note in p["new_failures"].items()]
        lines += [f"- known `{p['name']}` `{signature}`: hit by {hits} inputs"
                  for signature, hits in p["known_failures_hit"].items()]
    return "\n".join(lines) + "\n"
