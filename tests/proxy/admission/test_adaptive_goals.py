"""Issue 43's goals for MMGATE_MAX_MM_CONCURRENCY=auto, in the deterministic simulator (``testkit.adaptive_sim``:
its clock is injected, so the throughput ratios asserted here are the same on every machine).

Converge in seconds: 24 closed-loop clients, 15 s cells from a cold start (at ``START``, as mmgate starts it),
against a batching backend given by its throughput, a thrashing one and a knee-shaped one; ``auto`` against the best
fixed limit found by sweeping. Follow the backend: the same load while, 8 s into a 20 s cell, the backend becomes 2×
slower, 2× faster, or its best concurrency moves from 8 to 4; ``auto`` from 5 s after the step against the best
fixed limit of the backend after it. Each goal is asserted on the median of 3 seeds; a floor is asserted on every
seed. A goal not met yet is an expected failure (strict: meeting it fails the test until the mark goes), with the
figures measured.
"""

from __future__ import annotations

import asyncio
import random
import statistics
from collections.abc import Callable

import orjson
import pytest

from proxy.admission.adaptive import START, TOLERANCE, UP_GAIN, AdaptiveLimit
from proxy.admission.gate import Gate
from proxy.admission.lease import Lease
from proxy.admission.sample import Sample
from testkit.adaptive_sim import (
    CELL,
    CHEAP,
    CLIENTS,
    COLD_START,
    HONEST,
    PLATEAU,
    SETTLED,
    STEP_AT,
    STEP_CELL,
    STEPS,
    Curve,
    Group,
    Run,
    Simulation,
    fixed_rates,
    flat,
    slowed,
    switched,
)
from testkit.media import eventually

SEEDS = range(3)


def auto(seed: int) -> Callable[[Callable[[], float]], AdaptiveLimit]:
    return lambda clock: AdaptiveLimit(1, 64, initial=START, clock=clock, rng=random.Random(seed))


def best_fixed(curve: Curve, duration: float) -> float:
    """The best fixed limit's completions per second over the whole cell."""
    return max(fixed_rates(curve, duration).values())


def runs(curve: Curve, duration: float) -> list[Run]:
    return [Simulation([Group("clients", CLIENTS, curve)], adaptive=auto(seed), seed=seed).run(duration)
            for seed in SEEDS]


def cold_start(name: str) -> tuple[list[float], list[float]]:
    """Per seed: ``auto`` over the best fixed limit over the whole cell, and from 5 s on."""
    curve = COLD_START[name]
    best = best_fixed(curve, CELL)
    done = runs(curve, CELL)
    return ([run.rate("clients", 0, CELL) / best for run in done],
            [run.rate("clients", SETTLED, CELL) / best for run in done])


def after_step(name: str) -> list[float]:
    """Per seed: ``auto`` from 5 s after the step to the end of the cell, over the new backend's best fixed limit."""
    curve, after = STEPS[name]
    best = best_fixed(after, STEP_CELL - STEP_AT)
    return [run.rate("clients", STEP_AT + SETTLED, STEP_CELL) / best for run in runs(curve, STEP_CELL)]


@pytest.mark.parametrize("name", COLD_START)
def test_from_a_cold_start_auto_is_near_the_best_fixed_limit_within_5_s(name: str) -> None:
    """From 5 s to the end of the cell. Measured: batching 1.00, thrashing 0.99, knee 0.99 (medians). Last round:
    0.38, 0.59, 0.26 (startup doubled 8 to 16 and waited for 16 answers of 3 s there)."""
    _whole, settled = cold_start(name)
    assert statistics.median(settled) >= 0.9
    assert min(settled) >= 0.8


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("name", COLD_START)
def test_once_found_the_limit_holds_within_one_step_of_its_probe(name: str, seed: int) -> None:
    """From 10 s to 30 s the cruise limit takes values at most one probe up apart. Last round: 8 and 16 on the
    batching and knee backends (the overshoot, held for seconds), 6 to 8 on the thrashing one."""
    run = Simulation([Group("clients", CLIENTS, COLD_START[name])], adaptive=auto(seed), seed=seed).run(30)
    held = {run.cruise_at(10 + tenth / 10) for tenth in range(200)}
    assert max(held) <= max(min(held) + 1, int(UP_GAIN * min(held)))


