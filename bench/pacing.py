"""Pacing: small text requests and /mmgate/health while 16 clients resend one 12 MP photo (cache hits).

Why: with the processed-media cache on (the default), a resent photo is a cache hit, and its work is moving
the body through the one event loop: the loop, not the decoders, is then the limit, and a small request or a
liveness probe queues behind megabytes of body. mmgate paces the reading of big uploads by the loop's lag
(MMGATE_LOOP_LAG_TARGET, proxy/edge/pacing.py); this measures what a small request and a prober see, and what the
pacing costs media throughput, against a minimal aiohttp proxy forwarding the same bodies in the same run.

Per round, fresh processes for each scenario (an idle control server runs throughout):

  * upstream: the raw asyncio upstream of testkit/text_load.py (reads the whole body, answers a fixed JSON);
  * idle: mmgate (default settings), no load: a text prober POSTs a small text chat through mmgate every
    10 ms, a health prober GETs /mmgate/health every 10 ms, a third GETs the control server's /health;
  * mmgate: the same three probers while 16 clients (this process, aiohttp, one keep-alive connection each)
    POST the same 12 MP photo chat (a 4000x3000 JPEG, ~3.5 MB as base64) back to back: after the first,
    every one is a cache hit;
  * mmgate, pacing off: the same with MMGATE_LOOP_LAG_TARGET=0 (what mmgate did before pacing);
  * mmgate on uvloop: the same with MMGATE_LOOP=uvloop (the other scenarios run on asyncio's own loop, what
    ``pip install mmgate`` gives): libuv reads up to 32 buffers from a socket in one pass of the loop, so a
    held upload's reading stops only between such bursts;
  * minimal: the minimal aiohttp proxy of testkit/text_load.py (read the body, forward it, stream the answer)
    under the same load, probed with the text request and the control.

Figures per round: text p99 (idle and loaded), health p99 and the control's in the same window, media
requests answered per second in the window, CPU per media request (the proxy process and its children, from
/proc, over the window) and its minor page faults (fresh memory, a 4 KiB page each); and, in this process, the CPU
of a SHA-256 of the photo's base64 (a hit's cache key: mmgate hashes in its hasher threads). Goals (each judged
on the median of the rounds, spread min–max): loaded text p99 ≤ idle text p99 + 15 ms; health p99 ≤ control p99
+ 5 ms; media req/s ≥ 0.6 × minimal's.

    python -m bench run pacing [--set KNOB=VALUE] [--rounds N] [--quick]
    python -m bench list pacing   # the knobs and their defaults
Writes bench/results/pacing.md and .json.
"""

from __future__ import annotations

import datetime
import platform
import time
from typing import Any

from bench import _results as R
from testkit import load as L
from testkit.cache_hit_load import figures, progress, run_case
from testkit.media import PHOTO_QUALITY, PHOTO_SIZE, chat_body, photo_jpeg
from testkit.probed_load import in_turns
from testkit.text_load import start_role

WHAT = "small text request and /mmgate/health latency while 16 clients resend one 12 MP photo (cache hits)"
GOAL_TEXT_MS = 15.0
GOAL_HEALTH_MS = 5.0
GOAL_THROUGHPUT = 0.6
CASES = ("idle", "mmgate", "mmgate_unpaced", "mmgate_uvloop", "minimal")
LABELS = {"idle": "mmgate idle", "mmgate": "mmgate (default settings)",
          "mmgate_unpaced": "mmgate, pacing off (MMGATE_LOOP_LAG_TARGET=0)",
          "mmgate_uvloop": "mmgate on uvloop (MMGATE_LOOP=uvloop)", "minimal": "minimal aiohttp proxy"}


def measure(args: R.Knobs) -> dict[str, Any]:
    names = [n for n in CASES if n == "idle" or not args.only or n in args.only.split(",")]
    started = time.monotonic()
    stamp = R.stamp("pacing.py", WHAT)
    up_start = L.uptime()
    photo = photo_jpeg()
    body = chat_body(photo)
    upstream, upstream_url = start_role("upstream")
    control, control_url = L.start_control()
    try:
        rounds = in_turns(names, args.rounds, lambda name: run_case(name, body, upstream_url, control_url, args),
                          progress, 15)
    finally:
        L.stop(control)
        L.stop(upstream)
    meta = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "python": platform.python_version(), "usable_cpus": R.usable_cores(), "rounds": args.rounds,
            "seconds": args.seconds, "interval": args.interval, "clients": args.clients,
            "photo": f"{PHOTO_SIZE[0]}x{PHOTO_SIZE[1]} JPEG q{PHOTO_QUALITY} ({len(photo) / 1e6:.2f} MB)",
            "body_mb": len(body) / 1e6, "uptime_start": up_start, "uptime_end": L.uptime(),
            "wall_s": round(time.monotonic() - started, 1)}
    return stamp | {"meta": meta, "figures": figures(rounds), "rounds": rounds}


