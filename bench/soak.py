"""Soak test: many mixed multimodal requests through mmgate, watching its RSS for drift and its gauges for leaks.

What it sends (weights of the default mix; bodies prebuilt once, so the client allocates nothing per request):

* 55 % a small 64x64 PNG, 25 % a ~1 MP JPEG (fits: validated and forwarded untouched),
* 6 % a 4 MP JPEG, 3 % a 12 MP JPEG, 1 % a 6 MP PNG (all resized to <= 1 MP: ``--resize-max-pixels 1000000``),
* 5 % invalid media (half bad base64, half a truncated JPEG): expected 400,
* 5 % client disconnects: the whole request is written on a raw socket, then the socket is closed after a
  random 0-150 ms (during preprocessing, forwarding or the streamed answer),
* half the requests stream (SSE); 80 % OpenAI /v1/chat/completions, 20 % Anthropic /v1/messages.

``--clients`` (16) coroutines send back to back. The stub backend streams 16 tokens 2 ms apart. A thread
samples mmgate's VmRSS from /proc every 0.5 s with the number of requests finished so far. At the end
(after 3 s idle) the gauges mmgate_media_bytes_live, mmgate_media_bytes_inflight, mmgate_gate_in_use
(and gate_waiting, pool_queue_depth, pool_stuck_workers) are scraped: anything but 0 is a leak.

Reported: RSS after warm-up (the first sample once 10 % of the requests are done) vs the max after warm-up,
the RSS when the load ends and after idling; drift in % of the warm-up RSS (goal: <= 10 %); the slope of a
least-squares line through the post-warm-up samples (MiB per 1000 requests); counts by status.

Each ``--variants`` entry is one run with its own mmgate process and environment: ``default``, ``arena2``
(MALLOC_ARENA_MAX=2), ``mmap1m`` (MALLOC_MMAP_THRESHOLD_=MALLOC_TRIM_THRESHOLD_=1 MiB), ``blocks0``
(PILLOW_BLOCKS_MAX=0), ``mmap1m+blocks0``, ``jemalloc`` (LD_PRELOAD libjemalloc.so.2, if installed).
``--append`` adds runs to the existing JSON/chart (replacing rows of the same variant). All curves go on one chart: bench/results/soak.png.

    python bench/soak.py [--requests 10000] [--clients 16] [--variants default,arena2]

The machine may be shared: the load average is recorded before and after each run.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import random
import statistics
import sys
import threading
import time
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
import pybase64
from PIL import Image

from _load import RESULTS, parse_prom, photo_jpeg, start_mmgate, start_stub, stop, uptime
from image_pipeline import photo_sized

MIB = 1 << 20
JEMALLOC = "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"
VARIANTS: dict[str, dict[str, str]] = {
    "default": {},
    "arena2": {"MALLOC_ARENA_MAX": "2"},
    "mmap1m": {"MALLOC_MMAP_THRESHOLD_": str(MIB), "MALLOC_TRIM_THRESHOLD_": str(MIB)},
    "blocks0": {"PILLOW_BLOCKS_MAX": "0"},
    "mmap1m+blocks0": {"MALLOC_MMAP_THRESHOLD_": str(MIB), "MALLOC_TRIM_THRESHOLD_": str(MIB), "PILLOW_BLOCKS_MAX": "0"},
    "jemalloc": {"LD_PRELOAD": JEMALLOC},
}
GAUGES = ("mmgate_media_bytes_live", "mmgate_media_bytes_inflight", "mmgate_gate_in_use", "mmgate_gate_waiting",
          "mmgate_pool_queue_depth", "mmgate_pool_stuck_workers")
MUST_BE_ZERO = ("mmgate_media_bytes_live", "mmgate_media_bytes_inflight", "mmgate_gate_in_use")


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
    kinds, weights = zip(*MIX)
    out = []
    for kind in rng.choices(kinds, weights, k=n):
        disconnect = kind == "disconnect"
        if disconnect:
            kind = rng.choice(DISCONNECT_KINDS)
        out.append((kind, "openai" if rng.random() < 0.8 else "anthropic", rng.random() < 0.5, disconnect))
    return out


# --- RSS sampler ---------------------------------------------------------------------------------------

def vm_rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


class Sampler(threading.Thread):
    def __init__(self, pid: int, progress: list[int], interval: float = 0.5) -> None:
        super().__init__(daemon=True)
        self.pid, self.progress, self.interval = pid, progress, interval
        self.samples: list[tuple[float, int, int]] = []  # (t, requests done, rss bytes)
        self.stopped = threading.Event()
        self.t0 = time.monotonic()

    def run(self) -> None:
        while not self.stopped.is_set():
            try:
                self.samples.append((time.monotonic() - self.t0, self.progress[0], vm_rss(self.pid)))
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
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
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


async def run_load(url: str, work: list[tuple[str, bytes, bool, bool]], clients: int, progress: list[int],
                   seed: int) -> tuple[Counter[str], float]:
    import aiohttp

    host, port = url.rsplit("//", 1)[1].split(":")
    counts: Counter[str] = Counter()
    queue = iter(range(len(work)))
    rng = random.Random(seed + 1)
    connector = aiohttp.TCPConnector(limit=clients)
    timeout = aiohttp.ClientTimeout(total=120)

    async def client(session: aiohttp.ClientSession) -> None:
        for i in queue:
            path, body, stream, disconnect = work[i]
            if disconnect:
                status = await disconnecting_request(host, int(port), path, body, rng.uniform(0.0, 0.15))
            else:
                status = await one_request(session, url, path, body, stream)
            counts[status] += 1
            progress[0] += 1

    t0 = time.monotonic()
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        await asyncio.gather(*(client(session) for _ in range(clients)))
    return counts, time.monotonic() - t0


async def scrape(url: str) -> dict:
    import aiohttp

    async with aiohttp.ClientSession() as s, s.get(url + "/mmgate/metrics") as r:
        return parse_prom(await r.text())


def gauges(prom: dict) -> dict[str, float]:
    return {g: sum(v for (name, _labels), v in prom.items() if name == g) for g in GAUGES}


def status_counts(prom: dict) -> dict[str, float]:
    out: Counter[str] = Counter()
    for (name, labels), v in prom.items():
        if name in ("mmgate_requests_total", "mmgate_requests"):
            out[dict(labels).get("code", "?")] += v
    return dict(sorted(out.items()))


# --- one run -------------------------------------------------------------------------------------------

def analyse(samples: list[tuple[float, int, int]], n: int, warm_fraction: float) -> dict[str, Any]:
    warm_at = int(n * warm_fraction)
    warm = next((s for s in samples if s[1] >= warm_at), samples[0])
    during = [s for s in samples if s[1] < n]
    after_warm = [s for s in samples if s[0] >= warm[0]]
    loaded = [s for s in after_warm if s[1] < n] or after_warm
    end_of_load = next((s for s in samples if s[1] >= n), samples[-1])
    rss_max = max(s[2] for s in after_warm)
    slope = float("nan")
    if len(loaded) > 3:
        xs, ys = [s[1] for s in loaded], [s[2] / MIB for s in loaded]
        slope = statistics.linear_regression(xs, ys).slope * 1000
    warm_rss, final = warm[2], samples[-1][2]

    def window(lo: float, hi: float) -> list[int]:
        return [s[2] for s in samples if n * lo <= s[1] < n * hi] or [warm_rss]

    # One sample is noisy (RSS swings with whichever big images are in flight at that instant): also compare
    # the samples taken while requests 10-20 % finished with those taken during the last 10 %.
    early, late = window(warm_fraction, 2 * warm_fraction), window(1 - warm_fraction, 1.0 + 1e-9)
    med_e, med_l, max_e, max_l = statistics.median(early), statistics.median(late), max(early), max(late)
    return {
        "warmup_requests": warm_at,
        "rss_warm_mib": round(warm_rss / MIB, 1),
        "rss_max_mib": round(max(s[2] for s in samples) / MIB, 1),
        "rss_max_after_warm_mib": round(rss_max / MIB, 1),
        "rss_end_of_load_mib": round(end_of_load[2] / MIB, 1),
        "rss_final_idle_mib": round(final / MIB, 1),
        "drift_max_pct": round(100 * (rss_max - warm_rss) / warm_rss, 1),
        "drift_final_pct": round(100 * (final - warm_rss) / warm_rss, 1),
        "slope_mib_per_1000_requests": round(slope, 2),
        "window_median_early_mib": round(med_e / MIB, 1),
        "window_median_late_mib": round(med_l / MIB, 1),
        "window_max_early_mib": round(max_e / MIB, 1),
        "window_max_late_mib": round(max_l / MIB, 1),
        "drift_window_median_pct": round(100 * (med_l - med_e) / med_e, 1),
        "drift_window_max_pct": round(100 * (max_l - max_e) / max_e, 1),
        "rss_during_load_median_mib": round(statistics.median(s[2] for s in during) / MIB, 1) if during else None,
    }


def run_variant(name: str, env: dict[str, str], n: int, clients: int, seed: int, stub_url: str,
                media: dict[str, tuple[str, bytes | str]], warm_fraction: float, idle: float) -> dict[str, Any]:
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
    progress = [0]
    sampler = Sampler(proc.pid, progress)
    try:
        rss_start = vm_rss(proc.pid)
        sampler.start()
        counts, elapsed = asyncio.run(run_load(url, work, clients, progress, seed))
        time.sleep(idle)
        sampler.stopped.set()
        sampler.join()
        sampler.samples.append((time.monotonic() - sampler.t0, progress[0], vm_rss(proc.pid)))
        prom = asyncio.run(scrape(url))
    finally:
        sampler.stopped.set()
        stop(proc)
    g = gauges(prom)
    result = {
        "variant": name,
        "env": env,
        "requests": n,
        "clients": clients,
        "elapsed_s": round(elapsed, 1),
        "req_per_s": round(n / elapsed, 1),
        "rss_start_mib": round(rss_start / MIB, 1),
        **analyse(sampler.samples, n, warm_fraction),
        "client_statuses": dict(sorted(counts.items())),
        "proxy_statuses": status_counts(prom),
        "gauges_at_end": g,
        "leak": {k: v for k, v in g.items() if k in MUST_BE_ZERO and v != 0},
        "uptime_before": load_before,
        "uptime_after": uptime(),
        "samples": sampler.samples,
    }
    return result


# --- report --------------------------------------------------------------------------------------------

def plot(runs: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.8))
    for run in runs:
        s = run["samples"]
        env = " ".join(f"{k}={v}" for k, v in run["env"].items()) or "(glibc defaults)"
        env = env.replace(JEMALLOC, "jemalloc").replace(f"={MIB}", "=1MiB").replace("MALLOC_", "")
        label = f"{run['variant']}: {env}"
        ax1.plot([x[1] for x in s], [x[2] / MIB for x in s], label=label, lw=1)
        ax2.plot([x[0] for x in s], [x[2] / MIB for x in s], label=label, lw=1)
        ax1.axhline(run["rss_warm_mib"] * 1.1, ls=":", lw=0.8, color=ax1.lines[-1].get_color())
    if runs:
        ax1.axvline(runs[0]["warmup_requests"], color="grey", ls="--", lw=0.8, label="end of warm-up (10 %)")
    ax1.set_xlabel("requests finished")
    ax2.set_xlabel("seconds")
    for ax in (ax1, ax2):
        ax.set_ylabel("mmgate VmRSS (MiB)")
        ax.grid(alpha=0.3)
        ax.set_ylim(bottom=0)
    ax1.legend(fontsize=7, loc="lower right", framealpha=0.9)
    ax1.set_title("RSS vs requests (dotted: warm-up RSS + 10 %)", fontsize=10)
    ax2.set_title("RSS vs time (last seconds: idle)", fontsize=10)
    fig.suptitle(f"mmgate soak: {runs[0]['requests'] if runs else 0} mixed multimodal requests, "
                 f"{runs[0]['clients'] if runs else 0} clients", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def markdown(runs: list[dict[str, Any]], args: argparse.Namespace, mix: dict[str, int]) -> str:
    lines = [
        "# Soak: RSS drift and gauge leaks under mixed multimodal load",
        "",
        f"Generated by `python bench/soak.py {getattr(args, 'command', None) or ' '.join(sys.argv[1:])}` on "
        f"{datetime.now(UTC):%Y-%m-%d %H:%M} UTC"
        + (" (with `--append`: earlier variants' rows kept from the previous JSON)." if args.append else ".")
        + (" Tables re-derived from the stored samples with `--report-only`." if args.report_only else ""),
        f"{args.requests} requests per run, {args.clients} clients, mmgate `--resize-max-pixels 1000000`, other "
        "settings default (4 media slots, decode workers = usable CPUs); stub backend (2 workers) streams 16 "
        "tokens 2 ms apart. The machine has 2 cores and is shared with other benchmarks (load averages below).",
        "",
        "Planned mix (request kinds): " + ", ".join(f"{k} {v}" for k, v in mix.items()) + ".",
        "Half stream (SSE); 80 % OpenAI chat, 20 % Anthropic messages. Disconnects close a raw socket 0-150 ms after "
        "sending the whole request.",
        "",
        "## RSS (MiB)",
        "",
        "Warm-up RSS = first sample once 10 % of the requests are done. Drift = (x - warm-up) / warm-up. Goal: "
        "within 10 %. Slope = least-squares fit of the samples taken under load after warm-up.",
        "",
        "| variant | env | req/s | start | warm-up | max after warm-up | end of load | idle (final) | "
        "drift max | drift final | slope MiB/1k req | within 10 % |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in runs:
        env = " ".join(f"`{k}={v}`" for k, v in r["env"].items()).replace(JEMALLOC, "libjemalloc.so.2") or "-"
        ok = "yes" if r["drift_max_pct"] <= 10 and r["drift_final_pct"] <= 10 else "**no**"
        lines.append(f"| {r['variant']} | {env} | {r['req_per_s']} | {r['rss_start_mib']} | {r['rss_warm_mib']} | "
                     f"{r['rss_max_after_warm_mib']} | {r['rss_end_of_load_mib']} | {r['rss_final_idle_mib']} | "
                     f"{r['drift_max_pct']:+} % | {r['drift_final_pct']:+} % | {r['slope_mib_per_1000_requests']} | "
                     f"{ok} |")
    lines += ["", "Windows (robust to the swings): samples taken while requests 10-20 % finished (early) vs during the "
              "last 10 % (late).", "",
              "| variant | early median | late median | drift of medians | early max | late max | drift of maxima |",
              "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in runs:
        lines.append(f"| {r['variant']} | {r['window_median_early_mib']} | {r['window_median_late_mib']} | "
                     f"{r['drift_window_median_pct']:+} % | {r['window_max_early_mib']} | {r['window_max_late_mib']} | "
                     f"{r['drift_window_max_pct']:+} % |")
    lines += ["", "Per tenth of the run (samples under load): median / max RSS in MiB. A leak climbs steadily; a plateau "
              "bounded by what is in flight does not.", "",
              "| variant | " + " | ".join(f"{10 * q}-{10 * q + 10} %" for q in range(10)) + " |",
              "| --- | " + " | ".join("---:" for _ in range(10)) + " |"]
    for r in runs:
        n, cells = r["requests"], []
        for q in range(10):
            w = [x[2] / MIB for x in r["samples"] if n * q / 10 <= x[1] < n * (q + 1) / 10] or [float("nan")]
            cells.append(f"{statistics.median(w):.0f} / {max(w):.0f}")
        lines.append(f"| {r['variant']} | " + " | ".join(cells) + " |")
    lines += ["", "## Counts by status", "",
              "Client side (`disconnect` = we hung up; `disconnect_too_late` = the answer ended before we did) and "
              "proxy side (`mmgate_requests` by status; 499 = client went away).", ""]
    for r in runs:
        lines.append(f"- **{r['variant']}** client: " + ", ".join(f"{k}: {v}" for k, v in r["client_statuses"].items()))
        lines.append("  proxy: " + ", ".join(f"{k}: {v:.0f}" for k, v in r["proxy_statuses"].items()))
    lines += ["", "## Gauges after the run (3 s idle)", "",
              "| variant | " + " | ".join(GAUGES) + " | leak? |",
              "| --- | " + " | ".join("---:" for _ in GAUGES) + " | --- |"]
    for r in runs:
        leak = ", ".join(f"{k}={v:g}" for k, v in r["leak"].items()) or "none"
        lines.append(f"| {r['variant']} | " + " | ".join(f"{r['gauges_at_end'][g]:g}" for g in GAUGES) + f" | {leak} |")
    lines += ["", "## Load", ""]
    for r in runs:
        lines.append(f"- {r['variant']}: before `{r['uptime_before']}`; after `{r['uptime_after']}`")
    lines += ["", "Plot: `bench/results/soak.png` (RSS vs requests and vs time, one curve per variant).", ""]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=10_000)
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--variants", default="default,arena2", help="comma-separated: " + ", ".join(VARIANTS))
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--warmup", type=float, default=0.10, help="fraction of requests counted as warm-up")
    p.add_argument("--idle", type=float, default=3.0, help="seconds idle before the final RSS and gauges")
    p.add_argument("--out", default="soak", help="basename under bench/results/")
    p.add_argument("--append", action="store_true",
                   help="keep the runs already in the JSON (other variants) and add these to table and chart")
    p.add_argument("--report-only", action="store_true",
                   help="send nothing: re-analyse the samples in the JSON and rewrite the .md and .png")
    args = p.parse_args()

    if args.report_only:
        saved = json.loads((RESULTS / f"{args.out}.json").read_text())
        runs = saved["runs"]
        for r in runs:
            r.update(analyse([tuple(s) for s in r["samples"]], r["requests"], args.warmup))
        args.requests, args.clients = runs[0]["requests"], runs[0]["clients"]
        cmds = dict.fromkeys(r.get("command", saved.get("command", "")) for r in runs)
        args.command = "` and `python bench/soak.py ".join(cmds)
        args.append = any("--append" in c for c in cmds)
        (RESULTS / f"{args.out}.json").write_text(json.dumps(saved | {"runs": runs}, indent=1))
        (RESULTS / f"{args.out}.md").write_text(markdown(runs, args, saved["mix_weights"]))
        plot(runs, RESULTS / f"{args.out}.png")
        print(f"rewrote {RESULTS / args.out}.md/.json/.png")
        return

    media = media_set()
    stub, stub_url = start_stub("--workers", "2", "--tokens", "16", "--token-delay", "0.002")
    runs = []
    try:
        for name in args.variants.split(","):
            env = VARIANTS[name]
            if "LD_PRELOAD" in env and not Path(env["LD_PRELOAD"]).exists():
                print(f"skip {name}: {env['LD_PRELOAD']} missing")
                continue
            print(f"[{name}] {args.requests} requests, {args.clients} clients ... {uptime()}", flush=True)
            r = run_variant(name, env, args.requests, args.clients, args.seed, stub_url, media, args.warmup, args.idle)
            r["command"] = " ".join(sys.argv[1:])
            print(f"[{name}] {r['elapsed_s']} s, {r['req_per_s']} req/s; RSS warm {r['rss_warm_mib']} max "
                  f"{r['rss_max_after_warm_mib']} end {r['rss_end_of_load_mib']} idle {r['rss_final_idle_mib']} MiB "
                  f"(drift max {r['drift_max_pct']:+} %, final {r['drift_final_pct']:+} %); "
                  f"gauges {r['gauges_at_end']}; {r['client_statuses']}", flush=True)
            runs.append(r)
    finally:
        stop(stub)
    RESULTS.mkdir(parents=True, exist_ok=True)
    mix = {k: w for k, w in MIX}
    previous = RESULTS / f"{args.out}.json"
    if args.append and previous.exists():
        mine = {r["variant"] for r in runs}
        runs = [r for r in json.loads(previous.read_text())["runs"] if r["variant"] not in mine] + runs
    (RESULTS / f"{args.out}.json").write_text(json.dumps(
        {"args": vars(args), "command": " ".join(sys.argv[1:]), "mix_weights": mix, "runs": runs}, indent=1))
    (RESULTS / f"{args.out}.md").write_text(markdown(runs, args, mix))
    plot(runs, RESULTS / f"{args.out}.png")
    print(f"wrote {RESULTS / args.out}.md/.json/.png")


if __name__ == "__main__":
    main()