@pytest.mark.parametrize("name", COLD_START)
def test_from_a_cold_start_auto_over_the_whole_cell_is_09_of_the_best_fixed_limit(name: str) -> None:
    """Measured: batching 0.92 (0.91-0.92), thrashing 0.91 (0.90-0.91), knee 0.94 (0.91-0.94). Before the start
    at 4, a startup step of at least a third (not a half) and one middle tried past the knee: 0.82, 0.80, 0.85
    (the climb from 1 and the search past the knee cost most of the gap)."""
    whole, _settled = cold_start(name)
    assert statistics.median(whole) >= 0.9


NOISY, NOISY_SEEDS = 0.3, range(7)  # service times ±30 %, seven seeds


@pytest.mark.parametrize("name", [pytest.param(name, marks=pytest.mark.xfail(
    strict=True, reason="a noisy batching backend's 8 can read as a doubling's worth: some cold starts go on to 16"))
    if name == "batching" else name for name in COLD_START])
def test_from_a_cold_start_on_a_noisy_backend_every_run_finds_the_knee(name: str) -> None:
    """The same cold start with service times ±30 % instead of ±5 %: bench/fleet's runs over HTTP on the thrashing
    backend (0.784, 0.943, 0.799 of the best fixed limit) look like these, not like the quiet simulator's. Goal:
    median ≥ 0.9 and no run under 0.8. Measured, 7 seeds: thrashing 0.921 (0.89-0.93), knee 0.902 (0.87-0.95);
    batching 0.804 (0.71-0.94): its 8 read as a doubling's worth over 4 in the low runs, the climb went on to 16,
    where answers take 3 s, and the search back to 8 cost most of the cell. With a rate counted from completions
    instead of Little's law (``occupancy``): thrashing 0.884 (0.70-0.92), knee 0.916 (0.73-0.95), batching 0.906
    (0.72-0.94)."""
    curve = COLD_START[name]
    best = max(fixed_rates(curve, CELL, jitter=NOISY).values())
    whole = [Simulation([Group("clients", CLIENTS, curve)], adaptive=auto(seed), seed=seed, jitter=NOISY).run(CELL)
             .rate("clients", 0, CELL) / best for seed in NOISY_SEEDS]
    assert statistics.median(whole) >= 0.9 and min(whole) >= 0.8


@pytest.mark.parametrize("name", COLD_START)
def test_from_a_cold_start_auto_over_the_whole_cell_is_far_above_last_round(name: str) -> None:
    """Last round: batching 0.45, thrashing 0.54, knee 0.40."""
    whole, _settled = cold_start(name)
    assert min(whole) >= 0.7


@pytest.mark.parametrize("name", STEPS)
def test_a_capacity_step_is_followed_within_5_s(name: str) -> None:
    """Measured: 2x slower 0.97 (0.97-1.01), 2x faster 0.94 (0.92-0.98), knee 8 to 4 0.95 (0.81-1.02), batching
    best 8 to 4 0.98 (0.97-1.01). Last round: 0.32 (the limit gave way and stayed down), 0.94, 0.00 and 0.22 (the
    limit stayed past the new knee, and nothing completed)."""
    assert statistics.median(after_step(name)) >= 0.9


@pytest.mark.parametrize("name", STEPS)
def test_a_capacity_step_costs_at_most_a_fifth_on_every_seed(name: str) -> None:
    assert min(after_step(name)) >= 0.8


PLATEAU_SEEDS = range(20)


def plateau_runs() -> list[Simulation]:
    """Cold starts on the real vLLM's plateau: 16 clients (as bench/fleet_vllm's), service times ±30 % (its phases'
    rates differ that much), 40 s."""
    simulations = [Simulation([Group("clients", 16, PLATEAU)], adaptive=auto(seed), seed=seed, jitter=NOISY)
                   for seed in PLATEAU_SEEDS]
    for simulation in simulations:
        simulation.run(40)
    return simulations


def test_on_a_plateau_every_cold_start_settles_at_its_lower_end() -> None:
    """The median cruise limit from 20 s to 40 s, per seed. Measured: 4 (3-5), 17 seeds of 20 at 4. When startup
    settled on the smallest limit with 95 % of the best rate: 4 (2-13), 7 seeds past 6 (±50 %: 5.5 (2-15), 8), as
    the real vLLM's rounds settled at 6, 13 and 15: the plateau's limits read within noise of each other, and the
    highest reading chose among them."""
    settled = [statistics.median_low(simulation.result.cruise_at(20 + tenth / 10) for tenth in range(200))
               for simulation in plateau_runs()]
    assert statistics.median(settled) == 4 and max(settled) <= 6, settled


