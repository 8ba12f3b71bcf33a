"""One cell of bench/gate_sweep.py's scenarios (gate_sweep, peak_rss): a stub backend configured like a VLM
server (``STUB_FLAGS``: it holds every decoded image until its answer ends) and mmgate before it, both fresh
processes, so that VmHWM is the cell's own; a warm-up request, then a burst of streaming requests with one
12 MP photo each, and both processes' memory, CPU and mmgate's own figures.

- ``run_cell``: one cell (gate off, a gate size, or ``direct``: the clients talk to the backend, no mmgate);
  with ``memory_trace``, VmHWM is reset after the warm-up and RSS and mmgate's gauges are sampled
  (``trace_memory``, ``TRACE_COLUMNS``).
- ``one_request_working_set``: what one request alone costs each process, cold and warm (the terms of peak_rss's
  model, ``testkit.memory_model``).
- ``photo_run``: a scenario's cells with the 12 MP photo's request, and the run's meta (software, load, photo).
"""

from __future__ import annotations

import asyncio
import datetime
import math
import os
import platform
import re
import subprocess
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import aiohttp
import PIL

import proxy
from proxy.settings import usable_cpus
from testkit import load as L
from testkit import procfs
from testkit.media import PHOTO_QUALITY, PHOTO_SIZE, chat_body, photo_jpeg

STUB_FLAGS = ("--hold-pixels", "--cpu-ms-per-mp", "20", "--workers", "8", "--tokens", "8", "--token-delay", "0.01")
OFF = 10000  # a gate or queue limit no cell reaches
MIB = 2**20
QUEUE_TIMING = re.compile(r"\bqueue;dur=([0-9.]+)")  # mmgate's Server-Timing queue stage, ms
LOG_PROBLEMS = ("ERROR", "WARNING", "Traceback", "Error")
IDLE_SETTLE_S = 1.0  # after a request, before reading idle RSS: let the response and its buffers go
TRACE_INTERVAL_S = 0.1
TRACE_GAUGES = ("mmgate_media_bytes_live", "mmgate_gate_in_use", "mmgate_gate_waiting", "mmgate_pool_queue_depth")
TRACE_COLUMNS = ("t_s", "proxy_rss_mib", "backend_rss_mib", "media_live_mib", "gate_in_use", "gate_waiting",
                 "pool_queue")


def mib(n: float) -> float:
    return round(n / MIB, 1)


def mmgate_flags(limit: int, queue: int, release_at: str, preprocess_timeout: float,
                 extra: tuple[str, ...] = ()) -> tuple[str, ...]:
    # validate full: every image decoded (what the memory model weighs); ``extra`` may say header instead
    return ("--validate", "full", "--max-mm-concurrency", str(limit), "--max-queue", str(queue), "--queue-timeout",
            "600", "--preprocess-timeout", str(preprocess_timeout), "--release-at", release_at, *extra)


def memory_of(proc: subprocess.Popen[bytes] | None) -> Mapping[str, float]:
    """VmHWM and VmRSS of ``proc``; NaN for the mmgate a ``direct`` cell does not start."""
    return procfs.memory(proc.pid) if proc else {"VmHWM": math.nan, "VmRSS": math.nan}


async def one_request(url: str, body: bytes, what: str) -> L.LoadRun:
    run = await L.run_load(url, body, 1, requests_per_client=1)
    if run.statuses() != {"200": 1}:
        raise RuntimeError(f"{what} answered {run.statuses()}")
    return run


