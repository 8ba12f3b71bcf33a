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
"""

from __future__ import annotations

import json
import sys
from typing import Any

from bench import _results as R
from testkit import allocators as A
from testkit.allocator_burst import burst_then_idle, paired
from testkit.load import RESULTS, start_stub, stop
from testkit.media import chat_body, photo_jpeg

WHAT = "RSS after bursts of 12 MP images under glibc/Pillow allocator settings"
# Every variant but shipped under UNTUNED: mmgate's own tuning would override theirs.
VARIANTS = {"default": A.UNTUNED} | A.SETTINGS | {"shipped": {"MMGATE_MALLOC_TUNING": "on"}}
TUNED = "mmap1m+blocks0"  # what MMGATE_MALLOC_TUNING applies, set by hand
SHIPPED = "shipped"  # the same, applied by mmgate itself
COLUMNS = ("workers", "variant", "env", "start MiB", "peak MiB", "after burst MiB", "idle MiB", "req/s", "CPU ms/req",
           "peak ×", "idle ×", "req/s ×", "CPU/req ×", "statuses")
TEXT_COLUMNS = ("variant", "env", "statuses")


def measure(args: R.Knobs) -> dict[str, Any]:
    stamp = R.stamp("malloc_arenas.py", WHAT)
    body = chat_body(photo_jpeg())
    stub, stub_url = start_stub("--workers", "2")
    runs = []
    try:
        for workers in (int(w) for w in args.workers.split(",")):
            for name in args.variants.split(","):
                if lib := A.missing(VARIANTS[name]):
                    print(f"skip {name}: {lib} missing")
                    continue
                r = burst_then_idle(stub_url, name, VARIANTS[name], workers, body, args)
                r["samples"] = R.downsample(r["samples"], column=1, points=60)
                print(f"workers={workers} {name:16s} peak {r['peak_rss_mib']:7.1f} "
                      f"after {r['rss_after_burst_mib']:7.1f} idle {r['idle_rss_mib']:7.1f} MiB  "
                      f"{r['req_per_s']:6.2f} req/s  {r['statuses']}", flush=True)
                runs.append(r | {"command": " ".join(sys.argv[1:])})
    finally:
        stop(stub)
    previous = RESULTS / f"{args.name}.json"
    if args.append and previous.exists():
        runs = json.loads(previous.read_text())["runs"] + runs
    return stamp | {"args": {k: v for k, v in vars(args).items() if k != "quick"}, "runs": runs}


def goals(data: dict[str, Any]) -> list[R.Goal]:
    """Idle (and peak) RSS of each tuned run ÷ the default run it was paired with (same command, workers)."""
    runs, out = data["runs"], []
    for tuned in (TUNED, SHIPPED):
        if not any(r["variant"] == tuned for r in runs):
            continue
        pairs = paired(runs, tuned)
        out += [R.goal(f"idle RSS, {tuned} ÷ default", [t["idle_rss_mib"] / d["idle_rss_mib"] for d, t in pairs],
                       "< 1", lambda v: v < 1, unit="×", over="paired runs", met_on="every"),
                R.goal(f"peak RSS, {tuned} ÷ default", [t["peak_rss_mib"] / d["peak_rss_mib"] for d, t in pairs],
                       unit="×", over="paired runs")]
    return out


def report(data: dict[str, Any]) -> str:
    runs, args = data["runs"], data["args"]
    lines = [
        "Commands above each table. Each row: a fresh mmgate process "
        f"(`--resize-max-pixels 1000000 --max-mm-concurrency 8`), {args['requests']} × 12 MP JPEG (4000x3000) OpenAI "
        f"chat requests from {args['clients']} clients (non-streaming), then {args['idle']:g} s idle. Peak = VmHWM; "
        "idle = VmRSS after the idle wait. Every row but `shipped` runs with `MMGATE_MALLOC_TUNING=off` under its own "
        "variables (mmgate would otherwise tune the allocators itself over them). Ratios are to `default` with the "
        "same decode-worker count. 2 cores, shared with other benchmarks (load averages at the end): req/s is noisy, "
        "RSS is not.",
        "",
    ]
    for command in dict.fromkeys(r.get("command", "") for r in runs):
        group = [r for r in runs if r.get("command", "") == command]
        base = {r["decode_workers"]: r for r in group if r["variant"] == "default"}
        rows = []
        for r in group:
            b = base.get(r["decode_workers"])

            def ratio(k: str, r: dict = r, b: dict | None = b) -> str:  # this row's r and b, bound now
                return f"{r[k] / b[k]:.2f}" if b and r.get(k) and b.get(k) else "-"

            rows.append(dict(zip(COLUMNS, [
                r["decode_workers"], r["variant"], A.env_text(r["env"]), r["rss_start_mib"], r["peak_rss_mib"],
                r["rss_after_burst_mib"], r["idle_rss_mib"], r["req_per_s"], r.get("cpu_ms_per_request", "-"),
                *map(ratio, ("peak_rss_mib", "idle_rss_mib", "req_per_s", "cpu_ms_per_request")),
                ", ".join(f"{k}: {v}" for k, v in r["statuses"].items())], strict=True)))
        lines += ["", f"## `python -m bench run malloc_arenas {command}`", "",
                  *R.table([(c, c, "s" if c in TEXT_COLUMNS else "") for c in COLUMNS], rows, spaced=True)]
    lines += ["", "## Load", "", *(f"- {r['variant']} / {r['decode_workers']} workers: `{r['uptime_before']}`"
                                   for r in runs), ""]
    return "\n".join(lines)