def test_on_a_plateau_two_classes_of_the_same_work_settle_as_one() -> None:
    """Half the requests, at random, are of another class (the real vLLM's answers of 15 and 16 tokens fall in two
    output buckets): a class first seen in a phase at a higher limit, its first answer slower for the load, was
    seeded that much dearer, and that phase's rate read higher by its share. Measured, 20 seeds, the median cruise
    limit from 20 s to 40 s: 4 (2-6), 16 seeds at 4; seeded as its first answer came, 4 (2-15), 6 seeds past 6."""
    settled = []
    for seed in PLATEAU_SEEDS:
        simulation = Simulation([Group("clients", 16, PLATEAU, other_cls=("chat", False, 6, 1))],
                                adaptive=auto(seed), seed=seed, jitter=NOISY)
        simulation.run(40)
        settled.append(statistics.median_low(simulation.result.cruise_at(20 + tenth / 10) for tenth in range(200)))
    assert statistics.median(settled) == 4 and max(settled) <= 6, settled


def test_on_a_plateau_a_first_phase_slowed_by_the_start_s_burst_is_measured_again() -> None:
    """Every answer 1.3 times slower for the first second (the clients' first requests, built and prepared all at
    once on the backend's cores: on the real vLLM the first phase read up to 27 % under the rate its limit keeps):
    4's first phase reads low, 8 looked like growth. Measured, 20 seeds, the median cruise limit from 20 s to 40 s:
    4 (3-4); judged on the first phase, 8 (4-15), 16 seeds past 6."""
    settled = []
    for seed in PLATEAU_SEEDS:
        simulation = Simulation([Group("clients", 16, slowed(PLATEAU, 1.3, 0, 1.0))], adaptive=auto(seed), seed=seed,
                                jitter=NOISY)
        simulation.run(40)
        settled.append(statistics.median_low(simulation.result.cruise_at(20 + tenth / 10) for tenth in range(200)))
    assert statistics.median(settled) == 4 and max(settled) <= 5, settled


def test_settling_below_the_limit_in_force_is_not_read_as_a_slowdown() -> None:
    """Startup settles on 4 after trying 13: the backend still holds 13 requests, each slower for it. Read against
    4's usual latency, they looked 3.06× late and the limit gave way (seed 6); the backend never changed."""
    gave_way = {seed: [move.why for move in simulation.adaptive.moves if "giving way" in move.why]
                for seed, simulation in zip(PLATEAU_SEEDS, plateau_runs(), strict=True)
                if simulation.adaptive is not None}
    assert not any(gave_way.values()), gave_way


def test_a_backend_that_stops_answering_is_given_way_before_anything_completes() -> None:
    """From 10 s every answer takes a minute: no sample arrives for a minute, but the requests' ages say the
    rate fell, and the tick acts on them (last round: the limit stayed at 16 until answers came)."""
    curve = switched(flat(0.1), flat(60.0), 10)
    run = Simulation([Group("clients", 16, curve)], adaptive=auto(0), seed=0).run(14)
    assert run.cruise_at(10) == 16
    assert run.samples_between(10.2, 14) == 0
    assert run.cruise_at(14) <= 16 / TOLERANCE  # it gave way by the lateness it saw, without a single answer


async def test_the_gate_ticks_the_limit_while_nothing_completes() -> None:
    """Startup went from 1 to 2; the two requests of the phase at 2 stay at the backend 10 s, ten times what
    one took at 1: without any answer or counter change, the gate's timer lets the controller see that the
    phase cannot beat 1's rate, and the limit comes back to 1."""
    now = [0.0]
    adaptive = AdaptiveLimit(1, 8, clock=lambda: now[0], rng=random.Random(0))
    gate = Gate(0, byte_budget=0, max_queue=100, adaptive=adaptive, clock=lambda: now[0])
    waiting = asyncio.create_task(gate.acquire(0, 60))  # demand beyond the limit all along: the phases are busy
    await eventually(lambda: gate.waiting == 1 or waiting.done(), "one request waiting")
    first = await waiting if waiting.done() else None
    while gate.limit == 1:
        lease = first or await gate.acquire(0, 60)
        first = None
        lease.handed_off()
        now[0] += 0.1
        gate.observe(lease, Sample(0.1, HONEST))
        lease.release()
    held: list[Lease] = [await gate.acquire(0, 60) for _ in range(gate.limit)]
    extra = asyncio.create_task(gate.acquire(0, 60))
    for lease in held:
        lease.handed_off()
    samples = adaptive.samples
    now[0] += 10.0
    await eventually(lambda: gate.limit == 1, "the limit back at 1 with nothing completed")
    assert adaptive.samples == samples and gate.in_use == 2
    for lease in held:
        lease.release()
    (await extra).release()
    assert gate.in_use == 0


