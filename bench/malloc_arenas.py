"""Allocator fragmentation from the decode threads: mmgate's RSS after a burst of big images, and once idle.

Every decode thread that mallocs gets its own glibc arena (up to 8 × cores), and Pillow's 16 MiB image
blocks sit right at glibc's *dynamic* mmap threshold: after the first mmapped block is freed, the
threshold rises and later blocks come from the arenas, where freed memory often stays mapped. On top, with
``MMGATE_MALLOC_TUNING=off`` mmgate keeps up to 16 freed Pillow blocks for reuse (``PILLOW_BLOCKS_KEPT`` in
proxy/runtime/memory.py, 256 MiB at most; ``PILLOW_BLOCKS_MAX`` overrides it).

mmgate sets its allocators itself when it starts serving (``proxy.runtime.memory.tune_process``): with
``MMGATE_MALLOC_TUNING`` on (its default) it would apply the tuned settings over every variant below, so
every run but ``shipped`` starts mmgate with ``MMGATE_MALLOC_TUNING=off`` and the variant's own environment:
the baseline is glibc's defaults with mmgate's 16 kept blocks, and each variant changes only what it names.

For each allocator setting × decode-worker count, one fresh mmgate process (``--resize-max-pixels
1000000 --max-mm-concurrency 8``) gets ``--requests`` (200) OpenAI chat requests, each one 12 MP photo
JPEG (4000x3000, ~2.6 MB; draft-decoded, resized to 1 MP, re-encoded), from 8 clients, non-streaming.
Measured: VmHWM (peak RSS), VmRSS right after the burst and after ``--idle`` seconds, throughput, and the
mmgate process's CPU time per request (utime+stime: steadier than req/s on a shared machine).
``--append`` keeps earlier runs (e.g. a repeated A/B of two settings) and adds a table for the new ones.
Settings (environment of the mmgate process only):

* default: glibc defaults, mmgate's 16 kept Pillow blocks (``MMGATE_MALLOC_TUNING=off`` alone)
* arena2: MALLOC_ARENA_MAX=2
* mmap1m: MALLOC_MMAP_THRESHOLD_=1 MiB and MALLOC_TRIM_THRESHOLD_=1 MiB (fixed threshold: big buffers are
  always mmapped, so freeing them returns them to the OS)
* blocks0: PILLOW_BLOCKS_MAX=0 (Pillow keeps no freed blocks)
* mmap1m+blocks0, arena2+blocks0
* jemalloc: LD_PRELOAD=libjemalloc.so.2 (Debian libjemalloc2), if installed
* shipped: mmgate as it ships (``MMGATE_MALLOC_TUNING=on``: what ``mmap1m+blocks0`` sets by hand, applied by
  mmgate at start-up)

The stub backend (2 workers) is one separate process shared by all runs. The machine may be shared
(2 cores): load averages are recorded; throughput ratios are noisier than the memory figures.

Goal: the settings MMGATE_MALLOC_TUNING applies (``mmap1m+blocks0``, and ``shipped``, mmgate applying them
itself) leave a lower idle RSS than glibc's defaults, run for run (each against the default run of the same
command and worker count).

    python -m bench run malloc_arenas [--set KNOB=VALUE] [--rounds N] [--quick]
    python -m bench list malloc_arenas   # the knobs and their defaults
    python -m bench list malloc_arenas   # the knobs and their defaults
"""

from __future__ import annotations

import asyncio
import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

from bench import _results as R
from testkit.load import RESULTS, start_mmgate, start_stub, stop, uptime
from testkit.media import chat_body, photo_jpeg
from testkit.procfs import CLK_TCK, cpu_ticks

MIB = 1 << 20
JEMALLOC = "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"
_MMAP = {"MALLOC_MMAP_THRESHOLD_": str(MIB), "MALLOC_TRIM_THRESHOLD_": str(MIB)}
VARIANTS: dict[str, dict[str, str]] = {
    "default": {},
    "arena2": {"MALLOC_ARENA_MAX": "2"},
    "mmap1m": dict(_MMAP),
    "blocks0": {"PILLOW_BLOCKS_MAX": "0"},
    "mmap1m+blocks0": {**_MMAP, "PILLOW_BLOCKS_MAX": "0"},
    "arena2+blocks0": {"MALLOC_ARENA_MAX": "2", "PILLOW_BLOCKS_MAX": "0"},
    "jemalloc": {"LD_PRELOAD": JEMALLOC},
    "shipped": {"MMGATE_MALLOC_TUNING": "on"},
}
UNTUNED = {"MMGATE_MALLOC_TUNING": "off"}  # under every variant: mmgate's own tuning would override theirs


