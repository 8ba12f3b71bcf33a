"""MMGATE_MAX_MM_CONCURRENCY=auto: the controller against model backends and attacks in the deterministic simulator
(``testkit.adaptive_sim``: its clock, seeded jitter, so every figure here is the same on every machine), its
bounds under any input, the Gate feeding it, and the proxy exporting it.

The attacks are the issue's scenario: 8 honest closed loops against a backend that takes 1 s an answer, 60 s to
settle, then 2 attacker loops for 3 s. Goals: honest throughput during the attack and in the 10 s after it at
least 0.8 times what it was in the 20 s before, and the limit back within 10 % of where it was 10 s after."""

from __future__ import annotations

import asyncio
import random
from collections import deque
from collections.abc import Callable

import aiohttp
import pytest
from aiohttp import web
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.admission.adaptive import MIN_GRADIENT, NON_VALIDATED_S, START, AdaptiveLimit, Move
from proxy.admission.gate import Gate
from proxy.admission.lease import Lease
from proxy.admission.sample import Sample, SampleClass
from proxy.settings import ConfigError, Settings
from testkit.adaptive_sim import (
    CHEAP,
    HONEST,
    Curve,
    Group,
    Run,
    Simulation,
    batching,
    by_throughput,
    flat,
    slowed,
    switched,
    thrashing,
)
from testkit.media import chat_with_image, data_uri, eventually, image_bytes
from tests.conftest import StartProxy, Upstream

SETTLE, ATTACK, AFTER = 60.0, 3.0, 10.0


def auto(seed: int = 0, floor: int = 1, ceiling: int = 64, initial: int = START
         ) -> Callable[[Callable[[], float]], AdaptiveLimit]:
    """As mmgate makes it (``GateClient``): a cold start at ``START``."""
    return lambda clock: AdaptiveLimit(floor, ceiling, initial=initial, clock=clock, rng=random.Random(seed))


def honest() -> Group:
    return Group("honest", 8, flat(1.0))


def attacked(attacker: Group, seed: int = 0) -> tuple[Run, Simulation]:
    simulation = Simulation([honest(), attacker], adaptive=auto(seed), seed=seed)
    return simulation.run(attacker.start + ATTACK + AFTER + 5), simulation


def assert_unmoved(run: Run, start: float = SETTLE) -> None:
    end = start + ATTACK
    before = run.rate("honest", start - 20, start)
    assert run.rate("honest", start, end) >= 0.8 * before
    assert run.rate("honest", end, end + AFTER) >= 0.8 * before
    pre = run.cruise_at(start)
    assert pre == 8  # as many as the honest clients: the backend has room for all
    assert abs(run.cruise_at(end + AFTER) - pre) <= 0.1 * pre


# --- attacks -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(3))
def test_fast_answers_of_another_class_move_nothing(seed: int) -> None:
    """``max_tokens: 1`` answers, at once: their own class, worth a thousandth of an honest answer."""
    run, _ = attacked(Group("attacker", 2, flat(0.001), cls=CHEAP, start=SETTLE, stop=SETTLE + ATTACK), seed)
    assert run.rate("attacker", SETTLE, SETTLE + ATTACK) > 10  # they did get through, dozens of them
    assert_unmoved(run)


# Starts found by sweeping the attack's start in 0.1 s steps (seed 0): each landed on the end of a phase that the
# attack's cheap answers filled alone, before an honest request admitted in it could complete.
@pytest.mark.parametrize("after_settling", [0.2, 8.6, 12.5, 23.9, 26.7, 27.0, 27.1, 27.3, 28.4])
def test_fast_answers_that_begin_as_a_phase_ends_move_nothing(after_settling: float) -> None:
    start = SETTLE + after_settling
    run, _ = attacked(Group("attacker", 2, flat(0.001), cls=CHEAP, start=start, stop=start + ATTACK))
    assert_unmoved(run, start)


