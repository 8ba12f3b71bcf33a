"""Soak test: many mixed multimodal requests through mmgate; does its memory creep, do its gauges leak?

What it sends (weights of the default mix; bodies prebuilt once, so the client allocates nothing per request):

* 55 % a small 64x64 PNG, 25 % a ~1 MP JPEG (fits: validated and forwarded untouched),
* 6 % a 4 MP JPEG, 3 % a 12 MP JPEG, 1 % a 6 MP PNG (all resized to <= 1 MP: ``--resize-max-pixels 1000000``),
* 5 % invalid media (half bad base64, half a truncated JPEG): expected 400,
* 5 % client disconnects: the whole request is written on a raw socket, then the socket is closed after a
  random 0-150 ms (during preprocessing, forwarding or the streamed answer),
* half the requests stream (SSE); 80 % OpenAI /v1/chat/completions, 20 % Anthropic /v1/messages.

``--clients`` (16) coroutines send back to back. The stub backend streams 16 tokens 2 ms apart.

Why idle checkpoints. Instantaneous RSS under a random mix of 64x64..12 MP images varies with whichever
big images are being decoded at that moment (tens of MiB each, bounded by the memory formula in docs/tuning.md), so
"RSS under load within 10 %" measures the dice, not a leak (bench/results/soak.md of the 6000-request
runs: +18..+47 % with flat per-tenth maxima). A leak or fragmentation creep is what is left when nothing is
in flight. So every ``--checkpoint-every`` requests (1000) all clients finish their current request and
wait at a barrier; the script waits until mmgate is idle (gate_in_use, gate_waiting, media_bytes_live,
media_buffers_live all 0 on /mmgate/metrics), then until mmgate_memory_trims_total has risen (variants with
MMGATE_TRIM_IDLE > 0, at most ``--trim-timeout`` s) or for ``--settle`` s (no trim: about the same idle
time), samples VmRSS and the gauges, and lets the clients go on.

Criterion: the idle RSS at every checkpoint after warm-up stays within 10 % of the first one after
warm-up (the checkpoint at ``--warmup`` = 10 % of the requests). A gauge in MUST_BE_ZERO that is not 0
at any checkpoint is a leak.

Also reported, as a second table and not the leak criterion: RSS under load (a thread samples VmRSS every
0.5 s with the number of requests finished; pauses excluded): warm-up sample vs max, slope of a
least-squares line (MiB per 1000 requests), early vs late windows, median/max per tenth of the run.

Each ``--variants`` entry is one run with its own mmgate process and environment: ``default`` (mmgate's own
allocator tuning, MMGATE_MALLOC_TUNING: glibc mmap/trim thresholds 1 MiB and no Pillow block cache; trim after
1 s idle), ``untuned`` (MMGATE_MALLOC_TUNING=off: glibc defaults, Pillow cache of 16 blocks; trims),
``untuned-no-trim`` (also MMGATE_TRIM_IDLE=0: mmgate without its allocator remedies), and, all untuned plus their
own environment: ``arena2`` (MALLOC_ARENA_MAX=2), ``mmap1m`` (MALLOC_MMAP_THRESHOLD_=MALLOC_TRIM_THRESHOLD_=
1 MiB), ``blocks0`` (PILLOW_BLOCKS_MAX=0), ``mmap1m+blocks0``, ``jemalloc`` (LD_PRELOAD libjemalloc.so.2, if
installed). ``--append`` adds runs to the existing JSON/chart (replacing rows of the same variant). All
curves go on one chart: bench/results/soak.png.

    python -m bench run soak [--set KNOB=VALUE] [--rounds N] [--quick]
    python -m bench run soak_cost [--set KNOB=VALUE] [--rounds N] [--quick]
    python -m bench run soak_long [--set KNOB=VALUE] [--rounds N] [--quick]
    python -m bench list soak soak_cost soak_long   # the knobs and their defaults
    python -m bench list soak soak_cost soak_long   # the knobs and their defaults

The machine may be shared: the load average is recorded before and after each run and at every checkpoint.
"""

from __future__ import annotations

import asyncio
import io
import json
import random
import statistics
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pybase64
from PIL import Image

from bench import _results as R
from testkit.load import RESULTS, loadavg, proc_status, scrape, start_mmgate, start_stub, stop, uptime
from testkit.media import photo_jpeg, photo_sized