async def run_cell(gate: str, release_at: str, body: bytes, args: SimpleNamespace, *, queue: int = OFF,
                   extra_flags: tuple[str, ...] = (), env: dict[str, str] | None = None,
                   memory_trace: bool = False) -> dict[str, Any]:
    """One cell in fresh processes. ``memory_trace`` (peak_rss): VmHWM is reset after the warm-up, so the peaks
    are the load's own, and RSS plus mmgate's gauges are sampled during the load (``trace``)."""
    direct = gate == "direct"  # reference: the clients talk to the backend itself, no mmgate
    limit = OFF if gate in ("off", "direct") else int(gate)
    flags = () if direct else mmgate_flags(limit, queue, release_at, args.preprocess_timeout, extra_flags)
    stub = mmgate = None
    quiet = await asyncio.to_thread(L.wait_quiet, args.quiet_wait)
    try:
        stub, stub_url = L.start_stub(*STUB_FLAGS)
        mmgate, url = (None, stub_url) if direct else L.start_mmgate(stub_url, *flags, env=env)
        pids = [p.pid for p in (mmgate, stub) if p]
        await one_request(url, body, f"gate {gate}: warm-up")
        await L.get_json(stub_url, "/stub/reset", "POST")  # the peak of held pixels counts from here
        base_proxy, base_stub = memory_of(mmgate), memory_of(stub)
        hwm_reset = memory_trace and procfs.reset_peaks(pids)
        load0, watch = L.loadavg(), L.CpuWatch([*pids, os.getpid()])
        stop_trace = asyncio.Event()
        tracer = asyncio.create_task(trace_memory(mmgate, stub, url, stop_trace)) if memory_trace and mmgate else None
        run = await L.run_load(url, body, args.clients, requests_per_client=args.per_client)
        stop_trace.set()
        trace = await tracer if tracer else []
        machine, load1 = watch.stop(), L.loadavg()
        hwm_proxy, hwm_stub = memory_of(mmgate), memory_of(stub)
        stats = await L.get_json(stub_url, "/stats")
        prom = await L.scrape(url) if mmgate else {}
    finally:
        log_tail = L.stop(mmgate)
        L.stop(stub)
    ok = run.ok()
    wall = run.ended - run.started
    queue_ms = [float(m.group(1)) for r in ok if (m := QUEUE_TIMING.search(r.server_timing or ""))]
    return {
        "gate": gate, "limit": None if direct else limit, "max_queue": None if direct else queue,
        "release_at": "-" if direct else release_at, "flags": list(flags),
        "requests": len(run.results), "ok": len(ok), "statuses": run.statuses(),
        "n429": sum(1 for r in run.results if r.status == 429),
        "rejected": {dict(k[1])["reason"]: v for k, v in prom.items() if k[0] == "mmgate_rejected_total"},
        "wall_s": round(wall, 2), "req_per_s": round(len(ok) / wall, 3) if wall else math.nan,
        "latency_ms": L.summarize_ms([r.latency for r in ok]),
        "queue_ms": L.summarize_ms([q / 1000 for q in queue_ms]) if queue_ms else {},
        "proxy_hwm_mib": mib(hwm_proxy["VmHWM"]), "proxy_base_rss_mib": mib(base_proxy["VmRSS"]),
        "backend_hwm_mib": mib(hwm_stub["VmHWM"]), "backend_base_rss_mib": mib(base_stub["VmRSS"]),
        "backend_peak_held_mib": mib(stats["peak_held_pixel_bytes"]),
        "backend_images_decoded": stats["images_decoded"], "backend_requests": stats["requests"],
        "loadavg": [load0, load1], "quiet_wait": quiet, "cpu_during_run": machine,
        **({"hwm_reset_after_warmup": hwm_reset, "trace": trace} if memory_trace else {}),
        "mmgate_log_problems": [line for line in log_tail.splitlines() if any(w in line for w in LOG_PROBLEMS)][-20:],
    }


def progress(name: str, row: dict[str, Any]) -> None:
    print(f"{name}: {row['statuses']} {row['req_per_s']:.2f} req/s, p50 {row['latency_ms']['p50'] / 1000:.2f} s, "
          f"HWM backend {row['backend_hwm_mib']} proxy {row['proxy_hwm_mib']} MiB, wall {row['wall_s']} s, "
          f"other jobs {row['cpu_during_run']['other_jobs_cpu_pct']} % CPU", flush=True)