def cpu_seconds(pid: int) -> float:
    """utime + stime of the whole process (all threads), from /proc/PID/stat: robust to a shared machine."""
    return cpu_ticks([pid]) / CLK_TCK


def status(pid: int) -> dict[str, int]:
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmHWM", "VmRSS", "RssAnon"):
                out[key] = int(rest.split()[0]) * 1024
    return out


async def burst(url: str, body: bytes, n: int, clients: int) -> tuple[dict[str, int], float]:
    import aiohttp

    counts: dict[str, int] = {}
    todo = iter(range(n))

    async def client(s: aiohttp.ClientSession) -> None:
        for _ in todo:
            try:
                async with s.post(url + "/v1/chat/completions", data=body,
                                  headers={"Content-Type": "application/json"}) as r:
                    await r.read()
                    key = str(r.status)
            except aiohttp.ClientError as exc:
                key = type(exc).__name__
            counts[key] = counts.get(key, 0) + 1

    t0 = time.monotonic()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as s:
        await asyncio.gather(*(client(s) for _ in range(clients)))
    return counts, time.monotonic() - t0


def one(name: str, env: dict[str, str], workers: int, stub_url: str, body: bytes, n: int, clients: int,
        idle: float) -> dict[str, Any]:
    load = uptime()
    proc, url = start_mmgate(stub_url, "--resize-max-pixels", "1000000", "--decode-workers", str(workers),
                             "--max-mm-concurrency", "8", env=UNTUNED | env)
    samples: list[tuple[float, int]] = []
    done = threading.Event()

    def sample() -> None:
        t0 = time.monotonic()
        while not done.is_set():
            samples.append((time.monotonic() - t0, status(proc.pid)["VmRSS"]))
            done.wait(0.1)

    try:
        time.sleep(0.5)
        start = status(proc.pid)
        cpu0 = cpu_seconds(proc.pid)
        th = threading.Thread(target=sample, daemon=True)
        th.start()
        counts, elapsed = asyncio.run(burst(url, body, n, clients))
        cpu = cpu_seconds(proc.pid) - cpu0
        after = status(proc.pid)
        time.sleep(idle)
        idle_st = status(proc.pid)
        done.set()
        th.join()
    finally:
        done.set()
        stop(proc)
    return {
        "variant": name, "env": UNTUNED | env, "decode_workers": workers, "requests": n, "clients": clients,
        "statuses": counts, "elapsed_s": round(elapsed, 2), "req_per_s": round(n / elapsed, 2),
        "cpu_ms_per_request": round(1000 * cpu / n, 1),
        "rss_start_mib": round(start["VmRSS"] / MIB, 1),
        "peak_rss_mib": round(idle_st["VmHWM"] / MIB, 1),
        "rss_after_burst_mib": round(after["VmRSS"] / MIB, 1),
        "idle_rss_mib": round(idle_st["VmRSS"] / MIB, 1),
        "idle_rss_anon_mib": round(idle_st.get("RssAnon", 0) / MIB, 1),
        "uptime_before": load, "uptime_after": uptime(),
        "samples": R.downsample([(round(t, 2), round(r / MIB, 1)) for t, r in samples], column=1, points=60),
    }


