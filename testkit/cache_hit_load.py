"""A proxy probed while clients resend one cached photo (``bench/pacing.py``): one case is a fresh mmgate (the
processed-media cache on, pacing on or off, on asyncio's loop or uvloop) or the minimal aiohttp proxy of
``testkit.text_load``, a small text chat, /mmgate/health and a control server probed over one window of
``testkit.probed_load``, and the row of that round; ``figures`` turns the rounds into per-round figures, and
``hash_cpu_ms`` is the CPU of a hit's cache key.
"""

from __future__ import annotations

import asyncio
import json
import time
from types import SimpleNamespace

from proxy.settings import setting_default
from testkit import load as L
from testkit.probed_load import MediaLoad, Row, TreeUsage, log_problems, probe_all, warm_up
from testkit.text_load import start_role

TEXT_BODY = json.dumps({"model": "stub-vlm", "max_tokens": 16,
                        "messages": [{"role": "user", "content": "Say hello in one short sentence."}]}).encode()
CACHE_ON = ("--cache-mb", str(setting_default('cache_mb')))  # the default, which L turns off
CASE_ENV = {"mmgate_unpaced": {"MMGATE_LOOP_LAG_TARGET": "0"}, "mmgate_uvloop": {"MMGATE_LOOP": "uvloop"}}
LOADED_CASES = ("mmgate", "mmgate_unpaced", "mmgate_uvloop")  # the cases compared with idle and minimal


async def run_case(name: str, body: bytes, upstream: str, control_url: str, knobs: SimpleNamespace) -> Row:
    """One round of one case ("idle", "minimal" or an mmgate of ``LOADED_CASES``): a fresh proxy, the probe
    window, and its row. ``knobs``: seconds, interval, clients, ramp and quiet_wait (``bench/scenarios.py``)."""
    quiet = await asyncio.to_thread(L.wait_quiet, knobs.quiet_wait)
    if name == "minimal":
        proc, url = start_role("minimal-proxy", "--upstream", upstream)
    else:
        proc, url = L.start_mmgate(upstream, *CACHE_ON, env=CASE_ENV.get(name, {}))
    try:
        await warm_up(url, body, 2, 2, name)  # the first fills the cache
        load = MediaLoad(url, body, 0 if name == "idle" else knobs.clients)
        if name != "idle":
            await asyncio.sleep(knobs.ramp)
        usage = TreeUsage(proc.pid)  # with its decode worker processes
        probers = {"text": (url, "/v1/chat/completions", TEXT_BODY), "control": (control_url, "/health", None)}
        if name != "minimal":
            probers["health"] = (url, "/mmgate/health", None)
        probes = await probe_all(probers, knobs.seconds, knobs.interval)
        window = usage.close()
        run = await load.stop()
    finally:
        log = L.stop(proc)
    spent = window.per_media_request(run, cpu_ms_digits=2)
    hashed = {"hash_cpu_ms": hash_cpu_ms(body)} if name == "idle" else {}
    return {
        "name": name, "quiet_wait": quiet, "window_s": round(window.seconds, 2),
        "probes": {k: L.summarize_ms(v["latencies"]) | {"statuses": v["statuses"]} for k, v in probes.items()},
        "media_req_per_s": spent["media_req_per_s"] if run else None,
        "load_statuses": run.statuses() if run else {},
        **{key: spent[key] for key in ("cpu_ms_per_media_req", "cpu_pct", "minor_faults_per_media_req")},
        "log_problems": log_problems(log, ("ERROR", "Traceback"), 10),
    } | hashed


def progress(row: Row) -> str:
    """A round's row in one line, as it is measured."""
    p = row["probes"]
    return (f"text p50 {p['text']['p50']:6.2f} p99 {p['text']['p99']:6.2f}"
            + (f" health p99 {p['health']['p99']:6.2f}" if "health" in p else " " * 18)
            + f" control p99 {p['control']['p99']:6.2f}  media {row['media_req_per_s']} req/s "
            f"cpu {row['cpu_ms_per_media_req']} ms/req {row['cpu_pct']}%  {row['load_statuses']}"
            + (f"  LOG {row['log_problems']}" if row["log_problems"] else ""))


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


def figures(rounds: list[dict[str, Row]]) -> dict[str, list[float]]:
    """Per-round figures, ``case/figure``: each case's probes' p50 and p99 and its load figures; each loaded mmgate's
    text p99 over idle's, health p99 over the control's and, against the minimal proxy, media req/s and CPU per
    request as ratios; the hash's CPU; the minimal proxy's text p99 over mmgate's idle one."""
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
            for key in ("media_req_per_s", "cpu_ms_per_media_req", "cpu_pct", "minor_faults_per_media_req"):
                add(f"{name}/{key}", row.get(key))
        minimal = rnd.get("minimal")
        for name in (n for n in LOADED_CASES if n in rnd):
            row = rnd[name]
            add(f"{name}/text_p99_over_idle_ms", row["probes"]["text"]["p99"] - idle_text)
            add(f"{name}/health_p99_over_control_ms", row["probes"]["health"]["p99"] - row["probes"]["control"]["p99"])
            if minimal and minimal["media_req_per_s"]:
                add(f"{name}/throughput_over_minimal", row["media_req_per_s"] / minimal["media_req_per_s"])
                if row["cpu_ms_per_media_req"] and minimal["cpu_ms_per_media_req"]:
                    add(f"{name}/cpu_per_req_over_minimal",
                        row["cpu_ms_per_media_req"] / minimal["cpu_ms_per_media_req"])
        if "hash_cpu_ms" in rnd.get("idle", {}):
            add("sha256_cpu_ms_per_payload", rnd["idle"]["hash_cpu_ms"])
        if minimal:
            add("minimal/text_p99_over_idle_ms", minimal["probes"]["text"]["p99"] - idle_text)
    return out