def test_it_says_why_the_limit_last_moved_and_what_it_had_measured() -> None:
    """``explain`` (what /mmgate/stats can show): the phase it is in, and each change of the limit with the
    reason and the samples behind it; here the give-way after the knee moved from 8 to 4."""
    simulation = Simulation([Group("clients", CLIENTS, STEPS["knee 8 to 4"][0])], adaptive=auto(0), seed=0)
    simulation.run(STEP_CELL)
    assert simulation.adaptive is not None
    explained = simulation.adaptive.explain()
    assert explained["mode"] in ("startup", "probe") and explained["limit"] == simulation.limit
    moves = explained["moves"]
    assert isinstance(moves, list) and moves
    assert all(move["limit"] != move["before"] for move in moves[1:])
    assert [move["limit"] for move in moves] == [limit for _t, limit in _changes(simulation.result.limits)]
    gave_way = [move for move in moves if move["at"] >= STEP_AT and "giving way" in move["why"]]
    assert gave_way and gave_way[0]["limit"] < gave_way[0]["before"]
    assert gave_way[0]["at_least"] is not None or gave_way[0]["latency"] is not None  # what it saw
    measured = [move for move in moves if move["rate"] is not None]  # phases that ended on their answers ...
    assert measured and all(0 <= move["spread"] < 0.5 for move in measured if move["spread"] is not None)
    assert sum(move["spread"] is not None for move in measured) >= len(measured) - 1  # ... say how noisy they were
    orjson.dumps(explained)  # as /mmgate/stats would serve it


def _changes(trace: list[tuple[float, int]]) -> list[tuple[float, int]]:
    changes: list[tuple[float, int]] = []
    for when, limit in trace:
        if not changes or changes[-1][1] != limit:
            changes.append((when, limit))
    return changes


ATTACK_START, ATTACK_STOP, ATTACK_AFTER = 60.0, 63.0, 10.0
ATTACKS: dict[str, Group] = {
    "fast answers of another class": Group("attacker", 2, flat(0.001), cls=CHEAP, start=ATTACK_START,
                                           stop=ATTACK_STOP),
    "fast answers of the same class": Group("attacker", 2, flat(0.001), start=ATTACK_START, stop=ATTACK_STOP),
    "refusals": Group("attacker", 2, flat(0.001), outcome="refused", start=ATTACK_START, stop=ATTACK_STOP),
    "aborts after 50 ms": Group("attacker", 2, flat(1.0), outcome="abort", after=0.05, start=ATTACK_START,
                                stop=ATTACK_STOP),
    "readers that stall after 50 ms": Group("attacker", 2, flat(1.0), outcome="stall", after=0.05, stall_for=5.0,
                                            start=ATTACK_START, stop=ATTACK_STOP),
}


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("name", ATTACKS)
def test_every_attack_keeps_its_goals_with_the_new_signals(name: str, seed: int) -> None:
    """test_adaptive.py's attacks on every seed, now that the ages of requests and a fall of the rate move the
    limit too: 8 honest loops at 1 s an answer; honest throughput during the attack and in the 10 s after it at
    least 0.8 of the 20 s before, the limit back within 10 % (a flood inside an honest class may move it a step:
    its throughput is asserted, not its limit)."""
    simulation = Simulation([Group("honest", 8, flat(1.0)), ATTACKS[name]], adaptive=auto(seed), seed=seed)
    run = simulation.run(ATTACK_STOP + ATTACK_AFTER + 5)
    before = run.rate("honest", ATTACK_START - 20, ATTACK_START)
    assert run.rate("honest", ATTACK_START, ATTACK_STOP) >= 0.8 * before
    assert run.rate("honest", ATTACK_STOP, ATTACK_STOP + ATTACK_AFTER) >= 0.8 * before
    if name != "fast answers of the same class":
        pre = run.cruise_at(ATTACK_START)
        assert abs(run.cruise_at(ATTACK_STOP + ATTACK_AFTER) - pre) <= 0.1 * pre
