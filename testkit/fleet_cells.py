"""The cells of ``bench/fleet.py``: one situation of a fleet each, mmgate built in this process in front of a
``testkit.curve_backend.CurveBackend``, its clients on the same event loop. What each cell does and records is
the bench's docstring; the constants here are its settings, which its goals and report name. The attack, slow
reader and fairness cells print what they saw as they end (a round of the bench takes about ten minutes).

- ``cases`` and ``load_cell``: closed-loop clients through a fixed limit or ``auto`` on one of issue 43's backends
  (``testkit.adaptive_sim``: a cold start or a capacity step), the seconds each answer came at; ``rate_between``
  and ``time_to_reach`` read them;
- ``attack_cell``: honest loops, then attacker loops for a while (answers at once, refusals, aborts);
- ``slow_reader_cell``: a client that reads nothing of its streamed answer, beside honest loops;
- ``fairness_cell``: two flows, with and without the fairness header.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import statistics
import time
from dataclasses import dataclass
from typing import Any

import aiohttp

from proxy.admission.client import LocalGate
from proxy.admission.lease import Lease
from proxy.state import AppState
from testkit.adaptive_sim import CELL, CLIENTS, COLD_START, STEP_AT, STEP_CELL, STEPS, Curve, fixed_rates
from testkit.curve_backend import behind_mmgate, post, tagged_body
from testkit.media import data_uri, image_bytes
from testkit.servers import reader_of_nothing

TOO_HIGH = ("thrashing", 24)  # a fixed limit far past the thrashing backend's knee, which ``auto`` must beat by far
WINDOW = 2.0  # seconds of completions a rate is read over, for the time ``auto`` took to reach the best's
ATTACK_WARMUP, ATTACK_SECONDS, ATTACK_AFTER = 30.0, 3.0, 15.0
HONEST_LOOPS, ATTACKERS, HONEST_SECONDS, GIVE_UP_AFTER = 8, 2, 1.0, 0.05
ATTACKS = ("fast answers", "refusals", "aborts")
SLOW_LIMITS = ("auto", "4")
BASE_SECONDS = 0.1  # the slow reader's honest loops: the backend's seconds an answer
WRITE_DEADLINE, SLOW_QUEUE_TIMEOUT, SLOW_AFTER = 5.0, 2.0, 3.0
SLOW_ID = "slow-reader"  # its X-Request-Id, which its access log line carries
HANG_BOUND = 60.0  # seconds: a bound on a hang, not a measure of speed
FAIR_SERVICE = 0.2
FAIR_LIMIT = 2
BIG, SMALL = 12, 2
FAIRNESS_HEADER = "x-gateway-inference-fairness-id"
AUTO_ENV = {"MMGATE_RELEASE_AT": "complete", "MMGATE_MAX_QUEUE": "256", "MMGATE_QUEUE_TIMEOUT": "600",
            "MMGATE_MIN_MM_CONCURRENCY": "1", "MMGATE_MAX_MM_CONCURRENCY_AUTO": "64"}


@dataclass(frozen=True)
class Case:
    """One of issue 43's backends: ``curve`` the cell's, ``after`` the backend after a capacity step (None: a cold
    start), and the fixed limits the cell's ``auto`` is held against."""

    name: str
    curve: Curve
    after: Curve | None
    fixed: tuple[int, ...]


def near_best(curve: Curve, duration: float, count: int) -> tuple[int, ...]:
    """The ``count`` fixed limits with the best rates in the simulator: the best fixed limit over HTTP is among
    them, and a sweep of every limit would take ten times as long."""
    rates = fixed_rates(curve, duration)
    return tuple(sorted(sorted(rates, key=lambda limit: -rates[limit])[:count]))


def cases(quick: bool) -> list[Case]:
    count = 2 if quick else 3
    return ([Case(name, curve, None, near_best(curve, CELL, count)) for name, curve in COLD_START.items()]
            + [Case(name, curve, after, near_best(after, STEP_CELL - STEP_AT, count))
               for name, (curve, after) in STEPS.items()])


