"""A long load in blocks with an idle checkpoint after each, and what mmgate's RSS did meanwhile: bench/soak.py's
leak test, one variant (an mmgate environment) at a time (``soak_run``).

RSS under load measures which big images happen to be in flight; a leak is what remains when nothing is. So
``CheckpointedLoad`` sends its work in blocks of ``checkpoint_every`` requests from ``clients`` coroutines; after
each block every client waits at a barrier until mmgate is idle (``IDLE_WHEN_ZERO`` gauges all 0) and has trimmed
(or, trim off, for ``settle`` s), then VmRSS and the ``GAUGES`` are read (``checkpoint``). ``criterion`` compares
the idle RSS at the checkpoints after warm-up; ``under_load`` sums up the RSS samples taken while the clients were
sending (``procfs.RssSampler`` rows of ``CheckpointedLoad.sample``); ``idle_rss_at`` and ``tenth_rss`` are a run's
figures per checkpoint and per tenth of its requests.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from collections import Counter
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

from testkit.load import loadavg, scrape, start_mmgate, stop, uptime
from testkit.mix import Media, Work, disconnecting_request, workload
from testkit.procfs import RssSampler, memory

MIB = 1 << 20
GAUGES = ("mmgate_media_bytes_live", "mmgate_media_buffers_live", "mmgate_media_bytes_inflight", "mmgate_gate_in_use",
          "mmgate_gate_waiting", "mmgate_pool_queue_depth", "mmgate_pool_stuck_workers")
MUST_BE_ZERO = GAUGES[:4]  # when idle; a leak otherwise
IDLE_WHEN_ZERO = ("mmgate_gate_in_use", "mmgate_gate_waiting", "mmgate_media_bytes_live", "mmgate_media_buffers_live")
TRIMS = ("mmgate_memory_trims_total", ())
IDLE_TIMEOUT_S = 30.0  # a checkpoint that never gets idle is recorded as such (idle_reached False)
POLL_S = 0.05
Sample = tuple[float, int, int, bool]  # (t, requests done, rss bytes, under load)


def mib(size: float) -> float:
    return round(size / MIB, 1)


def change_pct(value: float, reference: float) -> float:
    return round(100 * (value - reference) / reference, 1)


def gauges(prom: dict) -> dict[str, float]:
    return {g: sum(v for (name, _labels), v in prom.items() if name == g) for g in GAUGES}


class CheckpointedLoad:
    """One mmgate's load: ``work`` in blocks, an idle checkpoint after each. ``done``, ``loading`` and ``t0`` are
    plain attributes that ``sample`` (run by a sampler thread) reads: the GIL is enough."""

    def __init__(self, url: str, pid: int, *, clients: int, checkpoint_every: int, seed: int, trim: bool,
                 settle: float, trim_timeout: float) -> None:
        self.url, self.pid, self.clients, self.every, self.seed = url, pid, clients, checkpoint_every, seed
        self.trim, self.settle, self.trim_timeout = trim, settle, trim_timeout
        self.done, self.loading, self.sending_s = 0, False, 0.0  # sending_s: checkpoint pauses excluded
        self.counts: Counter[str] = Counter()  # client side, by outcome
        self.checkpoints: list[dict[str, Any]] = []
        self.t0 = time.monotonic()

    def sample(self, rss: int) -> Sample:
        return time.monotonic() - self.t0, self.done, rss, self.loading

    async def run(self, work: Work) -> None:
        import aiohttp

        host, port = self.url.rsplit("//", 1)[1].split(":")
        rng = random.Random(self.seed + 1)

        async def client(session: aiohttp.ClientSession, block: Iterator[int]) -> None:
            for i in block:
                path, body, disconnect = work[i]
                if disconnect:
                    outcome = await disconnecting_request(host, int(port), path, body, rng.uniform(0.0, 0.15))
                else:
                    try:
                        async with session.post(self.url + path, data=body,
                                                headers={"Content-Type": "application/json"}) as r:
                            async for _chunk in r.content.iter_any():
                                pass
                        outcome = str(r.status)
                    except (TimeoutError, aiohttp.ClientError) as exc:
                        outcome = "client_error:" + type(exc).__name__
                self.counts[outcome] += 1
                self.done += 1

        connector = aiohttp.TCPConnector(limit=self.clients)
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=120)) as session:
            for start in range(0, len(work), self.every):
                block = iter(range(start, min(start + self.every, len(work))))  # shared: each client takes the next
                self.loading = True
                t_block = time.monotonic()
                await asyncio.gather(*(client(session, block) for _ in range(self.clients)))
                self.sending_s += time.monotonic() - t_block
                self.loading = False
                self.checkpoints.append(c := await self.checkpoint())
                print(f"  checkpoint {c['requests_done']}: idle RSS {c['rss_idle_mib']} MiB (at pause "
                      f"{c['rss_at_pause_mib']}), trim seen {c['trim_seen']}, not zero {c['not_zero'] or '-'}",
                      flush=True)

    async def poll(self, until: Callable[[dict], bool], timeout: float) -> bool:
        """Scrape the metrics until ``until`` holds of them or ``timeout`` s pass: whether it held."""
        deadline = time.monotonic() + timeout
        while True:
            if until(await scrape(self.url)):
                return True
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(POLL_S)

    async def checkpoint(self) -> dict[str, Any]:
        """All clients are at the barrier: wait for mmgate to be idle (disconnected requests may still be finishing
        their media work) and trimmed, or ``settle`` s without trim (about the same idle time); read RSS, gauges."""
        paused = time.monotonic()
        rss_at_pause = memory(self.pid)["VmRSS"]
        trims_at_pause = (await scrape(self.url)).get(TRIMS, 0.0)
        idle_reached = await self.poll(lambda prom: all(gauges(prom)[g] == 0 for g in IDLE_WHEN_ZERO), IDLE_TIMEOUT_S)
        idle_at = time.monotonic()
        rss_when_idle = memory(self.pid)["VmRSS"]
        trim_seen = None
        if self.trim:
            trim_seen = await self.poll(lambda prom: prom.get(TRIMS, 0.0) > trims_at_pause, self.trim_timeout)
        else:
            await asyncio.sleep(self.settle)
        rss = memory(self.pid)["VmRSS"]
        prom = await scrape(self.url)
        g = gauges(prom)
        return {"requests_done": self.done, "t_s": round(paused - self.t0, 1), "rss_at_pause_mib": mib(rss_at_pause),
                "rss_when_idle_mib": mib(rss_when_idle), "rss_idle_mib": mib(rss), "idle_reached": idle_reached,
                "idle_wait_s": round(idle_at - paused, 2), "trim_seen": trim_seen, "trims_total": prom.get(TRIMS, 0.0),
                "pause_s": round(time.monotonic() - paused, 2), "gauges": g,
                "not_zero": {k: v for k, v in g.items() if k in MUST_BE_ZERO and v != 0}, "loadavg": loadavg()}


def criterion(checkpoints: list[dict[str, Any]], n: int, warm_fraction: float, tolerance_pct: float) -> dict[str, Any]:
    """Idle RSS at every checkpoint after warm-up vs the first one after warm-up (the reference): ``met`` if within
    ``tolerance_pct`` at every one."""
    after = [c for c in checkpoints if c["requests_done"] >= n * warm_fraction]
    if not after:
        return {"reference_requests": None, "reference_rss_mib": None, "max_deviation_pct": None, "met": None}
    idle = [c["rss_idle_mib"] for c in after]
    deviations = [change_pct(rss, idle[0]) for rss in idle]
    return {"reference_requests": after[0]["requests_done"], "reference_rss_mib": idle[0],
            "deviations_pct": dict(zip((str(c["requests_done"]) for c in after), deviations, strict=True)),  # JSON's
            "max_deviation_pct": max(deviations, key=abs),
            "max_increase_pct": max(deviations),  # creep; a drop (memory given back) fails the goal too
            "idle_rss_min_mib": min(idle), "idle_rss_max_mib": max(idle),
            "met": all(abs(d) <= tolerance_pct for d in deviations)}


def under_load(samples: list[Sample], n: int, warm_fraction: float) -> dict[str, Any]:
    """RSS while the clients were sending (pauses excluded): bounded by what is in flight, not a leak test."""
    loaded = [s for s in samples if s[3]] or samples
    warm_at = int(n * warm_fraction)
    after_warm = [s for s in loaded if s[1] >= warm_at] or loaded
    warm_rss = after_warm[0][2]
    rss_max = max(s[2] for s in after_warm)
    slope = float("nan")
    if len(after_warm) > 3:
        slope = statistics.linear_regression([s[1] for s in after_warm], [s[2] / MIB for s in after_warm]).slope * 1000

    def window(lo: float, hi: float) -> list[int]:
        return [s[2] for s in loaded if n * lo <= s[1] < n * hi] or [warm_rss]

    # Samples taken while requests 10-20 % finished vs during the last 10 % (one sample alone is the dice).
    early, late = window(warm_fraction, 2 * warm_fraction), window(1 - warm_fraction, 1.0 + 1e-9)
    med_e, med_l, max_e, max_l = statistics.median(early), statistics.median(late), max(early), max(late)
    return {"warmup_requests": warm_at, "rss_warm_mib": mib(warm_rss), "rss_max_mib": mib(max(s[2] for s in loaded)),
            "rss_max_after_warm_mib": mib(rss_max),
            "rss_median_after_warm_mib": mib(statistics.median(s[2] for s in after_warm)),
            "drift_max_pct": change_pct(rss_max, warm_rss), "slope_mib_per_1000_requests": round(slope, 2),
            "window_median_early_mib": mib(med_e), "window_median_late_mib": mib(med_l),
            "window_max_early_mib": mib(max_e), "window_max_late_mib": mib(max_l),
            "drift_window_median_pct": change_pct(med_l, med_e), "drift_window_max_pct": change_pct(max_l, max_e)}


def soak_run(stub_url: str, variant: str, env: dict[str, str], knobs: SimpleNamespace, media: Media,
             tolerance_pct: float) -> dict[str, Any]:
    """A fresh mmgate (``--resize-max-pixels 1000000`` under ``env``) before ``stub_url`` gets ``knobs.requests`` of
    the mix as a ``CheckpointedLoad``, its RSS sampled every 0.5 s: the run's figures, its checkpoints with their
    ``criterion`` (within ``tolerance_pct``), ``under_load``, and every sample ``[t_s, requests done, rss, loading]``
    (the caller may thin them out)."""
    n = knobs.requests
    work = workload(n, knobs.seed, media)
    load_before = uptime()
    proc, url = start_mmgate(stub_url, "--resize-max-pixels", "1000000", env=env)
    soak = CheckpointedLoad(url, proc.pid, clients=knobs.clients, checkpoint_every=knobs.checkpoint_every,
                            seed=knobs.seed, trim=float(env.get("MMGATE_TRIM_IDLE", "1")) > 0,  # mmgate's default: 1 s
                            settle=knobs.settle, trim_timeout=knobs.trim_timeout)
    try:
        rss_start = memory(proc.pid)["VmRSS"]
        with RssSampler(proc.pid, 0.5, soak.sample) as samples:
            t_start = time.monotonic()
            asyncio.run(soak.run(work))
            wall = time.monotonic() - t_start
        peak = memory(proc.pid)["VmHWM"]
        prom = asyncio.run(scrape(url))
    finally:
        stop(proc)
    proxy_statuses: Counter[str] = Counter()
    for (metric, labels), v in prom.items():
        if metric in ("mmgate_requests_total", "mmgate_requests"):
            proxy_statuses[dict(labels).get("code", "?")] += v
    highest = {g: max(c["gauges"][g] for c in soak.checkpoints) for g in MUST_BE_ZERO}
    return {"variant": variant, "env": env, "trim": soak.trim, "requests": n, "clients": knobs.clients,
            "checkpoint_every": knobs.checkpoint_every, "sending_s": round(soak.sending_s, 1), "wall_s": round(wall, 1),
            "req_per_s": round(n / soak.sending_s, 1), "rss_start_mib": mib(rss_start), "rss_peak_mib": mib(peak),
            "checkpoints": soak.checkpoints, "criterion": criterion(soak.checkpoints, n, knobs.warmup, tolerance_pct),
            "under_load": under_load(samples, n, knobs.warmup),
            "client_statuses": dict(sorted(soak.counts.items())),
            "proxy_statuses": dict(sorted(proxy_statuses.items())),
            "gauges_not_zero_at_some_checkpoint": {g: v for g, v in highest.items() if v != 0},
            "uptime_before": load_before, "uptime_after": uptime(),
            "samples": [[round(t, 2), done, rss, int(loading)] for t, done, rss, loading in samples]}


def tenth_rss(run: dict[str, Any], q: int) -> str:
    """Median / max RSS (MiB) of ``run``'s samples under load while the ``q``-th tenth of its requests finished."""
    n = run["requests"]
    rss = [s[2] / MIB for s in run["samples"] if s[3] and n * q / 10 <= s[1] < n * (q + 1) / 10] or [float("nan")]
    return f"{statistics.median(rss):.0f} / {max(rss):.0f}"


def idle_rss_at(run: dict[str, Any], done: int) -> str:
    """``run``'s idle RSS (MiB) at the checkpoint after ``done`` requests, with its deviation from the reference."""
    c = next((c for c in run["checkpoints"] if c["requests_done"] == done), None)
    dev = run["criterion"].get("deviations_pct", {}).get(str(done))
    return "-" if c is None else f"{c['rss_idle_mib']}" + (f" ({dev:+} %)" if dev is not None else "")