@pytest.mark.parametrize("seed", range(3))
def test_refusals_at_once_are_no_samples(seed: int) -> None:
    run, simulation = attacked(Group("attacker", 2, flat(0.001), outcome="refused", start=SETTLE,
                                     stop=SETTLE + ATTACK), seed)
    assert_unmoved(run)
    assert simulation.adaptive is not None
    assert simulation.adaptive.samples == len(run.completions["honest"])


@pytest.mark.parametrize("seed", range(3))
def test_clients_that_abort_after_50_ms_move_nothing(seed: int) -> None:
    run, _ = attacked(Group("attacker", 2, flat(1.0), outcome="abort", after=0.05, start=SETTLE,
                            stop=SETTLE + ATTACK), seed)
    assert_unmoved(run)


def test_fast_answers_of_the_same_class_barely_move_its_reference() -> None:
    """The worst case: answers that look honest (no usage, no max_tokens) and come at once. The class's
    reference is a long average: it moves at most 2/601 a sample. Their work counts, so the limit may move a
    step (reported, not asserted); honest throughput holds."""
    simulation = Simulation([honest(), Group("attacker", 2, flat(0.001), start=SETTLE, stop=SETTLE + ATTACK)],
                            adaptive=auto())
    assert simulation.adaptive is not None
    simulation.advance(SETTLE)
    reference = simulation.adaptive.references.value(HONEST)
    run = simulation.advance(SETTLE + ATTACK)
    attacks = len(run.completions["attacker"])
    assert attacks >= 40
    assert simulation.adaptive.references.value(HONEST) >= 0.83 * reference
    run = simulation.advance(SETTLE + ATTACK + AFTER)
    before = run.rate("honest", SETTLE - 20, SETTLE)
    assert run.rate("honest", SETTLE, SETTLE + ATTACK) >= 0.8 * before
    assert run.rate("honest", SETTLE + ATTACK, SETTLE + ATTACK + AFTER) >= 0.8 * before


def test_a_slow_reader_right_after_the_start_costs_only_what_the_backend_holds_for_it() -> None:
    """Clients that stop reading after 50 ms: no sample, so the limit grows from the start as it would without
    them; their slots stay until the backend is done (2 s of every 5 s, 4 readers), so honest clients get
    16 slots less theirs. Measured 0.93× the honest rate alone."""
    clients = [Group("honest", 16, flat(0.1))]
    readers = [Group("reader", 4, flat(2.0), outcome="stall", after=0.05, stall_for=5.0)]
    alone = Simulation(clients, adaptive=auto()).run(30)
    stalled = Simulation(clients + readers, adaptive=auto()).run(30)
    grown = next(t for t, limit in alone.cruise if limit >= 16)
    assert next(t for t, limit in stalled.cruise if limit >= 16) <= grown + 0.5
    assert stalled.rate("honest", 0, 30) >= 0.9 * alone.rate("honest", 0, 30)


def test_traffic_that_comes_a_minute_after_the_start_is_climbed_as_at_once() -> None:
    """A phase begun on an idle gate is measured from its first request: a wait for traffic is not demand
    that left the limit unfilled, which would end the doubling at the floor."""
    at_once = Simulation([Group("clients", 16, flat(0.1))], adaptive=auto()).run(10)
    late = Simulation([Group("clients", 16, flat(0.1), start=60)], adaptive=auto()).run(70)
    grown = next(t for t, limit in at_once.cruise if limit >= 16)
    assert next(t for t, limit in late.cruise if limit >= 16) - 60 <= grown + 0.5


# --- finding the best limit ----------------------------------------------------------------------------------


def against_fixed(groups: list[Group], fixed: list[int], duration: float, seed: int = 0) -> tuple[float, Run]:
    """``auto``'s throughput over the best fixed limit's, the same loads in the same simulator; and its run."""
    def total(run: Run) -> float:
        return sum(run.rate(group.name, 0, duration) for group in groups)

    best = max(total(Simulation(groups, fixed=limit, seed=seed).run(duration)) for limit in fixed)
    run = Simulation(groups, adaptive=auto(seed), seed=seed).run(duration)
    return total(run) / best, run


