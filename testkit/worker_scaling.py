"""One cell of the decode-worker scaling bench (``bench/scale.py``): one mmgate process in front of
``testkit.text_load``'s upstream, loaded with the 12 MP photo by load-generator processes of their own, its
throughput, CPU, health latency and peak memory over a measured window; and the first request after a start
against warm ones.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from testkit import load as L
from testkit import procfs
from testkit.media import chat_body, photo_jpeg
from testkit.text_load import start_role

RESIZE_FLAGS = ("--resize-max-pixels", "1000000")
FIRST_WARM = 5  # warm requests after the first one
PROBE_INTERVAL = 0.01
PROBER_START_S = 0.5  # the prober's interpreter starts this early, so every probe falls while the load runs
# The variable of the decode_mode setting, spelt the way Settings derives it from the setting's name: a build
# without the setting must not list it among the variables the project uses.
MODE_VARIABLE = "MMGATE_" + "decode_mode".upper()


def process_mode_available() -> bool:
    """Whether this build knows the decode mode ``process`` (an unknown variable is warned about, not refused)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MMGATE_")} | {MODE_VARIABLE: "process"}
    out = subprocess.run([sys.executable, "-m", "proxy", "--print-config", "--upstream", "http://127.0.0.1:9"],
                         cwd=L.REPO, env=env, capture_output=True, text=True, timeout=60)
    return out.returncode == 0 and MODE_VARIABLE not in out.stderr


def _load_generator(url: str, clients: int, stop_at: float, results: Any) -> None:
    """Runs in a child process: ``clients`` clients until ``stop_at`` (time.monotonic, shared by every process
    on Linux); sends back (monotonic end time, status) of each answer."""
    body = chat_body(photo_jpeg())

    async def until_stop() -> L.LoadRun:
        stop = asyncio.Event()
        asyncio.get_running_loop().call_later(max(0.0, stop_at - time.monotonic()), stop.set)
        return await L.run_load(url, body, clients, stop_event=stop, timeout=120)

    offset = time.monotonic() - time.perf_counter()  # run_load stamps perf_counter
    run = asyncio.run(until_stop())
    results.send([(r.ended + offset, r.status if not r.error else 0) for r in run.results])
    results.close()


def _peaks(root: int) -> tuple[int, int]:
    """(VmHWM of mmgate, sum of its descendants' VmHWM), bytes."""
    return (procfs.memory(root).get("VmHWM", 0),
            sum(procfs.memory(pid).get("VmHWM", 0) for pid in procfs.descendants(root)))


