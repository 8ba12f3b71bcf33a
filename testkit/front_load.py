"""One cell of the front-processes bench (``bench/front.py``): a fresh mmgate with N front processes
(``--processes N``) in front of ``testkit.text_load``'s upstream, driven by ``testkit.text_load``'s client
processes: SSE streams (saturating and paced), 1 KB and 4 MB text requests, cache-hit media requests, each with
the CPU of mmgate's whole process tree over the window; and the chat replay's cache hit rate, each request on a
fresh connection (the kernel picks the front: the worst case for per-front caches).
"""

from __future__ import annotations

import asyncio
import io
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from testkit import load as L
from testkit.media import conversation, photo_sized, tagged, turns
from testkit.procfs import CLK_TCK, cpu_ticks, descendants
from testkit.text_load import ROLE, client_results, start_clients, text_body


@dataclass(frozen=True)
class Loads:
    """The loads of a cell: ``clients`` load-generator processes share each."""

    clients: int
    warmup: float  # seconds before each window
    seconds: float  # each window
    streams: int  # SSE streams per client, saturating
    paced_streams: int  # SSE streams per client that one process carries unsaturated
    conns: int  # keep-alive connections of the request loads, over all clients
    paced_rate: float  # 1 KB requests/s in all, paced
    turns: int  # of each chat-replay conversation
    decode_workers: int


class TreeCpu:
    """CPU of mmgate's whole tree over a measured window (pids read at its start: no restarts happen)."""

    def __init__(self, pid: int) -> None:
        self.pids = [pid, *descendants(pid)]
        self.t0 = cpu_ticks(self.pids)

    def seconds(self) -> float:
        return (cpu_ticks(self.pids) - self.t0) / CLK_TCK


def sse(url: str, pid: int, loads: Loads, streams: int) -> dict[str, Any]:
    """Events/s and CPU per event of ``streams`` SSE streams per client, and /mmgate/health's p99 meanwhile."""
    argv = [[*ROLE, "sse-client", "--url", url + "/v1/chat/completions", "--streams", str(streams),
             "--warmup", str(loads.warmup), "--duration", str(loads.seconds), "--period", "0.5"]
            for _ in range(loads.clients)]
    clients = start_clients(argv)
    cpu = TreeCpu(pid)
    prober, out = L.start_prober(url, loads.seconds, 0.01)
    results = client_results(clients)
    cpu_s = cpu.seconds()
    probes = L.prober_result(prober, out)
    events = sum(r["tokens"] for r in results)
    seconds = statistics.mean(r["seconds"] for r in results)
    return {"events_per_s": events / seconds, "cpu_us_per_event": cpu_s / max(events, 1) * 1e6,
            "errors": sum(r["errors"] for r in results),
            "health_p99_ms": L.percentile([v * 1000 for v in probes["latencies"]], 99),
            "health_probes": len(probes["latencies"])}


