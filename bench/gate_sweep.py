#!/usr/bin/env python
"""Gate sweep: what the admission gate does to a VLM backend's memory and to throughput (issue 4).

The lmdeploy seed (#4687) limited how many requests' images the server processes at once and cut peak RSS
222.5 → 68.1 GiB (−69 %) with gate=1 at equal throughput. Here the same experiment runs with mmgate as a
sidecar in front of an unchanged backend:

  64 clients (this process, aiohttp, one keep-alive connection each) each send N streaming chat requests
  (default 3, so 192 in all) carrying one synthetic photo-like 12 MP JPEG (4000x3000, q85, ~2.6 MB)
  → mmgate (--release-at complete, queue 10000, queue timeout 600 s so clients wait instead of getting 429s)
  → the stub backend configured like a VLM server: --hold-pixels (decodes every image to an RGB array and
    holds it until its answer is sent), --cpu-ms-per-mp 20 (simulated vision-encoder CPU, 240 ms per 12 MP
    image), --workers 8 (vLLM's default media-loading thread count), 8 streamed tokens 10 ms apart.

Cells: gate off (--max-mm-concurrency 10000 --max-queue 10000) and gate = 1, 2, 4, 8. Fresh processes per
cell, so VmHWM (peak RSS, /proc/PID/status) is the cell's own, for mmgate and for the backend; the stub's
/stats peak_held_pixel_bytes is the peak of decoded pixels it held at once. Throughput = successful requests /
wall time from the first send to the last byte. 429s (none expected with this queue) are counted.

Why --release-at complete: the stub sends its response headers only after it has decoded the image (the
prepare() comes after the decode) but keeps the pixels until the last token; so `headers` (what `auto`
picks for streaming requests) would release the slot while the backend still holds the pixels, and `sent`
(auto for non-streaming) even before it has decoded them. Only `complete` bounds the backend's live pixels
by the gate. An extra cell, gate=2 with --release-at auto (= headers here), shows the difference, and a
`direct` cell (clients → stub, no mmgate) is the no-sidecar reference (--no-extra skips both).

Everything (clients, mmgate, stub) shares the machine's 2 cores, and the machine is shared with other jobs:
`uptime` is recorded at start and end; read ratios, not absolute numbers.

Usage: python bench/gate_sweep.py [--per-client 3] [--clients 64] [--gates off,1,2,4,8] [--no-extra]
Writes bench/results/gate_sweep.md and .json.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import math
import os
import platform
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _load as L  # noqa: E402

STUB_FLAGS = ("--hold-pixels", "--cpu-ms-per-mp", "20", "--workers", "8", "--tokens", "8", "--token-delay", "0.01")
OFF = 10000
MIB = 2**20
GIB = 2**30
ANCHOR = "lmdeploy #4687: gate=1 cut peak RSS 222.5 → 68.1 GiB (−69 %) at equal throughput"


def _timing(header: str | None, name: str) -> float | None:
    if not header:
        return None
    m = re.search(rf"\b{name};dur=([0-9.]+)", header)
    return float(m.group(1)) if m else None


async def run_cell(gate: str, release_at: str, body: bytes, args: argparse.Namespace) -> dict:
    direct = gate == "direct"  # reference: the clients talk to the backend itself, no mmgate
    limit = OFF if gate in ("off", "direct") else int(gate)
    queue = OFF
    flags = () if direct else ("--max-mm-concurrency", str(limit), "--max-queue", str(queue), "--queue-timeout", "600",
             "--preprocess-timeout", str(args.preprocess_timeout), "--release-at", release_at)
    stub = proxy = None
    quiet = await asyncio.to_thread(L.wait_quiet, args.quiet_wait)
    log_tail = ""
    try:
        stub, stub_url = L.start_stub(*STUB_FLAGS)
        proxy, url = (None, stub_url) if direct else L.start_mmgate(stub_url, *flags)
        warm = await L.run_load(url, body, 1, requests_per_client=1)
        if warm.statuses() != {"200": 1}:
            raise RuntimeError(f"gate {gate}: warm-up answered {warm.statuses()}")
        await L.get_json(stub_url, "/stub/reset", "POST")  # the peak of held pixels counts from here
        nothing = {"VmHWM": math.nan, "VmRSS": math.nan}
        base_proxy, base_stub = L.proc_status(proxy.pid) if proxy else nothing, L.proc_status(stub.pid)
        load0 = L.loadavg()
        watch = L.CpuWatch([p.pid for p in (proxy, stub) if p] + [os.getpid()])
        run = await L.run_load(url, body, args.clients, requests_per_client=args.per_client)
        machine = watch.stop()
        load1 = L.loadavg()
        hwm_proxy, hwm_stub = L.proc_status(proxy.pid) if proxy else nothing, L.proc_status(stub.pid)
        stats = await L.get_json(stub_url, "/stats")
        prom = await L.scrape(url) if proxy else {}
    finally:
        log_tail = L.stop(proxy)
        L.stop(stub)
    ok = run.ok()
    wall = run.ended - run.started
    lat = L.summarize_ms([r.latency for r in ok])
    queue_ms = [q for r in ok if (q := _timing(r.server_timing, "queue")) is not None]
    rejected = {dict(k[1])["reason"]: v for k, v in prom.items() if k[0] == "mmgate_rejected_total"}
    return {
        "gate": gate, "limit": None if direct else limit, "max_queue": None if direct else queue,
        "release_at": "-" if direct else release_at, "flags": list(flags),
        "requests": len(run.results), "ok": len(ok), "statuses": run.statuses(),
        "n429": sum(1 for r in run.results if r.status == 429), "rejected": rejected,
        "wall_s": round(wall, 2), "req_per_s": round(len(ok) / wall, 3) if wall else math.nan,
        "latency_ms": lat, "queue_ms": L.summarize_ms([q / 1000 for q in queue_ms]) if queue_ms else {},
        "proxy_hwm_mib": round(hwm_proxy["VmHWM"] / MIB, 1), "proxy_base_rss_mib": round(base_proxy["VmRSS"] / MIB, 1),
        "backend_hwm_mib": round(hwm_stub["VmHWM"] / MIB, 1), "backend_base_rss_mib": round(base_stub["VmRSS"] / MIB, 1),
        "backend_peak_held_mib": round(stats["peak_held_pixel_bytes"] / MIB, 1),
        "backend_images_decoded": stats["images_decoded"], "backend_requests": stats["requests"],
        "loadavg": [load0, load1], "quiet_wait": quiet, "cpu_during_run": machine,
        "mmgate_log_problems": [line for line in log_tail.splitlines()
                                if any(w in line for w in ("ERROR", "WARNING", "Traceback", "Error"))][-20:],
    }


def fmt(x: float, nd: int = 2) -> str:
    if isinstance(x, float) and math.isnan(x):
        return "-"
    return f"{x:.{nd}f}"


def ratio(a: float, b: float) -> str:
    return fmt(a / b) if b else "-"


def table(rows: list[dict]) -> str:
    ref = next((r for r in rows if r["gate"] == "off"), rows[0])
    lines = [
        "| gate | release | ok / sent | 429 | req/s (×off) | p50 s (×off) | p99 s (×off) | queue p50 s "
        "| backend peak RSS MiB (×off) | backend peak held pixels MiB (×off) | proxy peak RSS MiB (×off) "
        "| other jobs CPU % |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lat, rl = r["latency_ms"], ref["latency_ms"]
        q = r["queue_ms"].get("p50", math.nan) / 1000 if r["queue_ms"] else math.nan
        lines.append(
            f"| {'direct (no mmgate)' if r['gate'] == 'direct' else r['gate']} | {r['release_at']} | {r['ok']} / {r['requests']} | {r['n429']} "
            f"| {fmt(r['req_per_s'])} ({ratio(r['req_per_s'], ref['req_per_s'])}) "
            f"| {fmt(lat['p50'] / 1000)} ({ratio(lat['p50'], rl['p50'])}) "
            f"| {fmt(lat['p99'] / 1000)} ({ratio(lat['p99'], rl['p99'])}) | {fmt(q)} "
            f"| {fmt(r['backend_hwm_mib'], 0)} ({ratio(r['backend_hwm_mib'], ref['backend_hwm_mib'])}) "
            f"| {fmt(r['backend_peak_held_mib'], 0)} ({ratio(r['backend_peak_held_mib'], ref['backend_peak_held_mib'])}) "
            f"| {fmt(r['proxy_hwm_mib'], 0)} ({ratio(r['proxy_hwm_mib'], ref['proxy_hwm_mib'])}) "
            f"| {fmt(r['cpu_during_run']['other_jobs_cpu_pct'], 0)} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--per-client", type=int, default=2)
    ap.add_argument("--gates", default="off,1,2,4,8")
    ap.add_argument("--release-at", default="complete")
    ap.add_argument("--preprocess-timeout", type=float, default=600.0,
                    help="MMGATE_PREPROCESS_TIMEOUT for every cell (default 30 would cut gate-off requests whose "
                         "items wait long in the decode pool's queue)")
    ap.add_argument("--no-extra", action="store_true",
                    help="skip the extra cells: gate=2 --release-at auto, and direct (clients → backend, no mmgate)")
    ap.add_argument("--quiet-wait", type=float, default=10.0,
                    help="before each cell, wait up to this many s for the shared machine to be <15%% busy")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--render", action="store_true", help="only rebuild the .md from the .json")
    args = ap.parse_args()
    if args.render:
        rerender()
        return

    started = time.monotonic()
    up_start = L.uptime()
    print(f"start: {up_start}", flush=True)
    image = L.photo_jpeg()
    body = L.chat_body(image, stream=True)
    cells = [(g, args.release_at) for g in args.gates.split(",")]
    if not args.no_extra:
        cells += [("2", "auto"), ("direct", "-")]
    rows = []
    for gate, release_at in cells:
        row = asyncio.run(run_cell(gate, release_at, body, args))
        rows.append(row)
        print(f"gate {gate:>3} {release_at:8s} ok {row['ok']}/{row['requests']} 429 {row['n429']} "
              f"{row['req_per_s']:.2f} req/s p50 {row['latency_ms']['p50'] / 1000:.2f} s "
              f"p99 {row['latency_ms']['p99'] / 1000:.2f} s  backend HWM {row['backend_hwm_mib']} MiB "
              f"held {row['backend_peak_held_mib']} MiB  proxy HWM {row['proxy_hwm_mib']} MiB  "
              f"wall {row['wall_s']} s  others CPU {row['cpu_during_run']['other_jobs_cpu_pct']}%  "
              f"quiet {row['quiet_wait']}  statuses {row['statuses']} rejected {row['rejected']}",
              flush=True)
    up_end = L.uptime()
    print(f"end: {up_end}", flush=True)

    import PIL
    import aiohttp
    from proxy.settings import usable_cpus

    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(), "aiohttp": aiohttp.__version__, "pillow": PIL.__version__,
        "usable_cpus": usable_cpus(), "uptime_start": up_start, "uptime_end": up_end,
        "clients": args.clients, "per_client": args.per_client, "release_at": args.release_at,
        "preprocess_timeout": args.preprocess_timeout,
        "image": {"format": "JPEG", "size": list(L.PHOTO_SIZE), "quality": L.PHOTO_QUALITY, "bytes": len(image),
                  "body_bytes": len(body), "decoded_rgb_bytes": L.PHOTO_SIZE[0] * L.PHOTO_SIZE[1] * 3},
        "stub_flags": list(STUB_FLAGS),
        "stub": "python -m proxy.stub_backend " + " ".join(STUB_FLAGS),
        "mmgate": "python -m proxy --access-log off --max-mm-concurrency K --max-queue 10000 --queue-timeout 600 "
                  f"--preprocess-timeout {args.preprocess_timeout:g} --release-at R (decode workers default = "
                  "usable CPUs, validate full, no resize)",
        "wall_s": round(time.monotonic() - started, 1),
    }
    md, verdict = render(meta, rows)
    print()
    print(table(rows))
    print(verdict)
    if not args.no_write:
        L.RESULTS.mkdir(parents=True, exist_ok=True)
        (L.RESULTS / "gate_sweep.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1, default=str))
        (L.RESULTS / "gate_sweep.md").write_text(md)


def render(meta: dict, rows: list[dict]) -> tuple[str, str]:
    """The Markdown report (and its one-line verdict) from the measured rows."""
    off = next((r for r in rows if r["gate"] == "off"), None)
    two = next((r for r in rows if r["gate"] == "2" and r["release_at"] == meta["release_at"]), None)
    verdict = ""
    if off and two:
        cut = 1 - two["backend_hwm_mib"] / off["backend_hwm_mib"]
        tput = two["req_per_s"] / off["req_per_s"]
        verdict = (f"**gate=2: backend peak RSS {off['backend_hwm_mib']:.0f} → {two['backend_hwm_mib']:.0f} MiB "
                   f"({-cut * 100:+.0f} %; goal ≤ −70 %: {'met' if cut >= 0.70 else 'NOT met'}), throughput "
                   f"{tput:.2f}× gate off ({two['req_per_s']:.2f} vs {off['req_per_s']:.2f} req/s).** "
                   f"Anchor: {ANCHOR}.")
    img = meta["image"]
    w, h = img["size"]
    md = "\n".join([
        "# Gate sweep: backend memory and throughput vs MMGATE_MAX_MM_CONCURRENCY",
        "",
        f"`python bench/gate_sweep.py` -- {meta['date']}, Python {meta['python']}, aiohttp {meta['aiohttp']}, "
        f"Pillow {meta['pillow']}, {meta['usable_cpus']} usable CPUs, {meta['wall_s']} s in all.",
        f"Start: `{meta['uptime_start']}`  ",
        f"End: `{meta['uptime_end']}`",
        "",
        verdict,
        "",
        f"{meta['clients']} clients × {meta['per_client']} streaming chat requests "
        f"({meta['clients'] * meta['per_client']} in all), each with one {w}x{h} photo-like JPEG "
        f"(q{img['quality']}, {img['bytes'] / 1e6:.2f} MB; body {img['body_bytes'] / 1e6:.2f} MB; "
        f"{img['decoded_rgb_bytes'] / MIB:.0f} MiB as decoded RGB) → mmgate → stub backend "
        f"`{' '.join(meta['stub_flags'])}` (decodes every image and holds the pixels until the last token; "
        "240 ms simulated encoder CPU per image; 8 decode threads, vLLM's default "
        "VLLM_MEDIA_LOADING_THREAD_COUNT). mmgate: "
        f"`{meta['mmgate']}`; gate off = --max-mm-concurrency {OFF}. "
        "Fresh processes per cell: peak RSS = VmHWM of that cell's processes (their RSS after one warm-up "
        "request is in the JSON); peak held pixels = the stub's /stats peak_held_pixel_bytes. Latency: send → "
        "last SSE byte, successes only; queue = mmgate's Server-Timing queue stage. Ratios (×off) are to gate "
        "off. Clients, mmgate and the stub share 2 cores with each other (and with any other job on the "
        "machine: 'other jobs CPU' is the machine's busy time minus this benchmark's processes, in % of one core).",
        "",
        table(rows),
        "",
        "direct: the same clients send to the backend itself (no mmgate): what the backend sees without a "
        "sidecar. mmgate with the gate off is close to it, but not quite: its decode pool (usable-CPU threads, "
        "niceness 10) paces the requests' arrival at the backend.",
        "",
        "`complete` releases the slot when the response has ended (the stub has dropped the pixels); `auto` is "
        "`headers` for these streaming requests: the stub sends its headers after decoding, so the slot is "
        "released while the backend still holds the pixels for the rest of the generation (here only 8 tokens "
        "× 10 ms, so the difference is small; with long generations `headers` lets held pixels pile up).",
        "",
        "The backend's peak RSS is mostly decode transients, not held pixels: each decode in the stub briefly "
        "holds the request body, the decoded JPEG bytes, Pillow's 4-byte-per-pixel image, its RGB copy and "
        "the numpy array (~130 MiB for one 12 MP photo), so peak RSS follows how many requests the backend "
        "decodes at once, which the gate bounds.",
        "",
    ])
    return md, verdict


def rerender() -> None:
    """--render: rebuild gate_sweep.md from gate_sweep.json (no measurement)."""
    data = json.loads((L.RESULTS / "gate_sweep.json").read_text())
    md, verdict = render(data["meta"], data["rows"])
    (L.RESULTS / "gate_sweep.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