def loaded_cell(mode: str, resize: bool, workers: int, seconds: float, ramp: float, load_procs: int,
                mode_env: bool) -> dict[str, Any]:
    """``workers`` decode workers in ``mode`` (set only where ``mode_env``: the build knows the setting), 2 ×
    workers + 2 clients over ``load_procs`` processes, the gate admitting 2 × workers: over a window of
    ``seconds`` after ``ramp``, the 200s completed per second, mmgate's cores and CPU per request (its tree,
    reaped children included), health latency, peak RSS and the load generators' cores."""
    clients = 2 * workers + 2
    # --validate full: with resize off each image is still decoded and checked, the pool's work being measured
    flags = ["--validate", "full", "--decode-workers", str(workers), "--max-mm-concurrency", str(2 * workers),
             "--max-queue", str(4 * clients), "--queue-timeout", "120", "--max-inflight-media-mb", "8192",
             *(RESIZE_FLAGS if resize else ())]
    upstream, upstream_url = start_role("upstream")
    gate = None
    generators: list[tuple[Any, Any]] = []  # (process, the end of its pipe)
    try:
        gate, url = L.start_mmgate(upstream_url, *flags, env={MODE_VARIABLE: mode} if mode_env else {})
        warm = asyncio.run(L.run_load(url, chat_body(photo_jpeg()), workers, requests_per_client=1))
        if warm.statuses() != {"200": workers}:
            raise RuntimeError(f"{mode}/{workers}: the warm-up answered {warm.statuses()}")
        procs = max(1, min(load_procs, clients))
        ctx = multiprocessing.get_context("spawn")
        window_start = time.monotonic() + ramp + 1.0  # the generators need about a second to start
        window_end = window_start + seconds
        for n in range(procs):
            receive, send = ctx.Pipe(duplex=False)
            share = clients // procs + (1 if n < clients % procs else 0)
            proc = ctx.Process(target=_load_generator, args=(url, share, window_end, send), daemon=True)
            proc.start()
            send.close()
            generators.append((proc, receive))
        time.sleep(max(0.0, window_start - PROBER_START_S - time.monotonic()))
        prober, out = L.start_prober(url, seconds, PROBE_INTERVAL)
        time.sleep(max(0.0, window_start - time.monotonic()))
        procfs.reset_peaks(procfs.tree(gate.pid))
        load_pids = [[p.pid] for p, _ in generators]
        cpu0 = procfs.tree_cpu_seconds(gate.pid, reaped=True)
        load0 = [procfs.cpu_ticks(pids) / procfs.CLK_TCK for pids in load_pids]
        t0 = time.monotonic()
        probe = L.prober_result(prober, out)
        time.sleep(max(0.0, window_end - time.monotonic()))
        wall = time.monotonic() - t0
        cpu1 = procfs.tree_cpu_seconds(gate.pid, reaped=True)
        load1 = [procfs.cpu_ticks(pids) / procfs.CLK_TCK for pids in load_pids]
        rss_gate, rss_workers = _peaks(gate.pid)
        answers: list[tuple[float, int]] = []
        for proc, receive in generators:
            answers += receive.recv()
            proc.join(30)
    finally:
        for proc, _ in generators:
            if proc.is_alive():
                proc.terminate()
        L.stop(gate)
        L.stop(upstream)
    inside = [status for ended, status in answers if window_start <= ended < window_end]
    ok = sum(1 for status in inside if status == 200)
    health = L.summarize_ms(probe["latencies"])
    used = cpu1 - cpu0
    return {"rps": ok / seconds, "cores": used / wall, "cpu_ms_per_req": used * 1000 / ok if ok else None,
            "health_p50_ms": health["p50"], "health_p99_ms": health["p99"], "health_max_ms": health["max"],
            "probes": health["n"], "rss_mmgate_mb": rss_gate / 2**20, "rss_workers_mb": rss_workers / 2**20,
            "load_cores": [(b - a) / wall for a, b in zip(load0, load1, strict=True)], "clients": clients,
            "not_ok": len(inside) - ok}


def _timed_post(url: str, body: bytes) -> float:
    """One request on a new connection: seconds from connect to the last byte of a 200 answer."""
    import http.client
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    started = time.perf_counter()
    conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port, timeout=120)
    try:
        conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
        answer = conn.getresponse()
        answer.read()
    finally:
        conn.close()
    if answer.status != 200:
        raise RuntimeError(f"the request answered {answer.status}")
    return time.perf_counter() - started


def first_request(mode: str, mode_env: bool, model: Path | None = None) -> dict[str, Any]:
    """A fresh mmgate (defaults, or with ``MMGATE_MODEL`` = ``model``), as soon as it answers: its first
    request and ``FIRST_WARM`` warm ones, one at a time; the first over the warm ones' median."""
    body = chat_body(photo_jpeg())
    upstream, upstream_url = start_role("upstream")
    gate = None
    try:
        env = ({MODE_VARIABLE: mode} if mode_env else {}) | ({"MMGATE_MODEL": str(model)} if model else {})
        gate, url = L.start_mmgate(upstream_url, env=env)
        first = _timed_post(url, body)
        warm = [_timed_post(url, body) for _ in range(FIRST_WARM)]
    finally:
        L.stop(gate)
        L.stop(upstream)
    warm_ms = sorted(w * 1000 for w in warm)[len(warm) // 2]
    return {"first_ms": first * 1000, "warm_ms": warm_ms, "x_warm": first * 1000 / warm_ms}
