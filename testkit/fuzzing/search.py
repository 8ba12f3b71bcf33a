"""The large-budget search of ``bench/fuzz.py``: each property run in hypothesis rounds with fresh seeds until its
budget is spent, known failures counted rather than stopping the search (``search``; one property:
``run_property``).

Unlike CI (``tests/proxy/test_app_fuzz.py``), a failure whose signature is already known (kept in the corpus, or
found earlier in this search) does not end a round: it is counted and the round goes on, so the budget goes to
finding *new* faults. A new fault is shrunk by hypothesis and, with ``save``, its minimal input written to the
corpus (``corpus.keep_failures``).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from hypothesis import HealthCheck, given, seed, settings

from ..servers import start_proxy_server, start_upstream
from .corpus import Tally, corpus_signatures, keep_failures, signature_of
from .faults import FaultLog, Harness
from .properties import PROPERTIES, strategy_for

ROUND_EXAMPLES = 500  # inputs per hypothesis round: each round starts from a fresh seed


@dataclass
class Outcome:
    """One property's search, as the bench prints and writes it."""

    name: str
    inputs: int = 0
    rounds: int = 0
    seconds: float = 0.0
    new: dict[str, str] = field(default_factory=dict)  # signature -> note of the minimal example
    known_hits: dict[str, int] = field(default_factory=dict)  # known signature -> inputs that hit it again
    saved: list[str] = field(default_factory=list)

    def record(self) -> dict[str, Any]:
        """The property's entry in the result's JSON."""
        return {"name": self.name, "inputs": self.inputs, "rounds": self.rounds, "seconds": round(self.seconds, 1),
                "failures": len(self.new) + len(self.known_hits), "new_failures": self.new,
                "known_failures_hit": self.known_hits, "saved": self.saved}


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


async def _session() -> aiohttp.ClientSession:
    return aiohttp.ClientSession()


def run_property(name: str, examples: int, seconds: float | None, rng: random.Random, save: bool) -> Outcome:
    """Rounds of up to ``ROUND_EXAMPLES`` examples until ``examples`` inputs ran or ``seconds`` passed; an HTTP
    property runs against a proxy and a scripted upstream of its own on 127.0.0.1."""
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
                _round(name, run_one, min(ROUND_EXAMPLES, examples - tally.inputs), rng.getrandbits(64), known,
                       outcome, tally, save)
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


def search(names: list[str], examples: int, minutes: float, rng: random.Random, save: bool) -> list[Outcome]:
    """Each property of ``names`` in turn, up to ``examples`` inputs each or, with ``minutes``, an equal share of
    the time left, printing a line per property (and each new fault) as it ends."""
    deadline = time.perf_counter() + minutes * 60 if minutes else None
    outcomes = []
    print(f"{'property':<15} {'inputs':>8} {'new':>4} {'known':>6} {'time s':>8}")
    for i, name in enumerate(names):
        # An equal share of what is left: time a fast property did not need goes to the ones after it.
        share = None if deadline is None else max(0.0, deadline - time.perf_counter()) / (len(names) - i)
        outcome = run_property(name, examples, share, rng, save)
        outcomes.append(outcome)
        print(f"{name:<15} {outcome.inputs:>8} {len(outcome.new):>4} {len(outcome.known_hits):>6} "
              f"{outcome.seconds:>8.1f}", flush=True)
        for signature, note in outcome.new.items():
            print(f"    new: {signature}: {note[:200]}")
    return outcomes