async def trace_memory(mmgate: subprocess.Popen[bytes], stub: subprocess.Popen[bytes], url: str,
                       stop: asyncio.Event) -> list[list[float]]:
    """RSS of both processes and mmgate's own gauges (``TRACE_COLUMNS``) until ``stop``: VmHWM gives the peak,
    this says what the proxy was holding around it (bodies live, requests admitted / waiting)."""
    rows: list[list[float]] = []
    t0 = time.perf_counter()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as session:
        while not stop.is_set():
            try:
                rss = [procfs.memory(p.pid)["VmRSS"] for p in (mmgate, stub)]
            except OSError:
                break
            try:
                async with session.get(url + "/mmgate/metrics") as r:
                    prom = L.parse_prom(await r.text())
            except (aiohttp.ClientError, TimeoutError):
                prom = {}
            live, *gauges = (prom.get((name, ()), math.nan) for name in TRACE_GAUGES)
            rows.append([round(time.perf_counter() - t0, 2), mib(rss[0]), mib(rss[1]), mib(live), *gauges])
            try:
                await asyncio.wait_for(stop.wait(), TRACE_INTERVAL_S)
            except TimeoutError:
                pass
    return rows


async def one_request_working_set(body: bytes, label: str, flags: tuple[str, ...], args: SimpleNamespace) -> dict:
    """Fresh stub + mmgate; two requests, one at a time. For each: idle RSS before it, VmHWM during it (reset
    just before), so peak − idle is what one request alone costs. The first request is `cold` (every buffer is
    new memory); the second `warm` (it may reuse what the first left in the allocators)."""
    quiet = await asyncio.to_thread(L.wait_quiet, args.quiet_wait)
    stub = mmgate = None
    runs = []
    try:
        stub, stub_url = L.start_stub(*STUB_FLAGS)
        mmgate, url = L.start_mmgate(stub_url, *flags)
        procs = {"proxy": mmgate, "backend": stub}

        def read(key: str) -> dict[str, int]:
            return {who: procfs.memory(p.pid)[key] for who, p in procs.items()}

        await asyncio.sleep(IDLE_SETTLE_S)
        for name in ("cold", "warm"):
            idle = read("VmRSS")
            reset = procfs.reset_peaks(p.pid for p in procs.values())
            run = await one_request(url, body, f"{label}: one request")
            peak = read("VmHWM")
            await asyncio.sleep(IDLE_SETTLE_S)
            after = read("VmRSS")
            runs.append({"request": name, "hwm_reset": reset, "latency_s": round(run.results[0].latency, 3),
                         **{f"{who}_{k}_mib": mib(v[who]) for who in procs
                            for k, v in (("idle", idle), ("peak", peak), ("idle_after", after))},
                         **{f"{who}_ws_mib": mib(peak[who] - idle[who]) for who in procs}})
    finally:
        L.stop(mmgate)
        L.stop(stub)
    return {"label": label, "flags": list(flags), "quiet_wait": quiet, "runs": runs}


def photo_run(args: SimpleNamespace, cells: Callable[[bytes], Any]) -> tuple[dict[str, Any], Any]:
    """The run's meta (software, machine, load, the photo and both processes' command lines) and what
    ``cells(body)`` measured with the 12 MP photo's streaming request, ``uptime`` printed before and after."""
    started = time.monotonic()
    up_start = L.uptime()
    print(f"start: {up_start}", flush=True)
    image = photo_jpeg()
    body = chat_body(image, stream=True)
    found = cells(body)
    up_end = L.uptime()
    print(f"end: {up_end}", flush=True)
    meta = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "python": platform.python_version(), "aiohttp": aiohttp.__version__, "pillow": PIL.__version__,
        "usable_cpus": usable_cpus(), "uptime_start": up_start, "uptime_end": up_end,
        "proxy_source": str(Path(proxy.__file__).resolve().parent),
        "clients": args.clients, "per_client": args.per_client, "release_at": args.release_at,
        "preprocess_timeout": args.preprocess_timeout,
        "image": {"format": "JPEG", "size": list(PHOTO_SIZE), "quality": PHOTO_QUALITY, "bytes": len(image),
                  "body_bytes": len(body), "decoded_rgb_bytes": PHOTO_SIZE[0] * PHOTO_SIZE[1] * 3},
        "stub_flags": list(STUB_FLAGS),
        "stub": "python -m demo.backend " + " ".join(STUB_FLAGS),
        "mmgate": "python -m proxy --access-log off --max-mm-concurrency K --max-queue 10000 --queue-timeout 600 "
                  f"--preprocess-timeout {args.preprocess_timeout:g} --release-at R (decode workers default = "
                  "usable CPUs, validate full, no resize)",
        "wall_s": round(time.monotonic() - started, 1),
    }
    return meta, found
