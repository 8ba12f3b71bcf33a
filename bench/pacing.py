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

import asyncio
import datetime
import json
import platform
import subprocess
import time
from typing import Any

from bench import _results as R
from proxy.settings import setting_default
from testkit import load as L
from testkit.media import PHOTO_QUALITY, PHOTO_SIZE, chat_body, photo_jpeg
from testkit.procfs import tree_cpu_seconds, tree_minor_faults
from testkit.text_load import ROLE

WHAT = "small text request and /mmgate/health latency while 16 clients resend one 12 MP photo (cache hits)"
TEXT_BODY = json.dumps({"model": "stub-vlm", "max_tokens": 16,
                        "messages": [{"role": "user", "content": "Say hello in one short sentence."}]}).encode()
CACHE_ON = ("--cache-mb", str(setting_default('cache_mb')))  # the default, which L turns off
GOAL_TEXT_MS = 15.0
GOAL_HEALTH_MS = 5.0
GOAL_THROUGHPUT = 0.6
CASES = ("idle", "mmgate", "mmgate_unpaced", "mmgate_uvloop", "minimal")
LABELS = {"idle": "mmgate idle", "mmgate": "mmgate (default settings)",
          "mmgate_unpaced": "mmgate, pacing off (MMGATE_LOOP_LAG_TARGET=0)",
          "mmgate_uvloop": "mmgate on uvloop (MMGATE_LOOP=uvloop)", "minimal": "minimal aiohttp proxy"}
SCENARIO_ENV = {"mmgate_unpaced": {"MMGATE_LOOP_LAG_TARGET": "0"}, "mmgate_uvloop": {"MMGATE_LOOP": "uvloop"}}


def start_role(role: str, *args: str) -> tuple[subprocess.Popen[bytes], str]:
    """A role of testkit/text_load.py in its own process (the upstream, the minimal proxy)."""
    port = L.free_port()
    proc = subprocess.Popen([*ROLE, role, "--port", str(port), *args],
                            cwd=L.REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # the upstream answers any path; the minimal proxy forwards to it
        try:
            import urllib.request

            with urllib.request.urlopen(urllib.request.Request(url + "/v1/ping", data=b"{}"), timeout=1):
                return proc, url
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"{role} did not answer within 30 s")


async def run_case(name: str, body: bytes, upstream: str, control_url: str, args: R.Knobs) -> dict:
    quiet = await asyncio.to_thread(L.wait_quiet, args.quiet_wait)
    if name == "minimal":
        proc, url = start_role("minimal-proxy", "--upstream", upstream)
    else:
        proc, url = L.start_mmgate(upstream, *CACHE_ON, env=SCENARIO_ENV.get(name, {}))
    try:
        warm = await L.run_load(url, body, 2, requests_per_client=2)  # the first fills the cache
        if warm.statuses() != {"200": 4}:
            raise RuntimeError(f"{name}: warm-up answered {warm.statuses()}")
        stop_load = asyncio.Event()
        load_task = None
        if name != "idle":
            load_task = asyncio.create_task(L.run_load(url, body, args.clients, stop_event=stop_load))
            await asyncio.sleep(args.ramp)
        cpu0, t0 = tree_cpu_seconds(proc.pid), time.perf_counter()  # with its decode worker processes
        faults0 = tree_minor_faults(proc.pid)
        probers = {"text": L.start_prober(url, args.seconds, args.interval, "/v1/chat/completions", TEXT_BODY),
                   "control": L.start_prober(control_url, args.seconds, args.interval, "/health")}
        if name != "minimal":
            probers["health"] = L.start_prober(url, args.seconds, args.interval)
        probes = {k: await asyncio.to_thread(L.prober_result, *v) for k, v in probers.items()}
        t1, cpu1, faults1 = time.perf_counter(), tree_cpu_seconds(proc.pid), tree_minor_faults(proc.pid)
        stop_load.set()
        run = await load_task if load_task else None
    finally:
        log = L.stop(proc)
    media = [r for r in run.ok() if t0 <= r.ended <= t1] if run else []
    hashed = {"hash_cpu_ms": hash_cpu_ms(body)} if name == "idle" else {}
    row: dict[str, Any] = {
        "name": name, "quiet_wait": quiet, "window_s": round(t1 - t0, 2),
        "probes": {k: L.summarize_ms(v["latencies"]) | {"statuses": v["statuses"]} for k, v in probes.items()},
        "media_req_per_s": round(len(media) / (t1 - t0), 2) if run else None,
        "load_statuses": run.statuses() if run else {},
        "cpu_ms_per_media_req": round(1000 * (cpu1 - cpu0) / len(media), 2) if media else None,
        "cpu_pct": round(100 * (cpu1 - cpu0) / (t1 - t0), 1),
        "minor_faults_per_media_req": round((faults1 - faults0) / len(media)) if media else None,
        "log_problems": [line for line in log.splitlines() if any(w in line for w in ("ERROR", "Traceback"))][-10:],
    } | hashed
    return row