def markdown(runs: list[dict[str, Any]], args: R.Knobs) -> str:
    lines = [
        "Commands above each table. Each row: a fresh mmgate process "
        f"(`--resize-max-pixels 1000000 --max-mm-concurrency 8`), {args.requests} × 12 MP JPEG (4000x3000) OpenAI "
        f"chat requests from {args.clients} clients (non-streaming), then {args.idle:g} s idle. Peak = VmHWM; "
        "idle = VmRSS after the idle wait. Every row but `shipped` runs with `MMGATE_MALLOC_TUNING=off` under its own "
        "variables (mmgate would otherwise tune the allocators itself over them). Ratios are to `default` with the "
        "same decode-worker count. 2 cores, "
        "shared with other benchmarks (load averages at the end): req/s is noisy, RSS is not.",
        "",
    ]
    for command in dict.fromkeys(r.get("command", "") for r in runs):
        group = [r for r in runs if r.get("command", "") == command]
        lines += ["", f"## `python -m bench run malloc_arenas {command}`", "",
                  "| workers | variant | env | start MiB | peak MiB | after burst MiB | idle MiB | req/s "
                  "| CPU ms/req | "
                  "peak × | idle × | req/s × | CPU/req × | statuses |",
                  "| ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
        base = {r["decode_workers"]: r for r in group if r["variant"] == "default"}
        for r in group:
            b = base.get(r["decode_workers"])

            def ratio(k: str, r: dict = r, b: dict | None = b) -> str:  # this row's r and b, bound now
                return f"{r[k] / b[k]:.2f}" if b and r.get(k) and b.get(k) else "-"

            env = " ".join(f"`{k}={v}`" for k, v in r["env"].items()).replace(JEMALLOC, "libjemalloc.so.2") or "-"
            lines.append(f"| {r['decode_workers']} | {r['variant']} | {env} | {r['rss_start_mib']} | "
                         f"{r['peak_rss_mib']} | {r['rss_after_burst_mib']} | {r['idle_rss_mib']} | {r['req_per_s']} | "
                         f"{r.get('cpu_ms_per_request', '-')} | {ratio('peak_rss_mib')} | {ratio('idle_rss_mib')} | "
                         f"{ratio('req_per_s')} | {ratio('cpu_ms_per_request')} | "
                         + ", ".join(f"{k}: {v}" for k, v in r["statuses"].items()) + " |")
    lines += ["", "## Load", ""]
    lines += [f"- {r['variant']} / {r['decode_workers']} workers: `{r['uptime_before']}`" for r in runs]
    lines.append("")
    return "\n".join(lines)


def measure(args: R.Knobs) -> dict[str, Any]:
    stamp = R.stamp("malloc_arenas.py", WHAT)
    body = chat_body(photo_jpeg())
    stub, stub_url = start_stub("--workers", "2")
    runs = []
    try:
        for workers in (int(w) for w in args.workers.split(",")):
            for name in args.variants.split(","):
                env = VARIANTS[name]
                if "LD_PRELOAD" in env and not Path(env["LD_PRELOAD"]).exists():
                    print(f"skip {name}: {env['LD_PRELOAD']} missing")
                    continue
                r = one(name, env, workers, stub_url, body, args.requests, args.clients, args.idle)
                print(f"workers={workers} {name:16s} peak {r['peak_rss_mib']:7.1f} "
                      f"after {r['rss_after_burst_mib']:7.1f} "
                      f"idle {r['idle_rss_mib']:7.1f} MiB  {r['req_per_s']:6.2f} req/s  {r['statuses']}", flush=True)
                r["command"] = " ".join(sys.argv[1:])
                runs.append(r)
    finally:
        stop(stub)
    previous = RESULTS / f"{args.name}.json"
    if args.append and previous.exists():
        runs = json.loads(previous.read_text())["runs"] + runs
    return stamp | {"args": {k: v for k, v in vars(args).items() if k != "quick"}, "runs": runs}


def report(data: dict[str, Any]) -> str:
    return markdown(data["runs"], R.Knobs(**data["args"] | {"date": data.get("date")}))


WHAT = "RSS after bursts of 12 MP images under glibc/Pillow allocator settings"
TUNED = "mmap1m+blocks0"  # what MMGATE_MALLOC_TUNING applies, set by hand
SHIPPED = "shipped"  # the same, applied by mmgate itself


def goals(data: dict[str, Any]) -> list[R.Goal]:
    """Idle (and peak) RSS of each tuned run ÷ the default run it was paired with (same command, workers)."""
    runs = data["runs"]
    out = []
    for tuned in (TUNED, SHIPPED):
        if any(r["variant"] == tuned for r in runs):
            out += _goals_of(runs, tuned)
    return out


def _goals_of(runs: list[dict[str, Any]], tuned: str) -> list[R.Goal]:
    pairs: list[tuple[dict, dict]] = []
    for command in dict.fromkeys(r.get("command", "") for r in runs):
        for workers in dict.fromkeys(r["decode_workers"] for r in runs):
            group = [r for r in runs if r.get("command", "") == command and r["decode_workers"] == workers]
            # strict=False: a run cut short leaves a default without its tuned partner; pair what there is
            pairs += zip([r for r in group if r["variant"] == "default"], [r for r in group if r["variant"] == tuned],
                         strict=False)
    return [
        R.goal(f"idle RSS, {tuned} ÷ default", [t["idle_rss_mib"] / d["idle_rss_mib"] for d, t in pairs], "< 1",
               lambda v: v < 1, unit="×", over="paired runs", met_on="every"),
        R.goal(f"peak RSS, {tuned} ÷ default", [t["peak_rss_mib"] / d["peak_rss_mib"] for d, t in pairs], unit="×",
               over="paired runs"),
    ]
