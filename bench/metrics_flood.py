"""Does a /metrics flood slow mmgate's other answers? /mmgate/health and a small text chat completion, idle and
while 8 clients loop on ``GET /metrics`` with ``MMGATE_BACKEND_METRICS=merge`` (issue 39).

Per round and exposition size (300 KB and 4 MB, decimal): a backend in its own process (``testkit.servers``'
scriptable upstream) whose ``/metrics`` answers a vLLM-shaped exposition of that size, with a
``vllm:num_requests_waiting`` gauge so mmgate merges it; mmgate in front (``python -m proxy``, merge on, default
settings otherwise). Then three windows of ``--seconds`` each: idle; flood, ``--clients`` clients (this process,
one keep-alive connection each) sending ``GET /metrics`` to mmgate back to back, reading each answer whole; and
floor, the same clients looping on the backend's own ``/metrics`` (a bare aiohttp server answering the same bytes,
prebuilt): what serving them costs any aiohttp loop on this machine. Probers (own processes, one keep-alive
connection each, every ``--interval``) record /mmgate/health, a small text chat POSTed through mmgate, the
backend's /health and GET /health of a control server (a bare aiohttp app in its own process, doing nothing
else: what the shared machine's scheduling alone costs a loop that does no work). Goals: under the flood, health
and text p50 within their idle p50 + 5 ms (the difference per round, median over rounds); p99 reported beside.

    python -m bench run metrics_flood [--set KNOB=VALUE] [--rounds N] [--quick]
    python -m bench list metrics_flood   # the knobs and their defaults
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from bench import _results as R
from testkit import load as L
from testkit.metrics_flood import Windows, run_size

WHAT = "health and text chat latency, idle and while 8 clients loop on GET /metrics (merge on; 300 KB, 4 MB)"
GOAL_OVER_IDLE_MS = 5.0
PROBES = ("health", "text", "bare", "control")
WINDOWS = ("idle", "flood", "floor")


def over_idle(data: dict[str, Any], size: int, probe: str, q: str, loaded: str = "flood") -> list[float]:
    """Per round: the probe's ``q`` in the ``loaded`` window minus its ``q`` idle, ms."""
    return [round(r[str(size)][loaded][probe][q] - r[str(size)]["idle"][probe][q], 3) for r in data["rounds"]]


def goals(data: dict[str, Any]) -> list[R.Goal]:
    out = []
    for size in data["sizes_kb"]:
        for probe, words in (("health", "/mmgate/health"), ("text", "text chat")):
            out.append(R.goal(f"{size} KB exposition: {words} p50 under the flood − idle", over_idle(data, size, probe,
                              "p50"), f"≤ {GOAL_OVER_IDLE_MS:g}", lambda v: v <= GOAL_OVER_IDLE_MS, unit="ms"))
            out.append(R.goal(f"{size} KB exposition: {words} p99 under the flood − idle",
                              over_idle(data, size, probe, "p99"), unit="ms"))
        out.append(R.goal(f"{size} KB exposition: control server p50 under the flood − idle (the machine's share)",
                          over_idle(data, size, "control", "p50"), unit="ms"))
        out.append(R.goal(f"{size} KB exposition: a bare aiohttp server's health p50 under the same flood of it − "
                          "idle (the floor)", over_idle(data, size, "bare", "p50", "floor"), unit="ms"))
    return out


def report(data: dict[str, Any]) -> str:
    def cell(size: int, phase: str, probe: str, figure: str) -> str:
        return R.spread_cell(r[str(size)][phase].get(probe, {}).get(figure) for r in data["rounds"])

    lines = [
        f"{len(data['rounds'])} rounds, windows of {data['seconds']:g} s, probes every {data['interval'] * 1000:g} ms, "
        f"{data['clients']} flood clients. Each cell: median over rounds (min–max), ms; bare: the backend's /health; "
        "answers/s: the clients' GET /metrics answers; CPU: mmgate's process over the window (its socket sends' "
        "softirq time not counted).",
        "",
        "| exposition | window | health p50 | health p99 | text p50 | text p99 | bare p50 | bare p99 | control p50 "
        "| control p99 | /metrics answers/s | mmgate CPU % |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for size in data["sizes_kb"]:
        for phase in WINDOWS:
            figures = [*((p, q) for p in PROBES for q in ("p50", "p99")), ("flood", "answers_per_s"),
                       ("mmgate", "cpu_pct")]
            lines.append(f"| {size} KB | {phase} | {' | '.join(cell(size, phase, *f) for f in figures)} |")
    lines += ["", f"Start: `{data['uptime_start']}`  ", f"End: `{data['uptime_end']}`", ""]
    return "\n".join(lines)


def measure(knobs: R.Knobs) -> dict[str, Any]:
    data: dict[str, Any] = R.stamp("metrics_flood.py", WHAT) | {
        "sizes_kb": [int(s) for s in knobs.sizes_kb.split(",")], "seconds": knobs.seconds,
        "interval": knobs.interval, "clients": knobs.clients, "uptime_start": L.uptime(), "rounds": []}
    asyncio.run(_flood_rounds(knobs, data))
    data["uptime_end"] = L.uptime()
    return data


async def _flood_rounds(args: R.Knobs, data: dict[str, Any]) -> None:
    windows = Windows(args.seconds, args.interval, args.clients)
    control, control_url = L.start_control()
    try:
        for rnd in range(args.rounds):
            rows = {}
            for size in data["sizes_kb"]:
                rows[str(size)] = row = await run_size(size * 1000, windows, control_url)
                p50s = {ph: {p: row[ph][p]["p50"] for p in PROBES if p in row[ph]} for ph in WINDOWS}
                print(f"r{rnd} {size} KB p50 ms {json.dumps(p50s)}", flush=True)
            data["rounds"].append(rows)
    finally:
        L.stop(control)
