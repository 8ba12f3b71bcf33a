"""mmgate in a fleet: the adaptive limit against fixed ones from a cold start and across capacity steps, under
attack, against a client that reads nothing, and fair waiting.

**Adaptive limit** (``MMGATE_MAX_MM_CONCURRENCY=auto``), issue 43's scenarios (``testkit.adaptive_sim``, which
the simulator's tests in tests/proxy/admission/test_adaptive_goals.py share): 24 closed-loop clients, each sending
its next media request when its answer comes, against a backend that shares itself among the requests it holds,
as a batching server's steps serve its whole batch: each request is one unit of work, done at ``1 / curve(c)``
units a second while it holds ``c`` (it waits on timers, so the figures depend little on the shared machine).
Shared, not fixed at each request's arrival as the simulator's: over HTTP the clients answered together send
again a few milliseconds apart, and requests that came while the backend held fewer would keep their short times
while the rest came after them, a rate that no server gives and that read a thrashing backend's 8 as ×1.8 of
its 4 (it is ×1.1).

- *Cold start*, 15 s cells: the issue's batching backend (3.5, 6.4, 10.7, 16, 5.3 answers/s at 1, 2, 4, 8, 16),
  a thrashing one (250 ms × max(1, (c/6)²)) and a knee (200 ms × (1 + (c-1)/4) × max(1, (c/8)²)). ``auto``
  starts cold in every cell, at its ``START``. Goals: ``auto``'s answers/s over the whole cell ≥ 0.9× the best
  fixed limit's; the end of the first 2 s window whose answers/s reach 0.9× the best's ≤ 5 s. On the thrashing
  backend a fixed limit of 24, far past the knee, is measured too (``auto`` ≥ 2× it).
- *Capacity steps*, 8 s into a 20 s cell: the knee 2× slower, 2× faster, its knee from 8 to 4, and the batching
  backend's best from 8 to 4. The fixed limits run on the backend after the step (12 s cells: the new best).
  Goals: ``auto`` from 5 s after the step to the end ≥ 0.9× the new best; the first 2 s window after the step at
  0.9× the new best ends ≤ 5 s after the step.

The fixed limits measured are the three the simulator finds best for the backend (``near_best``): the best over
HTTP is among them, and a sweep of every limit would take ten times as long. Fixed limits use
``MMGATE_RELEASE_AT=complete`` like ``auto`` does, so both bound the backend; ``auto`` runs between
``MMGATE_MIN_MM_CONCURRENCY=1`` and ``MMGATE_MAX_MM_CONCURRENCY_AUTO=64``. Answers carry ``completion_tokens`` in
``usage`` (16), as a model server's do. Throughput = answers completed within the cell ÷ its seconds: ``auto``
pays for its own convergence. Recorded for ``auto``: the limit every 50 ms (the gate's, and between probes), and
the range of the limit between probes over the cell's second half.

**Attacks** (``auto``; the issue's scenario, unscaled): 8 honest client loops against a backend that takes 1 s
an answer; after ``ATTACK_WARMUP`` s, 2 attacker loops for 3 s, then 15 s more. One cell per kind: answers at
once (``max_tokens: 1``, ``completion_tokens: 1``), refusals at once (the backend answers 400), clients that
give up after 50 ms. Goals: honest answers/s during the attack and in the 10 s after it, each ÷ the 10 s
before it, ≥ 0.8; the limit between probes (``AdaptiveLimit.cruise_limit``) 10 s after the attack within 10 %
of where it was when the attack began.

**Slow reader** (``MMGATE_CLIENT_WRITE_TIMEOUT=5``, ``MMGATE_QUEUE_TIMEOUT=2``): one client with a 4 KiB receive
buffer asks for an 8 MiB streamed answer and reads none of it; once it holds its lease, 8 honest client loops
(backend 100 ms an answer) run for the deadline + 3 s. One cell with ``auto`` right after the start (its limit at
``START``), one with a fixed limit of 4 released at completion. Recorded: how long the slow reader's lease was
held from its grant (polled every 5 ms; the backend streams at once, so the answer waits on the client from the
start), when its request ended and its access log code, the honest answers' statuses. Both keep the slot as long
as the backend is held: mmgate reads 1 MiB of the answer ahead for the client, and the rest waits on it. Goals: the
slot held ≤ the deadline + 5 % (the deadline starts once mmgate's buffer for the client is full; the lease goes
back once the cut connection's handler is cancelled); no honest 429 (the queue timeout is shorter than the
deadline, so the only slot held to it would show as 429s); the slow reader cut (``client_write_timeout``) in both
cells, else its answer fit in the buffers and the cell tested nothing.

**Fairness.** A backend with a constant 200 ms service time behind mmgate with a limit of 2. Flow ``big``
sends 12 media requests at once; once they are all in (2 admitted, 10 queued), flow ``small`` sends 2. With
``x-gateway-inference-fairness-id`` the flows take turns; without it (FIFO) ``small`` waits behind all of
``big``. Recorded: how many forwards to the backend happen after ``small`` arrives until each of its requests
is forwarded (slots), and ``small``'s wait (Server-Timing ``queue``), fair against FIFO.

Everything runs in this process on one event loop (clients, mmgate from ``build_app``, the model backends);
the backends sleep rather than burn CPU, so the figures depend little on the shared machine.

    python -m bench run fleet [--set KNOB=VALUE] [--rounds N] [--quick]
    python -m bench list fleet   # the knobs and their defaults
Writes bench/results/fleet.md and .json (or PATH.md / PATH.json).
"""

