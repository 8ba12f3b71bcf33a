"""Event-loop responsiveness under multimodal load: /mmgate/health latency while 16 clients send 12 MP photos.

Why: vLLM #34789 reported /health P99 18.9 ms under multimodal load, because media decoding ran on
(or starved) the server's event loop. mmgate decodes in a thread pool whose workers lower their own CPU
priority; this measures what a liveness prober sees.

Per scenario, fresh processes (stub backend, mmgate) so every process-lifetime counter is the scenario's own:
  * a prober in its own process sends GET /mmgate/health every 10 ms over one keep-alive connection (blocking
    sockets) for --seconds; latency = send → last response byte;
  * 16 clients (this process, aiohttp, one keep-alive connection each) send the same synthetic photo-like
    12 MP JPEG (4000x3000, q85, ~2.6 MB, 3.5 MB as base64) to /v1/chat/completions through mmgate to the stub
    backend (default stub: 1 decode thread, no simulated encoder CPU), back to back, non-streaming;
  * mmgate's own mmgate_event_loop_lag_seconds histogram (a 250 ms timer, so ~40 samples per 10 s; bucket
    edges, not exact values) is read at the start and end of the probe window and diffed.

Scenarios: idle; loaded with the pool as shipped (default workers = usable CPUs, the default decode mode for
them, workers at niceness 10); the same in thread mode; loaded with the pool's threads left at niceness 0;
loaded with every decode on the event loop (the baseline a server without a pool is); and the same four
loaded variants with --resize-max-pixels 1000000 (decode + resize + JPEG
re-encode: heavier work). The two baselines are not settings of mmgate: mmgate runs through
``python -m testkit.variants nice0|loop``, its own app with the variant's decode pool (nothing in proxy/ is
edited).

Everything (clients, prober, mmgate, stub) shares the machine's 2 cores, and the machine is shared with other
jobs: `uptime` is recorded at start and end. A control server (a bare aiohttp app answering /health, its
own process) is probed at the same time, so each round shows what the machine's scheduling alone costs.
Goal (default settings, 16 clients): with the pool, mmgate's health p99 within 5 ms of the control's p99
probed in the same window (each round's difference; the median of the rounds is judged).

    python -m bench run loop_latency [--set KNOB=VALUE] [--rounds N] [--quick]
    python -m bench list loop_latency   # the knobs and their defaults
Writes bench/results/loop_latency.md and .json.
"""

from __future__ import annotations

import datetime
import math
import platform
import time
from typing import Any

from bench import _results as R
from testkit import load as L
from testkit.health_under_load import Case, aggregate, progress, run_case
from testkit.media import PHOTO_QUALITY, PHOTO_SIZE, chat_body, photo_jpeg
from testkit.probed_load import in_turns

RESIZE = ("--resize-max-pixels", "1000000")
THREADS = ("--decode-mode", "thread")  # the default is process from 2 CPUs: threads shown beside it
VLLM_ANCHOR_P99_MS = 18.9
GOAL_P99_MS = 5.0
WHAT = "/mmgate/health p99 while 16 clients send 12 MP photos: decode pool vs decode on the loop"

CASES = [
    Case("idle", "idle (pool, no load)", False),
    Case("pool", "loaded, pool (default: decode mode for this machine's CPUs, nice 10)", True),
    Case("pool_thread", "loaded, pool, thread mode (nice 10)", True, THREADS),
    Case("pool_nice0", "loaded, pool, threads at nice 0", True, variant="nice0"),
    Case("inline", "loaded, inline decode on the loop", True, variant="loop"),
    Case("resize_pool", "loaded + resize 1 MP, pool (default mode, nice 10)", True, RESIZE),
    Case("resize_pool_thread", "loaded + resize 1 MP, pool, thread mode (nice 10)", True, RESIZE + THREADS),
    Case("resize_pool_nice0", "loaded + resize 1 MP, pool, threads at nice 0", True, RESIZE, variant="nice0"),
    Case("resize_inline", "loaded + resize 1 MP, inline decode", True, RESIZE, variant="loop"),
    Case("pinned_pool", "pinned: mmgate alone on 1 core, pool (nice 10)", True, pinned=True),
    Case("pinned_pool_nice0", "pinned: mmgate alone on 1 core, pool, workers nice 0", True,
         variant="nice0", pinned=True),
]