@pytest.mark.parametrize("seed", range(3))
def test_a_thrashing_backend_is_held_at_its_knee(seed: int) -> None:
    """bench/fleet's model: service time 100 ms × max(1, (c/4)²), 32 clients."""
    ratio, run = against_fixed([Group("clients", 32, thrashing(0.1, 4))], [1, 2, 3, 4, 5, 6, 8, 16], 60, seed)
    assert ratio >= 0.85
    assert {limit for t, limit in run.cruise if t >= 10} <= {3, 4, 5}


@pytest.mark.parametrize("seed", range(3))
def test_a_batching_backend_is_climbed_to_near_its_best_limit(seed: int) -> None:
    """Latency 100 ms × (1 + (c-1)/4) grows with the batch while throughput still grows, up to 12; past it,
    × (c/12)²: a controller driven by latency alone reads the rise as queueing and stays low."""
    ratio, run = against_fixed([Group("clients", 48, batching(0.1, 12))], [1, 2, 4, 8, 12, 16, 24], 60, seed)
    assert ratio >= 0.85
    assert 8 <= run.cruise_at(60) <= 14


@pytest.mark.parametrize("seed", range(3))
def test_a_vllm_shaped_backend(seed: int) -> None:
    """The issue's real vLLM: 2.6 answers/s at 1, 4.0 at 4, 5.2 at 8; 16 clients (vllm bench serve)."""
    curve = by_throughput({1: 2.6, 2: 3.4, 4: 4.0, 8: 5.2, 16: 5.5})
    ratio, _run = against_fixed([Group("clients", 16, curve)], [1, 2, 4, 8, 12, 16], 60, seed)
    assert ratio >= 0.8


# bench/fleet_vllm's real vLLM through mmgate on 2 cores: a plateau from 2 to 12, within 12 % of its best.
VLLM_PLATEAU = by_throughput({1: 4.78, 2: 7.38, 4: 7.72, 8: 8.33, 12: 8.21})


def plateau_moves(jitter: float, duration: float) -> list[list[Move]]:
    """Each of 12 seeds' moves on the plateau, 16 clients, service times ±``jitter``."""
    out = []
    for seed in range(12):
        simulation = Simulation([Group("clients", 16, VLLM_PLATEAU)], adaptive=auto(seed), seed=seed, jitter=jitter)
        simulation.run(duration)
        assert simulation.adaptive is not None
        out.append(list(simulation.adaptive.moves))
    return out


def test_noise_does_not_walk_the_limit_down_a_plateau() -> None:
    """With service times ±20 %, a probe down must keep 95 % of the best lately by a standard error of its rate:
    no run keeps two in 90 s. Judged on the rate alone, seeds 0 and 9 walked down two and three steps by luck."""
    for seed, moves in enumerate(plateau_moves(0.2, 90)):
        kept = [move.before for move in moves if move.why == "probe down kept the rate"]
        assert len(kept) <= 1, (seed, kept)


def test_noise_rarely_walks_the_limit_up_a_plateau() -> None:
    """With service times ±30 %, a probe up must grow the rate 10 % by a standard error of its rate: 4 kept in 12
    runs of 90 s. Judged on the rate alone, 10."""
    kept = [sum(move.why.startswith("probe up paid") for move in moves) for moves in plateau_moves(0.3, 90)]
    assert sum(kept) <= 4, kept


def test_a_first_phase_that_could_not_have_won_is_not_measured_again() -> None:
    """Startup measures its first phase again only where reading it 30 % low could be why it lost: a backend with
    room for all 8 clients doubles its rate from 4 to 8, and 4 is left as measured."""
    simulation = Simulation([Group("clients", 8, flat(1.0))], adaptive=auto(), seed=0)
    simulation.run(20)
    assert simulation.adaptive is not None
    whys = [move.why for move in simulation.adaptive.moves]
    assert any("startup over" in why for why in whys)
    assert not any("measured again" in why for why in whys), whys


