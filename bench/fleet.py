#!/usr/bin/env python
"""mmgate in a fleet: the adaptive limit against fixed ones on a thrashing and on a batching backend, under
attack, against a client that reads nothing, and fair waiting.

**Adaptive limit** (``MMGATE_MAX_MM_CONCURRENCY=auto``). Two backend models, the ones ``testkit.adaptive_sim``
simulates (a request's service time is set by ``c``, the requests in the backend when it arrives):

- *thrashing*: ``100 ms × max(1, (c / 4)²)``: throughput grows with ``c`` up to the knee (4) and falls as
  ``1/c`` past it, the way a server that swaps KV cache or preempts does. 32 closed-loop clients.
- *batching*: ``100 ms × (1 + (c - 1) / 4) × max(1, (c / 12)²)``: latency grows with the batch while throughput
  still grows, up to the knee (12); past it, it swaps. 48 clients. A controller driven by latency alone reads
  the rise as queueing and stays low.

Each client sends its next media request when its answer comes, for ``--duration`` s per cell, with fixed
limits and with ``auto`` (``MMGATE_MIN_MM_CONCURRENCY=1``, ``MMGATE_MAX_MM_CONCURRENCY_AUTO=64``, starting cold
in every round, at its ``START``). Throughput = answers completed within the cell's duration ÷ duration:
``auto`` pays for its own convergence. Convergence (thrashing) = the first time from which the adaptive limit
spends at least 90 % of the rest of the cell within one of the best fixed limit of that round. Fixed limits use
``MMGATE_RELEASE_AT=complete`` like ``auto`` does, so both bound the backend. Answers carry
``completion_tokens`` in ``usage`` (16), as a model server's do.

**Attacks** (``auto``; the issue's scenario, unscaled): 8 honest client loops against a backend that takes 1 s
an answer; after ``ATTACK_WARMUP`` s, 2 attacker loops for 3 s, then 15 s more. One cell per kind: answers at
once (``max_tokens: 1``, ``completion_tokens: 1``), refusals at once (the backend answers 400), clients that
give up after 50 ms. Goals: honest answers/s during the attack and in the 10 s after it, each ÷ the 10 s
before it, ≥ 0.8; the limit between probes (``AdaptiveLimit.cruise_limit``) 10 s after the attack within 10 %
of where it was when the attack began.

**Slow reader** (``MMGATE_CLIENT_WRITE_TIMEOUT=5``, ``MMGATE_QUEUE_TIMEOUT=2``): one client with a 4 KiB receive
buffer asks for an 8 MiB streamed answer and reads none of it; once it holds its lease, 8 honest client loops
(backend 100 ms an answer) run for the deadline + 3 s. One cell with ``auto`` right after the start (its limit at
its floor, 1: the slow reader holds the only slot), one with a fixed limit of 4 released at completion.
Recorded: how long the slow reader's lease was held from its grant (polled every 5 ms; the backend streams at
once, so the answer waits on the client from the start), when its request ended and its access log code, the
honest answers' statuses. Goals: the slot held ≤ the deadline + 5 % (the deadline starts once mmgate's buffer
for the client is full; the lease goes back once the cut connection's handler is cancelled); no honest 429 (the
queue timeout is shorter than the deadline, so the only slot held to it shows as 429s); the slow reader cut
(``client_write_timeout``) in both cells, else its answer fit in the buffers and the cell tested nothing.
``auto`` gives the lease back when the answer first waits on the client; a fixed limit holds it until the cut.

**Fairness.** A backend with a constant 200 ms service time behind mmgate with a limit of 2. Flow ``big``
sends 12 media requests at once; once they are all in (2 admitted, 10 queued), flow ``small`` sends 2. With
``x-gateway-inference-fairness-id`` the flows take turns; without it (FIFO) ``small`` waits behind all of
``big``. Recorded: how many forwards to the backend happen after ``small`` arrives until each of its requests
is forwarded (slots), and ``small``'s wait (Server-Timing ``queue``), fair against FIFO.

Everything runs in this process on one event loop (clients, mmgate from ``build_app``, the model backends);
the backends sleep rather than burn CPU, so the figures depend little on the shared machine.

Usage: python -m bench.fleet [--rounds 3] [--duration 20] [--quick (1 round, fewer limits, 4 s cells, attacks
       shortened; the slow-reader cells as they are)] [--out PATH]
Writes bench/results/fleet.md and .json (or PATH.md / PATH.json).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import re
import socket
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
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
from testkit.adaptive_sim import Curve, batching, by_throughput, slowed, switched, thrashing
from testkit.media import chat_with_image, data_uri, image_bytes
from testkit.servers import start_proxy_server

BASE_SECONDS = 0.1


@dataclass(frozen=True)
class Model:
    """A backend model and the fixed limits it is compared with."""

    name: str
    curve: Curve
    clients: int
    fixed: tuple[int, ...]
    quick: tuple[int, ...]
    too_high: int
    described: str


MODELS = (
    Model("thrashing", thrashing(BASE_SECONDS, 4), 32, (1, 2, 3, 4, 5, 6, 8, 16), (2, 4, 16), 16,
          f"{BASE_SECONDS * 1000:.0f} ms × max(1, (c/4)²), 32 clients"),
    Model("batching", batching(BASE_SECONDS, 12), 48, (1, 2, 4, 8, 12, 16, 24), (4, 12, 24), 24,
          f"{BASE_SECONDS * 1000:.0f} ms × (1 + (c-1)/4) × max(1, (c/12)²), 48 clients"),
    # issue 43: a backend given by its throughput that collapses past 8, and capacity steps 8 s into the cell
    Model("collapsing", by_throughput({1: 3.5, 2: 6.4, 4: 10.7, 8: 16, 16: 5.3}), 24, (4, 6, 8, 12, 16), (4, 8, 16),
          16, "c / throughput(c), 3.5 answers/s at 1, 16 at 8, 5.3 at 16, 24 clients"),
    Model("2x slower at 8 s", slowed(batching(2 * BASE_SECONDS, 8), 2.0, 8.0, float("inf")), 24, (4, 8, 12), (4, 8),
          12, f"{2 * BASE_SECONDS * 1000:.0f} ms × (1 + (c-1)/4) × max(1, (c/8)²), twice that from 8 s, 24 clients"),
    Model("knee 8 to 4 at 8 s", switched(batching(2 * BASE_SECONDS, 8), batching(2 * BASE_SECONDS, 4), 8.0), 24,
          (4, 8, 12), (4, 8), 12, f"{2 * BASE_SECONDS * 1000:.0f} ms × (1 + (c-1)/4) × max(1, (c/8)²), its knee 4 "
          "from 8 s, 24 clients"),
)
ATTACK_WARMUP, ATTACK_SECONDS, ATTACK_AFTER = 30.0, 3.0, 15.0
HONEST_LOOPS, ATTACKERS, HONEST_SECONDS, GIVE_UP_AFTER = 8, 2, 1.0, 0.05
ATTACKS = ("fast answers", "refusals", "aborts")
SLOW_LIMITS = ("auto", "4")
WRITE_DEADLINE, SLOW_QUEUE_TIMEOUT, SLOW_AFTER, SLOW_SLACK = 5.0, 2.0, 3.0, 1.05
SLOW_RCVBUF = 4096
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
    """A backend whose service time is ``curve(c, now)``, ``c`` the requests in it (this one counted); records
    the order of arrivals. A request asking for one token is answered at once; one tagged ``refuse`` gets 400; a
    streamed one gets ``SLOW_EVENTS`` SSE events at once."""

    curve: Curve
    active: int = 0
    order: list[str] = field(default_factory=list)
    server: TestServer | None = None
    started: float = field(default_factory=time.perf_counter)

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
        self.active += 1
        try:
            await asyncio.sleep(self.curve(self.active, time.perf_counter() - self.started))
        finally:
            self.active -= 1
        return web.json_response(ANSWER)

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


AUTO_ENV = {"MMGATE_RELEASE_AT": "complete", "MMGATE_MAX_QUEUE": "256", "MMGATE_QUEUE_TIMEOUT": "600",
            "MMGATE_MIN_MM_CONCURRENCY": "1", "MMGATE_MAX_MM_CONCURRENCY_AUTO": "64"}


async def load_cell(model: Model, limit: str, duration: float) -> dict[str, Any]:
    backend = ModelBackend(model.curve)
    proxy, stop = await start_proxy_server(await backend.start(), MMGATE_MAX_MM_CONCURRENCY=limit, **AUTO_ENV)
    body = _body(model.name, data_uri(image_bytes()))
    gate = proxy.state.gate
    done: list[float] = []
    statuses: dict[int, int] = {}
    trace: list[tuple[float, int]] = []
    started = time.perf_counter()
    end = started + duration

    async def client(session: aiohttp.ClientSession) -> None:
        while time.perf_counter() < end:
            async with session.post(proxy.url + "/v1/chat/completions", data=body,
                                    headers={"Content-Type": "application/json"}) as response:
                await response.read()
                statuses[response.status] = statuses.get(response.status, 0) + 1
                if response.status == 200:
                    done.append(time.perf_counter() - started)

    async def watch() -> None:
        while time.perf_counter() < end:
            trace.append((time.perf_counter() - started, gate.counters().limit))
            await asyncio.sleep(0.05)

    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=model.clients)) as session:
            clients = [asyncio.create_task(client(session)) for _ in range(model.clients)]
            watcher = asyncio.create_task(watch())
            await asyncio.sleep(duration)
            await watcher
            for task in clients:
                task.cancel()
            await asyncio.gather(*clients, return_exceptions=True)
    finally:
        await stop()
        assert backend.server is not None
        await backend.server.close()
    completed = sum(1 for t in done if t <= duration)
    return {"model": model.name, "limit": limit, "throughput": completed / duration, "completed": completed,
            "statuses": statuses, "trace": trace if limit == "auto" else [], "final_limit": gate.counters().limit}


def cruise_limit(state: AppState) -> int:
    """The adaptive limit between its probes (the gate's own limit moves with each probe)."""
    assert isinstance(state.gate, LocalGate)  # the bench serves in one process
    gate = state.gate.gate
    return gate.adaptive.cruise_limit if gate.adaptive is not None else gate.limit


async def attack_cell(kind: str, warmup: float, length: float, after: float) -> dict[str, Any]:
    """8 honest loops; 2 attacker loops from ``warmup`` s for ``length`` s; ``after`` s more."""
    backend = ModelBackend(lambda concurrency, now: HONEST_SECONDS)
    proxy, stop = await start_proxy_server(await backend.start(), MMGATE_MAX_MM_CONCURRENCY="auto", **AUTO_ENV)
    image = data_uri(image_bytes())
    honest_body = _body("honest", image)
    attack_body = {"fast answers": _body("fast", image, max_tokens=1), "refusals": _body("refuse", image),
                   "aborts": _body("abort", image)}[kind]
    headers = {"Content-Type": "application/json"}
    honest: list[float] = []
    attacks: dict[str, int] = {}
    trace: list[tuple[float, int, int]] = []  # (t, gate limit, cruise limit)
    started = time.perf_counter()
    total = warmup + length + after

    def now() -> float:
        return time.perf_counter() - started

    async def honest_loop(session: aiohttp.ClientSession) -> None:
        while now() < total:
            async with session.post(proxy.url + "/v1/chat/completions", data=honest_body, headers=headers) as response:
                await response.read()
                if response.status == 200:
                    honest.append(now())

    async def attacker(session: aiohttp.ClientSession) -> None:
        await asyncio.sleep(warmup)
        while now() < warmup + length:
            outcome = "gave up"
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(GIVE_UP_AFTER if kind == "aborts" else None):
                    async with session.post(proxy.url + "/v1/chat/completions", data=attack_body,
                                            headers=headers) as response:
                        await response.read()
                        outcome = str(response.status)
            attacks[outcome] = attacks.get(outcome, 0) + 1

    async def watch() -> None:
        while now() < total:
            trace.append((round(now(), 2), proxy.state.gate.counters().limit, cruise_limit(proxy.state)))
            await asyncio.sleep(0.1)

    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            tasks = [asyncio.create_task(honest_loop(session)) for _ in range(HONEST_LOOPS)]
            tasks += [asyncio.create_task(attacker(session)) for _ in range(ATTACKERS)]
            tasks.append(asyncio.create_task(watch()))
            await asyncio.sleep(total)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    finally:
        await stop()
        assert backend.server is not None
        await backend.server.close()

    def rate(start: float, end: float) -> float:
        return sum(start <= t < end for t in honest) / (end - start)

    def cruise_at(t: float) -> int:
        return next((c for when, _limit, c in reversed(trace) if when <= t), trace[0][2])

    end = warmup + length
    before = rate(warmup - 10, warmup)
    pre, later = cruise_at(warmup), cruise_at(end + 10)
    return {"kind": kind, "honest_before": before, "during": rate(warmup, end) / before,
            "after": rate(end, end + 10) / before, "pre_limit": pre, "limit_10s_after": later,
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


async def reader_of_nothing(port: int, body: bytes) -> socket.socket:
    """A client with a ``SLOW_RCVBUF`` receive buffer that sends ``body`` and never reads its answer."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SLOW_RCVBUF)  # before connecting: the window is agreed then
    sock.setblocking(False)
    loop = asyncio.get_running_loop()
    await loop.sock_connect(sock, ("127.0.0.1", port))
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: mmgate\r\nX-Request-Id: {SLOW_ID}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n")
    await loop.sock_sendall(sock, head.encode() + body)
    return sock


async def slow_reader_cell(limit: str) -> dict[str, Any]:
    """A client that reads nothing of its streamed answer; once its lease is granted, ``HONEST_LOOPS`` honest
    loops for ``WRITE_DEADLINE + SLOW_AFTER`` s."""
    backend = ModelBackend(lambda concurrency, now: BASE_SECONDS)
    env = AUTO_ENV | {"MMGATE_CLIENT_WRITE_TIMEOUT": f"{WRITE_DEADLINE:g}",
                      "MMGATE_QUEUE_TIMEOUT": f"{SLOW_QUEUE_TIMEOUT:g}", "MMGATE_ACCESS_LOG": "on"}
    proxy, stop = await start_proxy_server(await backend.start(), MMGATE_MAX_MM_CONCURRENCY=limit, **env)
    image = data_uri(image_bytes())
    honest_body = _body("honest", image)
    statuses: dict[str, int] = {}
    ended = AccessLogEnd(SLOW_ID)
    access_log = logging.getLogger("mmgate.access")
    level = access_log.level
    access_log.setLevel(logging.INFO)
    access_log.addHandler(ended)
    granted = first_lease(proxy.state)
    sock = None
    try:
        sock = await reader_of_nothing(proxy.server.port, _body("slow", image, stream=True))
        lease = await asyncio.wait_for(granted, HANG_BOUND)
        started = time.perf_counter()
        end = started + WRITE_DEADLINE + SLOW_AFTER

        async def honest_loop(session: aiohttp.ClientSession) -> None:
            while time.perf_counter() < end:
                async with session.post(proxy.url + "/v1/chat/completions", data=honest_body,
                                        headers={"Content-Type": "application/json"}) as response:
                    await response.read()
                    statuses[str(response.status)] = statuses.get(str(response.status), 0) + 1

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
        await stop()
        assert backend.server is not None
        await backend.server.close()
    # a lease not given back within the cell counts as held for the whole cell: a lower bound, still over the goal
    return {"limit": limit, "held_s": released_at - started, "released": released,
            "ended_s": None if ended.at is None else ended.at - started, "code": ended.code, "honest": statuses}


def convergence(trace: list[tuple[float, int]], best: int, share: float = 0.9) -> float | None:
    """The first time from which the limit spends at least ``share`` of the rest of the run within one of
    ``best`` (it keeps probing one above and backing off, so "never leaves" would be the wrong test); None if
    it never does."""
    near = [abs(limit - best) <= 1 for _t, limit in trace]
    for index, (t, _limit) in enumerate(trace):
        rest = near[index:]
        if near[index] and sum(rest) >= share * len(rest):
            return t
    return None


async def fairness_cell(fair: bool) -> dict[str, Any]:
    backend = ModelBackend(lambda concurrency, now: FAIR_SERVICE)
    proxy, stop = await start_proxy_server(await backend.start(), MMGATE_MAX_MM_CONCURRENCY=str(FAIR_LIMIT),
                                           MMGATE_RELEASE_AT="complete", MMGATE_MAX_QUEUE="64",
                                           MMGATE_TRUST_FLOW_HEADERS_FROM="127.0.0.1/32")
    image = data_uri(image_bytes())
    gate = proxy.state.gate
    waits: dict[str, float] = {}

    async def post(session: aiohttp.ClientSession, flow: str, tag: str) -> None:
        headers = {"Content-Type": "application/json", **({FAIRNESS_HEADER: flow} if fair else {})}
        async with session.post(proxy.url + "/v1/chat/completions", data=_body(tag, image),
                                headers=headers) as response:
            await response.read()
            assert response.status == 200, response.status
            match = re.search(r"queue;dur=([0-9.]+)", response.headers.get("Server-Timing", ""))
            waits[tag] = float(match.group(1)) / 1000 if match else 0.0

    try:
        async with aiohttp.ClientSession() as session:
            tasks = [asyncio.create_task(post(session, "big", f"big{i}")) for i in range(BIG)]
            # every big request is in: the first ones at the backend, the rest queued
            # polled: there is no event for "n queued"
            while gate.counters().waiting < BIG - FAIR_LIMIT or len(backend.order) < FAIR_LIMIT:  # noqa: ASYNC110
                await asyncio.sleep(0.001)
            forwarded_before = len(backend.order)
            tasks += [asyncio.create_task(post(session, "small", f"small{i}")) for i in range(SMALL)]
            await asyncio.gather(*tasks)
    finally:
        await stop()
        assert backend.server is not None
        await backend.server.close()
    after = backend.order[forwarded_before:]
    slots = [after.index(f"small{i}") + 1 for i in range(SMALL)]  # 1 = the very next forward
    return {"fair": fair, "slots": slots, "small_wait": statistics.mean(waits[f"small{i}"] for i in range(SMALL)),
            "big_wait": statistics.mean(waits[f"big{i}"] for i in range(BIG)), "order": backend.order}


async def run(args: argparse.Namespace) -> dict[str, Any]:
    rounds: list[dict[str, Any]] = []
    for number in range(args.rounds):
        models = {}
        for model in MODELS:
            cells = []
            for limit in [*map(str, model.quick if args.quick else model.fixed), "auto"]:  # taking turns
                cell = await load_cell(model, limit, args.duration)
                print(f"  round {number + 1} {model.name} limit {limit:>4}: {cell['throughput']:6.2f} answers/s "
                      f"(final limit {cell['final_limit']}, statuses {cell['statuses']})", flush=True)
                cells.append(cell)
            best = max((c for c in cells if c["limit"] != "auto"), key=lambda c: c["throughput"])
            auto = cells[-1]
            auto["convergence_s"] = convergence(auto["trace"], int(best["limit"]))
            auto["trace"] = R.downsample([[t, float(limit)] for t, limit in auto["trace"]], 1)
            models[model.name] = {"cells": cells, "best_fixed": best["limit"]}
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

    found: list[R.Goal] = []
    for model in MODELS:
        name = model.name
        found += [
            R.goal(f"auto ÷ best fixed limit, throughput ({name} backend)",
                   [throughput(r, name, "auto") / throughput(r, name, r["models"][name]["best_fixed"]) for r in rounds],
                   "≥ 0.85", lambda v: v >= 0.85),
            R.goal(f"auto ÷ fixed limit {model.too_high} (too high), throughput ({name} backend)",
                   [throughput(r, name, "auto") / throughput(r, name, str(model.too_high)) for r in rounds
                    if any(c["limit"] == str(model.too_high) for c in r["models"][name]["cells"])],
                   *(("≥ 2", lambda v: v >= 2) if name == "thrashing" else ())),
            R.goal(f"auto: convergence from a cold start ({name} backend)",
                   [next(c for c in r["models"][name]["cells"] if c["limit"] == "auto").get("convergence_s")
                    for r in rounds], unit="s"),
        ]
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


def render(data: dict[str, Any]) -> str:
    s = data["settings"]
    rounds = data["rounds"]
    lines = ["# fleet: the adaptive limit on a thrashing and a batching backend, under attack, against a slow "
             "reader; fair waiting", "",
             f"`python -m bench.fleet --rounds {s['rounds']} --duration {s['duration']:g}`: closed-loop clients; "
             "throughput in answers/s, median (min–max) of the rounds; `auto` starts cold every round."]
    for model in MODELS:
        cells = rounds[0]["models"][model.name]["cells"]
        best = statistics.median(next(c["throughput"] for c in r["models"][model.name]["cells"]
                                      if c["limit"] == r["models"][model.name]["best_fixed"]) for r in rounds)
        lines += ["", f"**{model.name}** backend: service time {model.described}.", "",
                  "| limit | answers/s | spread | × best fixed |", "|---|---:|---|---:|"]
        for limit in [c["limit"] for c in cells]:
            m = R.summary(next(c["throughput"] for c in r["models"][model.name]["cells"] if c["limit"] == limit)
                          for r in rounds)
            lines.append(f"| {limit} | {R.number(m['median'])} | {R.number(m['spread'][0])}–"
                         f"{R.number(m['spread'][1])} | {m['median'] / best:.2f} |")
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
              f"`MMGATE_QUEUE_TIMEOUT={SLOW_QUEUE_TIMEOUT:g}`; one client with a {SLOW_RCVBUF // 1024} KiB receive "
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration", type=float, default=None, help="seconds per throughput cell [20; 4 quick]")
    parser.add_argument("--quick", action="store_true",
                        help="1 round, 4 s cells, three fixed limits per model and auto; attacks 10 + 3 + 12 s")
    parser.add_argument("--out", type=Path, help="write PATH.json and PATH.md instead of bench/results/fleet")
    args = parser.parse_args()
    if args.quick:
        args.rounds = 1
    args.duration = args.duration or (4.0 if args.quick else 20.0)
    args.attack = (10.0, ATTACK_SECONDS, 12.0) if args.quick else (ATTACK_WARMUP, ATTACK_SECONDS, ATTACK_AFTER)
    stamp = R.stamp("fleet.py", "adaptive concurrency limit vs fixed limits on thrashing and batching backends, "
                                "under attack, against a slow reader; fair waiting")
    data = stamp | asyncio.run(run(args))
    data["settings"] = {"rounds": args.rounds, "duration": args.duration, "quick": args.quick,
                        "models": {m.name: {"clients": m.clients, "service": m.described} for m in MODELS},
                        "attack": list(args.attack), "base_seconds": BASE_SECONDS,
                        "slow_reader": {"write_deadline": WRITE_DEADLINE, "queue_timeout": SLOW_QUEUE_TIMEOUT,
                                        "rcvbuf": SLOW_RCVBUF, "stream_bytes": SLOW_EVENTS * len(SLOW_EVENT)}}
    data["goals"] = goals(data)
    R.print_goals(data["goals"])
    R.write("fleet", data, render(data), args.out)


if __name__ == "__main__":
    main()
