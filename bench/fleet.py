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
import contextlib
import logging
import re
import statistics
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson
from aiohttp import web
from aiohttp.test_utils import TestServer

from bench import _results as R
from proxy.admission.client import LocalGate
from proxy.admission.lease import Lease
from proxy.edge.write_deadline import WRITE_TIMEOUT_CODE
from proxy.state import AppState
from testkit.adaptive_sim import (
    CELL,
    CLIENTS,
    COLD_START,
    SETTLED,
    STEP_AT,
    STEP_CELL,
    STEPS,
    Curve,
    fixed_rates,
)
from testkit.media import chat_with_image, data_uri, image_bytes
from testkit.servers import READER_RCVBUF, Proxy, reader_of_nothing, start_proxy_server

BASE_SECONDS = 0.1


@dataclass(frozen=True)
class Case:
    """One of issue 43's backends (``testkit.adaptive_sim``): ``curve`` the cell's, ``after`` the backend after a
    capacity step (None: a cold start), and the fixed limits the cell's ``auto`` is held against."""

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


TOO_HIGH = ("thrashing", 24)  # a fixed limit far past the thrashing backend's knee, which ``auto`` must beat by far
WINDOW = 2.0  # seconds of completions a rate is read over, for the time ``auto`` took to reach the best's
ATTACK_WARMUP, ATTACK_SECONDS, ATTACK_AFTER = 30.0, 3.0, 15.0
HONEST_LOOPS, ATTACKERS, HONEST_SECONDS, GIVE_UP_AFTER = 8, 2, 1.0, 0.05
ATTACKS = ("fast answers", "refusals", "aborts")
SLOW_LIMITS = ("auto", "4")
WRITE_DEADLINE, SLOW_QUEUE_TIMEOUT, SLOW_AFTER, SLOW_SLACK = 5.0, 2.0, 3.0, 1.05
# 8 MiB of SSE events: more than every buffer between mmgate and a client that reads nothing (Linux lets a
# socket's send buffer grow to tcp_wmem's maximum, 4 MiB by default; a 2 MiB answer fits in it whole)
SLOW_EVENT, SLOW_EVENTS = b"data: " + b"x" * (16 << 10) + b"\n\n", 512
SLOW_ID = "slow-reader"  # its X-Request-Id, which its access log line carries
HANG_BOUND = 60.0  # seconds: a bound on a hang, not a measure of speed
FAIR_SERVICE = 0.2
FAIR_LIMIT = 2
BIG, SMALL = 12, 2
FAIRNESS_HEADER = "x-gateway-inference-fairness-id"