from __future__ import annotations

import asyncio
import statistics
from typing import Any

from bench import _results as R
from proxy.edge.write_deadline import WRITE_TIMEOUT_CODE
from testkit import fleet_cells as fleet
from testkit.adaptive_sim import CELL, CLIENTS, SETTLED, STEP_AT, STEP_CELL
from testkit.curve_backend import SLOW_EVENT, SLOW_EVENTS
from testkit.servers import READER_RCVBUF

SLOW_SLACK = 1.05  # the slow reader's slot may be held the write deadline and this share more


async def case_cells(case: fleet.Case, quick: bool) -> dict[str, Any]:
    """The fixed limits (on the backend after the step, for a step), then ``auto``; its ratios and times."""
    step = case.after is not None
    fixed_curve = case.after if case.after is not None else case.curve
    auto_seconds = STEP_CELL if step else CELL
    limits = list(case.fixed) + ([fleet.TOO_HIGH[1]] if case.name == fleet.TOO_HIGH[0] and not quick else [])
    cells = [await fleet.load_cell(case.name, fixed_curve, str(limit), (STEP_CELL - STEP_AT) if step else CELL)
             for limit in limits]
    auto = await fleet.load_cell(case.name, case.curve, "auto", auto_seconds)
    auto["trace"] = R.downsample(auto["trace"], 1)
    best = max(cells[: len(case.fixed)], key=lambda c: c["throughput"])
    done = auto["done"]
    auto |= {"ratio": fleet.rate_between(done, STEP_AT + SETTLED if step else 0.0, auto_seconds) / best["throughput"],
             "reach_s": fleet.time_to_reach(done, 0.9 * best["throughput"], STEP_AT if step else 0.0, auto_seconds)}
    cruise = [c for t, _g, c in auto["trace"] if t >= auto_seconds / 2]
    auto["cruise_second_half"] = [min(cruise), max(cruise)] if cruise else None
    return {"cells": [*cells, auto], "best_fixed": best["limit"], "step": step}