def measure(args: R.Knobs) -> dict[str, Any]:
    started = time.monotonic()
    stamp = R.stamp("loop_latency.py", WHAT)
    up_start = L.uptime()
    print(f"start: {up_start}", flush=True)
    image = photo_jpeg()
    body = chat_body(image)
    only = args.only.split(",") if args.only else None
    chosen = {c.name: c for c in CASES if (c.name in only if only else args.pinned or not c.pinned)}
    control, control_url = L.start_control()
    try:
        rounds = in_turns(list(chosen), args.rounds,
                          lambda name: run_case(chosen[name], body, args, control, control_url), progress, 18)
    finally:
        L.stop(control)
    up_end = L.uptime()
    print(f"end: {up_end}", flush=True)
    rows = [aggregate([rnd[name] for rnd in rounds]) for name in chosen]

    import aiohttp
    import PIL

    from proxy.settings import usable_cpus

    meta = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "python": platform.python_version(), "aiohttp": aiohttp.__version__, "pillow": PIL.__version__,
        "usable_cpus": usable_cpus(), "uptime_start": up_start, "uptime_end": up_end,
        "seconds": args.seconds, "interval": args.interval, "clients": args.clients, "ramp": args.ramp,
        "rounds": args.rounds, "quiet_wait": args.quiet_wait,
        "image": {"format": "JPEG", "size": list(PHOTO_SIZE), "quality": PHOTO_QUALITY, "bytes": len(image),
                  "body_bytes": len(body)},
        "stub": "python -m demo.backend (defaults: 1 decode thread, no cpu-ms-per-mp, no hold, 16 tokens, "
                "no delays)",
        "mmgate": "python -m proxy --access-log off --validate full (+ scenario flags); gate defaults: "
                  "--max-mm-concurrency 4, "
                  "--max-queue 64; decode workers default = usable CPUs",
        "wall_s": round(time.monotonic() - started, 1),
    }
    return stamp | {"meta": meta, "rows": rows}  # the runner prints the table


def goals(data: dict[str, Any]) -> list[R.Goal]:
    """Per-round health p99 of the loaded scenarios: the pool's, over the control's, against the goal; the rest
    reported beside it.

    The median of the rounds' p99s, not the p99 of the pooled probes: one noisy round cannot carry it.
    """
    by = {r["name"]: r for r in data["rows"]}
    out = []
    if "pool" in by:
        pool = by["pool"]
        over = [h - c for h, c in zip(pool["health_p99_per_round"], pool["control_p99_per_round"], strict=True)]
        out.append(R.goal("health p99 over the control server's, loaded, pool (default settings)", over,
                          f"≤ {GOAL_P99_MS:g}", lambda v: v <= GOAL_P99_MS, unit="ms"))
    for name, words in (("pool", "health p99, loaded, pool (default settings)"),
                        ("pool_thread", "health p99, loaded, pool, thread mode"),
                        ("pool_nice0", "health p99, loaded, pool, threads at nice 0"),
                        ("inline", "health p99, loaded, decode on the loop")):
        if name in by:
            out.append(R.goal(words, by[name]["health_p99_per_round"], unit="ms"))
    if "pool" in by:
        out.append(R.goal("control server p99 at the same time (the machine's share)",
                          by["pool"]["control_p99_per_round"], unit="ms"))
    return out


def fmt(x: float, digits: int = 2) -> str:
    if isinstance(x, float) and (math.isnan(x) or math.isinf(x)):
        return "inf" if x == math.inf else "-"
    return f"{x:.{digits}f}"


TITLES = ("scenario", "health p50 ms", "p99 ms", "max ms", "p99 per round", "control p99 ms (per round)",
          "loop lag p99 per round / max (bucket <=, ms)", "media req/s", "mmgate CPU %", "mmgate CPU ms / req",
          "mmgate minor faults / req", "other jobs CPU % per round", "mmgate thread niceness")