MIB = 1 << 20
JEMALLOC = "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"
MMAP_1M = {"MALLOC_MMAP_THRESHOLD_": str(MIB), "MALLOC_TRIM_THRESHOLD_": str(MIB)}
# mmgate tunes the allocators itself (MMGATE_MALLOC_TUNING, on by default); every other variant turns that
# off first, so each one shows exactly its own environment's effect.
UNTUNED = {"MMGATE_MALLOC_TUNING": "off"}
VARIANTS: dict[str, dict[str, str]] = {
    "default": {},
    "untuned": UNTUNED,
    "untuned-no-trim": UNTUNED | {"MMGATE_TRIM_IDLE": "0"},
    "arena2": UNTUNED | {"MALLOC_ARENA_MAX": "2"},
    "mmap1m": UNTUNED | MMAP_1M,
    "blocks0": UNTUNED | {"PILLOW_BLOCKS_MAX": "0"},
    "mmap1m+blocks0": UNTUNED | MMAP_1M | {"PILLOW_BLOCKS_MAX": "0"},
    "jemalloc": UNTUNED | {"LD_PRELOAD": JEMALLOC},
}
GAUGES = ("mmgate_media_bytes_live", "mmgate_media_buffers_live", "mmgate_media_bytes_inflight", "mmgate_gate_in_use",
          "mmgate_gate_waiting", "mmgate_pool_queue_depth", "mmgate_pool_stuck_workers")
MUST_BE_ZERO = ("mmgate_media_bytes_live", "mmgate_media_buffers_live", "mmgate_media_bytes_inflight",
                "mmgate_gate_in_use")
IDLE_WHEN_ZERO = ("mmgate_gate_in_use", "mmgate_gate_waiting", "mmgate_media_bytes_live", "mmgate_media_buffers_live")
TRIMS = ("mmgate_memory_trims_total", ())
TOLERANCE_PCT = 10.0
MAX_SAMPLES_STORED = 1500  # per run, to keep the JSON small


def trims_enabled(env: dict[str, str]) -> bool:
    """Whether this variant's mmgate trims when idle (MMGATE_TRIM_IDLE, default 1 s)."""
    return float(env.get("MMGATE_TRIM_IDLE", "1")) > 0


# --- media and bodies ----------------------------------------------------------------------------------

def _photo(width: int, height: int, seed: int) -> Image.Image:
    return photo_sized(width, height, seed, noise=9)


def _encode(img: Image.Image, fmt: str, **kw: Any) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt, **kw)
    return buf.getvalue()


def media_set() -> dict[str, tuple[str, bytes | str]]:
    """kind -> (mime, raw image bytes, or an already-broken base64 string)."""
    small = _encode(Image.fromarray(np.random.default_rng(7).integers(0, 255, (64, 64, 3), np.uint8)), "PNG")
    one_mp = _encode(_photo(1152, 864, 1), "JPEG", quality=90)
    return {
        "small_png": ("image/png", small),
        "jpeg_1mp": ("image/jpeg", one_mp),
        "jpeg_4mp": ("image/jpeg", _encode(_photo(2309, 1732, 2), "JPEG", quality=90)),
        "jpeg_12mp": ("image/jpeg", photo_jpeg()),
        "png_6mp": ("image/png", _encode(_photo(2828, 2121, 3), "PNG", compress_level=1)),
        "bad_base64": ("image/png", "iVBORw0KGgo!!not*base64??" * 8),
        "truncated_jpeg": ("image/jpeg", one_mp[: len(one_mp) // 2]),
    }


def body_for(mime: str, data: bytes | str, dialect: str, stream: bool) -> tuple[str, bytes]:
    b64 = data if isinstance(data, str) else pybase64.b64encode(data).decode()
    if dialect == "openai":
        msg = {"model": "stub-vlm", "stream": stream, "max_tokens": 16, "messages": [{"role": "user", "content": [
            {"type": "text", "text": "Describe this image."},
            {"type": "image_url", "image_url": {"url": f"data:{mime};base64,{b64}"}}]}]}
        return "/v1/chat/completions", json.dumps(msg).encode()
    msg = {"model": "stub-vlm", "stream": stream, "max_tokens": 16, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": mime, "data": b64}},
        {"type": "text", "text": "Describe this image."}]}]}
    return "/v1/messages", json.dumps(msg).encode()


MIX = [("small_png", 55), ("jpeg_1mp", 25), ("jpeg_4mp", 6), ("jpeg_12mp", 3), ("png_6mp", 1),
       ("bad_base64", 2.5), ("truncated_jpeg", 2.5), ("disconnect", 5)]
DISCONNECT_KINDS = ["small_png", "jpeg_1mp", "jpeg_1mp", "jpeg_4mp"]


def plan(n: int, seed: int) -> list[tuple[str, str, bool, bool]]:
    """n × (kind, dialect, stream, disconnect), reproducible."""
    rng = random.Random(seed)
    kinds, weights = zip(*MIX, strict=True)
    out = []
    for kind in rng.choices(kinds, weights, k=n):
        disconnect = kind == "disconnect"
        if disconnect:
            kind = rng.choice(DISCONNECT_KINDS)
        out.append((kind, "openai" if rng.random() < 0.8 else "anthropic", rng.random() < 0.5, disconnect))
    return out