async def run(rounds: int, quick: bool, attack: tuple[float, float, float]) -> list[dict[str, Any]]:
    measured: list[dict[str, Any]] = []
    for number in range(1, rounds + 1):
        print(f"round {number} of {rounds}", flush=True)
        models = {}
        for case in fleet.cases(quick)[:: 4 if quick else 1]:  # quick: one cold start, one step
            models[case.name] = await case_cells(case, quick)
            for c in models[case.name]["cells"]:
                extra = (f", ratio {c['ratio']:.3f}, 0.9× after {c['reach_s']} s, cruise in the second half "
                         f"{c['cruise_second_half']}") if c["limit"] == "auto" else ""
                print(f"  {case.name} limit {c['limit']:>4}: {c['throughput']:6.2f} answers/s "
                      f"(statuses {c['statuses']}){extra}", flush=True)
        attacks = [await fleet.attack_cell(kind, *attack) for kind in fleet.ATTACKS]
        slow = [await fleet.slow_reader_cell(limit) for limit in fleet.SLOW_LIMITS]
        fair, fifo = await fleet.fairness_cell(True), await fleet.fairness_cell(False)
        measured.append({"models": models, "attacks": [c | {"trace": R.downsample(c["trace"], 1)} for c in attacks],
                         "slow_reader": slow, "fair": fair, "fifo": fifo})
    return measured


def measure(knobs: R.Knobs) -> dict[str, Any]:
    attack = ((10.0, fleet.ATTACK_SECONDS, 12.0) if knobs.quick
              else (fleet.ATTACK_WARMUP, fleet.ATTACK_SECONDS, fleet.ATTACK_AFTER))
    stamp = R.stamp("fleet.py", "adaptive concurrency limit vs fixed limits on thrashing and batching backends, "
                                "under attack, against a slow reader; fair waiting")
    data = stamp | {"rounds": asyncio.run(run(knobs.rounds, knobs.quick, attack))}
    data["settings"] = {"rounds": knobs.rounds, "quick": knobs.quick, "clients": CLIENTS, "cell": CELL,
                        "step_at": STEP_AT, "step_cell": STEP_CELL, "settled": SETTLED,
                        "attack": list(attack), "base_seconds": fleet.BASE_SECONDS,
                        "slow_reader": {"write_deadline": fleet.WRITE_DEADLINE,
                                        "queue_timeout": fleet.SLOW_QUEUE_TIMEOUT, "rcvbuf": READER_RCVBUF,
                                        "stream_bytes": SLOW_EVENTS * len(SLOW_EVENT)}}
    return data


def slow_name(limit: str) -> str:
    return "auto" if limit == "auto" else f"fixed limit {limit}, released at completion"


def cell_of(r: dict[str, Any], model: str, limit: str) -> dict[str, Any]:
    return next(c for c in r["models"][model]["cells"] if c["limit"] == limit)