def test_a_probe_down_does_not_give_way_for_the_requests_the_phase_above_left() -> None:
    """With service times ±60 %, a probe down's requests at the backend include the last phase's, which took
    longer because there were more of them: their ages count from the probe's start, so none gives way for them
    (counted from their hand-off, seeds 3, 7 and 9 gave way from 3 to 2 in their first seconds)."""
    for seed, moves in enumerate(plateau_moves(0.6, 30)):
        stuck = [(move.at, move.why) for move in moves if move.why.startswith("down: ")]
        assert not stuck, (seed, stuck)


@pytest.mark.parametrize("seed", range(3))
def test_a_backend_slowing_down_is_given_way_and_taken_back(seed: int) -> None:
    """Three times slower from 40 s to 60 s (other work on it): the first cruising phase that sees it cuts the
    limit, by no more than half (a probe up and down may come first: they do not judge latency); then it is
    searched for again, and once the backend is fast again the limit (within one step of a probe up) and the
    throughput come back."""
    curve: Curve = slowed(thrashing(0.1, 8), 3.0, 40, 60)
    run = Simulation([Group("clients", 32, curve)], adaptive=auto(seed), seed=seed).run(90)
    pre = run.cruise_at(40)
    assert pre == 8
    cut_at, cut = next((t, limit) for t, limit in run.cruise if t >= 40)
    assert cut_at <= 45 and MIN_GRADIENT * pre <= cut < pre
    assert pre <= run.cruise_at(75) <= pre + 1  # found again, give or take one step of its probe up
    assert run.rate("clients", 75, 90) >= 0.9 * run.rate("clients", 25, 40)  # issue 43: back to 0.9 of the best


@pytest.mark.parametrize("seed", range(3))
def test_a_quick_first_batch_is_not_the_usual_latency(seed: int) -> None:
    """A backend whose first answers, on an idle server, come twice as fast as steady ones (the real vLLM's first
    batch: its requests start together and nothing else is prefilled beside them): startup's phases measured
    that, and the first cruise phase learns the usual instead of giving way to it."""
    def curve(concurrency: int, now: float) -> float:
        return VLLM_PLATEAU(concurrency, now) * (0.5 if now < 1.0 else 1.0)

    simulation = Simulation([Group("clients", 16, curve)], adaptive=auto(seed), seed=seed)
    simulation.run(30)
    assert simulation.adaptive is not None
    gave_way = [(move.at, move.why) for move in simulation.adaptive.moves if "giving way" in move.why]
    assert not gave_way


@pytest.mark.parametrize("seed", range(3))
def test_a_collapsed_limit_comes_back_within_10_s(seed: int) -> None:
    """For 30 s the backend thrashes past one request: the limit sits at the floor (where it starts here: from
    ``START`` it takes longer to come down, ``test_a_backend_whose_best_is_under_the_start_is_found``). Then it
    has room for all 16 clients: five busy phases at the floor force a probe up, two that pay in proportion
    double again."""
    curve = switched(thrashing(0.1, 1), flat(0.1), 30)
    run = Simulation([Group("clients", 16, curve)], adaptive=auto(seed, initial=1), seed=seed).run(45)
    assert run.cruise_at(30) == 1
    back = next(t for t, limit in run.cruise if t >= 30 and abs(limit - 16) <= 1.6)
    assert back <= 40
    assert abs(run.cruise_at(45) - 16) <= 1.6