def cruise_limit(state: AppState) -> int:
    """The adaptive limit between its probes (the gate's own limit moves with each probe)."""
    assert isinstance(state.gate, LocalGate)  # the bench serves in one process
    gate = state.gate.gate
    return gate.adaptive.cruise_limit if gate.adaptive is not None else gate.limit


async def load_cell(name: str, curve: Curve, limit: str, duration: float) -> dict[str, Any]:
    """``CLIENTS`` closed-loop clients for ``duration`` s through mmgate with ``limit`` in front of ``curve``;
    with ``auto``, the seconds each answer came at and the limits every 50 ms (the gate's, and between probes),
    every sample: the caller thins the trace."""
    body = tagged_body(name, data_uri(image_bytes()))
    done: list[float] = []
    statuses: dict[int, int] = {}
    trace: list[tuple[float, int, int]] = []
    async with behind_mmgate(curve, MMGATE_MAX_MM_CONCURRENCY=limit, **AUTO_ENV) as (_backend, proxy):
        gate = proxy.state.gate
        started = time.perf_counter()
        end = started + duration

        async def client(session: aiohttp.ClientSession) -> None:
            while time.perf_counter() < end:
                status = await post(session, proxy, body)
                statuses[status] = statuses.get(status, 0) + 1
                if status == 200:
                    done.append(time.perf_counter() - started)

        async def watch() -> None:
            while time.perf_counter() < end:
                trace.append((time.perf_counter() - started, gate.counters().limit, cruise_limit(proxy.state)))
                await asyncio.sleep(0.05)

        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=CLIENTS)) as session:
            clients = [asyncio.create_task(client(session)) for _ in range(CLIENTS)]
            await asyncio.create_task(watch())  # it ends with the cell
            for task in clients:
                task.cancel()
            await asyncio.gather(*clients, return_exceptions=True)
    done = [t for t in done if t <= duration]
    cell: dict[str, Any] = {"limit": limit, "throughput": len(done) / duration, "completed": len(done),
                            "statuses": statuses, "final_limit": gate.counters().limit}
    if limit == "auto":
        cell |= {"done": [round(t, 3) for t in done], "trace": [[t, float(g), float(c)] for t, g, c in trace]}
    return cell


def rate_between(done: list[float], start: float, end: float) -> float:
    return sum(start <= t < end for t in done) / (end - start)


def time_to_reach(done: list[float], target: float, since: float, end: float) -> float | None:
    """Seconds from ``since`` to the end of the first ``WINDOW`` s after it whose answers/s reach ``target``
    (read every 0.1 s); None if none does before ``end``."""
    t = since + WINDOW
    while t <= end + 1e-9:
        if rate_between(done, t - WINDOW, t) >= target:
            return round(t - since, 1)
        t += 0.1
    return None