def goals(data: dict[str, Any]) -> list[R.Goal]:
    rounds = data["rounds"]

    def attack(r: dict[str, Any], kind: str) -> dict[str, Any]:
        return next(c for c in r["attacks"] if c["kind"] == kind)

    found: list[R.Goal] = []
    for name in rounds[0]["models"]:
        step = rounds[0]["models"][name]["step"]
        what = f"a step, {name}" if step else f"cold start, {name} backend"
        found += [
            R.goal(f"auto ÷ best fixed limit, answers/s ({what}; {'from 5 s after the step' if step else '15 s'})",
                   [cell_of(r, name, "auto")["ratio"] for r in rounds], "≥ 0.9", lambda v: v >= 0.9),
            R.goal(f"auto: seconds {'from the step ' if step else ''}to a {fleet.WINDOW:g} s window at 0.9× the best "
                   f"fixed limit ({what})", [cell_of(r, name, "auto")["reach_s"] for r in rounds], "≤ 5",
                   lambda v: v is not None and v <= 5, unit="s"),
        ]
        too_high = str(fleet.TOO_HIGH[1])
        if name == fleet.TOO_HIGH[0] and any(c["limit"] == too_high for c in rounds[0]["models"][name]["cells"]):
            found.append(R.goal(f"auto ÷ fixed limit {too_high} (too high), answers/s ({what})",
                                [cell_of(r, name, "auto")["throughput"] / cell_of(r, name, too_high)["throughput"]
                                 for r in rounds], "≥ 2", lambda v: v >= 2))
    for kind in fleet.ATTACKS:
        found += [
            R.goal(f"attack, {kind}: honest answers/s during ÷ before", [attack(r, kind)["during"] for r in rounds],
                   "≥ 0.8", lambda v: v >= 0.8, met_on="min"),
            R.goal(f"attack, {kind}: honest answers/s in the 10 s after ÷ before",
                   [attack(r, kind)["after"] for r in rounds], "≥ 0.8", lambda v: v >= 0.8, met_on="min"),
            R.goal(f"attack, {kind}: limit 10 s after ÷ when it began",
                   [attack(r, kind)["limit_10s_after"] / attack(r, kind)["pre_limit"] for r in rounds],
                   "0.9–1.1", lambda v: 0.9 <= v <= 1.1, met_on="every"),
        ]
    for limit in fleet.SLOW_LIMITS:
        cells = [next(c for c in r["slow_reader"] if c["limit"] == limit) for r in rounds]
        found += [
            R.goal(f"slow reader, {slow_name(limit)}: its slot held (write deadline {fleet.WRITE_DEADLINE:g} s)",
                   [c["held_s"] for c in cells], f"≤ {fleet.WRITE_DEADLINE * SLOW_SLACK:g}",
                   lambda v: v <= fleet.WRITE_DEADLINE * SLOW_SLACK, unit="s", met_on="max"),
            R.goal(f"slow reader, {slow_name(limit)}: honest answers 429", [c["honest"].get("429", 0) for c in cells],
                   "= 0", lambda v: v == 0, met_on="max"),
        ]
    found.append(R.goal("slow reader: cells whose client was cut (log code client_write_timeout)",
                        [sum(c["code"] == WRITE_TIMEOUT_CODE for c in r["slow_reader"]) for r in rounds],
                        f"= {len(fleet.SLOW_LIMITS)}", lambda v: v == len(fleet.SLOW_LIMITS), met_on="min"))
    return [
        *found,
        R.goal("fair: forwards until the small flow's last request (of those after it arrived)",
               [max(r["fair"]["slots"]) for r in rounds], "≤ 4", lambda v: v <= 4, met_on="max"),
        R.goal("FIFO: forwards until the small flow's last request", [max(r["fifo"]["slots"]) for r in rounds]),
        R.goal("small flow's wait, fair ÷ FIFO", [r["fair"]["small_wait"] / r["fifo"]["small_wait"] for r in rounds]),
    ]