def test_answers_that_come_in_bunches_read_the_rate_the_backend_gave() -> None:
    """Over HTTP the clients answered together send again together, after the whole bunch: four requests of
    250 ms at a time are 16 answers a second, worth 4 seconds of typical service a second. Counted from the
    completions during each request's time at the backend, the k-th of the bunch read k of them: 2.5."""
    now = [0.0]
    limit = AdaptiveLimit(1, 64, initial=4, clock=lambda: now[0], rng=random.Random(0))
    while len(limit.moves) < 2:
        handed = []
        for request in range(4):
            now[0] += 1e-4
            limit.load(request + 1, 20)
            granted_at = limit.granted()
            handed.append((limit.phase, granted_at, limit.started(limit.phase)))
        now[0] = handed[0][2] + 0.25
        for phase, granted_at, started_at in handed:
            now[0] += 1e-5
            limit.observe(Sample(0.25, HONEST), phase, granted_at)
            limit.ended(phase, started_at)
            limit.given_back(granted_at)
        limit.load(0, 20)
        now[0] += 0.002  # the clients' next requests reach the gate
    first = limit.moves[1]
    assert first.before == 4 and first.rate is not None
    assert abs(first.rate - 4.0) < 0.1


def test_a_slot_held_while_mmgate_prepares_the_request_counts_against_the_rate() -> None:
    """Two slots, each held 0.1 s while mmgate prepares its request, then 0.2 s at the backend: the limit delivers
    2 / 0.3 completions a second, worth 0.2 s of service each. Read at the backend alone (the requests it held
    over each one's 0.2 s there: 1.5) the rate would be 7.5 a second, and a small limit, which loses the most to
    such gaps, would look as good as a larger one."""
    now = [0.0]
    limit = AdaptiveLimit(1, 64, initial=2, clock=lambda: now[0], rng=random.Random(0))
    events: list[tuple[float, int, str, tuple[int, float, float]]] = [(0.0, 0, "grant", (0, 0.0, 0.0)),
                                                                     (0.15, 1, "grant", (0, 0.0, 0.0))]
    held = 0
    while len(limit.moves) < 2:
        events.sort()
        now[0], slot, what, (phase, granted_at, started_at) = events.pop(0)
        if what == "grant":
            held += 1
            limit.load(held, 20)
            events.append((now[0] + 0.1, slot, "hand off", (limit.phase, limit.granted(), 0.0)))
        elif what == "hand off":
            events.append((now[0] + 0.2, slot, "answered", (phase, granted_at, limit.started(phase))))
        else:
            limit.observe(Sample(0.2, HONEST), phase, granted_at)
            limit.ended(phase, started_at)
            limit.given_back(granted_at)
            held -= 1
            limit.load(held, 20)
            events.append((now[0], slot, "grant", (0, 0.0, 0.0)))
    first = limit.moves[1]
    assert first.before == 2 and first.rate is not None
    assert abs(first.rate - 2 / 0.3 * 0.2) < 0.02


def test_a_class_first_seen_under_more_load_is_worth_what_the_others_are() -> None:
    """The known class's answers take twice their reference now (the backend holds more than when it was learnt):
    a new class's first answer, as long as theirs, is seeded at their reference, not at twice it (which would make
    every answer of it count double in the rates startup compares)."""
    other: SampleClass = ("chat", False, 6, 1)
    now = [0.0]
    limit = AdaptiveLimit(1, 64, initial=4, clock=lambda: now[0], rng=random.Random(0))
    limit.load(4, 20)
    granted_at = limit.granted()
    limit.observe(Sample(1.0, HONEST), limit.phase, granted_at)
    for _ in range(8):
        now[0] += 0.1
        limit.observe(Sample(2.0, HONEST), limit.phase - 1, granted_at)  # admitted earlier: no rate, a load
    now[0] += 0.1
    limit.observe(Sample(2.0, other), limit.phase, granted_at)
    assert limit.references.value(HONEST) == 1.0
    assert limit.references.value(other) == pytest.approx(1.0)


