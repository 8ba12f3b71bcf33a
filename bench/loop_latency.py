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

import asyncio
import datetime
import math
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from bench import _results as R
from testkit import load as L
from testkit import procfs
from testkit.media import PHOTO_QUALITY, PHOTO_SIZE, chat_body, photo_jpeg
from testkit.procfs import descendants, tree_cpu_seconds, tree_minor_faults

RESIZE = ("--resize-max-pixels", "1000000")
THREADS = ("--decode-mode", "thread")  # the default is process from 2 CPUs: threads shown beside it
VLLM_ANCHOR_P99_MS = 18.9
GOAL_P99_MS = 5.0


@dataclass(frozen=True)
class Case:
    name: str
    label: str
    loaded: bool
    flags: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    variant: str | None = None  # None: mmgate as shipped (workers at niceness 10); else a testkit.variants pool
    pinned: bool = False  # mmgate alone on CPU 0; stub, clients, probers and control on CPU 1


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
GATE_CPUS, REST_CPUS = {0}, {1}


async def run_case(sc: Case, body: bytes, args: R.Knobs, control: subprocess.Popen[bytes],
                       control_url: str) -> dict:
    stub = gate = None
    quiet = await asyncio.to_thread(L.wait_quiet, args.quiet_wait)
    log_tail = ""
    all_cpus = os.sched_getaffinity(0)
    gate_cpus = rest_cpus = None
    if sc.pinned:
        gate_cpus, rest_cpus = GATE_CPUS, REST_CPUS
        os.sched_setaffinity(0, rest_cpus)  # this thread (the clients' loop), and the probers it starts
        os.sched_setaffinity(control.pid, rest_cpus)
    try:
        stub, stub_url = L.start_stub(cpus=rest_cpus)
        # --validate full: every image is decoded, in the pool or on the loop, which is what the scenarios compare
        gate, url = L.start_mmgate(stub_url, "--validate", "full", *sc.flags, env=dict(sc.env), variant=sc.variant,
                                   cpus=gate_cpus)
        warm = await L.run_load(url, body, 1, requests_per_client=2)  # starts the decode threads, warms caches
        if warm.statuses() != {"200": 2}:
            raise RuntimeError(f"{sc.name}: warm-up answered {warm.statuses()}")
        nice = {k: sorted(set(v)) for k, v in L.thread_niceness(gate.pid).items()}
        stop_load = asyncio.Event()
        load_task = None
        if sc.loaded:
            load_task = asyncio.create_task(L.run_load(url, body, args.clients, stop_event=stop_load))
            await asyncio.sleep(args.ramp)
        before = L.histogram(await L.scrape(url), "mmgate_event_loop_lag_seconds")
        load_before = L.loadavg()
        cpu0, t0 = tree_cpu_seconds(gate.pid), time.perf_counter()
        faults0 = tree_minor_faults(gate.pid)
        watch = L.CpuWatch([gate.pid, *descendants(gate.pid), stub.pid, control.pid, os.getpid()])
        prober, out = L.start_prober(url, args.seconds, args.interval)
        ctl_prober, ctl_out = L.start_prober(control_url, args.seconds, args.interval, "/health")
        probe = await asyncio.to_thread(L.prober_result, prober, out)
        ctl = await asyncio.to_thread(L.prober_result, ctl_prober, ctl_out)
        t1 = time.perf_counter()
        cpu1 = tree_cpu_seconds(gate.pid)
        faults1 = tree_minor_faults(gate.pid)
        machine = watch.stop(extra_cpu_s=probe["cpu_s"] + ctl["cpu_s"])
        after_prom = await L.scrape(url)
        lag = L.histogram_diff(L.histogram(after_prom, "mmgate_event_loop_lag_seconds"), before)
        stop_load.set()
        run = await load_task if load_task else None
        status = procfs.memory(gate.pid)
    finally:
        log_tail = L.stop(gate)
        L.stop(stub)
        if sc.pinned:
            os.sched_setaffinity(0, all_cpus)
            os.sched_setaffinity(control.pid, all_cpus)

    in_window = [r for r in run.ok() if t0 <= r.ended <= t1] if run else []
    lat = L.summarize_ms(probe["latencies"])
    late = [x for x in probe["lateness"] if x > probe["interval"]]
    return {
        "name": sc.name, "label": sc.label, "loaded": sc.loaded, "flags": list(sc.flags), "env": dict(sc.env),
        "variant": sc.variant, "worker_niceness_requested": 0 if sc.variant == "nice0" else None,
        "thread_niceness": nice, "pinned": sc.pinned,
        "mmgate_threads": sum(len(v) for v in nice.values()),
        "health": lat, "health_statuses": probe["statuses"], "control": L.summarize_ms(ctl["latencies"]),
        "probes_sent_late": len(late),
        "skipped_slots": probe["skipped_slots"],
        "probe_elapsed_s": round(probe["elapsed"], 2),
        "lateness_ms": L.summarize_ms(probe["lateness"]),
        "loop_lag": {"samples": int(lag["count"]),
                     "mean_ms": round(lag["sum"] / lag["count"] * 1000, 3) if lag["count"] else math.nan,
                     "p50_le_ms": L.histogram_quantile(lag, 0.5) * 1000,
                     "p99_le_ms": L.histogram_quantile(lag, 0.99) * 1000,
                     "max_le_ms": L.histogram_max_bucket(lag) * 1000,
                     "buckets": {str(k): v for k, v in lag["buckets"].items()}},
        "media_req_per_s": round(len(in_window) / (t1 - t0), 2),
        "load_statuses": run.statuses() if run else {},
        "load_latency_ms": L.summarize_ms([r.latency for r in run.ok()]) if run else {},
        "mmgate_cpu_pct": round(100 * (cpu1 - cpu0) / (t1 - t0), 1),
        "mmgate_cpu_ms_per_media_req": round(1000 * (cpu1 - cpu0) / len(in_window), 1) if in_window else None,
        "mmgate_minor_faults_per_media_req": round((faults1 - faults0) / len(in_window)) if in_window else None,
        "mmgate_vmhwm_mib": round(status.get("VmHWM", 0) / 2**20, 1),
        "loadavg_during": [load_before, L.loadavg()],
        "quiet_wait": quiet, "cpu_during_window": machine,
        "mmgate_log_problems": [line for line in log_tail.splitlines()
                                if any(w in line for w in ("ERROR", "WARNING", "Traceback", "Error"))][-20:],
        "_latencies": probe["latencies"], "_control": ctl["latencies"],
    }


