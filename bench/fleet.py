#!/usr/bin/env python
"""mmgate in a fleet: the adaptive limit against fixed ones on a thrashing backend, and fair waiting.

**Adaptive limit** (``MMGATE_MAX_MM_CONCURRENCY=auto``). A backend model that thrashes past its capacity: a
request's service time is ``base × max(1, (c / knee)²)``, ``c`` the requests in the backend when it arrives
(knee 4, base 100 ms): throughput grows with ``c`` up to the knee and falls as ``1/c`` past it, the way a
server that swaps KV cache or preempts does. 32 closed-loop clients (each sends its next media request when
its answer comes) drive mmgate for ``--duration`` s per cell, with fixed limits 1..16 and with ``auto``
(``MMGATE_MIN_MM_CONCURRENCY=1``, ``MMGATE_MAX_MM_CONCURRENCY_AUTO=64``, starting cold at 1 in every round).
Throughput = answers completed within the cell's duration ÷ duration: ``auto`` pays for its own convergence.
Convergence = the first time from which the adaptive limit spends at least 90 % of the rest of the cell
within one of the best fixed limit of that round. Fixed limits use ``MMGATE_RELEASE_AT=complete`` like
``auto`` does, so both bound the backend.

**Fairness.** A backend with a constant 200 ms service time behind mmgate with a limit of 2. Flow ``big``
sends 12 media requests at once; once they are all in (2 admitted, 10 queued), flow ``small`` sends 2. With
``x-gateway-inference-fairness-id`` the flows take turns; without it (FIFO) ``small`` waits behind all of
``big``. Recorded: how many forwards to the backend happen after ``small`` arrives until each of its requests
is forwarded (slots), and ``small``'s wait (Server-Timing ``queue``), fair against FIFO.

Everything runs in this process on one event loop (clients, mmgate from ``build_app``, the model backends);
the backends sleep rather than burn CPU, so the figures depend little on the shared machine.

Usage: python -m bench.fleet [--rounds 3] [--duration 20] [--quick (1 round, limits 2, 4, 16, 4 s)] [--out PATH]
Writes bench/results/fleet.md and .json (or PATH.md / PATH.json).
"""

from __future__ import annotations

import argparse
import asyncio
import re
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
from testkit.media import chat_with_image, data_uri, image_bytes
from testkit.servers import start_proxy_server

KNEE = 4
BASE_SECONDS = 0.1
CLIENTS = 32
FIXED = (1, 2, 3, 4, 5, 6, 8, 16)
TOO_HIGH = 16
FAIR_SERVICE = 0.2
FAIR_LIMIT = 2
BIG, SMALL = 12, 2
FAIRNESS_HEADER = "x-gateway-inference-fairness-id"
ANSWER = {"id": "c", "object": "chat.completion", "choices": [{"index": 0, "finish_reason": "stop",
                                                                 "message": {"role": "assistant", "content": "ok"}}]}


@dataclass
class ModelBackend:
    """A backend whose service time is ``base × max(1, (c / knee)²)``; records the order of arrivals."""

    base: float
    knee: int
    active: int = 0
    order: list[str] = field(default_factory=list)
    server: TestServer | None = None

    async def chat(self, request: web.Request) -> web.Response:
        body = orjson.loads(await request.read())
        self.order.append(body["messages"][0]["content"][0]["text"])
        self.active += 1
        try:
            await asyncio.sleep(self.base * max(1.0, (self.active / self.knee) ** 2))
        finally:
            self.active -= 1
        return web.json_response(ANSWER)

    async def start(self) -> str:
        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/v1/chat/completions", self.chat)
        self.server = TestServer(app, host="127.0.0.1")
        await self.server.start_server()
        return f"http://127.0.0.1:{self.server.port}"


def _body(tag: str, image: str) -> bytes:
    return orjson.dumps(chat_with_image(image, text=tag))


