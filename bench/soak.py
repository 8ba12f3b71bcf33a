"""Soak: many mixed multimodal requests through mmgate; does its idle memory creep, do its gauges leak?

``clients`` coroutines send a reproducible mix back to back (``MIX``: small and ~1 MP images passed untouched,
4-12 MP ones resized to 1 MP, invalid media, client disconnects 0-150 ms after the whole request; half streamed;
OpenAI and Anthropic) to a stub backend streaming 16 tokens 2 ms apart. RSS under load measures which big images
happen to be in flight, so the leak test is at idle checkpoints: every ``checkpoint_every`` requests the clients
wait at a barrier until mmgate is idle and has trimmed (or, trim off, for ``settle`` s), then VmRSS and the
gauges are read. Goals: after warm-up (``warmup`` of the requests) the idle RSS stays within 10 % of the first
checkpoint after it (``default`` variant; the others are reported), and the ``MUST_BE_ZERO`` gauges are 0 at
every checkpoint. Also reported: RSS under load, counts by status, load averages (the machine may be shared) and
a chart. Each of ``variants`` runs its own mmgate process; ``append`` keeps the other variants' runs written.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from bench import _results as R
from testkit import procfs
from testkit.load import RESULTS, loadavg, scrape, start_mmgate, start_stub, stop, uptime
from testkit.mix import MIX, Media, Work, disconnecting_request, media_set, workload

MIB = 1 << 20
JEMALLOC = "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"
MMAP_1M = {"MALLOC_MMAP_THRESHOLD_": str(MIB), "MALLOC_TRIM_THRESHOLD_": str(MIB)}
# mmgate tunes the allocators itself (MMGATE_MALLOC_TUNING, on by default: glibc mmap/trim thresholds 1 MiB, no
# Pillow block cache) and trims after 1 s idle (MMGATE_TRIM_IDLE). Every other variant turns the tuning off first
# (glibc defaults, Pillow cache of 16 blocks), so each one shows exactly its own environment's effect.
UNTUNED = {"MMGATE_MALLOC_TUNING": "off"}
VARIANTS: dict[str, dict[str, str]] = {
    "default": {},
    "untuned": UNTUNED,
    "untuned-no-trim": UNTUNED | {"MMGATE_TRIM_IDLE": "0"},  # mmgate without its allocator remedies
    "arena2": UNTUNED | {"MALLOC_ARENA_MAX": "2"},
    "mmap1m": UNTUNED | MMAP_1M,
    "blocks0": UNTUNED | {"PILLOW_BLOCKS_MAX": "0"},
    "mmap1m+blocks0": UNTUNED | MMAP_1M | {"PILLOW_BLOCKS_MAX": "0"},
    "jemalloc": UNTUNED | {"LD_PRELOAD": JEMALLOC},  # skipped where it is not installed
}
GAUGES = ("mmgate_media_bytes_live", "mmgate_media_buffers_live", "mmgate_media_bytes_inflight", "mmgate_gate_in_use",
          "mmgate_gate_waiting", "mmgate_pool_queue_depth", "mmgate_pool_stuck_workers")
MUST_BE_ZERO = GAUGES[:4]  # when idle; a leak otherwise
IDLE_WHEN_ZERO = ("mmgate_gate_in_use", "mmgate_gate_waiting", "mmgate_media_bytes_live", "mmgate_media_buffers_live")
TRIMS = ("mmgate_memory_trims_total", ())
TOLERANCE_PCT = 10.0
MAX_SAMPLES_STORED = 1500  # per run, to keep the JSON small
IDLE_TIMEOUT_S = 30.0  # a checkpoint that never gets idle is recorded as such (idle_reached False)
POLL_S = 0.05
def mib(size: float) -> float:
    return round(size / MIB, 1)


def change_pct(value: float, reference: float) -> float:
    return round(100 * (value - reference) / reference, 1)


def vm_rss(pid: int) -> int:
    return procfs.memory(pid)["VmRSS"]


def gauges(prom: dict) -> dict[str, float]:
    return {g: sum(v for (name, _labels), v in prom.items() if name == g) for g in GAUGES}


class Soak:
    """One variant's load on its mmgate: blocks of ``checkpoint_every`` requests, an idle checkpoint after each (the
    barrier), while ``sample`` (a thread) reads VmRSS every 0.5 s with the requests finished and whether the
    clients were sending (plain attributes: the GIL is enough)."""

    def __init__(self, url: str, pid: int, knobs: R.Knobs, trim: bool) -> None:
        self.url, self.pid, self.knobs, self.trim = url, pid, knobs, trim
        self.done, self.loading, self.sending_s = 0, False, 0.0  # sending_s: checkpoint pauses excluded
        self.counts: Counter[str] = Counter()  # client side, by outcome
        self.checkpoints: list[dict[str, Any]] = []
        self.samples: list[tuple[float, int, int, bool]] = []  # (t, requests done, rss bytes, under load)
        self.stopped = threading.Event()
        self.t0 = time.monotonic()

    def sample(self) -> None:
        while not self.stopped.is_set():
            rss = procfs.memory(self.pid).get("VmRSS")
            if rss is None:  # mmgate is gone
                return
            self.samples.append((time.monotonic() - self.t0, self.done, rss, self.loading))
            self.stopped.wait(0.5)

    async def run(self, work: Work) -> None:
        import aiohttp

        host, port = self.url.rsplit("//", 1)[1].split(":")
        rng = random.Random(self.knobs.seed + 1)

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

        every, clients = self.knobs.checkpoint_every, self.knobs.clients
        connector = aiohttp.TCPConnector(limit=clients)
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=120)) as session:
            for start in range(0, len(work), every):
                block = iter(range(start, min(start + every, len(work))))  # shared: each client takes the next one
                self.loading = True
                t_block = time.monotonic()
                await asyncio.gather(*(client(session, block) for _ in range(clients)))
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
        rss_at_pause = vm_rss(self.pid)
        trims_at_pause = (await scrape(self.url)).get(TRIMS, 0.0)
        idle_reached = await self.poll(lambda prom: all(gauges(prom)[g] == 0 for g in IDLE_WHEN_ZERO), IDLE_TIMEOUT_S)
        idle_at = time.monotonic()
        rss_when_idle = vm_rss(self.pid)
        trim_seen = None
        if self.trim:
            trim_seen = await self.poll(lambda prom: prom.get(TRIMS, 0.0) > trims_at_pause, self.knobs.trim_timeout)
        else:
            await asyncio.sleep(self.knobs.settle)
        rss = vm_rss(self.pid)
        prom = await scrape(self.url)
        g = gauges(prom)
        return {"requests_done": self.done, "t_s": round(paused - self.t0, 1), "rss_at_pause_mib": mib(rss_at_pause),
                "rss_when_idle_mib": mib(rss_when_idle), "rss_idle_mib": mib(rss), "idle_reached": idle_reached,
                "idle_wait_s": round(idle_at - paused, 2), "trim_seen": trim_seen, "trims_total": prom.get(TRIMS, 0.0),
                "pause_s": round(time.monotonic() - paused, 2), "gauges": g,
                "not_zero": {k: v for k, v in g.items() if k in MUST_BE_ZERO and v != 0}, "loadavg": loadavg()}


def checkpoint_criterion(checkpoints: list[dict[str, Any]], n: int, warm_fraction: float) -> dict[str, Any]:
    """Idle RSS at every checkpoint after warm-up vs the first one after warm-up (the reference)."""
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
            "met": all(abs(d) <= TOLERANCE_PCT for d in deviations)}


def analyse_under_load(samples: list[tuple[float, int, int, bool]], n: int, warm_fraction: float) -> dict[str, Any]:
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


def run_variant(name: str, knobs: R.Knobs, stub_url: str, media: Media) -> dict[str, Any]:
    env, n = VARIANTS[name], knobs.requests
    work = workload(n, knobs.seed, media)
    load_before = uptime()
    proc, url = start_mmgate(stub_url, "--resize-max-pixels", "1000000", env=env)
    soak = Soak(url, proc.pid, knobs, trim=float(env.get("MMGATE_TRIM_IDLE", "1")) > 0)  # mmgate's default: 1 s
    sampler = threading.Thread(target=soak.sample, daemon=True)  # the load's event loop would delay its readings
    try:
        rss_start = vm_rss(proc.pid)
        sampler.start()
        t_start = time.monotonic()
        asyncio.run(soak.run(work))
        wall = time.monotonic() - t_start
        soak.stopped.set()
        sampler.join()
        peak = procfs.memory(proc.pid)["VmHWM"]
        prom = asyncio.run(scrape(url))
    finally:
        soak.stopped.set()
        stop(proc)
    proxy_statuses: Counter[str] = Counter()
    for (metric, labels), v in prom.items():
        if metric in ("mmgate_requests_total", "mmgate_requests"):
            proxy_statuses[dict(labels).get("code", "?")] += v
    highest = {g: max(c["gauges"][g] for c in soak.checkpoints) for g in MUST_BE_ZERO}
    samples = [[round(t, 2), done, rss, int(loading)] for t, done, rss, loading in soak.samples]
    return {"variant": name, "env": env, "trim": soak.trim, "requests": n, "clients": knobs.clients,
            "checkpoint_every": knobs.checkpoint_every, "sending_s": round(soak.sending_s, 1), "wall_s": round(wall, 1),
            "req_per_s": round(n / soak.sending_s, 1), "rss_start_mib": mib(rss_start), "rss_peak_mib": mib(peak),
            "checkpoints": soak.checkpoints, "criterion": checkpoint_criterion(soak.checkpoints, n, knobs.warmup),
            "under_load": analyse_under_load(soak.samples, n, knobs.warmup),
            "client_statuses": dict(sorted(soak.counts.items())),
            "proxy_statuses": dict(sorted(proxy_statuses.items())),
            "gauges_not_zero_at_some_checkpoint": {g: v for g, v in highest.items() if v != 0},
            "uptime_before": load_before, "uptime_after": uptime(),
            "samples": R.downsample(samples, column=2, points=MAX_SAMPLES_STORED)}  # keeps each bucket's peak


def env_text(env: dict[str, str], quote: str = "`", empty: str = "-") -> str:
    return " ".join(f"{quote}{k}={v}{quote}" for k, v in env.items()).replace(JEMALLOC, "libjemalloc.so.2") or empty


def plot(runs: list[dict[str, Any]], path: Path) -> None:
    """Left: RSS vs requests (thin: under load; thick: idle checkpoints; the goal's band); right: RSS vs time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 5.2), gridspec_kw={"width_ratios": [3, 2]})
    reference = next((r for r in runs if r["variant"] == "default"), runs[0] if runs else None)
    if reference and (ref := reference["criterion"]["reference_rss_mib"]):
        ax1.axhspan(ref * (1 - TOLERANCE_PCT / 100), ref * (1 + TOLERANCE_PCT / 100), color="green", alpha=0.12,
                    label=f"±{TOLERANCE_PCT:g} % of {reference['variant']}'s idle RSS at "
                          f"{reference['criterion']['reference_requests']} requests")
    for run in runs:
        loaded = [s for s in run["samples"] if s[3]]
        line, = ax1.plot([s[1] for s in loaded], [s[2] / MIB for s in loaded], lw=0.6, alpha=0.45)
        cps, color = run["checkpoints"], line.get_color()
        label = f"{run['variant']}: {env_text(run['env'], '', '(defaults)')}, trim {'on' if run['trim'] else 'off'}"
        ax1.plot([c["requests_done"] for c in cps], [c["rss_idle_mib"] for c in cps], "o-", lw=2.4, ms=5, color=color,
                 label=label)
        ax2.plot([s[0] for s in run["samples"]], [s[2] / MIB for s in run["samples"]], lw=0.6, color=color,
                 label=run["variant"])
        ax2.plot([c["t_s"] + c["pause_s"] for c in cps], [c["rss_idle_mib"] for c in cps], "o", ms=4, color=color)
    if runs:
        ax1.axvline(runs[0]["criterion"]["reference_requests"] or 0, color="grey", ls="--", lw=0.8,
                    label="end of warm-up (10 %)")
    ax1.set_xlabel("requests finished")
    ax2.set_xlabel("seconds since mmgate started (dips: idle checkpoints)")
    for ax in (ax1, ax2):
        ax.set_ylabel("mmgate VmRSS (MiB)")
        ax.grid(alpha=0.3)
        ax.set_ylim(bottom=0)
    ax1.legend(fontsize=7, loc="upper left", framealpha=0.9)
    ax1.set_title("RSS vs requests: thin = under load (0.5 s samples), thick = idle RSS at checkpoints", fontsize=10)
    ax2.set_title("RSS vs time", fontsize=10)
    fig.suptitle(f"mmgate soak, {max((r['requests'] for r in runs), default=0)} mixed multimodal requests, "
                 f"{runs[0]['clients'] if runs else 0} clients. Goal: after warm-up, idle RSS within "
                 f"{TOLERANCE_PCT:g} % of the first post-warm-up checkpoint", fontsize=11)
    ax1.set_ylim(top=ax1.get_ylim()[1] * 1.3)  # room for the legend
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def table(columns: list[str], rows: list[list[Any]], left: tuple[int, ...] = (0,)) -> list[str]:
    """A Markdown table: the columns at the indices ``left`` (text) left-aligned, the others (figures) right."""
    def line(cells: list[Any]) -> str:
        return "| " + " | ".join(map(str, cells)) + " |"
    aligns = ["---" if i in left or i - len(columns) in left else "---:" for i in range(len(columns))]
    return [line(columns), line(aligns), *map(line, rows)]


def run_table(runs: list[dict[str, Any]], columns: dict[str, str], left: tuple[int, ...] = (0,)) -> list[str]:
    """One row per run, the cells filled in from its figures (``figures``) by each column's template."""
    return table(["variant", *columns], [[r["variant"], *(template.format_map(figures(r))
                                                          for template in columns.values())] for r in runs], left)


def figures(run: dict[str, Any]) -> dict[str, Any]:
    """A run's figures in one dict (its criterion's and under-load's too), with the cells made of several."""
    highest = {g: max(c["gauges"][g] for c in run["checkpoints"]) for g in GAUGES}
    leaks = ", ".join(f"{k}={v:g}" for k, v in run["gauges_not_zero_at_some_checkpoint"].items()) or "none"
    return run | run["criterion"] | run["under_load"] | highest | {
        "env_md": env_text(run["env"]), "trim_md": "on" if run["trim"] else "off", "leaks": leaks,
        "goal_md": {True: "met", False: "**not met**", None: "-"}[run["criterion"]["met"]]}


def idle_cell(run: dict[str, Any], done: int) -> str:
    """Idle RSS at the checkpoint after ``done`` requests, with its deviation from the reference."""
    c = next((c for c in run["checkpoints"] if c["requests_done"] == done), None)
    dev = run["criterion"].get("deviations_pct", {}).get(str(done))
    return "-" if c is None else f"{c['rss_idle_mib']}" + (f" ({dev:+} %)" if dev is not None else "")


def tenth(run: dict[str, Any], q: int) -> str:
    """Median / max RSS (MiB) of the samples under load while the ``q``-th tenth of the requests finished."""
    n = run["requests"]
    rss = [s[2] / MIB for s in run["samples"] if s[3] and n * q / 10 <= s[1] < n * (q + 1) / 10] or [float("nan")]
    return f"{statistics.median(rss):.0f} / {max(rss):.0f}"


def run_lines(run: dict[str, Any]) -> list[str]:
    """RSS at the pause, when idle and after the trim at each checkpoint; waits, trims and load averages."""
    cps = run["checkpoints"]
    trims = f", trim seen at {sum(1 for c in cps if c['trim_seen'])}/{len(cps)} checkpoints" if run["trim"] else ""
    return [f"- **{run['variant']}**: " + "; ".join(
        f"{c['requests_done']}: {c['rss_at_pause_mib']:.0f} → {c['rss_when_idle_mib']:.0f} → {c['rss_idle_mib']:.0f}"
        + ("" if c["trim_seen"] in (True, None) else " (no trim seen)") + ("" if c["idle_reached"] else " (NOT idle)")
        for c in cps),
        f"  idle after {min(c['idle_wait_s'] for c in cps)}..{max(c['idle_wait_s'] for c in cps)} s; trims total "
        f"{cps[-1]['trims_total']:g}{trims}; load avg 1-min " + ", ".join(f"{c['loadavg'][0]:g}" for c in cps)]


def report(data: dict[str, Any]) -> str:
    runs, args = data["runs"], data["args"]
    name = args.get("name") or args.get("out", "soak")  # older results recorded ``out``
    every = runs[0]["checkpoint_every"] if runs else "?"
    done = sorted({c["requests_done"] for r in runs for c in r["checkpoints"]})
    lines = [
        *(["With `append`: earlier variants' rows kept from the previous JSON.", ""] if args["append"] else []),
        "Requests per run: " + ", ".join(f"{r['variant']} {r['requests']}" for r in runs) + f"; {args['clients']} "
        "clients; mmgate `--resize-max-pixels 1000000`, otherwise its defaults (4 media slots, decode workers = "
        "usable CPUs, `MMGATE_TRIM_IDLE=1` unless the variant says otherwise); stub backend (2 workers) streaming 16 "
        "tokens 2 ms apart; 2 cores shared with other benchmarks (load averages below).", "",
        "Planned mix (request kinds): " + ", ".join(f"{k} {v:g}" for k, v in data["mix_weights"].items()) + ". "
        "Half stream (SSE); 80 % OpenAI chat, 20 % Anthropic messages; disconnects close a raw socket 0-150 ms after "
        "sending the whole request.", "",
        "## Criterion: idle RSS at checkpoints", "",
        "RSS under load swings by tens of MiB with the big images being decoded at that moment (docs/tuning.md bounds "
        f"it); a leak is what remains when nothing is in flight. So every {every} requests the clients wait until "
        "mmgate is idle (`gate_in_use`, `gate_waiting`, `media_bytes_live`, `media_buffers_live` all 0) and has "
        f"trimmed (at most {args['trim_timeout']:g} s) or, trim off, for {args['settle']:g} s; then VmRSS and the "
        "gauges are read.", "",
        f"**Goal**: the idle RSS at every checkpoint after warm-up stays within {TOLERANCE_PCT:g} % of the first "
        f"checkpoint after warm-up (at {args['warmup']:.0%} of the requests).", "",
        *run_table(runs, {"env": "{env_md}", "trim": "{trim_md}", "req/s (sending)": "{req_per_s}",
                          "reference (MiB)": "{reference_rss_mib} @ {reference_requests}",
                          "idle RSS min..max after warm-up": "{idle_rss_min_mib}..{idle_rss_max_mib}",
                          "max deviation": "{max_deviation_pct:+} %", "largest increase": "{max_increase_pct:+} %",
                          "goal": "{goal_md}"}, left=(0, 1, 2, -1)),
        "", "Idle RSS (MiB) per checkpoint, deviation from the reference in brackets:", "",
        *table(["requests done", *(r["variant"] for r in runs)], [[d, *(idle_cell(r, d) for r in runs)] for d in done],
               left=()),
        "", "Per checkpoint: RSS when the clients stopped, when mmgate was idle, and after the trim (or the settle "
        "time); seconds until idle; trims so far; 1-min load average.", "",
        *(line for r in runs for line in run_lines(r)),
        "", "## Gauges at every checkpoint", "",
        f"Must be 0 when idle: {', '.join(MUST_BE_ZERO)}. Max seen at any checkpoint:", "",
        *run_table(runs, {g.removeprefix("mmgate_"): f"{{{g}:g}}" for g in GAUGES} | {"leak?": "{leaks}"},
                   left=(0, -1)),
        "", "## RSS under load (not the leak criterion)", "",
        "Samples every 0.5 s while the clients were sending (checkpoint pauses excluded), bounded by what is in flight "
        "(docs/tuning.md). Warm-up sample = first sample once 10 % of the requests are done; drift = (max - warm-up) "
        "/ warm-up; slope = least-squares fit after warm-up.", "",
        *run_table(runs, {"start": "{rss_start_mib}", "warm-up sample": "{rss_warm_mib}",
                          "median after warm-up": "{rss_median_after_warm_mib}",
                          "max after warm-up": "{rss_max_after_warm_mib}", "peak (VmHWM)": "{rss_peak_mib}",
                          "drift of max": "{drift_max_pct:+} %", "slope MiB/1k req": "{slope_mib_per_1000_requests}"}),
        "", "Windows: samples while requests 10-20 % finished (early) vs during the last 10 % (late).", "",
        *run_table(runs, {"early median": "{window_median_early_mib}", "late median": "{window_median_late_mib}",
                          "drift of medians": "{drift_window_median_pct:+} %", "early max": "{window_max_early_mib}",
                          "late max": "{window_max_late_mib}", "drift of maxima": "{drift_window_max_pct:+} %"}),
        "", "Per tenth of the run (samples under load): median / max RSS in MiB; a leak climbs steadily.", "",
        *table(["variant", *(f"{10 * q}-{10 * q + 10} %" for q in range(10))],
               [[r["variant"], *(tenth(r, q) for q in range(10))] for r in runs]),
        "", "## Counts by status", "",
        "Client side (`disconnect` = we hung up; `disconnect_too_late` = the answer ended before we did) and proxy "
        "side (`mmgate_requests` by status; 499 = client went away).", "",
        *(line for r in runs for line in (
            f"- **{r['variant']}** client: " + ", ".join(f"{k}: {v}" for k, v in r["client_statuses"].items()),
            "  proxy: " + ", ".join(f"{k}: {v:.0f}" for k, v in r["proxy_statuses"].items()))),
        "", "## Load", "",
        *(f"- {r['variant']} ({r['sending_s']} s sending, {r['wall_s']} s with pauses): before `{r['uptime_before']}`; "
          f"after `{r['uptime_after']}`" for r in runs),
        "", f"Plot: `bench/results/{name}.png` (left: RSS vs requests; right: RSS vs time).", ""]
    return "\n".join(lines)


def goals(data: dict[str, Any]) -> list[R.Goal]:
    """Per variant, over its idle checkpoints after warm-up: the RSS deviation from the first (``default``, mmgate's
    own tuning, must stay within ±10 % at every one; the others are reported); the idle gauges, every variant."""
    runs = data["runs"]
    out = []
    for r in runs:
        deviations = list((r["criterion"].get("deviations_pct") or {}).values())
        target = f"within ±{TOLERANCE_PCT:g}" if r["variant"] == "default" else None
        out.append(R.goal(f"{r['variant']}: idle RSS vs first warm checkpoint", deviations, target,
                          (lambda v: abs(v) <= TOLERANCE_PCT) if target else None, unit="%", over="checkpoints",
                          met_on="every"))
    leaks = [sum(1 for g in MUST_BE_ZERO if cp["gauges"].get(g, 0)) for r in runs for cp in r["checkpoints"]]
    out.append(R.goal("idle gauges not 0 (all variants)", leaks, "= 0", lambda v: v == 0, over="checkpoints",
                      met_on="every"))
    return out


def measure(knobs: R.Knobs) -> dict[str, Any]:
    stamp = R.stamp("soak.py", f"{knobs.requests:,} mixed media requests (invalid ones and disconnects included), "
                               "idle RSS and gauges at checkpoints")
    media = media_set()
    stub, stub_url = start_stub("--workers", "2", "--tokens", "16", "--token-delay", "0.002")
    json_path = RESULTS / f"{knobs.name}.json"
    # With ``append``, the other variants' runs are kept from the result already written.
    kept = json.loads(json_path.read_text())["runs"] if knobs.append and json_path.exists() else []
    data = stamp | {"args": vars(knobs), "mix_weights": dict(MIX), "runs": kept}
    try:
        for name in knobs.variants.split(","):
            preload = VARIANTS[name].get("LD_PRELOAD")
            if preload and not Path(preload).exists():
                print(f"skip {name}: {preload} missing")
                continue
            print(f"[{name}] {knobs.requests} requests, {knobs.clients} clients ... {uptime()}", flush=True)
            r = run_variant(name, knobs, stub_url, media)
            print(f"[{name}] {r['sending_s']} s sending, {r['req_per_s']} req/s, {r['client_statuses']}", flush=True)
            data["runs"] = [run for run in data["runs"] if run["variant"] != name] + [r]
            if not knobs.quick:  # written after every variant: a later crash or time-out keeps the finished runs
                R.write(knobs.name, data | {"goals": goals(data)}, report(data))
    finally:
        stop(stub)
    if not knobs.quick:
        plot(data["runs"], RESULTS / f"{knobs.name}.png")
    return data