def cells(r: dict[str, Any]) -> dict[str, str]:
    """A case's row of the page's table, by column title (a CPU or fault figure that is missing or 0: -)."""
    h, c = r["health"], r["control"]

    def per_round(key: str, digits: int) -> str:
        return " / ".join(fmt(x, digits) for x in r[key])

    return dict(zip(TITLES, (
        r["label"], fmt(h["p50"]), f"**{fmt(h['p99'])}**", fmt(h["max"]), per_round("health_p99_per_round", 1),
        f"{fmt(c['p99'])} ({per_round('control_p99_per_round', 1)})",
        f"{per_round('loop_lag_p99_le_ms_per_round', 1)} / {fmt(r['loop_lag_max_le_ms'], 1)}",
        fmt(r["media_req_per_s"]), fmt(r["mmgate_cpu_pct"], 0), fmt(r["mmgate_cpu_ms_per_media_req"] or math.nan, 0),
        fmt(float(r["mmgate_minor_faults_per_media_req"] or math.nan), 0),
        per_round("other_jobs_cpu_pct_per_round", 0),
        ",".join(map(str, sorted({n for v in r["thread_niceness"].values() for n in v}))),
    ), strict=True))


def report(data: dict[str, Any]) -> str:
    """The Markdown report, its verdict line first, from the measured rows."""
    meta, rows = data["meta"], data["rows"]
    pool = next((r for r in rows if r["name"] == "pool"), None)
    verdict = ""
    if pool:
        p99 = pool["health"]["p99"]
        verdict = (f"**Loaded, pool: /mmgate/health p99 {p99:.2f} ms** over {pool['health']['n']} probes "
                   f"pooled over all rounds (the goal is judged on the rounds' median above; the control server "
                   f"probed at the same time: p99 {pool['control']['p99']:.2f} ms; vLLM #34789 anchor: "
                   f"{VLLM_ANCHOR_P99_MS} ms).")
    img = meta["image"]
    w, h = img["size"]
    pinned = any(r.get("pinned") for r in rows)
    md = "\n".join([
        f"{meta['rounds']} interleaved rounds, {meta['wall_s']} s in all; aiohttp {meta['aiohttp']}, Pillow "
        f"{meta['pillow']}{'; pinned' if pinned else ''}. Load average at the start: `{meta['uptime_start']}`; at the "
        f"end: `{meta['uptime_end']}`.",
        "",
        verdict,
        "",
        f"Probes every {meta['interval'] * 1000:g} ms for {meta['seconds']:g} s a round; p50/p99/max pool the probes "
        f"of all rounds. Load: {meta['clients']} clients, each POSTing a {w}x{h} JPEG (q{img['quality']}, "
        f"{img['bytes'] / 1e6:.2f} MB, body {img['body_bytes'] / 1e6:.2f} MB). Loop lag: bucket upper edges. "
        "'Other jobs CPU': the machine's busy time in the window less this benchmark's processes' (percent of one "
        "core): the noise.",
        "",
        *R.table([(title, title, "s") for title in TITLES], map(cells, rows)),
        "",
        "Baselines: `nice 0` scenarios run mmgate as `python -m testkit.variants nice0` (its decode workers "
        "keep the loop's priority), `inline` ones as `python -m testkit.variants loop` (every decode on the "
        "event loop); both are mmgate's own app with that decode pool, nothing in proxy/ is edited. The "
        "last column is the set of niceness values read back from /proc/PID/task/*/stat of the mmgate process "
        "(the loop and aiohttp threads are 0; decode workers 10 when lowered).",
        "",
        *([
            "Pinned scenarios (`--pinned`): mmgate alone on CPU 0 (so 1 usable CPU: 1 decode worker), the stub, "
            "the clients, the probers and the control on CPU 1: mmgate's loop then competes only with its own "
            "decode worker, which is what the worker niceness is for. Only meaningful when no other job runs "
            "(other jobs share CPU 0 with mmgate): check the 'other jobs' column.",
            "",
        ] if pinned else []),
    ])
    return md