# Figures reported beside the goals: (name, figure, unit)
REPORTED = (
    ("CPU per media request, mmgate ÷ minimal aiohttp proxy", "mmgate/cpu_per_req_over_minimal", ""),
    ("SHA-256 of the photo's base64 (the cache key of a hit), CPU ms, in this process", "sha256_cpu_ms_per_payload",
     "ms"),
    ("minor page faults per media request, mmgate", "mmgate/minor_faults_per_media_req", ""),
    ("minor page faults per media request, minimal proxy", "minimal/minor_faults_per_media_req", ""),
    ("pacing off: loaded text p99 over idle text p99", "mmgate_unpaced/text_p99_over_idle_ms", "ms"),
    ("pacing off: health p99 over the control's", "mmgate_unpaced/health_p99_over_control_ms", "ms"),
    ("pacing off: media req/s ÷ minimal's", "mmgate_unpaced/throughput_over_minimal", ""),
    ("uvloop: loaded text p99 over idle text p99", "mmgate_uvloop/text_p99_over_idle_ms", "ms"),
    ("uvloop: health p99 over the control's", "mmgate_uvloop/health_p99_over_control_ms", "ms"),
    ("uvloop: media req/s ÷ minimal's", "mmgate_uvloop/throughput_over_minimal", ""),
    ("minimal proxy: loaded text p99 over mmgate's idle text p99", "minimal/text_p99_over_idle_ms", "ms"),
)


def goals(data: dict[str, Any]) -> list[R.Goal]:
    f = data["figures"]
    return [
        R.goal("loaded text p99 over idle text p99, mmgate (default settings)",
               f.get("mmgate/text_p99_over_idle_ms", []), f"≤ {GOAL_TEXT_MS:g}", lambda v: v <= GOAL_TEXT_MS,
               unit="ms"),
        R.goal("/mmgate/health p99 over the idle control server's p99, loaded", f.get(
            "mmgate/health_p99_over_control_ms", []), f"≤ {GOAL_HEALTH_MS:g}", lambda v: v <= GOAL_HEALTH_MS,
            unit="ms"),
        R.goal("media req/s, mmgate ÷ minimal aiohttp proxy", f.get("mmgate/throughput_over_minimal", []),
               f"≥ {GOAL_THROUGHPUT:g}", lambda v: v >= GOAL_THROUGHPUT),
        *(R.goal(name, f.get(key, []), unit=unit) for name, key, unit in REPORTED),
    ]


# The page's table: (title, figure) after the scenario; each cell the figure's median over rounds (min–max)
TABLE = (("text p50 ms", "text_p50_ms"), ("text p99 ms", "text_p99_ms"), ("health p99 ms", "health_p99_ms"),
         ("control p99 ms", "control_p99_ms"), ("media req/s", "media_req_per_s"),
         ("CPU ms / media req", "cpu_ms_per_media_req"), ("minor faults / media req", "minor_faults_per_media_req"),
         ("CPU %", "cpu_pct"))


def report(data: dict[str, Any]) -> str:
    meta, f, names = data["meta"], data["figures"], list(data["rounds"][0])
    rows = [{"scenario": LABELS[name]} | {key: R.spread_cell(f.get(f"{name}/{key}", [])) for _, key in TABLE}
            for name in names]
    return "\n".join([
        f"{meta['rounds']} rounds of {meta['seconds']:g} s per scenario, {meta['wall_s']} s in all; {meta['clients']} "
        f"clients resending one {meta['photo']} ({meta['body_mb']:.2f} MB body); probes every "
        f"{meta['interval'] * 1000:g} ms. Load average at the start: `{meta['uptime_start']}`; at the end: "
        f"`{meta['uptime_end']}`. Each cell: the median over rounds (min–max).",
        "",
        *R.table([("scenario", "scenario", "s"), *((title, key, "s") for title, key in TABLE)], rows, spaced=True),
        "",
    ])