# --- RSS sampler ---------------------------------------------------------------------------------------

def vm_rss(pid: int) -> int:
    return proc_status(pid)["VmRSS"]


@dataclass
class Progress:
    """Shared between the load loop and the sampler thread (plain reads/writes, the GIL is enough)."""

    done: int = 0
    loading: bool = False  # False while the clients wait at a checkpoint


class Sampler(threading.Thread):
    """VmRSS every ``interval`` s, tagged with the requests finished and whether the clients were sending."""

    def __init__(self, pid: int, progress: Progress, interval: float = 0.5) -> None:
        super().__init__(daemon=True)
        self.pid, self.progress, self.interval = pid, progress, interval
        self.samples: list[tuple[float, int, int, bool]] = []  # (t, requests done, rss bytes, under load)
        self.stopped = threading.Event()
        self.t0 = time.monotonic()

    def run(self) -> None:
        while not self.stopped.is_set():
            try:
                self.samples.append((time.monotonic() - self.t0, self.progress.done, vm_rss(self.pid),
                                     self.progress.loading))
            except OSError:
                return
            self.stopped.wait(self.interval)


# --- client --------------------------------------------------------------------------------------------

async def one_request(session: Any, url: str, path: str, body: bytes, stream: bool) -> str:
    import aiohttp

    try:
        async with session.post(url + path, data=body, headers={"Content-Type": "application/json"}) as r:
            async for _chunk in r.content.iter_any():
                pass
            return str(r.status)
    except (TimeoutError, aiohttp.ClientError) as exc:
        return "client_error:" + type(exc).__name__


async def disconnecting_request(host: str, port: int, path: str, body: bytes, delay: float) -> str:
    """Write the whole request on a raw socket, wait ``delay`` s (reading whatever comes), then close it."""
    reader, writer = await asyncio.open_connection(host, port)
    head = (f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    try:
        writer.write(head)
        writer.write(body)
        await writer.drain()
        try:
            async with asyncio.timeout(delay):
                while await reader.read(65536):
                    pass
            outcome = "disconnect_too_late"  # the answer finished before we hung up
        except TimeoutError:
            outcome = "disconnect"
    finally:
        writer.transport.abort()
    return outcome


# --- idle checkpoint -----------------------------------------------------------------------------------

def gauges(prom: dict) -> dict[str, float]:
    return {g: sum(v for (name, _labels), v in prom.items() if name == g) for g in GAUGES}


def status_counts(prom: dict) -> dict[str, float]:
    out: Counter[str] = Counter()
    for (name, labels), v in prom.items():
        if name in ("mmgate_requests_total", "mmgate_requests"):
            out[dict(labels).get("code", "?")] += v
    return dict(sorted(out.items()))


@dataclass
class CheckpointPolicy:
    trim: bool  # wait for a malloc_trim (MMGATE_TRIM_IDLE > 0) instead of a fixed settle time
    settle_s: float = 1.5  # no-trim variants idle this long (about trim delay + trim time)
    trim_timeout_s: float = 10.0
    idle_timeout_s: float = 30.0
    poll_s: float = 0.05


async def idle_checkpoint(url: str, pid: int, done: int, t0: float, policy: CheckpointPolicy) -> dict[str, Any]:
    """All clients are at the barrier: wait for mmgate to be idle (and trimmed), then read RSS and gauges."""
    paused = time.monotonic()
    rss_at_pause = vm_rss(pid)
    trims_at_pause = (await scrape(url)).get(TRIMS, 0.0)
    while True:  # disconnected requests may still be finishing their media work
        prom = await scrape(url)
        if all(gauges(prom)[g] == 0 for g in IDLE_WHEN_ZERO) or time.monotonic() - paused > policy.idle_timeout_s:
            break
        await asyncio.sleep(policy.poll_s)
    idle_reached = all(gauges(prom)[g] == 0 for g in IDLE_WHEN_ZERO)
    idle_at = time.monotonic()
    rss_when_idle = vm_rss(pid)
    trim_seen = None
    if policy.trim:
        while prom.get(TRIMS, 0.0) <= trims_at_pause and time.monotonic() - idle_at < policy.trim_timeout_s:
            await asyncio.sleep(policy.poll_s)
            prom = await scrape(url)
        trim_seen = prom.get(TRIMS, 0.0) > trims_at_pause
    else:
        await asyncio.sleep(policy.settle_s)
    rss = vm_rss(pid)
    prom = await scrape(url)
    g = gauges(prom)
    return {
        "requests_done": done,
        "t_s": round(paused - t0, 1),
        "rss_at_pause_mib": round(rss_at_pause / MIB, 1),
        "rss_when_idle_mib": round(rss_when_idle / MIB, 1),
        "rss_idle_mib": round(rss / MIB, 1),
        "idle_reached": idle_reached,
        "idle_wait_s": round(idle_at - paused, 2),
        "trim_seen": trim_seen,
        "trims_total": prom.get(TRIMS, 0.0),
        "pause_s": round(time.monotonic() - paused, 2),
        "gauges": g,
        "not_zero": {k: v for k, v in g.items() if k in MUST_BE_ZERO and v != 0},
        "loadavg": loadavg(),
    }


async def run_load(url: str, pid: int, work: list[tuple[str, bytes, bool, bool]], clients: int, every: int,
                   policy: CheckpointPolicy, progress: Progress, t0: float, seed: int,
                   ) -> tuple[Counter[str], float, list[dict[str, Any]]]:
    """Send ``work`` in blocks of ``every`` requests; an idle checkpoint after each block (the barrier).

    Returns client-side counts by outcome, seconds spent sending (checkpoint pauses excluded), checkpoints.
    """
    import aiohttp

    host, port = url.rsplit("//", 1)[1].split(":")
    counts: Counter[str] = Counter()
    rng = random.Random(seed + 1)
    checkpoints: list[dict[str, Any]] = []
    sending = 0.0

    async def client(session: aiohttp.ClientSession, block: Any) -> None:
        for i in block:
            path, body, stream, disconnect = work[i]
            if disconnect:
                status = await disconnecting_request(host, int(port), path, body, rng.uniform(0.0, 0.15))
            else:
                status = await one_request(session, url, path, body, stream)
            counts[status] += 1
            progress.done += 1

    connector = aiohttp.TCPConnector(limit=clients)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=120)) as session:
        for start in range(0, len(work), every):
            block = iter(range(start, min(start + every, len(work))))  # shared: clients take the next index
            progress.loading = True
            t_block = time.monotonic()
            await asyncio.gather(*(client(session, block) for _ in range(clients)))
            sending += time.monotonic() - t_block
            progress.loading = False
            checkpoints.append(await idle_checkpoint(url, pid, progress.done, t0, policy))
            c = checkpoints[-1]
            print(f"  checkpoint {c['requests_done']}: idle RSS {c['rss_idle_mib']} MiB (at pause "
                  f"{c['rss_at_pause_mib']}, idle {c['rss_when_idle_mib']}), trims {c['trims_total']:g} "
                  f"seen={c['trim_seen']}, waited {c['pause_s']} s, not zero {c['not_zero'] or '-'}", flush=True)
    return counts, sending, checkpoints


