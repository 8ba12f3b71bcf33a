"""The default ``MMGATE_MAX_MM_CONCURRENCY`` against the other limits, where the limit matters most.

Issue 40: the default limit follows the machine (the decode workers, never under 4: ``proxy.settings.cpus``),
chosen by measurement. This bench is that measurement on the machine it runs on: mmgate's model mode in front of
``demo.backend --profile frontend`` (one decode thread, processor CPU per megapixel, a short prefill: the backend
whose frontend the model mode relieves, so the one where mmgate's own decode pool is the busy part), 12 MP camera
JPEGs (``testkit.media.camera_photo``, q90 4:2:0) that Idefics3's own configuration
(``testkit.models.REAL_CHECKPOINTS``) shrinks to its 1456 px edge, one streaming chat request each, 8 output
tokens, from closed-loop clients (``testkit.load.run_load``).

Cells: each limit of ``--limits`` (one mmgate each, ``--max-mm-concurrency`` that limit, the queue long enough
that nobody is refused) × each client count of ``--clients``. Within a round the limits take turns, the order
turning round by round; each mmgate lives for the whole run and is warmed with one request first. Per cell:
req/s and the median latency (send → last byte); per round, each limit's req/s ÷ the best limit's (the limit of
the highest median req/s at that client count). Goal: the default's req/s ≥ 0.95× the best limit's at every
client count. ``auto`` (issue 43's adaptive limit) runs as one more cell, its mmgate living the whole run as the
others do, so its limit is what it learnt by then; its req/s ÷ the best fixed limit's is recorded, the figure that
decides whether it could be the default. Every figure is the median of ``--rounds`` (≥ 3) with its spread.

    python -m bench run default_limit [--set KNOB=VALUE] [--rounds N] [--quick]
    python -m bench list default_limit   # the knobs and their defaults

Writes bench/results/default_limit.md/.json.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import _results as R
from proxy.settings.cpus import usable_mm_concurrency
from testkit.load import closed_loop_cell, stub_and_gates, turn
from testkit.media import camera_jpeg, camera_photo, chat_body
from testkit.models import REAL_CHECKPOINTS

WHAT = "req/s of mmgate's model mode at each MMGATE_MAX_MM_CONCURRENCY, frontend-like stub, 12 MP camera JPEGs"
CHECKPOINT = "Idefics3"
OUTPUT_TOKENS = 8
TARGET = 0.95  # the default's req/s ÷ the best limit's, at least
AUTO = "auto"
Limit = int | str  # a fixed limit, or AUTO


def run_cell(url: str, body: bytes, clients: int, requests: int) -> dict[str, Any]:
    cell, run = closed_loop_cell(url, body, clients, requests)
    ok = run.ok()
    return cell | {"p50_s": statistics.median(r.latency for r in ok) if ok else None}


def measure(args: R.Knobs) -> dict[str, Any]:
    data: dict[str, Any] = R.stamp("default_limit.py", WHAT)
    given = [n for n in args.limits.split(",") if n]
    limits: list[Limit] = sorted({int(n) for n in given if n != AUTO} | {usable_mm_concurrency()})
    limits += [AUTO] if AUTO in given else []
    clients = [int(n) for n in args.clients.split(",") if n]
    data["settings"] = {"rounds": args.rounds, "limits": limits, "clients": clients, "requests": args.requests,
                        "default": usable_mm_concurrency(), "checkpoint": CHECKPOINT, "output_tokens": OUTPUT_TOKENS}
    body = chat_body(camera_jpeg(camera_photo()), stream=True, max_tokens=OUTPUT_TOKENS)
    data["body_bytes"] = len(body)
    cells: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="mmgate-default-limit-") as tmp:
        folder = REAL_CHECKPOINTS[CHECKPOINT](Path(tmp) / "model")
        gates = {limit: ("--model", str(folder), "--max-mm-concurrency", str(limit), "--max-queue", "10000")
                 for limit in limits}
        with stub_and_gates(("--profile", "frontend", "--tokens", str(OUTPUT_TOKENS)), gates) as (_, urls):
            for url in urls.values():
                run_cell(url, body, 1, 1)  # warm-up, not measured
            started = time.monotonic()
            for round_ in range(args.rounds):
                for n in clients:
                    for limit in turn(limits, round_):
                        cell = run_cell(urls[limit], body, n, max(args.requests, 2 * n))
                        cells.append({"limit": limit, "clients": n, "round": round_, **cell})
                        print(f"r={round_} {n:3} clients, limit {limit!s:>4}: {cell['rps']:6.2f} req/s, p50 "
                              f"{cell['p50_s'] or 0:.2f} s, {cell['statuses']}", flush=True)
            data["measured_s"] = time.monotonic() - started
    data["cells"] = cells
    return data


def figure(data: dict[str, Any], limit: Limit, clients: int, key: str) -> dict[int, float]:
    """Round → ``key`` of the cell (None-free: a cell with failed requests is left out)."""
    return {c["round"]: c[key] for c in data["cells"]
            if c["limit"] == limit and c["clients"] == clients and c["ok"] == c["sent"] and c[key] is not None}


def best_limit(data: dict[str, Any], clients: int) -> int:
    """The fixed limit of the highest median req/s at ``clients`` clients."""
    medians = {limit: R.summary(figure(data, limit, clients, "rps").values())["median"] or 0.0
               for limit in data["settings"]["limits"] if limit != AUTO}
    return max(medians, key=lambda limit: medians[limit])


def of_best(data: dict[str, Any], limit: Limit, clients: int) -> list[float | None]:
    """``limit``'s req/s ÷ the best limit's (``best_limit``: one limit for every round, not each round's own
    maximum, which would favour whichever limit was luckiest that round), round by round."""
    mine, best = figure(data, limit, clients, "rps"), figure(data, best_limit(data, clients), clients, "rps")
    return [mine[r] / best[r] if r in mine and r in best else None for r in sorted({c["round"] for c in data["cells"]})]


def goals(data: dict[str, Any]) -> list[R.Goal]:
    s = data["settings"]
    fixed = [R.goal(f"default limit ({s['default']}), {n} clients: req/s ÷ the best limit's ({best_limit(data, n)})",
                    of_best(data, s["default"], n), f"≥ {TARGET}", lambda v: v >= TARGET, unit="×")
             for n in s["clients"]]
    adaptive = [R.goal(f"auto, {n} clients: req/s ÷ the best fixed limit's ({best_limit(data, n)})",
                       of_best(data, AUTO, n), unit="×") for n in s["clients"] if AUTO in s["limits"]]
    return fixed + adaptive


def report(data: dict[str, Any]) -> str:
    s = data["settings"]
    text = R.spread_cell
    lines = [
        f"Request bodies {data['body_bytes'] / 1e6:.2f} MB; at least {s['requests']} requests a cell, {s['rounds']} "
        f"rounds; the default on this machine: **{s['default']}**. Median (min–max) of the rounds.",
        "",
        "| clients | limit | req/s | ÷ best | p50 latency s |",
        "| ---: | ---: | ---: | ---: | ---: |",
    ]
    for n in s["clients"]:
        for limit in s["limits"]:
            mark = " (default)" if limit == s["default"] else ""
            lines.append(f"| {n} | {limit}{mark} | {text(figure(data, limit, n, 'rps').values())} | "
                         f"{text(of_best(data, limit, n))} | {text(figure(data, limit, n, 'p50_s').values())} |")
    return "\n".join(lines) + "\n"