def requests(url: str, pid: int, body: bytes, conns: int, loads: Loads, rate: float = 0.0) -> dict[str, Any]:
    """Requests/s, MB/s and CPU per request of ``body`` posted over ``conns`` connections (``rate`` > 0: at that
    rate in all)."""
    with tempfile.NamedTemporaryFile(prefix="front-body-", suffix=".json", delete=False) as f:
        f.write(body)
    per_client = max(1, conns // loads.clients)
    argv = [[*ROLE, "http-client", "--url", url + "/v1/chat/completions", "--body-file", f.name, "--conns",
             str(per_client), "--warmup", str(loads.warmup), "--seconds", str(loads.seconds), "--rate",
             str(rate / loads.clients)] for _ in range(loads.clients)]
    try:
        clients = start_clients(argv)
        cpu = TreeCpu(pid)
        results = client_results(clients)
        cpu_s = cpu.seconds()
    finally:
        Path(f.name).unlink(missing_ok=True)
    count = sum(r["requests"] for r in results)
    seconds = statistics.mean(r["seconds"] for r in results)
    return {"requests_per_s": count / seconds, "mb_per_s": count * len(body) / seconds / 1e6,
            "cpu_us_per_request": cpu_s / max(count, 1) * 1e6, "errors": sum(r["errors"] for r in results)}


async def chat_replay_hit_rate(url: str, photo: bytes, tag: str, count: int) -> dict[str, float]:
    """``bench/cache.py``'s conversations, each request on a fresh connection; hits ÷ (hits + misses)."""
    import aiohttp

    await _gate_idle(url)
    before = L.parse_prom(await _text(url + "/mmgate/metrics"))
    for name in ("one_photo", "new_photo_each_turn"):
        for body in turns(name, photo, tag, count):
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s, \
                    s.post(url + "/v1/chat/completions", data=body,
                           headers={"Content-Type": "application/json"}) as r:
                answer = await r.read()
                if r.status != 200:
                    raise RuntimeError(f"chat replay got {r.status}: {answer[:300]!r}")
    after = L.parse_prom(await _text(url + "/mmgate/metrics"))

    def delta(name: str) -> float:
        return after.get((name, ()), 0.0) - before.get((name, ()), 0.0)

    hits, misses = delta("mmgate_cache_hits_total"), delta("mmgate_cache_misses_total")
    return {"hits": hits, "misses": misses, "hit_rate": hits / max(hits + misses, 1)}


async def _gate_idle(url: str, within: float = 120.0) -> None:
    """Wait until the previous load's requests have left the gate: the replay measures hits, not a queue
    that clients killed at the end of a window left behind (each waits out its own deadline)."""
    deadline = time.monotonic() + within
    while True:
        gate = (await L.get_json(url, "/mmgate/stats"))["gate"]
        if gate["in_use"] == 0 and gate["waiting"] == 0:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"the gate is not idle {within:.0f} s after the load: {gate}")
        await asyncio.sleep(0.2)


async def _text(url: str) -> str:
    import aiohttp

    async with aiohttp.ClientSession() as s, s.get(url) as r:
        return await r.text()


def small_photo() -> bytes:
    """The cache-hit requests' photo: a 640×480 JPEG."""
    out = io.BytesIO()
    photo_sized(640, 480).save(out, "JPEG", quality=85)
    return out.getvalue()


def front_cell(processes: int, upstream: str, loads: Loads, round_no: int, photo: bytes) -> dict[str, Any]:
    """Every load of the cell against a fresh mmgate of ``processes`` fronts, once every front is ready."""
    L.wait_quiet(10)
    # --validate full: the media requests are decoded once and then cached (a header-judged image never is)
    flags = ["--processes", str(processes), "--decode-workers", str(loads.decode_workers), "--validate", "full",
             "--max-body-mb", "16", "--max-connections", "4096", "--drain-timeout", "5"]
    proc, url = L.start_mmgate(upstream, *flags, "--cache-mb", "256")
    try:
        L.wait_http(url + "/mmgate/stats", proc)
        for _ in range(600):  # every front ready before any window opens
            if asyncio.run(L.get_json(url, "/mmgate/stats")).get("processes") == processes:
                break
            time.sleep(0.05)
        pid, text_1k = proc.pid, text_body(1024)
        return {"processes": processes,
                "sse": sse(url, pid, loads, loads.streams),
                "sse_paced": sse(url, pid, loads, loads.paced_streams),
                "text_1k": requests(url, pid, text_1k, loads.conns, loads),
                "text_1k_paced": requests(url, pid, text_1k, loads.conns, loads, rate=loads.paced_rate),
                "text_4m": requests(url, pid, text_body(4 << 20), max(2, loads.clients * 2), loads),
                "media_hit": requests(url, pid, conversation([tagged(photo, f"hit/{round_no}")]), loads.conns,
                                      loads),
                "chat_replay": asyncio.run(chat_replay_hit_rate(url, photo, f"replay/{round_no}/{processes}",
                                                                loads.turns))}
    finally:
        tail = L.stop(proc, timeout=30)
        if proc.returncode not in (0, None):
            print(tail, file=sys.stderr)
