"""A ``GET /metrics`` flood against mmgate (``MMGATE_BACKEND_METRICS=merge``), with probers timing its other
answers meanwhile: bench/metrics_flood.py's windows.

``run_size``: a backend in its own process whose ``/metrics`` answers an exposition of the given size
(``testkit.load.start_metrics_backend``), mmgate in front with merge on, then three windows: ``idle`` (probers
alone), ``flood`` (``clients`` keep-alive clients on mmgate's /metrics) and ``floor`` (the same clients on the
backend's own /metrics: what serving those bytes costs any aiohttp loop). Probers are processes of their own
(``testkit.load.start_prober``), one keep-alive connection each, one request every ``interval``.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Any

import aiohttp

from testkit import load as L
from testkit import procfs

TEXT_BODY = json.dumps({"model": "stub-vlm", "max_tokens": 16,
                        "messages": [{"role": "user", "content": "Say hello in one short sentence."}]}).encode()
Probes = dict[str, tuple[str, str, bytes | None]]  # name: url, path, body to POST (None: GET)


@dataclass(frozen=True)
class Windows:
    seconds: float  # each window's length
    interval: float  # between two probes of one prober
    clients: int  # flooding /metrics


async def window(probes: Probes, seconds: float, interval: float, pid: int) -> dict[str, Any]:
    """One prober per probe (own processes) over one window; mmgate's CPU share over it."""
    cpu0, t0 = procfs.cpu_ticks([pid]), time.perf_counter()
    probers = {name: L.start_prober(url, seconds, interval, path, body) for name, (url, path, body) in probes.items()}
    answers = {k: await asyncio.to_thread(L.prober_result, *v) for k, v in probers.items()}
    cpu_pct = round(100 * (procfs.cpu_ticks([pid]) - cpu0) / procfs.CLK_TCK / (time.perf_counter() - t0), 1)
    return {k: L.summarize_ms(v["latencies"]) | {"statuses": v["statuses"]} for k, v in answers.items()} | {
        "mmgate": {"cpu_pct": cpu_pct}}


async def flooded(url: str, probes: Probes, windows: Windows, pid: int) -> dict[str, Any]:
    """One window while ``windows.clients`` clients, one keep-alive connection each, GET ``url``/metrics back to
    back, each answer read whole."""
    stop, statuses, sizes = asyncio.Event(), dict[str, int](), set[int]()

    async def client() -> None:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as session:
            while not stop.is_set():
                async with session.get(url + "/metrics") as response:
                    sizes.add(len(await response.read()))
                statuses[str(response.status)] = statuses.get(str(response.status), 0) + 1

    started = time.perf_counter()
    flooding = asyncio.gather(*(client() for _ in range(windows.clients)))
    await asyncio.sleep(0.5)  # every client past its first answer
    row = await window(probes, windows.seconds, windows.interval, pid)
    stop.set()
    await flooding
    return row | {"flood": {"statuses": statuses, "body_bytes": sorted(sizes),
                            "answers_per_s": round(sum(statuses.values()) / (time.perf_counter() - started), 1)}}


async def run_size(size: int, windows: Windows, control_url: str) -> dict[str, Any]:
    """The three windows against an exposition of ``size`` bytes; ``control_url``: a bare server probed beside."""
    backend, backend_url = L.start_metrics_backend(size)
    proc = None
    try:
        proc, url = L.start_mmgate(backend_url, env={"MMGATE_BACKEND_METRICS": "merge"})
        async with aiohttp.ClientSession() as session, session.get(url + "/metrics") as response:
            merged = await response.read()
        if response.status != 200 or b"mmgate_" not in merged:
            raise RuntimeError(f"GET /metrics answered {response.status} without mmgate's families")
        mmgate: Probes = {"health": (url, "/mmgate/health", None), "text": (url, "/v1/chat/completions", TEXT_BODY)}
        bare: Probes = {"bare": (backend_url, "/health", None), "control": (control_url, "/health", None)}
        idle = await window(mmgate | bare, windows.seconds, windows.interval, proc.pid)
        loaded = await flooded(url, mmgate | {"control": bare["control"]}, windows, proc.pid)
        floor = await flooded(backend_url, bare, windows, proc.pid)
    finally:
        log = L.stop(proc)
        L.stop(backend)
    problems = [line for line in log.splitlines() if any(w in line for w in ("ERROR", "Traceback"))][-10:]
    return {"idle": idle, "flood": loaded, "floor": floor, "merged_bytes": len(merged), "log_problems": problems}