@pytest.mark.parametrize("seed", range(3))
def test_a_backend_whose_best_is_under_the_start_is_found(seed: int) -> None:
    """A backend that thrashes past 2 requests: the cold start at 4 is too high, nothing below it was tried, so the
    cycle opens on a probe down, and the descent goes on while it keeps the rate. Measured: 2 by 5.2-5.3 s, from
    20 s 0.92 of the best fixed limit's throughput (past one
    request, the same backend costs more: 2 and 3 alternate for a minute, about 0.5; docs/fleet.md)."""
    curve = thrashing(0.1, 2)
    run = Simulation([Group("clients", 16, curve)], adaptive=auto(seed), seed=seed).run(60)
    best = max(Simulation([Group("clients", 16, curve)], fixed=limit).run(60).rate("clients", 20, 60)
               for limit in (1, 2, 3, 4))
    assert run.cruise_at(10) == 2
    assert run.rate("clients", 20, 60) / best >= 0.85


# --- what it does not do -------------------------------------------------------------------------------------


def test_a_limit_demand_does_not_fill_never_grows_and_comes_down_to_what_was_used() -> None:
    """App-limited phases (under half the time full) raise nothing; a whole phase that leaves slots unused
    brings the limit down to what was used (TCP congestion window validation)."""
    groups = [Group("steady", 4, flat(0.1)), Group("burst", 12, flat(0.1), stop=20)]
    run = Simulation(groups, adaptive=auto(), seed=0).run(40)
    assert run.cruise_at(19) == 16
    assert {run.cruise_at(25 + t / 10) for t in range(150)} == {4}


def test_startup_waits_for_demand_that_fills_the_limit() -> None:
    """One request (a warm-up, a health probe with an image), a minute of nothing, then 16 clients: startup
    measured nothing busy before, so it doubles from ``START`` when they come: 16 within a second. Measured: 153
    answers/s over the 10 s, where ending startup on the lone request left the limit at 4 for 3 s, climbing by
    probes to 12 by 4 s and 15 by 6 s (113 answers/s)."""
    groups = [Group("warm", 1, flat(0.1), stop=0.05), Group("clients", 16, flat(0.1), start=60)]
    run = Simulation(groups, adaptive=auto(), seed=0).run(70)
    assert run.cruise_at(59) == START
    assert run.cruise_at(61.5) >= 14


def test_a_limit_lowered_for_want_of_demand_comes_back_when_demand_does() -> None:
    """RFC 7661: 16 clients for 20 s, 2 for 20 s (the limit comes down to what they use), then 16 again: the limit
    they had comes back at once, where a climb from 2 would take seconds."""
    groups = [Group("steady", 2, flat(0.1)), Group("burst", 14, flat(0.1), stop=20),
              Group("again", 14, flat(0.1), start=40)]
    run = Simulation(groups, adaptive=auto(), seed=0).run(45)
    assert run.cruise_at(19) >= 14
    assert run.cruise_at(39) <= 3
    assert run.cruise_at(40.05) >= 14


def test_after_the_non_validated_period_a_lowered_limit_stays_lowered() -> None:
    """After ``NON_VALIDATED_S`` the limit it had is forgotten: the backend may have changed meanwhile."""
    groups = [Group("steady", 2, flat(0.1)), Group("burst", 14, flat(0.1), stop=20),
              Group("again", 14, flat(0.1), start=30 + NON_VALIDATED_S)]
    run = Simulation(groups, adaptive=auto(), seed=0).run(31 + NON_VALIDATED_S)
    assert run.cruise_at(19) >= 14
    assert run.cruise_at(30.05 + NON_VALIDATED_S) <= 3


def test_a_limit_lowered_for_want_of_demand_does_not_come_back_once_the_backend_changed() -> None:
    """RFC 7661's restore brings back a limit that was measured. A backend that slowed down since (the limit gave
    way) voids that measurement: here its knee moved from beyond 16 to 4 while demand was low, and the 14
    clients who come back must not be let in at the old limit of 16 at once (by the time they wait, the
    restore would put 16 requests at a backend that thrashes past 4)."""
    curve = switched(flat(0.1), thrashing(0.2, 4), at=25)
    groups = [Group("steady", 4, curve), Group("burst", 12, curve, stop=20), Group("again", 12, curve, start=40)]
    run = Simulation(groups, adaptive=auto(), seed=0).run(42)
    assert run.cruise_at(19) >= 14
    assert run.cruise_at(39) <= 4
    assert run.cruise_at(40.05) <= 4