def hash_cpu_ms(body: bytes, repeats: int = 5) -> float:
    """CPU (this thread) to SHA-256 the body's base64 payload as the cache keys it, median of ``repeats``."""
    from proxy.media.cache import media_digest

    start = body.index(b"base64,") + len(b"base64,")
    payload = body[start:body.index(b'"', start)]
    spent = []
    for _ in range(repeats):
        c0 = time.thread_time()
        media_digest(payload, "base64")
        spent.append((time.thread_time() - c0) * 1000)
    return round(sorted(spent)[repeats // 2], 3)


def figures(rounds: list[dict[str, dict]]) -> dict[str, list[float]]:
    """Per-round figures the goals and the table are built from."""
    out: dict[str, list[float]] = {}

    def add(key: str, value: float | None) -> None:
        if value is not None:
            out.setdefault(key, []).append(value)

    for rnd in rounds:
        idle_text = rnd["idle"]["probes"]["text"]["p99"]
        for name, row in rnd.items():
            for probe, summary in row["probes"].items():
                add(f"{name}/{probe}_p50_ms", summary["p50"])
                add(f"{name}/{probe}_p99_ms", summary["p99"])
            add(f"{name}/media_req_per_s", row["media_req_per_s"])
            add(f"{name}/cpu_ms_per_media_req", row["cpu_ms_per_media_req"])
            add(f"{name}/cpu_pct", row["cpu_pct"])
            add(f"{name}/minor_faults_per_media_req", row.get("minor_faults_per_media_req"))
        for name in ("mmgate", "mmgate_unpaced", "mmgate_uvloop"):
            if name not in rnd:
                continue
            row = rnd[name]
            add(f"{name}/text_p99_over_idle_ms", row["probes"]["text"]["p99"] - idle_text)
            add(f"{name}/health_p99_over_control_ms", row["probes"]["health"]["p99"] - row["probes"]["control"]["p99"])
            if "minimal" in rnd and rnd["minimal"]["media_req_per_s"]:
                add(f"{name}/throughput_over_minimal", row["media_req_per_s"] / rnd["minimal"]["media_req_per_s"])
                if row["cpu_ms_per_media_req"] and rnd["minimal"]["cpu_ms_per_media_req"]:
                    add(f"{name}/cpu_per_req_over_minimal",
                        row["cpu_ms_per_media_req"] / rnd["minimal"]["cpu_ms_per_media_req"])
        if "hash_cpu_ms" in rnd.get("idle", {}):
            add("sha256_cpu_ms_per_payload", rnd["idle"]["hash_cpu_ms"])
        if "minimal" in rnd:
            add("minimal/text_p99_over_idle_ms", rnd["minimal"]["probes"]["text"]["p99"] - idle_text)
    return out


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
        R.goal("CPU per media request, mmgate ÷ minimal aiohttp proxy", f.get("mmgate/cpu_per_req_over_minimal", [])),
        R.goal("SHA-256 of the photo's base64 (the cache key of a hit), CPU ms, in this process",
               f.get("sha256_cpu_ms_per_payload", []), unit="ms"),
        R.goal("minor page faults per media request, mmgate", f.get("mmgate/minor_faults_per_media_req", [])),
        R.goal("minor page faults per media request, minimal proxy", f.get("minimal/minor_faults_per_media_req", [])),
        R.goal("pacing off: loaded text p99 over idle text p99", f.get("mmgate_unpaced/text_p99_over_idle_ms", []),
               unit="ms"),
        R.goal("pacing off: health p99 over the control's", f.get("mmgate_unpaced/health_p99_over_control_ms", []),
               unit="ms"),
        R.goal("pacing off: media req/s ÷ minimal's", f.get("mmgate_unpaced/throughput_over_minimal", [])),
        R.goal("uvloop: loaded text p99 over idle text p99", f.get("mmgate_uvloop/text_p99_over_idle_ms", []),
               unit="ms"),
        R.goal("uvloop: health p99 over the control's", f.get("mmgate_uvloop/health_p99_over_control_ms", []),
               unit="ms"),
        R.goal("uvloop: media req/s ÷ minimal's", f.get("mmgate_uvloop/throughput_over_minimal", [])),
        R.goal("minimal proxy: loaded text p99 over mmgate's idle text p99",
               f.get("minimal/text_p99_over_idle_ms", []), unit="ms"),
    ]


def table(f: dict[str, list[float]], names: list[str]) -> str:
    def cell(key: str) -> str:
        return R.spread_cell(f.get(key, []))

    lines = ["| scenario | text p50 ms | text p99 ms | health p99 ms | control p99 ms | media req/s "
             "| CPU ms / media req | minor faults / media req | CPU % |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name in names:
        lines.append(f"| {LABELS[name]} | {cell(name + '/text_p50_ms')} | {cell(name + '/text_p99_ms')} "
                     f"| {cell(name + '/health_p99_ms')} | {cell(name + '/control_p99_ms')} "
                     f"| {cell(name + '/media_req_per_s')} | {cell(name + '/cpu_ms_per_media_req')} "
                     f"| {cell(name + '/minor_faults_per_media_req')} | {cell(name + '/cpu_pct')} |")
    return "\n".join(lines)


def report(data: dict[str, Any]) -> str:
    meta, f, names = data["meta"], data["figures"], list(data["rounds"][0])
    return "\n".join([
        f"{meta['rounds']} rounds of {meta['seconds']:g} s per scenario, {meta['wall_s']} s in all; {meta['clients']} "
        f"clients resending one {meta['photo']} ({meta['body_mb']:.2f} MB body); probes every "
        f"{meta['interval'] * 1000:g} ms. Load average at the start: `{meta['uptime_start']}`; at the end: "
        f"`{meta['uptime_end']}`. Each cell: the median over rounds (min–max).",
        "",
        table(f, names),
        "",
    ])


def measure(args: R.Knobs) -> dict[str, Any]:
    names = [n for n in CASES if n == "idle" or not args.only or n in args.only.split(",")]
    started = time.monotonic()
    stamp = R.stamp("pacing.py", WHAT)
    up_start = L.uptime()
    photo = photo_jpeg()
    body = chat_body(photo)
    upstream, upstream_url = start_role("upstream")
    control, control_url = L.start_control()
    rounds: list[dict[str, dict]] = []
    try:
        for rnd in range(args.rounds):
            result = {}
            for name in names:
                row = asyncio.run(run_case(name, body, upstream_url, control_url, args))
                result[name] = row
                p = row["probes"]
                print(f"r{rnd} {name:15s} text p50 {p['text']['p50']:6.2f} p99 {p['text']['p99']:6.2f}"
                      + (f" health p99 {p['health']['p99']:6.2f}" if "health" in p else " " * 18)
                      + f" control p99 {p['control']['p99']:6.2f}  media {row['media_req_per_s']} req/s "
                      f"cpu {row['cpu_ms_per_media_req']} ms/req {row['cpu_pct']}%  {row['load_statuses']}"
                      + (f"  LOG {row['log_problems']}" if row["log_problems"] else ""), flush=True)
            rounds.append(result)
    finally:
        L.stop(control)
        L.stop(upstream)
    f = figures(rounds)
    meta = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "python": platform.python_version(), "usable_cpus": R.usable_cores(), "rounds": args.rounds,
            "seconds": args.seconds, "interval": args.interval, "clients": args.clients,
            "photo": f"{PHOTO_SIZE[0]}x{PHOTO_SIZE[1]} JPEG q{PHOTO_QUALITY} ({len(photo) / 1e6:.2f} MB)",
            "body_mb": len(body) / 1e6, "uptime_start": up_start, "uptime_end": L.uptime(),
            "wall_s": round(time.monotonic() - started, 1)}
    return stamp | {"meta": meta, "figures": f, "rounds": rounds}