def fmt(x: float, nd: int = 2) -> str:
    if isinstance(x, float) and (math.isnan(x) or math.isinf(x)):
        return "inf" if x == math.inf else "-"
    return f"{x:.{nd}f}"


def _mean(values: Iterable[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return round(statistics.fmean(vals), 1) if vals else None


def aggregate(runs: list[dict]) -> dict:
    """One scenario over its rounds: probes pooled (p50/p99/max over all of them), per-round p99 kept."""
    first = runs[0]
    lag_p99 = [r["loop_lag"]["p99_le_ms"] for r in runs]
    lag_max = [r["loop_lag"]["max_le_ms"] for r in runs]
    return {
        "name": first["name"], "label": first["label"], "loaded": first["loaded"], "flags": first["flags"],
        "env": first["env"], "variant": first["variant"],
        "worker_niceness_requested": first["worker_niceness_requested"],
        "thread_niceness": first["thread_niceness"], "pinned": first["pinned"],
        "health": L.summarize_ms([x for r in runs for x in r["_latencies"]]),
        "health_p99_per_round": [r["health"]["p99"] for r in runs],
        "control": L.summarize_ms([x for r in runs for x in r["_control"]]),
        "control_p99_per_round": [r["control"]["p99"] for r in runs],
        "loop_lag_p99_le_ms_per_round": lag_p99, "loop_lag_max_le_ms": max(lag_max),
        "media_req_per_s": round(statistics.fmean(r["media_req_per_s"] for r in runs), 2),
        "mmgate_cpu_pct": round(statistics.fmean(r["mmgate_cpu_pct"] for r in runs), 1),
        "mmgate_cpu_ms_per_media_req": _mean(r["mmgate_cpu_ms_per_media_req"] for r in runs),
        "mmgate_minor_faults_per_media_req": _mean(r["mmgate_minor_faults_per_media_req"] for r in runs),
        "other_jobs_cpu_pct_per_round": [r["cpu_during_window"]["other_jobs_cpu_pct"] for r in runs],
        "rounds": [{k: v for k, v in r.items() if not k.startswith("_")} for r in runs],
    }


def table(rows: list[dict]) -> str:
    lines = [
        "| scenario | health p50 ms | p99 ms | max ms | p99 per round | control p99 ms (per round) "
        "| loop lag p99 per round / max (bucket <=, ms) | media req/s | mmgate CPU % | mmgate CPU ms / req "
        "| mmgate minor faults / req | other jobs CPU % per round | mmgate thread niceness |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        h, c = r["health"], r["control"]
        values = sorted({n for v in r["thread_niceness"].values() for n in v})
        lines.append(
            f"| {r['label']} | {fmt(h['p50'])} | **{fmt(h['p99'])}** | {fmt(h['max'])} "
            f"| {' / '.join(fmt(x, 1) for x in r['health_p99_per_round'])} "
            f"| {fmt(c['p99'])} ({' / '.join(fmt(x, 1) for x in r['control_p99_per_round'])}) "
            f"| {' / '.join(fmt(x, 1) for x in r['loop_lag_p99_le_ms_per_round'])} / {fmt(r['loop_lag_max_le_ms'], 1)} "
            f"| {fmt(r['media_req_per_s'])} | {fmt(r['mmgate_cpu_pct'], 0)} "
            f"| {fmt(r['mmgate_cpu_ms_per_media_req'] or math.nan, 0)} "
            f"| {fmt(float(r['mmgate_minor_faults_per_media_req'] or math.nan), 0)} "
            f"| {' / '.join(fmt(x, 0) for x in r['other_jobs_cpu_pct_per_round'])} | {','.join(map(str, values))} |")
    return "\n".join(lines)


WHAT = "/mmgate/health p99 while 16 clients send 12 MP photos: decode pool vs decode on the loop"


def measure(args: R.Knobs) -> dict[str, Any]:
    started = time.monotonic()
    stamp = R.stamp("loop_latency.py", WHAT)
    up_start = L.uptime()
    print(f"start: {up_start}", flush=True)
    image = photo_jpeg()
    body = chat_body(image)
    chosen = [s for s in CASES if (s.name in args.only.split(",") if args.only else (args.pinned or not s.pinned))]
    runs: dict[str, list[dict]] = {sc.name: [] for sc in chosen}
    control, control_url = L.start_control()
    try:
        for rnd in range(args.rounds):
            for sc in chosen:
                row = asyncio.run(run_case(sc, body, args, control, control_url))
                runs[sc.name].append(row)
                h, c, m = row["health"], row["control"], row["cpu_during_window"]
                print(f"r{rnd} {sc.name:18s} p50 {h['p50']:7.2f} p99 {h['p99']:7.2f} max {h['max']:8.2f} ms "
                      f"n {h['n']} (control p99 {c['p99']:.2f} max {c['max']:.2f})  "
                      f"lag p99<= {row['loop_lag']['p99_le_ms']} ms  {row['media_req_per_s']} req/s  "
                      f"mmgate CPU {row['mmgate_cpu_pct']}% ({row['mmgate_cpu_ms_per_media_req']} ms, "
                      f"{row['mmgate_minor_faults_per_media_req']} faults /req)  "
                      f"others CPU {m['other_jobs_cpu_pct']}%  "
                      f"quiet {row['quiet_wait']}  load {row['load_statuses']}  nice {row['thread_niceness']}"
                      + (f"  LOG {row['mmgate_log_problems']}" if row["mmgate_log_problems"] else ""),
                      flush=True)
    finally:
        L.stop(control)
    up_end = L.uptime()
    print(f"end: {up_end}", flush=True)
    rows = [aggregate(runs[sc.name]) for sc in chosen]

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
    print(table(rows))
    return stamp | {"meta": meta, "rows": rows}


def goals(data: dict[str, Any]) -> list[R.Goal]:
    rows = data["rows"]
    """Per-round health p99 of the loaded scenarios: the pool's, over the control's, against the goal; the rest
    reported beside it.

    The median of the rounds' p99s, not the p99 of the pooled probes: one noisy round cannot carry it.
    """
    by = {r["name"]: r for r in rows}
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
        table(rows),
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