def test_samples_of_requests_admitted_in_an_earlier_phase_judge_nothing() -> None:
    now = [0.0]
    limit = AdaptiveLimit(1, 64, clock=lambda: now[0], rng=random.Random(0))
    limit.load(1, 5)
    stale = limit.phase - 1
    for _ in range(200):
        now[0] += 0.1
        assert not limit.observe(Sample(0.1, HONEST), stale, now[0] - 0.1)
    assert limit.limit == 1 and limit.phase == stale + 1 and limit.samples == 200


def test_replicas_do_not_probe_in_step() -> None:
    """BBR's random start of the cycle: the first probe up comes at another time with another generator."""
    def first_probe(seed: int) -> float:
        run = Simulation([Group("clients", 32, thrashing(0.1, 4))], adaptive=auto(seed), seed=0).run(20)
        return next(t for t, limit in run.limits if t > 3 and limit > 4)

    assert len({first_probe(seed) for seed in range(4)}) > 1


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["load", "sample", "old sample"]), st.floats(0, 5),
                          st.integers(0, 80), st.integers(0, 80), st.sampled_from([HONEST, CHEAP])),
                max_size=300),
       st.integers(1, 8), st.integers(8, 64))
def test_the_limit_stays_within_its_bounds(events: list[tuple[str, float, int, int, SampleClass]],
                                           floor: int, ceiling: int) -> None:
    now = [0.0]
    limit = AdaptiveLimit(floor, ceiling, clock=lambda: now[0], rng=random.Random(0))
    for what, step, in_use, waiting, cls in events:
        now[0] += step
        if what == "load":
            limit.load(in_use, waiting)
        else:
            limit.observe(Sample(step * in_use / 10, cls), limit.phase if what == "sample" else limit.phase - 1,
                          now[0] - step)
        assert floor <= limit.limit <= ceiling and floor <= limit.cruise_limit <= ceiling


# --- the gate feeding it -------------------------------------------------------------------------------------


async def test_the_gate_stamps_leases_with_its_clock_and_follows_the_limit() -> None:
    now = [100.0]
    adaptive = AdaptiveLimit(1, 8, clock=lambda: now[0], rng=random.Random(0))
    gate = Gate(0, byte_budget=0, max_queue=100, adaptive=adaptive, clock=lambda: now[0])
    assert gate.limit == 1
    asking: list[asyncio.Task[Lease]] = []
    held: deque[tuple[Lease, float]] = deque()  # each with when it was handed off
    for _ in range(100):  # always more requests than slots; each spends 100 ms at the backend (dated, not slept)
        while len(asking) + len(held) <= 2 * gate.limit:
            asking.append(asyncio.create_task(gate.acquire(0, 60)))
        for _ in range(3):
            await asyncio.sleep(0)  # grants
        for task in [task for task in asking if task.done()]:
            asking.remove(task)
            lease = task.result()
            assert lease.granted_at == now[0]
            lease.handed_off()
            held.append((lease, now[0]))
        now[0] += 0.1 / len(held)
        lease, handed_off_at = held.popleft()
        gate.observe(lease, Sample(now[0] - handed_off_at, HONEST))
        lease.release()
    assert gate.limit == adaptive.limit == 8
    for lease, _ in held:
        lease.release()
    for task in asking:
        (await task).release()
    assert gate.in_use == 0 and gate.waiting == 0
    leases = [await gate.acquire(0, 5) for _ in range(gate.limit)]  # all admitted at once, none queued
    assert gate.in_use == len(leases) and gate.waiting == 0
    for lease in leases:
        lease.release()