async def attack_cell(kind: str, warmup: float, length: float, after: float) -> dict[str, Any]:
    """``HONEST_LOOPS`` honest loops; ``ATTACKERS`` attacker loops from ``warmup`` s for ``length`` s; ``after`` s
    more. The limits' trace has every sample (every 0.1 s): the caller thins it."""
    image = data_uri(image_bytes())
    honest_body = tagged_body("honest", image)
    attack_body = {"fast answers": tagged_body("fast", image, max_tokens=1), "refusals": tagged_body("refuse", image),
                   "aborts": tagged_body("abort", image)}[kind]
    honest: list[float] = []
    attacks: dict[str, int] = {}
    trace: list[tuple[float, int, int]] = []  # (t, gate limit, cruise limit)
    total = warmup + length + after
    async with behind_mmgate(lambda concurrency, now: HONEST_SECONDS, MMGATE_MAX_MM_CONCURRENCY="auto",
                             **AUTO_ENV) as (_backend, proxy):
        started = time.perf_counter()

        def now() -> float:
            return time.perf_counter() - started

        async def honest_loop(session: aiohttp.ClientSession) -> None:
            while now() < total:
                if await post(session, proxy, honest_body) == 200:
                    honest.append(now())

        async def attacker(session: aiohttp.ClientSession) -> None:
            await asyncio.sleep(warmup)
            while now() < warmup + length:
                outcome = "gave up"
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(GIVE_UP_AFTER if kind == "aborts" else None):
                        outcome = str(await post(session, proxy, attack_body))
                attacks[outcome] = attacks.get(outcome, 0) + 1

        async def watch() -> None:
            while now() < total:
                trace.append((round(now(), 2), proxy.state.gate.counters().limit, cruise_limit(proxy.state)))
                await asyncio.sleep(0.1)

        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            tasks = [asyncio.create_task(honest_loop(session)) for _ in range(HONEST_LOOPS)]
            tasks += [asyncio.create_task(attacker(session)) for _ in range(ATTACKERS)]
            await asyncio.create_task(watch())  # it ends with the cell
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def cruise_at(t: float) -> int:
        return next((c for when, _limit, c in reversed(trace) if when <= t), trace[0][2])

    end = warmup + length
    before = rate_between(honest, warmup - 10, warmup)
    pre, later = cruise_at(warmup), cruise_at(end + 10)
    print(f"  attack {kind}: honest {before:.2f}/s before, during ×{rate_between(honest, warmup, end) / before:.2f}, "
          f"after ×{rate_between(honest, end, end + 10) / before:.2f}; limit {pre} → {later} 10 s after; attacks "
          f"{attacks}", flush=True)
    return {"kind": kind, "honest_before": before, "during": rate_between(honest, warmup, end) / before,
            "after": rate_between(honest, end, end + 10) / before, "pre_limit": pre, "limit_10s_after": later,
            "limit_back": abs(later - pre) <= 0.1 * pre, "attacks": attacks,
            "trace": [[t, float(limit), float(c)] for t, limit, c in trace]}


def first_lease(state: AppState) -> asyncio.Future[Lease]:
    """The next lease the gate grants: that of the bench's one request in flight when it asks."""
    assert isinstance(state.gate, LocalGate)  # the bench serves in one process
    client = state.gate
    acquire = client.acquire
    granted: asyncio.Future[Lease] = asyncio.get_running_loop().create_future()

    async def watched(*args: Any, **kwargs: Any) -> Lease:
        lease = await acquire(*args, **kwargs)
        if not granted.done():
            granted.set_result(lease)
        return lease

    client.acquire = watched  # type: ignore[method-assign]
    return granted


class AccessLogEnd(logging.Handler):
    """When the request logged as ``request_id`` ended (``time.perf_counter``), and its access log code."""

    def __init__(self, request_id: str) -> None:
        super().__init__(logging.INFO)
        self.request_id = request_id
        self.at: float | None = None
        self.code: str | None = None

    def emit(self, record: logging.LogRecord) -> None:
        fields = getattr(record, "fields", {})
        if fields.get("request_id") == self.request_id:
            self.at, self.code = time.perf_counter(), fields.get("code")