# --- analysis ------------------------------------------------------------------------------------------

def checkpoint_criterion(checkpoints: list[dict[str, Any]], n: int, warm_fraction: float) -> dict[str, Any]:
    """Idle RSS at every checkpoint after warm-up vs the first one after warm-up (the reference)."""
    after = [c for c in checkpoints if c["requests_done"] >= n * warm_fraction]
    if not after:
        return {"reference_requests": None, "reference_rss_mib": None, "max_deviation_pct": None, "met": None}
    ref = after[0]["rss_idle_mib"]
    deviations = [round(100 * (c["rss_idle_mib"] - ref) / ref, 1) for c in after]
    worst = max(deviations, key=abs)
    return {
        "reference_requests": after[0]["requests_done"],
        "reference_rss_mib": ref,
        "deviations_pct": dict(zip((c["requests_done"] for c in after), deviations, strict=True)),
        "max_deviation_pct": worst,
        "max_increase_pct": max(deviations),  # creep; a drop (memory given back) fails the goal too
        "idle_rss_min_mib": min(c["rss_idle_mib"] for c in after),
        "idle_rss_max_mib": max(c["rss_idle_mib"] for c in after),
        "met": all(abs(d) <= TOLERANCE_PCT for d in deviations),
    }


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
    return {
        "warmup_requests": warm_at,
        "rss_warm_mib": round(warm_rss / MIB, 1),
        "rss_max_mib": round(max(s[2] for s in loaded) / MIB, 1),
        "rss_max_after_warm_mib": round(rss_max / MIB, 1),
        "rss_median_after_warm_mib": round(statistics.median(s[2] for s in after_warm) / MIB, 1),
        "drift_max_pct": round(100 * (rss_max - warm_rss) / warm_rss, 1),
        "slope_mib_per_1000_requests": round(slope, 2),
        "window_median_early_mib": round(med_e / MIB, 1),
        "window_median_late_mib": round(med_l / MIB, 1),
        "window_max_early_mib": round(max_e / MIB, 1),
        "window_max_late_mib": round(max_l / MIB, 1),
        "drift_window_median_pct": round(100 * (med_l - med_e) / med_e, 1),
        "drift_window_max_pct": round(100 * (max_l - max_e) / max_e, 1),
    }