async def test_a_release_teaches_nothing_nor_a_lease_never_forwarded() -> None:
    now = [0.0]
    adaptive = AdaptiveLimit(1, 8, clock=lambda: now[0], rng=random.Random(0))
    gate = Gate(0, byte_budget=0, max_queue=100, adaptive=adaptive, clock=lambda: now[0])
    for _ in range(60):  # reached the backend, but ended otherwise than normally: released, never observed
        lease = await gate.acquire(0, 5)
        lease.handed_off()
        now[0] += 0.1
        lease.release()
    for _ in range(60):  # refused media, client gone: never forwarded, observed all the same
        lease = await gate.acquire(0, 5)
        now[0] += 0.1
        gate.observe(lease, Sample(0.1, HONEST))
        lease.release()
    for _ in range(60):  # given back when its client stalled, observed all the same
        lease = await gate.acquire(0, 5)
        lease.handed_off()
        now[0] += 0.1
        lease.release()
        gate.observe(lease, Sample(0.1, HONEST))
    assert adaptive.samples == 0 and gate.limit == 1


def test_settings_accept_auto_and_its_range() -> None:
    settings = Settings.from_env({"MMGATE_UPSTREAM": "http://127.0.0.1:9", "MMGATE_MAX_MM_CONCURRENCY": "auto",
                                  "MMGATE_MIN_MM_CONCURRENCY": "2", "MMGATE_MAX_MM_CONCURRENCY_AUTO": "12"})
    assert settings.gate.adaptive_concurrency and settings.gate.mm_concurrency_ceiling == 12
    assert "MMGATE_MAX_MM_CONCURRENCY=auto" in settings.describe()
    with pytest.raises(ConfigError, match="MMGATE_MAX_MM_CONCURRENCY='sometimes'"):
        Settings.from_env({"MMGATE_MAX_MM_CONCURRENCY": "sometimes"})
    with pytest.raises(ConfigError, match="MMGATE_MIN_MM_CONCURRENCY is above"):
        Settings.from_env({"MMGATE_MAX_MM_CONCURRENCY": "auto", "MMGATE_MIN_MM_CONCURRENCY": "9",
                           "MMGATE_MAX_MM_CONCURRENCY_AUTO": "8"})


async def test_auto_limit_is_exported_and_holds_the_slot_through_the_answer(upstream: Upstream,
                                                                            start_proxy: StartProxy) -> None:
    async def held(request: web.Request) -> web.Response:
        await upstream.release.wait()
        return web.json_response({"ok": True})

    upstream.route("/v1/chat/completions", held)
    proxy = await start_proxy(upstream.url, MMGATE_MAX_MM_CONCURRENCY="auto", MMGATE_MIN_MM_CONCURRENCY="2",
                              MMGATE_MAX_MM_CONCURRENCY_AUTO="6")
    body = chat_with_image(data_uri(image_bytes()))
    async with aiohttp.ClientSession() as session:
        async with session.get(proxy.url + "/mmgate/metrics") as response:
            assert f"mmgate_gate_limit {START}.0" in await response.text()  # where a cold start begins
        posts = [asyncio.create_task(session.post(proxy.url + "/v1/chat/completions", json=body))
                 for _ in range(START + 1)]
        for _ in range(START):
            await upstream.arrived.get()
        # non-streaming, yet the slots stay held while the backend works: the latency it learns from
        counters = proxy.state.gate.counters
        await eventually(lambda: (counters().in_use, counters().waiting) == (START, 1), "all held, one waiting")
        upstream.release.set()
        for post in posts:
            async with await post as response:
                assert response.status == 200
        async with session.get(proxy.url + "/mmgate/stats") as response:
            stats = await response.json()
    assert stats["gate"]["adaptive"] is True and stats["limits"]["max_mm_concurrency"] == "auto"
    assert 2 <= stats["gate"]["limit"] <= 6