def answer(completion_tokens: int) -> dict[str, Any]:
    usage = {"prompt_tokens": 64, "completion_tokens": completion_tokens, "total_tokens": 64 + completion_tokens}
    return {"id": "c", "object": "chat.completion", "usage": usage,
            "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "ok"}}]}


ANSWER, ONE_TOKEN = answer(16), answer(1)


@dataclass
class ModelBackend:
    """A backend shared among the requests it holds (``serve``); records the order of arrivals. A request asking
    for one token is answered at once; one tagged ``refuse`` gets 400; a streamed one gets ``SLOW_EVENTS`` SSE
    events at once."""

    curve: Curve
    order: list[str] = field(default_factory=list)
    server: TestServer | None = None
    started: float = field(default_factory=time.perf_counter)
    remaining: dict[asyncio.Future[None], float] = field(default_factory=dict)  # each request's work left
    _updated: float = 0.0
    _timer: asyncio.TimerHandle | None = None

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = orjson.loads(await request.read())
        tag = body["messages"][0]["content"][0]["text"]
        self.order.append(tag)
        if tag == "refuse":
            return web.json_response({"error": {"message": "no", "type": "invalid_request_error"}}, status=400)
        if body.get("max_tokens") == 1:
            return web.json_response(ONE_TOKEN)
        if body.get("stream"):
            return await self.stream(request)
        await self.serve()
        return web.json_response(ANSWER)

    async def serve(self) -> None:
        """One request's service, sharing the backend with every request it holds meanwhile: each request is one
        unit of work, done at ``1 / curve(c, now)`` units a second while the backend holds ``c`` (as a batching
        server's steps serve its whole batch, each step slower as the batch grows)."""
        done = asyncio.get_running_loop().create_future()
        self._advance()
        self.remaining[done] = 1.0
        self._reschedule()
        try:
            await done
        finally:
            if self.remaining.pop(done, None) is not None:  # cancelled: the client went away
                self._advance()
                self._reschedule()

    def _advance(self) -> None:
        now = time.perf_counter()
        if self.remaining:
            progress = (now - self._updated) / self.curve(len(self.remaining), now - self.started)
            for request in self.remaining:
                self.remaining[request] -= progress
        self._updated = now

    def _reschedule(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self.remaining:
            now = time.perf_counter()
            left = min(self.remaining.values()) * self.curve(len(self.remaining), now - self.started)
            self._timer = asyncio.get_running_loop().call_later(max(0.0, left), self._finish)

    def _finish(self) -> None:
        self._timer = None
        self._advance()
        for request, left in list(self.remaining.items()):
            if left <= 1e-9:
                del self.remaining[request]
                request.set_result(None)
        self._reschedule()

    async def stream(self, request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        with contextlib.suppress(ConnectionError):  # mmgate closed the upstream: it cut its client
            for _ in range(SLOW_EVENTS):
                await response.write(SLOW_EVENT)
            await response.write(b"data: [DONE]\n\n")
        return response

    async def start(self) -> str:
        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/v1/chat/completions", self.chat)
        self.server = TestServer(app, host="127.0.0.1")
        await self.server.start_server()
        return f"http://127.0.0.1:{self.server.port}"


def _body(tag: str, image: str, **extra: Any) -> bytes:
    return orjson.dumps(chat_with_image(image, text=tag) | extra)


@contextlib.asynccontextmanager
async def behind_mmgate(curve: Curve, **env: str) -> AsyncIterator[tuple[ModelBackend, Proxy]]:
    """A ``ModelBackend`` of ``curve`` and mmgate in front of it (``env``: its settings), both stopped after."""
    backend = ModelBackend(curve)
    proxy, stop = await start_proxy_server(await backend.start(), **env)
    try:
        yield backend, proxy
    finally:
        await stop()
        assert backend.server is not None
        await backend.server.close()


async def post(session: aiohttp.ClientSession, proxy: Proxy, body: bytes, **headers: str) -> int:
    """One chat request through ``proxy``, its answer read whole; its status."""
    async with session.post(proxy.url + "/v1/chat/completions", data=body,
                            headers={"Content-Type": "application/json", **headers}) as response:
        await response.read()
        return response.status


AUTO_ENV = {"MMGATE_RELEASE_AT": "complete", "MMGATE_MAX_QUEUE": "256", "MMGATE_QUEUE_TIMEOUT": "600",
            "MMGATE_MIN_MM_CONCURRENCY": "1", "MMGATE_MAX_MM_CONCURRENCY_AUTO": "64"}


async def load_cell(name: str, curve: Curve, limit: str, duration: float) -> dict[str, Any]:
    """``CLIENTS`` closed-loop clients for ``duration`` s through mmgate with ``limit`` in front of ``curve``;
    with ``auto``, the seconds each answer came at and the limits every 50 ms (the gate's, and between probes)."""
    body = _body(name, data_uri(image_bytes()))
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
        cell |= {"done": [round(t, 3) for t in done],
                 "trace": R.downsample([[t, float(g), float(c)] for t, g, c in trace], 1)}
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


async def case_cells(case: Case, quick: bool) -> dict[str, Any]:
    """The fixed limits (on the backend after the step, for a step), then ``auto``; its ratios and times."""
    step = case.after is not None
    fixed_curve = case.after if case.after is not None else case.curve
    auto_seconds = STEP_CELL if step else CELL
    limits = list(case.fixed) + ([TOO_HIGH[1]] if case.name == TOO_HIGH[0] and not quick else [])
    cells = [await load_cell(case.name, fixed_curve, str(limit), (STEP_CELL - STEP_AT) if step else CELL)
             for limit in limits]
    auto = await load_cell(case.name, case.curve, "auto", auto_seconds)
    best = max(cells[: len(case.fixed)], key=lambda c: c["throughput"])
    done = auto["done"]
    since = STEP_AT if step else 0.0
    auto |= {"ratio": rate_between(done, STEP_AT + SETTLED if step else 0.0, auto_seconds) / best["throughput"],
             "reach_s": time_to_reach(done, 0.9 * best["throughput"], since, auto_seconds)}
    cruise = [c for t, _g, c in auto["trace"] if t >= auto_seconds / 2]
    auto["cruise_second_half"] = [min(cruise), max(cruise)] if cruise else None
    return {"cells": [*cells, auto], "best_fixed": best["limit"], "step": step}


def cruise_limit(state: AppState) -> int:
    """The adaptive limit between its probes (the gate's own limit moves with each probe)."""
    assert isinstance(state.gate, LocalGate)  # the bench serves in one process
    gate = state.gate.gate
    return gate.adaptive.cruise_limit if gate.adaptive is not None else gate.limit


async def attack_cell(kind: str, warmup: float, length: float, after: float) -> dict[str, Any]:
    """8 honest loops; 2 attacker loops from ``warmup`` s for ``length`` s; ``after`` s more."""
    image = data_uri(image_bytes())
    honest_body = _body("honest", image)
    attack_body = {"fast answers": _body("fast", image, max_tokens=1), "refusals": _body("refuse", image),
                   "aborts": _body("abort", image)}[kind]
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
    return {"kind": kind, "honest_before": before, "during": rate_between(honest, warmup, end) / before,
            "after": rate_between(honest, end, end + 10) / before, "pre_limit": pre, "limit_10s_after": later,
            "limit_back": abs(later - pre) <= 0.1 * pre, "attacks": attacks,
            "trace": R.downsample([[t, float(limit), float(c)] for t, limit, c in trace], 1)}


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
    honest_body = _body("honest", image)
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
            sock = await reader_of_nothing(proxy.server.port, _body("slow", image, stream=True), SLOW_ID)
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
    # a lease not given back within the cell counts as held for the whole cell: a lower bound, still over the goal
    return {"limit": limit, "held_s": released_at - started, "released": released,
            "ended_s": None if ended.at is None else ended.at - started, "code": ended.code, "honest": statuses}


async def fairness_cell(fair: bool) -> dict[str, Any]:
    image = data_uri(image_bytes())
    waits: dict[str, float] = {}
    async with behind_mmgate(lambda concurrency, now: FAIR_SERVICE, MMGATE_MAX_MM_CONCURRENCY=str(FAIR_LIMIT),
                             MMGATE_RELEASE_AT="complete", MMGATE_MAX_QUEUE="64",
                             MMGATE_TRUST_FLOW_HEADERS_FROM="127.0.0.1/32") as (backend, proxy):
        gate = proxy.state.gate

        async def send(session: aiohttp.ClientSession, flow: str, tag: str) -> None:
            async with session.post(proxy.url + "/v1/chat/completions", data=_body(tag, image),
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
    return {"fair": fair, "slots": slots, "small_wait": statistics.mean(waits[f"small{i}"] for i in range(SMALL)),
            "big_wait": statistics.mean(waits[f"big{i}"] for i in range(BIG)), "order": backend.order}


async def run(args: R.Knobs) -> dict[str, Any]:
    rounds: list[dict[str, Any]] = []
    for number in range(args.rounds):
        models = {}
        for case in cases(args.quick)[:: 4 if args.quick else 1]:  # quick: one cold start, one step
            result = await case_cells(case, args.quick)
            for cell in result["cells"]:
                extra = (f", ratio {cell['ratio']:.3f}, 0.9× after {cell['reach_s']} s, cruise in the second half "
                         f"{cell['cruise_second_half']}") if cell["limit"] == "auto" else ""
                print(f"  round {number + 1} {case.name} limit {cell['limit']:>4}: {cell['throughput']:6.2f} "
                      f"answers/s (statuses {cell['statuses']}){extra}", flush=True)
            models[case.name] = result
        attacks = []
        for kind in ATTACKS:
            cell = await attack_cell(kind, *args.attack)
            print(f"  round {number + 1} attack {kind}: honest {cell['honest_before']:.2f}/s before, during "
                  f"×{cell['during']:.2f}, after ×{cell['after']:.2f}; limit {cell['pre_limit']} → "
                  f"{cell['limit_10s_after']} 10 s after; attacks {cell['attacks']}", flush=True)
            attacks.append(cell)
        slow = []
        for limit in SLOW_LIMITS:
            cell = await slow_reader_cell(limit)
            print(f"  round {number + 1} slow reader, limit {limit}: slot held {cell['held_s']:.3f} s, request "
                  f"ended at {cell['ended_s']} s ({cell['code']}); honest statuses {cell['honest']}", flush=True)
            slow.append(cell)
        fair, fifo = await fairness_cell(True), await fairness_cell(False)
        print(f"  round {number + 1} fairness: small slots {fair['slots']} wait {fair['small_wait']:.2f} s; "
              f"FIFO slots {fifo['slots']} wait {fifo['small_wait']:.2f} s", flush=True)
        rounds.append({"models": models, "attacks": attacks, "slow_reader": slow, "fair": fair, "fifo": fifo})
    return {"rounds": rounds}


def slow_name(limit: str) -> str:
    return "auto" if limit == "auto" else f"fixed limit {limit}, released at completion"


def goals(data: dict[str, Any]) -> list[R.Goal]:
    rounds = data["rounds"]

    def throughput(r: dict[str, Any], model: str, limit: str) -> float:
        return float(next(c["throughput"] for c in r["models"][model]["cells"] if c["limit"] == limit))

    def attack(r: dict[str, Any], kind: str) -> dict[str, Any]:
        return next(c for c in r["attacks"] if c["kind"] == kind)

    def auto_cell(r: dict[str, Any], name: str) -> dict[str, Any]:
        return next(c for c in r["models"][name]["cells"] if c["limit"] == "auto")

    found: list[R.Goal] = []
    for name in rounds[0]["models"]:
        step = rounds[0]["models"][name]["step"]
        what = f"a step, {name}" if step else f"cold start, {name} backend"
        found += [
            R.goal(f"auto ÷ best fixed limit, answers/s ({what}; {'from 5 s after the step' if step else '15 s'})",
                   [auto_cell(r, name)["ratio"] for r in rounds], "≥ 0.9", lambda v: v >= 0.9),
            R.goal(f"auto: seconds {'from the step ' if step else ''}to a {WINDOW:g} s window at 0.9× the best "
                   f"fixed limit ({what})", [auto_cell(r, name)["reach_s"] for r in rounds], "≤ 5",
                   lambda v: v is not None and v <= 5, unit="s"),
        ]
        if name == TOO_HIGH[0] and any(c["limit"] == str(TOO_HIGH[1]) for c in rounds[0]["models"][name]["cells"]):
            found.append(R.goal(f"auto ÷ fixed limit {TOO_HIGH[1]} (too high), answers/s ({what})",
                                [throughput(r, name, "auto") / throughput(r, name, str(TOO_HIGH[1])) for r in rounds],
                                "≥ 2", lambda v: v >= 2))
    for kind in ATTACKS:
        found += [
            R.goal(f"attack, {kind}: honest answers/s during ÷ before", [attack(r, kind)["during"] for r in rounds],
                   "≥ 0.8", lambda v: v >= 0.8, met_on="min"),
            R.goal(f"attack, {kind}: honest answers/s in the 10 s after ÷ before",
                   [attack(r, kind)["after"] for r in rounds], "≥ 0.8", lambda v: v >= 0.8, met_on="min"),
            R.goal(f"attack, {kind}: limit 10 s after ÷ when it began",
                   [attack(r, kind)["limit_10s_after"] / attack(r, kind)["pre_limit"] for r in rounds],
                   "0.9–1.1", lambda v: 0.9 <= v <= 1.1, met_on="every"),
        ]
    for limit in SLOW_LIMITS:
        cells = [next(c for c in r["slow_reader"] if c["limit"] == limit) for r in rounds]
        found += [
            R.goal(f"slow reader, {slow_name(limit)}: its slot held (write deadline {WRITE_DEADLINE:g} s)",
                   [c["held_s"] for c in cells], f"≤ {WRITE_DEADLINE * SLOW_SLACK:g}",
                   lambda v: v <= WRITE_DEADLINE * SLOW_SLACK, unit="s", met_on="max"),
            R.goal(f"slow reader, {slow_name(limit)}: honest answers 429", [c["honest"].get("429", 0) for c in cells],
                   "= 0", lambda v: v == 0, met_on="max"),
        ]
    found.append(R.goal("slow reader: cells whose client was cut (log code client_write_timeout)",
                        [sum(c["code"] == WRITE_TIMEOUT_CODE for c in r["slow_reader"]) for r in rounds],
                        f"= {len(SLOW_LIMITS)}", lambda v: v == len(SLOW_LIMITS), met_on="min"))
    return [
        *found,
        R.goal("fair: forwards until the small flow's last request (of those after it arrived)",
               [max(r["fair"]["slots"]) for r in rounds], "≤ 4", lambda v: v <= 4, met_on="max"),
        R.goal("FIFO: forwards until the small flow's last request", [max(r["fifo"]["slots"]) for r in rounds]),
        R.goal("small flow's wait, fair ÷ FIFO", [r["fair"]["small_wait"] / r["fifo"]["small_wait"] for r in rounds]),
    ]


def report(data: dict[str, Any]) -> str:
    s = data["settings"]
    rounds = data["rounds"]
    lines = [f"{s['rounds']} rounds, {s['clients']} closed-loop clients; throughput in answers/s, median (min–max) of "
             "the rounds; `auto` starts cold in every cell."]
    for name, first in rounds[0]["models"].items():
        step = first["step"]
        where = (f"from {STEP_AT:g} s of a {STEP_CELL:g} s cell; the fixed limits on the backend after the step, "
                 f"{STEP_CELL - STEP_AT:g} s cells; `auto` from {SETTLED:g} s after the step" if step
                 else f"{CELL:g} s cells")
        lines += ["", f"**{name}** ({'a capacity step' if step else 'cold start'}: `testkit.adaptive_sim`, "
                  f"{where}).", "",
                  "| limit | answers/s | spread | × best fixed | 0.9× reached after s | cruise limit, second half |",
                  "|---|---:|---|---:|---|---|"]
        for limit in [c["limit"] for c in first["cells"]]:
            mine = [next(c for c in r["models"][name]["cells"] if c["limit"] == limit) for r in rounds]
            m = R.summary(c["throughput"] for c in mine)
            if limit == "auto":
                ratio = R.summary(c["ratio"] for c in mine)
                lines.append(f"| auto | {R.number(m['median'])} | {R.number(m['spread'][0])}–{R.number(m['spread'][1])}"
                             f" | {R.number(ratio['median'])} | {', '.join(str(c['reach_s']) for c in mine)} | "
                             f"{', '.join(str(c['cruise_second_half']) for c in mine)} |")
            else:
                best = [next(c["throughput"] for c in r["models"][name]["cells"]
                             if c["limit"] == r["models"][name]["best_fixed"]) for r in rounds]
                share = m["median"] / statistics.median(best)
                lines.append(f"| {limit} | {R.number(m['median'])} | {R.number(m['spread'][0])}–"
                             f"{R.number(m['spread'][1])} | {R.number(share)} | – | – |")
    warmup, length, after = s["attack"]
    lines += ["", f"**Attacks** on `auto`: {HONEST_LOOPS} honest loops, backend {HONEST_SECONDS:g} s an answer; "
              f"from {warmup:g} s, {ATTACKERS} attacker loops for {length:g} s, then {after:g} s more. Honest "
              "answers/s during the attack and in the 10 s after it, each ÷ the 10 s before; the limit between "
              "probes when the attack began and 10 s after it ended.", "",
              "| round | attack | honest/s before | during × | after × | limit then | 10 s after | attack outcomes |",
              "|---|---|---:|---:|---:|---:|---:|---|"]
    for i, r in enumerate(rounds, 1):
        for c in r["attacks"]:
            lines.append(f"| {i} | {c['kind']} | {c['honest_before']:.2f} | {c['during']:.2f} | {c['after']:.2f} | "
                         f"{c['pre_limit']} | {c['limit_10s_after']} | {c['attacks']} |")
    lines += ["", f"**Slow reader**: `MMGATE_CLIENT_WRITE_TIMEOUT={WRITE_DEADLINE:g}`, "
              f"`MMGATE_QUEUE_TIMEOUT={SLOW_QUEUE_TIMEOUT:g}`; one client with a {READER_RCVBUF // 1024} KiB receive "
              f"buffer asks for a stream of {SLOW_EVENTS * len(SLOW_EVENT) >> 20} MiB and reads nothing; then "
              f"{HONEST_LOOPS} honest loops (backend {BASE_SECONDS * 1000:.0f} ms an answer) for "
              f"{WRITE_DEADLINE + SLOW_AFTER:g} s. Seconds from its lease's grant.", "",
              "| round | limit | its slot held s | its request ended s | its log code | honest statuses |",
              "|---|---|---:|---:|---|---|"]
    for i, r in enumerate(rounds, 1):
        for c in r["slow_reader"]:
            lines.append(f"| {i} | {slow_name(c['limit'])} | {c['held_s']:.3f} | {R.number(c['ended_s'])} | "
                         f"{c['code']} | {c['honest']} |")
    lines += ["", f"Fairness: limit {FAIR_LIMIT}, service {FAIR_SERVICE * 1000:.0f} ms; flow `big` sends {BIG}, "
              f"then flow `small` sends {SMALL}. Slots: forwards after `small` arrived until each of its requests "
              "was forwarded (1 = the next one).", "",
              "| round | fair: slots | fair: small's wait s | FIFO: slots | FIFO: small's wait s |",
              "|---|---|---:|---|---:|"]
    for i, r in enumerate(rounds, 1):
        lines.append(f"| {i} | {r['fair']['slots']} | {r['fair']['small_wait']:.2f} | {r['fifo']['slots']} | "
                     f"{r['fifo']['small_wait']:.2f} |")
    return "\n".join(lines) + "\n"


def measure(knobs: R.Knobs) -> dict[str, Any]:
    attack = (10.0, ATTACK_SECONDS, 12.0) if knobs.quick else (ATTACK_WARMUP, ATTACK_SECONDS, ATTACK_AFTER)
    stamp = R.stamp("fleet.py", "adaptive concurrency limit vs fixed limits on thrashing and batching backends, "
                                "under attack, against a slow reader; fair waiting")
    data = stamp | asyncio.run(run(R.Knobs(**vars(knobs), attack=attack)))
    data["settings"] = {"rounds": knobs.rounds, "quick": knobs.quick, "clients": CLIENTS, "cell": CELL,
                        "step_at": STEP_AT, "step_cell": STEP_CELL, "settled": SETTLED,
                        "attack": list(attack), "base_seconds": BASE_SECONDS,
                        "slow_reader": {"write_deadline": WRITE_DEADLINE, "queue_timeout": SLOW_QUEUE_TIMEOUT,
                                        "rcvbuf": READER_RCVBUF, "stream_bytes": SLOW_EVENTS * len(SLOW_EVENT)}}
    return data