def model_rows(rounds: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    """One row per limit of one backend: answers/s and their spread, ÷ the best fixed limit's, and for ``auto`` the
    rounds' times to reach 0.9× it and their cruise limits over the cell's second half."""
    rows = []
    for limit in [c["limit"] for c in rounds[0]["models"][name]["cells"]]:
        mine = [cell_of(r, name, limit) for r in rounds]
        m = R.summary(c["throughput"] for c in mine)
        row = {"limit": limit, "rate": R.number(m["median"]), "spread": R.spread_text(m), "reach": "–", "cruise": "–"}
        if limit == "auto":
            row |= {"share": R.number(R.summary(c["ratio"] for c in mine)["median"]),
                    "reach": ", ".join(str(c["reach_s"]) for c in mine),
                    "cruise": ", ".join(str(c["cruise_second_half"]) for c in mine)}
        else:
            best = [cell_of(r, name, r["models"][name]["best_fixed"])["throughput"] for r in rounds]
            row["share"] = R.number(m["median"] / statistics.median(best))
        rows.append(row)
    return rows


def report(data: dict[str, Any]) -> str:
    s = data["settings"]
    rounds = data["rounds"]
    lines = [f"{s['rounds']} rounds, {s['clients']} closed-loop clients; throughput in answers/s, median (min–max) of "
             "the rounds; `auto` starts cold in every cell."]
    for name, first in rounds[0]["models"].items():
        where = (f"from {STEP_AT:g} s of a {STEP_CELL:g} s cell; the fixed limits on the backend after the step, "
                 f"{STEP_CELL - STEP_AT:g} s cells; `auto` from {SETTLED:g} s after the step" if first["step"]
                 else f"{CELL:g} s cells")
        lines += ["", f"**{name}** ({'a capacity step' if first['step'] else 'cold start'}: `testkit.adaptive_sim`, "
                  f"{where}).", "",
                  *R.table([("limit", "limit", "s"), ("answers/s", "rate", ""), ("spread", "spread", "s"),
                            ("× best fixed", "share", ""), ("0.9× reached after s", "reach", "s"),
                            ("cruise limit, second half", "cruise", "s")], model_rows(rounds, name))]
    warmup, length, after = s["attack"]
    lines += ["", f"**Attacks** on `auto`: {fleet.HONEST_LOOPS} honest loops, backend {fleet.HONEST_SECONDS:g} s an "
              f"answer; from {warmup:g} s, {fleet.ATTACKERS} attacker loops for {length:g} s, then {after:g} s more. "
              "Honest answers/s during the attack and in the 10 s after it, each ÷ the 10 s before; the limit between "
              "probes when the attack began and 10 s after it ended.", "",
              *R.table([("round", "round", "s"), ("attack", "kind", "s"), ("honest/s before", "honest_before", ".2f"),
                        ("during ×", "during", ".2f"), ("after ×", "after", ".2f"), ("limit then", "pre_limit", ""),
                        ("10 s after", "limit_10s_after", ""), ("attack outcomes", "attacks", "s")],
                       [c | {"round": str(i), "attacks": str(c["attacks"])}
                        for i, r in enumerate(rounds, 1) for c in r["attacks"]])]
    lines += ["", f"**Slow reader**: `MMGATE_CLIENT_WRITE_TIMEOUT={fleet.WRITE_DEADLINE:g}`, "
              f"`MMGATE_QUEUE_TIMEOUT={fleet.SLOW_QUEUE_TIMEOUT:g}`; one client with a {READER_RCVBUF // 1024} KiB "
              f"receive buffer asks for a stream of {SLOW_EVENTS * len(SLOW_EVENT) >> 20} MiB and reads nothing; then "
              f"{fleet.HONEST_LOOPS} honest loops (backend {fleet.BASE_SECONDS * 1000:.0f} ms an answer) for "
              f"{fleet.WRITE_DEADLINE + fleet.SLOW_AFTER:g} s. Seconds from its lease's grant.", "",
              *R.table([("round", "round", "s"), ("limit", "limit", "s"), ("its slot held s", "held_s", ".3f"),
                        ("its request ended s", "ended", ""), ("its log code", "code", "s"),
                        ("honest statuses", "honest", "s")],
                       [c | {"round": str(i), "limit": slow_name(c["limit"]), "ended": R.number(c["ended_s"]),
                             "code": str(c["code"]), "honest": str(c["honest"])}
                        for i, r in enumerate(rounds, 1) for c in r["slow_reader"]])]
    lines += ["", f"Fairness: limit {fleet.FAIR_LIMIT}, service {fleet.FAIR_SERVICE * 1000:.0f} ms; flow `big` sends "
              f"{fleet.BIG}, then flow `small` sends {fleet.SMALL}. Slots: forwards after `small` arrived until each "
              "of its requests was forwarded (1 = the next one).", "",
              *R.table([("round", "round", "s"), ("fair: slots", "fair", "s"),
                        ("fair: small's wait s", "fair_wait", ".2f"), ("FIFO: slots", "fifo", "s"),
                        ("FIFO: small's wait s", "fifo_wait", ".2f")],
                       [{"round": str(i), "fair": str(r["fair"]["slots"]), "fair_wait": r["fair"]["small_wait"],
                         "fifo": str(r["fifo"]["slots"]), "fifo_wait": r["fifo"]["small_wait"]}
                        for i, r in enumerate(rounds, 1)])]
    return "\n".join(lines) + "\n"
