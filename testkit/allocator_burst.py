"""A burst of big-image requests through a fresh mmgate under one allocator setting (``testkit.allocators``), then
an idle wait: what its RSS was at the peak, right after the burst and once idle (bench/malloc_arenas.py).

``burst_then_idle`` is one run; ``paired`` matches each run of a setting with the default run of the same command
and decode-worker count, which its ratios are taken against.
"""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace
from typing import Any

from testkit import procfs
from testkit.load import run_load, start_mmgate, stop, uptime

MIB = 1 << 20


def burst_then_idle(stub_url: str, variant: str, env: dict[str, str], workers: int, body: bytes,
                    knobs: SimpleNamespace) -> dict[str, Any]:
    """A fresh mmgate (``--resize-max-pixels 1000000 --max-mm-concurrency 8``, ``workers`` decode workers, under
    ``env``) gets ``knobs.requests`` × ``body`` from ``knobs.clients`` clients, then stays ``knobs.idle`` s idle.
    Its RSS is sampled every 0.1 s (``samples``, [t_s, MiB] each, all of them: the caller may thin them out)."""
    load, n = uptime(), knobs.requests
    if n % knobs.clients:
        raise SystemExit(f"requests ({n}) must be a multiple of clients ({knobs.clients})")
    proc, url = start_mmgate(stub_url, "--resize-max-pixels", "1000000", "--decode-workers", str(workers),
                             "--max-mm-concurrency", "8", env=env)
    t0 = time.monotonic()
    try:
        time.sleep(0.5)
        start, cpu0 = procfs.memory(proc.pid), procfs.cpu_ticks([proc.pid])
        with procfs.RssSampler(proc.pid, 0.1, lambda rss: (round(time.monotonic() - t0, 2), round(rss / MIB, 1))) \
                as samples:
            run = asyncio.run(run_load(url, body, knobs.clients, requests_per_client=n // knobs.clients, timeout=300))
            # utime + stime of the whole process (all threads): steadier than req/s on a shared machine
            cpu = (procfs.cpu_ticks([proc.pid]) - cpu0) / procfs.CLK_TCK
            after = procfs.memory(proc.pid)
            time.sleep(knobs.idle)
            idle = procfs.memory(proc.pid, ("VmHWM", "VmRSS", "RssAnon"))
    finally:
        stop(proc)
    elapsed = run.ended - run.started
    return {
        "variant": variant, "env": env, "decode_workers": workers, "requests": n, "clients": knobs.clients,
        "statuses": run.statuses(), "elapsed_s": round(elapsed, 2), "req_per_s": round(n / elapsed, 2),
        "cpu_ms_per_request": round(1000 * cpu / n, 1), "rss_start_mib": round(start["VmRSS"] / MIB, 1),
        "peak_rss_mib": round(idle["VmHWM"] / MIB, 1), "rss_after_burst_mib": round(after["VmRSS"] / MIB, 1),
        "idle_rss_mib": round(idle["VmRSS"] / MIB, 1), "idle_rss_anon_mib": round(idle.get("RssAnon", 0) / MIB, 1),
        "uptime_before": load, "uptime_after": uptime(), "samples": samples,
    }


def paired(runs: list[dict[str, Any]], variant: str) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(default run, ``variant`` run) of the same command and decode-worker count, in the order they ran."""
    pairs: list[tuple[dict[str, Any], dict[str, Any]]] = []
    for command in dict.fromkeys(r.get("command", "") for r in runs):
        for workers in dict.fromkeys(r["decode_workers"] for r in runs):
            group = [r for r in runs if r.get("command", "") == command and r["decode_workers"] == workers]
            # strict=False: a run cut short leaves a default without its partner; pair what there is
            pairs += zip([r for r in group if r["variant"] == "default"],
                         [r for r in group if r["variant"] == variant], strict=False)
    return pairs