def downsample(samples: list[Any], limit: int) -> list[Any]:
    """Every k-th sample so that at most about ``limit`` remain (the last one always kept)."""
    if len(samples) <= limit:
        return samples
    step = -(-len(samples) // limit)
    return samples[::step] + ([samples[-1]] if (len(samples) - 1) % step else [])


# --- one run -------------------------------------------------------------------------------------------

def run_variant(name: str, env: dict[str, str], n: int, clients: int, every: int, seed: int, stub_url: str,
                media: dict[str, tuple[str, bytes | str]], warm_fraction: float, policy: CheckpointPolicy,
                ) -> dict[str, Any]:
    bodies: dict[tuple[str, str, bool], tuple[str, bytes]] = {}
    work = []
    for kind, dialect, stream, disconnect in plan(n, seed):
        key = (kind, dialect, stream)
        if key not in bodies:
            bodies[key] = body_for(*media[kind], dialect, stream)
        path, body = bodies[key]
        work.append((path, body, stream, disconnect))
    load_before = uptime()
    proc, url = start_mmgate(stub_url, "--resize-max-pixels", "1000000", env=env)
    progress = Progress()
    sampler = Sampler(proc.pid, progress)
    try:
        rss_start = vm_rss(proc.pid)
        sampler.start()
        t_start = time.monotonic()
        counts, sending, checkpoints = asyncio.run(
            run_load(url, proc.pid, work, clients, every, policy, progress, sampler.t0, seed))
        wall = time.monotonic() - t_start
        sampler.stopped.set()
        sampler.join()
        peak = proc_status(proc.pid)["VmHWM"]
        prom = asyncio.run(scrape(url))
    finally:
        sampler.stopped.set()
        stop(proc)
    not_zero: dict[str, float] = {}
    for c in checkpoints:
        for k, v in c["not_zero"].items():
            not_zero[k] = max(not_zero.get(k, 0.0), v)
    return {
        "variant": name,
        "env": env,
        "trim": policy.trim,
        "requests": n,
        "clients": clients,
        "checkpoint_every": every,
        "sending_s": round(sending, 1),
        "wall_s": round(wall, 1),
        "req_per_s": round(n / sending, 1),
        "rss_start_mib": round(rss_start / MIB, 1),
        "rss_peak_mib": round(peak / MIB, 1),
        "checkpoints": checkpoints,
        "criterion": checkpoint_criterion(checkpoints, n, warm_fraction),
        "under_load": analyse_under_load(sampler.samples, n, warm_fraction),
        "client_statuses": dict(sorted(counts.items())),
        "proxy_statuses": status_counts(prom),
        "gauges_not_zero_at_some_checkpoint": not_zero,
        "uptime_before": load_before,
        "uptime_after": uptime(),
        "samples": downsample([[round(t, 2), d, r, int(u)] for t, d, r, u in sampler.samples], MAX_SAMPLES_STORED),
    }


# --- report --------------------------------------------------------------------------------------------

def env_label(env: dict[str, str]) -> str:
    text = " ".join(f"{k}={v}" for k, v in env.items()) or "(defaults)"
    text = text.replace(JEMALLOC, "jemalloc").replace(f"={MIB}", "=1MiB")
    return " ".join(word if word.startswith("MMGATE_") else word.replace("MALLOC_", "") for word in text.split())


def plot(runs: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 5.2), gridspec_kw={"width_ratios": [3, 2]})
    reference = next((r for r in runs if r["variant"] == "default"), runs[0] if runs else None)
    if reference and reference["criterion"]["reference_rss_mib"]:
        ref = reference["criterion"]["reference_rss_mib"]
        ax1.axhspan(ref * (1 - TOLERANCE_PCT / 100), ref * (1 + TOLERANCE_PCT / 100), color="green", alpha=0.12,
                    label=f"±{TOLERANCE_PCT:g} % of {reference['variant']}'s idle RSS at "
                          f"{reference['criterion']['reference_requests']} requests")
    for run in runs:
        loaded = [s for s in run["samples"] if s[3]]
        line, = ax1.plot([s[1] for s in loaded], [s[2] / MIB for s in loaded], lw=0.6, alpha=0.45)
        cps = run["checkpoints"]
        ax1.plot([c["requests_done"] for c in cps], [c["rss_idle_mib"] for c in cps], "o-", lw=2.4, ms=5,
                 color=line.get_color(), label=f"{run['variant']}: {env_label(run['env'])}, "
                                               f"trim {'on' if run['trim'] else 'off'}")
        ax2.plot([s[0] for s in run["samples"]], [s[2] / MIB for s in run["samples"]], lw=0.6,
                 color=line.get_color(), label=run["variant"])
        ax2.plot([c["t_s"] + c["pause_s"] for c in cps], [c["rss_idle_mib"] for c in cps], "o", ms=4,
                 color=line.get_color())
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
    ax1.set_title("RSS vs requests: thin = under load (0.5 s samples), thick = idle RSS at checkpoints",
                  fontsize=10)
    ax2.set_title("RSS vs time", fontsize=10)
    n = max((r["requests"] for r in runs), default=0)
    fig.suptitle(f"mmgate soak, {n} mixed multimodal requests, {runs[0]['clients'] if runs else 0} clients. Goal: "
                 f"after warm-up, idle RSS within {TOLERANCE_PCT:g} % of the first post-warm-up checkpoint",
                 fontsize=11)
    ax1.set_ylim(top=ax1.get_ylim()[1] * 1.3)  # room for the legend
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def markdown(data: dict[str, Any], args: R.Knobs, mix: dict[str, float]) -> str:
    runs = data["runs"]
    ok = {True: "met", False: "**not met**", None: "-"}
    lines = [
        "# Soak: idle-RSS creep and gauge leaks under mixed multimodal load",
        "",
        f"Generated by `python -m bench run {getattr(args, 'name', None) or getattr(args, 'out', 'soak')}` on "
        f"{data.get('date') or '?'}"
        + (" (with `append`: earlier variants' rows kept from the previous JSON)." if args.append else "."),
        "",
        "Requests per run: " + ", ".join(f"{r['variant']} {r['requests']}" for r in runs) + f"; {args.clients} "
        "clients; mmgate `--resize-max-pixels 1000000`, other settings default (4 media slots, decode workers = "
        "usable CPUs, `MMGATE_TRIM_IDLE=1` unless the variant says otherwise); stub backend (2 workers) streams "
        "16 tokens 2 ms apart. The machine has 2 cores and is shared with other benchmarks (load averages below).",
        "",
        "Planned mix (request kinds): " + ", ".join(f"{k} {v:g}" for k, v in mix.items()) + ". "
        "Half stream (SSE); 80 % OpenAI chat, 20 % Anthropic messages. Disconnects close a raw socket 0-150 ms after "
        "sending the whole request.",
        "",
        "## Criterion: idle RSS at checkpoints",
        "",
        ("Why not RSS under load: with a random mix of 64x64..12 MP images, instantaneous RSS depends on which big "
        "images happen to be decoded at that moment (bounded by the memory formula in docs/tuning.md), so it "
        "swings by tens of MiB without any leak. A leak or fragmentation creep is what remains when nothing is in "
        "flight. So every "
        f"{runs[0]['checkpoint_every'] if runs else '?'} requests all clients finish their current request and "
        "wait; the script waits until mmgate is idle (`gate_in_use`, `gate_waiting`, `media_bytes_live`, "
        "`media_buffers_live` all 0), then until `mmgate_memory_trims_total` has risen (trim on; at most "
        f"{args.trim_timeout:g} s) or for {args.settle:g} s (trim off, about the same idle time), then reads VmRSS "
        "and the gauges; then the load resumes."),
        "",
        (f"**Goal**: the idle RSS at every checkpoint after warm-up stays within {TOLERANCE_PCT:g} % of the first "
        f"checkpoint after warm-up (at {args.warmup:.0%} of the requests)."),
        "",
        ("| variant | env | trim | req/s (sending) | reference (MiB) | idle RSS min..max after warm-up | "
        "max deviation | largest increase | goal |"),
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in runs:
        c = r["criterion"]
        env = " ".join(f"`{k}={v}`" for k, v in r["env"].items()).replace(JEMALLOC, "libjemalloc.so.2") or "-"
        lines.append(f"| {r['variant']} | {env} | {'on' if r['trim'] else 'off'} | {r['req_per_s']} | "
                     f"{c['reference_rss_mib']} @ {c['reference_requests']} | {c.get('idle_rss_min_mib')}.."
                     f"{c.get('idle_rss_max_mib')} | {c['max_deviation_pct']:+} % | {c['max_increase_pct']:+} % | "
                     f"{ok[c['met']]} |")
    done = sorted({c["requests_done"] for r in runs for c in r["checkpoints"]})
    lines += ["", "Idle RSS (MiB) per checkpoint, deviation from the reference in brackets:", "",
              "| requests done | " + " | ".join(r["variant"] for r in runs) + " |",
              "| ---: | " + " | ".join("---:" for _ in runs) + " |"]
    for d in done:
        cells = []
        for r in runs:
            c = next((c for c in r["checkpoints"] if c["requests_done"] == d), None)
            dev = r["criterion"].get("deviations_pct", {}).get(d, r["criterion"].get("deviations_pct", {}).get(str(d)))
            cells.append("-" if c is None else f"{c['rss_idle_mib']}" + (f" ({dev:+} %)" if dev is not None else ""))
        lines.append(f"| {d} | " + " | ".join(cells) + " |")
    lines += ["", ("Per checkpoint: RSS when the clients stopped, when mmgate was idle, and after the trim (or the "
              "settle time); seconds until idle; trims so far; 1-min load average."), ""]
    for r in runs:
        cps = r["checkpoints"]
        lines.append(f"- **{r['variant']}**: " + "; ".join(
            f"{c['requests_done']}: {c['rss_at_pause_mib']:.0f} → {c['rss_when_idle_mib']:.0f} → "
            f"{c['rss_idle_mib']:.0f}" + ("" if c["trim_seen"] in (True, None) else " (no trim seen)")
            + ("" if c["idle_reached"] else " (NOT idle)") for c in cps))
        lines.append(f"  idle after {min(c['idle_wait_s'] for c in cps)}..{max(c['idle_wait_s'] for c in cps)} s; "
                     f"trims total {cps[-1]['trims_total']:g}"
                     + (f", trim seen at {sum(1 for c in cps if c['trim_seen'])}/{len(cps)} checkpoints"
                        if r["trim"] else "") + "; load avg 1-min "
                     + ", ".join(f"{c['loadavg'][0]:g}" for c in cps))
    lines += ["", "## Gauges at every checkpoint", "",
              f"Must be 0 when idle: {', '.join(MUST_BE_ZERO)}. Max seen at any checkpoint:", "",
              "| variant | " + " | ".join(g.removeprefix("mmgate_") for g in GAUGES) + " | leak? |",
              "| --- | " + " | ".join("---:" for _ in GAUGES) + " | --- |"]
    for r in runs:
        top = {g: max(c["gauges"][g] for c in r["checkpoints"]) for g in GAUGES}
        leak = ", ".join(f"{k}={v:g}" for k, v in r["gauges_not_zero_at_some_checkpoint"].items()) or "none"
        lines.append(f"| {r['variant']} | " + " | ".join(f"{top[g]:g}" for g in GAUGES) + f" | {leak} |")
    lines += ["", "## RSS under load (not the leak criterion)", "",
              ("Samples every 0.5 s while the clients were sending (checkpoint pauses excluded). Bounded by what is in "
              "flight (the memory formula in docs/tuning.md: admitted bodies + one decoded image per decode thread), "
              "so it swings with the dice. Warm-up sample = first sample once 10 % of the requests are done; drift = "
              "(max - warm-up) / warm-up; slope = least-squares fit after warm-up."), "",
              ("| variant | start | warm-up sample | median after warm-up | max after warm-up | peak (VmHWM) | "
              "drift of max | slope MiB/1k req |"),
              "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in runs:
        u = r["under_load"]
        lines.append(f"| {r['variant']} | {r['rss_start_mib']} | {u['rss_warm_mib']} | "
                     f"{u['rss_median_after_warm_mib']} | {u['rss_max_after_warm_mib']} | {r['rss_peak_mib']} | "
                     f"{u['drift_max_pct']:+} % | {u['slope_mib_per_1000_requests']} |")
    lines += ["", "Windows: samples while requests 10-20 % finished (early) vs during the last 10 % (late).", "",
              "| variant | early median | late median | drift of medians | early max | late max | drift of maxima |",
              "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in runs:
        u = r["under_load"]
        lines.append(f"| {r['variant']} | {u['window_median_early_mib']} | {u['window_median_late_mib']} | "
                     f"{u['drift_window_median_pct']:+} % | {u['window_max_early_mib']} | {u['window_max_late_mib']} | "
                     f"{u['drift_window_max_pct']:+} % |")
    lines += ["", ("Per tenth of the run (samples under load): median / max RSS in MiB. "
               "A leak climbs steadily; a plateau "
              "bounded by what is in flight does not."), "",
              "| variant | " + " | ".join(f"{10 * q}-{10 * q + 10} %" for q in range(10)) + " |",
              "| --- | " + " | ".join("---:" for _ in range(10)) + " |"]
    for r in runs:
        n, cells = r["requests"], []
        for q in range(10):
            w = [s[2] / MIB for s in r["samples"] if s[3] and n * q / 10 <= s[1] < n * (q + 1) / 10] or [float("nan")]
            cells.append(f"{statistics.median(w):.0f} / {max(w):.0f}")
        lines.append(f"| {r['variant']} | " + " | ".join(cells) + " |")
    lines += ["", "## Counts by status", "",
              ("Client side (`disconnect` = we hung up; `disconnect_too_late` = the answer ended before we did) and "
              "proxy side (`mmgate_requests` by status; 499 = client went away)."), ""]
    for r in runs:
        lines.append(f"- **{r['variant']}** client: " + ", ".join(f"{k}: {v}" for k, v in r["client_statuses"].items()))
        lines.append("  proxy: " + ", ".join(f"{k}: {v:.0f}" for k, v in r["proxy_statuses"].items()))
    lines += ["", "## Load", ""]
    for r in runs:
        lines.append(f"- {r['variant']} ({r['sending_s']} s sending, {r['wall_s']} s with pauses): before "
                     f"`{r['uptime_before']}`; after `{r['uptime_after']}`")
    lines += ["", ("Plot: `bench/results/soak.png` (left: RSS vs requests, thin under load, thick idle checkpoints, "
              "shaded ±10 % band; right: RSS vs time)."), ""]
    return "\n".join(lines)


def measure(knobs: R.Knobs) -> dict[str, Any]:
    stamp = R.stamp("soak.py", what(knobs.requests))
    media = media_set()
    stub, stub_url = start_stub("--workers", "2", "--tokens", "16", "--token-delay", "0.002")
    runs: list[dict[str, Any]] = []
    try:
        for name in knobs.variants.split(","):
            env = VARIANTS[name]
            if "LD_PRELOAD" in env and not Path(env["LD_PRELOAD"]).exists():
                print(f"skip {name}: {env['LD_PRELOAD']} missing")
                continue
            policy = CheckpointPolicy(trim=trims_enabled(env), settle_s=knobs.settle,
                                      trim_timeout_s=knobs.trim_timeout)
            print(f"[{name}] {knobs.requests} requests, {knobs.clients} clients ... {uptime()}", flush=True)
            r = run_variant(name, env, knobs.requests, knobs.clients, knobs.checkpoint_every, knobs.seed, stub_url,
                            media, knobs.warmup, policy)
            c, u = r["criterion"], r["under_load"]
            print(f"[{name}] {r['sending_s']} s sending, {r['req_per_s']} req/s; idle RSS ref {c['reference_rss_mib']} "
                  f"max deviation {c['max_deviation_pct']:+} % ({'met' if c['met'] else 'NOT met'}); under load "
                  f"warm {u['rss_warm_mib']} max {u['rss_max_after_warm_mib']} MiB; not zero "
                  f"{r['gauges_not_zero_at_some_checkpoint'] or '-'}; {r['client_statuses']}", flush=True)
            runs.append(r)
            if not knobs.quick:  # written after every variant: a later crash or time-out keeps the finished runs
                data = _data(knobs, stamp, runs)
                data["goals"] = goals(data)
                R.write(knobs.name, data, report(data))
    finally:
        stop(stub)
    data = _data(knobs, stamp, runs)
    if not knobs.quick:
        plot(data["runs"], RESULTS / f"{knobs.name}.png")
    return data


def _data(knobs: R.Knobs, stamp: dict[str, Any], runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The result: with ``append``, the other variants' runs kept from the result already written."""
    json_path = RESULTS / f"{knobs.name}.json"
    if knobs.append and json_path.exists():
        mine = {r["variant"] for r in runs}
        runs = [r for r in json.loads(json_path.read_text())["runs"] if r["variant"] not in mine] + runs
    return stamp | {"args": vars(knobs), "mix_weights": dict(MIX), "runs": runs}


def report(data: dict[str, Any]) -> str:
    return markdown(data, R.Knobs(**data["args"]), data["mix_weights"])


def what(requests: int) -> str:
    return (f"{requests:,} mixed media requests (invalid ones and disconnects included), idle RSS and gauges at "
            "checkpoints")


def goals(data: dict[str, Any]) -> list[R.Goal]:
    """Per variant, over its idle checkpoints after warm-up: the RSS deviation from the first (mmgate's own
    tuning, ``default``, must stay within ±10 % at every one; the others are reported), and the gauges that
    must be 0 when idle (at every checkpoint, every variant)."""
    runs = data["runs"]
    out = []
    for r in runs:
        c = r["criterion"]
        deviations = list((c.get("deviations_pct") or {}).values())
        target = f"within ±{TOLERANCE_PCT:g}" if r["variant"] == "default" else None
        out.append(R.goal(f"{r['variant']}: idle RSS vs first warm checkpoint", deviations, target,
                          (lambda v: abs(v) <= TOLERANCE_PCT) if target else None, unit="%", over="checkpoints",
                          met_on="every"))
    leaks = [sum(1 for g in MUST_BE_ZERO if cp["gauges"].get(g, 0)) for r in runs for cp in r["checkpoints"]]
    out.append(R.goal("idle gauges not 0 (all variants)", leaks, "= 0", lambda v: v == 0, over="checkpoints",
                      met_on="every"))
    return out