async def slow_reader_cell(limit: str) -> dict[str, Any]:
    """A client that reads nothing of its streamed answer; once its lease is granted, ``HONEST_LOOPS`` honest
    loops for ``WRITE_DEADLINE + SLOW_AFTER`` s."""
    env = AUTO_ENV | {"MMGATE_CLIENT_WRITE_TIMEOUT": f"{WRITE_DEADLINE:g}",
                      "MMGATE_QUEUE_TIMEOUT": f"{SLOW_QUEUE_TIMEOUT:g}", "MMGATE_ACCESS_LOG": "on"}
    image = data_uri(image_bytes())
    honest_body = tagged_body("honest", image)
    statuses: dict[str, int] = {}
    ended = AccessLogEnd(SLOW_ID)
    access_log = logging.getLogger("mmgate.access")
    level = access_log.level
    access_log.setLevel(logging.INFO)
    access_log.addHandler(ended)
    sock = None
    try:
        async with behind_mmgate(lambda concurrency, now: BASE_SECONDS, MMGATE_MAX_MM_CONCURRENCY=limit,
                                 **env) as (_backend, proxy):
            granted = first_lease(proxy.state)
            sock = await reader_of_nothing(proxy.server.port, tagged_body("slow", image, stream=True), SLOW_ID)
            lease = await asyncio.wait_for(granted, HANG_BOUND)
            started = time.perf_counter()
            end = started + WRITE_DEADLINE + SLOW_AFTER

            async def honest_loop(session: aiohttp.ClientSession) -> None:
                while time.perf_counter() < end:
                    status = str(await post(session, proxy, honest_body))
                    statuses[status] = statuses.get(status, 0) + 1

            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
                tasks = [asyncio.create_task(honest_loop(session)) for _ in range(HONEST_LOOPS)]
                # polled: a lease has no event for its release
                while not lease.released and time.perf_counter() < end:  # noqa: ASYNC110
                    await asyncio.sleep(0.005)
                released_at, released = time.perf_counter(), lease.released
                await asyncio.sleep(end - time.perf_counter())
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
    finally:
        if sock is not None:
            sock.close()
        access_log.removeHandler(ended)
        access_log.setLevel(level)
    ended_s = None if ended.at is None else ended.at - started
    print(f"  slow reader, limit {limit}: slot held {released_at - started:.3f} s, request ended at {ended_s} s "
          f"({ended.code}); honest statuses {statuses}", flush=True)
    # a lease not given back within the cell counts as held for the whole cell: a lower bound, still over the goal
    return {"limit": limit, "held_s": released_at - started, "released": released,
            "ended_s": ended_s, "code": ended.code, "honest": statuses}


async def fairness_cell(fair: bool) -> dict[str, Any]:
    """Flow ``big`` sends ``BIG`` requests at once, then flow ``small`` ``SMALL``; with ``fair``, each carries its
    flow in ``FAIRNESS_HEADER``. The forwards after ``small`` arrived until each of its requests (slots) and the
    flows' waits."""
    image = data_uri(image_bytes())
    waits: dict[str, float] = {}
    async with behind_mmgate(lambda concurrency, now: FAIR_SERVICE, MMGATE_MAX_MM_CONCURRENCY=str(FAIR_LIMIT),
                             MMGATE_RELEASE_AT="complete", MMGATE_MAX_QUEUE="64",
                             MMGATE_TRUST_FLOW_HEADERS_FROM="127.0.0.1/32") as (backend, proxy):
        gate = proxy.state.gate

        async def send(session: aiohttp.ClientSession, flow: str, tag: str) -> None:
            async with session.post(proxy.url + "/v1/chat/completions", data=tagged_body(tag, image),
                                    headers={"Content-Type": "application/json",
                                             **({FAIRNESS_HEADER: flow} if fair else {})}) as response:
                await response.read()
                assert response.status == 200, response.status
                match = re.search(r"queue;dur=([0-9.]+)", response.headers.get("Server-Timing", ""))
                waits[tag] = float(match.group(1)) / 1000 if match else 0.0

        async with aiohttp.ClientSession() as session:
            tasks = [asyncio.create_task(send(session, "big", f"big{i}")) for i in range(BIG)]
            # every big request is in: the first ones at the backend, the rest queued
            # polled: there is no event for "n queued"
            while gate.counters().waiting < BIG - FAIR_LIMIT or len(backend.order) < FAIR_LIMIT:  # noqa: ASYNC110
                await asyncio.sleep(0.001)
            forwarded_before = len(backend.order)
            tasks += [asyncio.create_task(send(session, "small", f"small{i}")) for i in range(SMALL)]
            await asyncio.gather(*tasks)
    after = backend.order[forwarded_before:]
    slots = [after.index(f"small{i}") + 1 for i in range(SMALL)]  # 1 = the next forward
    small_wait = statistics.mean(waits[f"small{i}"] for i in range(SMALL))
    print(f"  {'fair' if fair else 'FIFO'}: small slots {slots} wait {small_wait:.2f} s", flush=True)
    return {"fair": fair, "slots": slots, "small_wait": small_wait,
            "big_wait": statistics.mean(waits[f"big{i}"] for i in range(BIG)), "order": backend.order}