async def thrash_cell(limit: str, duration: float) -> dict[str, Any]:
    backend = ModelBackend(BASE_SECONDS, KNEE)
    env = {"MMGATE_MAX_MM_CONCURRENCY": limit, "MMGATE_RELEASE_AT": "complete", "MMGATE_MAX_QUEUE": "256",
           "MMGATE_QUEUE_TIMEOUT": "600", "MMGATE_MIN_MM_CONCURRENCY": "1", "MMGATE_MAX_MM_CONCURRENCY_AUTO": "64"}
    proxy, stop = await start_proxy_server(await backend.start(), **env)
    body = _body("thrash", data_uri(image_bytes()))
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
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=CLIENTS)) as session:
            clients = [asyncio.create_task(client(session)) for _ in range(CLIENTS)]
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
    return {"limit": limit, "throughput": completed / duration, "completed": completed, "statuses": statuses,
            "trace": trace if limit == "auto" else [], "final_limit": gate.counters().limit}


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
    backend = ModelBackend(FAIR_SERVICE, knee=1000)
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
        cells = []
        for limit in [*map(str, args.fixed), "auto"]:  # fixed and auto take turns, round after round
            cell = await thrash_cell(limit, args.duration)
            print(f"  round {number + 1} limit {limit:>4}: {cell['throughput']:6.2f} answers/s "
                  f"(final limit {cell['final_limit']}, statuses {cell['statuses']})", flush=True)
            cells.append(cell)
        fixed = [c for c in cells if c["limit"] != "auto"]
        best = max(fixed, key=lambda c: c["throughput"])
        auto = cells[-1]
        auto["convergence_s"] = convergence(auto["trace"], int(best["limit"]))
        auto["trace"] = R.downsample([[t, float(limit)] for t, limit in auto["trace"]], 1)
        fair, fifo = await fairness_cell(True), await fairness_cell(False)
        print(f"  round {number + 1} fairness: small slots {fair['slots']} wait {fair['small_wait']:.2f} s; "
              f"FIFO slots {fifo['slots']} wait {fifo['small_wait']:.2f} s", flush=True)
        rounds.append({"cells": cells, "best_fixed": best["limit"], "fair": fair, "fifo": fifo})
    return {"rounds": rounds}


def goals(data: dict[str, Any]) -> list[R.Goal]:
    rounds = data["rounds"]

    def throughput(r: dict[str, Any], limit: str) -> float:
        return next(c["throughput"] for c in r["cells"] if c["limit"] == limit)

    auto_vs_best = [throughput(r, "auto") / throughput(r, r["best_fixed"]) for r in rounds]
    auto_vs_high = [throughput(r, "auto") / throughput(r, str(TOO_HIGH)) for r in rounds
                    if any(c["limit"] == str(TOO_HIGH) for c in r["cells"])]
    conv = [next(c for c in r["cells"] if c["limit"] == "auto").get("convergence_s") for r in rounds]
    return [
        R.goal("auto ÷ best fixed limit, throughput (thrashing backend)", auto_vs_best, "≥ 0.8", lambda v: v >= 0.8),
        R.goal(f"auto ÷ fixed limit {TOO_HIGH} (too high), throughput", auto_vs_high, "≥ 2", lambda v: v >= 2),
        R.goal("auto: convergence from a cold start", conv, unit="s"),
        R.goal("fair: forwards until the small flow's last request (of those after it arrived)",
               [max(r["fair"]["slots"]) for r in rounds], "≤ 4", lambda v: v <= 4, met_on="max"),
        R.goal("FIFO: forwards until the small flow's last request", [max(r["fifo"]["slots"]) for r in rounds]),
        R.goal("small flow's wait, fair ÷ FIFO", [r["fair"]["small_wait"] / r["fifo"]["small_wait"] for r in rounds]),
    ]


def render(data: dict[str, Any]) -> str:
    s = data["settings"]
    lines = ["# fleet: the adaptive limit on a thrashing backend, and fair waiting", "",
             f"`python -m bench.fleet --rounds {s['rounds']} --duration {s['duration']:g}`: {CLIENTS} closed-loop "
             f"clients; backend service time {BASE_SECONDS * 1000:.0f} ms × max(1, (c/{KNEE})²). Throughput in "
             "answers/s, median (min–max) of the rounds; `auto` starts cold at 1 every round.", "",
             "| limit | answers/s | spread | × best fixed |", "|---|---:|---|---:|"]
    rounds = data["rounds"]
    limits = [c["limit"] for c in rounds[0]["cells"]]
    best = statistics.median(next(c["throughput"] for c in r["cells"] if c["limit"] == r["best_fixed"])
                             for r in rounds)
    for limit in limits:
        values = [next(c["throughput"] for c in r["cells"] if c["limit"] == limit) for r in rounds]
        m = R.summary(values)
        lines.append(f"| {limit} | {R.number(m['median'])} | {R.number(m['spread'][0])}–{R.number(m['spread'][1])}"
                     f" | {m['median'] / best:.2f} |")
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
    parser.add_argument("--quick", action="store_true", help="1 round, 4 s cells, limits 2, 4, 16 and auto")
    parser.add_argument("--out", type=Path, help="write PATH.json and PATH.md instead of bench/results/fleet")
    args = parser.parse_args()
    args.fixed = FIXED
    if args.quick:
        args.rounds, args.fixed = 1, (2, 4, 16)
    args.duration = args.duration or (4.0 if args.quick else 20.0)
    stamp = R.stamp("fleet.py", "adaptive concurrency limit vs fixed limits on a thrashing backend; fair waiting")
    data = stamp | asyncio.run(run(args))
    data["settings"] = {"rounds": args.rounds, "duration": args.duration, "fixed": list(args.fixed),
                        "clients": CLIENTS, "knee": KNEE, "base_seconds": BASE_SECONDS}
    data["goals"] = goals(data)
    R.print_goals(data["goals"])
    R.write("fleet", data, render(data), args.out)


if __name__ == "__main__":
    main()
