"""Gate sweep: what the admission gate does to a VLM backend's memory and to throughput.

The lmdeploy seed (#4687) limited how many requests' images the server processes at once and cut peak RSS
222.5 → 68.1 GiB (−69 %) with gate=1 at equal throughput. Here mmgate does it as a sidecar before an unchanged
backend: the stub configured like a VLM server (``testkit.memory_cell``: it holds every decoded image until its
answer ends), fresh processes per cell so that VmHWM is the cell's own.

gate_sweep: 64 clients × ``per_client`` streaming requests with one 12 MP photo each, gate off and 1, 2, 4, 8 (queue
10000: clients wait, no 429s), plus gate 2 with --release-at auto and ``direct`` (no mmgate) unless ``no_extra``.
Goal: gate 2 cuts the backend's peak RSS by ≥ 70 % vs gate off, round by round; its throughput ratio is reported.
--release-at complete, because the stub sends its headers after decoding but holds the pixels to the last token.

peak_rss: mmgate's own peak against a model: the working set of one request alone (VmHWM reset through
/proc/PID/clear_refs), then 128 clients × 1 request at once (gate off, gate 2, gate 2 with queue 16; again with
glibc's allocator defaults). Goal: measured ÷ ``predict``ed peak within 0.8–1.2 per cell; also writes peak_rss.png.

Clients, mmgate and the stub share the machine with each other and with other jobs (their CPU and ``uptime`` are
recorded): read ratios, not absolute numbers.
"""


from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Sequence
from operator import itemgetter
from typing import Any

from bench import _results as R
from testkit import load as L
from testkit import memory_cell as cell
from testkit import memory_model, memory_plots
from testkit.allocators import UNTUNED
from testkit.memory_cell import MIB, OFF

ANCHOR = "lmdeploy #4687: gate=1 cut peak RSS 222.5 → 68.1 GiB (−69 %) at equal throughput"
WHAT = "64 clients × 12 MP through mmgate to a VLM-like stub, gate off / 1 / 2 / 4 / 8: backend peak RSS, throughput"
MEMORY_WHAT = ("128 clients × one 12 MP photo at once: mmgate's peak RSS vs baseline + bodies × body + "
               "decoding × decode")
GOAL_CUT = 0.70

# Tight but sufficient limits (the body is 3.3 MiB, the photo exactly 12 MP), as docs/tuning.md advises for a
# sidecar: they change nothing for these requests but make worst_case_memory_bytes() a bound worth reading.
MEMORY_FLAGS = ("--max-body-mb", "4", "--max-image-pixels", "12000000")
RESIZE_FLAGS = ("--resize-max-pixels", "1000000")
# (label, gate, max queue): gate off; gate 2 with every other request queued; gate 2 with a short queue.
MEMORY_CELLS = (("gate off", "off", OFF), ("gate 2, queue 10000", "2", OFF), ("gate 2, queue 16", "2", 16))
# mmgate tunes the allocators by default (MMGATE_MALLOC_TUNING: every buffer >= 1 MiB in its own mmap, no
# Pillow block cache); the extra cells run with glibc's and Pillow's defaults to show what that changes.
MALLOC_LABEL = " + glibc defaults"
SWEEP_COLUMNS = ("gate", "release", "ok / sent", "429", "req/s (×off)", "p50 s (×off)", "p99 s (×off)", "queue p50 s",
                 "backend peak RSS MiB (×off)", "backend peak held pixels MiB (×off)", "proxy peak RSS MiB (×off)",
                 "other jobs CPU %")
ONE_COLUMNS = ("settings", "request", "proxy idle RSS MiB", "proxy peak MiB", "proxy working set MiB",
               "backend working set MiB")


def fmt(x: float, nd: int = 2) -> str:
    return "-" if isinstance(x, float) and math.isnan(x) else f"{x:.{nd}f}"


def ratio(a: float, b: float) -> str:
    return fmt(a / b) if b else "-"


def text_table(titles: tuple[str, ...], rows: Sequence[Sequence[str]]) -> str:
    """``R.table`` of text cells, one per title."""
    return "\n".join(R.table([(title, title, "s") for title in titles], [dict(zip(titles, row, strict=True))
                                                                          for row in rows]))


def table(rows: list[dict]) -> str:
    ref = next((r for r in rows if r["gate"] == "off"), rows[0])

    def vs_off(row: dict, get: Callable[[dict], float], nd: int = 2, scale: float = 1) -> str:
        return f"{fmt(get(row) / scale, nd)} ({ratio(get(row), get(ref))})"

    return text_table(SWEEP_COLUMNS, [(
        "direct (no mmgate)" if r["gate"] == "direct" else r["gate"], r["release_at"], f"{r['ok']} / {r['requests']}",
        str(r["n429"]), vs_off(r, itemgetter("req_per_s")), vs_off(r, lambda x: x["latency_ms"]["p50"], scale=1000),
        vs_off(r, lambda x: x["latency_ms"]["p99"], scale=1000),
        fmt(r["queue_ms"].get("p50", math.nan) / 1000 if r["queue_ms"] else math.nan),
        vs_off(r, itemgetter("backend_hwm_mib"), 0), vs_off(r, itemgetter("backend_peak_held_mib"), 0),
        vs_off(r, itemgetter("proxy_hwm_mib"), 0), fmt(r["cpu_during_run"]["other_jobs_cpu_pct"], 0)) for r in rows])


# --- the scenarios: gate_sweep (measure, goals, report) and peak_rss (measure_memory, memory_goals, render_memory)

def measure(args: R.Knobs) -> dict[str, Any]:
    cells = [(g, args.release_at) for g in args.gates.split(",")]
    if not args.no_extra:
        cells += [("2", "auto"), ("direct", "-")]

    def sweep(body: bytes) -> list[dict]:
        rows = []
        for rnd in range(args.rounds):
            for gate, release_at in cells:
                rows.append(asyncio.run(cell.run_cell(gate, release_at, body, args)) | {"round": rnd})
                cell.progress(f"gate {gate:>3} {release_at:8s}", rows[-1])
        return rows

    stamp = R.stamp("gate_sweep.py", WHAT)
    meta, rows = cell.photo_run(args, sweep)
    print(table(rows))
    return stamp | {"meta": meta | {"rounds": args.rounds}, "rows": rows}


def goals(data: dict[str, Any]) -> list[R.Goal]:
    """Gate 2 against gate off, round by round (cells of one round ran back to back, under the same load)."""
    meta, rows = data["meta"], data["rows"]

    def per_round(gate: str) -> dict[int, dict]:
        return {r.get("round", 0): r for r in rows if r["gate"] == gate and r["release_at"] == meta["release_at"]}

    off, two = per_round("off"), per_round("2")
    pairs = [(off[k], two[k]) for k in sorted(off.keys() & two.keys())]
    return [
        R.goal("gate 2: backend peak RSS cut vs gate off", [100 * (1 - t["backend_hwm_mib"] / o["backend_hwm_mib"])
                                                          for o, t in pairs],
               f"≥ {GOAL_CUT * 100:g}", lambda v: v >= GOAL_CUT * 100, unit="%"),
        R.goal("gate 2: throughput ÷ gate off", [t["req_per_s"] / o["req_per_s"] for o, t in pairs], unit="×"),
    ]


def _heading(title: str, scenario: str, meta: dict, verdict: str = "") -> list[str]:
    """The page's title, the run's software and machine, the verdict, and the load, as both pages begin."""
    img = meta["image"]
    w, h = img["size"]
    return [f"# {title}", "",
            f"`python -m bench run {scenario}` -- {meta['date']}, Python {meta['python']}, aiohttp {meta['aiohttp']}, "
            f"Pillow {meta['pillow']}, {meta['usable_cpus']} usable CPUs, {meta['wall_s']} s in all.",
            f"Start: `{meta['uptime_start']}`  ", f"End: `{meta['uptime_end']}`", "",
            *([verdict, ""] if verdict else []),
            f"{meta['clients']} clients × {meta['per_client']} streaming chat requests "
            f"({meta['clients'] * meta['per_client']} in all), each with one {w}x{h} photo-like JPEG "
            f"(q{img['quality']}, {img['bytes'] / 1e6:.2f} MB; body {img['body_bytes']:,} B = "
            f"{img['body_bytes'] / MIB:.2f} MiB; {img['decoded_rgb_bytes'] / MIB:.0f} MiB as decoded RGB) → mmgate → "
            f"stub backend `{' '.join(meta['stub_flags'])}` (it holds every decoded image until the last token, "
            "spends 240 ms of simulated encoder CPU on each and decodes on 8 threads, vLLM's default "
            "VLLM_MEDIA_LOADING_THREAD_COUNT). Fresh processes per cell, one warm-up request each."]


def report(data: dict[str, Any]) -> str:
    """The Markdown report, its one-line verdict first, from the measured rows."""
    meta, rows = data["meta"], data["rows"]
    off = next((r for r in rows if r["gate"] == "off"), None)
    two = next((r for r in rows if r["gate"] == "2" and r["release_at"] == meta["release_at"]), None)
    verdict = ""
    if off and two:
        cut = 1 - two["backend_hwm_mib"] / off["backend_hwm_mib"]
        verdict = (f"**First round, gate=2: backend peak RSS {off['backend_hwm_mib']:.0f} → "
                   f"{two['backend_hwm_mib']:.0f} MiB ({-cut * 100:+.0f} %), throughput "
                   f"{two['req_per_s'] / off['req_per_s']:.2f}× gate off ({two['req_per_s']:.2f} vs "
                   f"{off['req_per_s']:.2f} req/s).** Anchor: {ANCHOR}.")
    return "\n".join([
        *_heading("Gate sweep: backend memory and throughput vs MMGATE_MAX_MM_CONCURRENCY", "gate_sweep", meta,
                  verdict),
        f"mmgate: `{meta['mmgate']}`; gate off = --max-mm-concurrency {OFF}.",
        "",
        "Peak RSS = VmHWM of the cell's processes (their RSS after the warm-up is in the JSON); peak held pixels = "
        "the stub's /stats peak_held_pixel_bytes. Latency: send → last SSE byte, successes only; queue = mmgate's "
        "Server-Timing queue stage; ×off: the ratio to gate off. Other jobs CPU: the machine's busy time minus this "
        "benchmark's processes (which share its cores), in % of one core.",
        "",
        table(rows),
        "",
        "direct: the same clients send to the backend itself, the no-sidecar reference. `complete` releases the slot "
        "when the response has ended (the stub has dropped the pixels); `auto` is `headers` for these streaming "
        "requests, sent after the decode: it releases the slot while the backend still holds the pixels for the rest "
        "of the generation.",
        "",
    ])


def measure_memory(args: R.Knobs) -> dict[str, Any]:
    """The peak_rss scenario: one-request working sets, then the cells; beside the result, peak_rss.png."""
    stamp = R.stamp("gate_sweep.py", MEMORY_WHAT)
    cells: list[memory_model.Cell] = [(label, gate, queue, None) for _ in range(args.repeats)
                                      for label, gate, queue in MEMORY_CELLS]
    if not args.no_extra:
        cells += [(label + MALLOC_LABEL, gate, queue, UNTUNED) for label, gate, queue in MEMORY_CELLS]
    meta, found = cell.photo_run(args, lambda body: asyncio.run(
        memory_model.run_model(body, args, cells, MEMORY_FLAGS, RESIZE_FLAGS)))
    for row in found["rows"]:
        row["trace"] = R.downsample(row["trace"], column=1)  # after the peak was found in the whole trace
    meta |= {"memory_flags": list(MEMORY_FLAGS), "resize_flags": list(RESIZE_FLAGS),
             "one_repeats": args.one_repeats, "repeats": args.repeats, "trace_columns": list(cell.TRACE_COLUMNS)}
    data = stamp | {"meta": meta, **found}
    if not args.quick:
        memory_plots.peak_rss(data, memory_model.run_labels(data["rows"]), L.RESULTS / "peak_rss.png")
    return data


def memory_goals(data: dict[str, Any]) -> list[R.Goal]:
    """Measured ÷ predicted proxy peak per cell over its repeats (the model holds within ±20 %), and the
    backend's peak beside it."""
    cells = {label: [r for r in data["rows"] if r["label"] == label]
             for label in dict.fromkeys(r["label"] for r in data["rows"]) if MALLOC_LABEL not in label}
    return [*(R.goal(f"{label}: mmgate peak ÷ predicted", [r["proxy_hwm_mib"] / r["predicted_mib"] for r in runs],
                     "0.8–1.2", lambda v: 0.8 <= v <= 1.2, unit="×") for label, runs in cells.items()),
            *(R.goal(f"{label}: backend peak RSS", [r["backend_hwm_mib"] for r in runs], unit="MiB")
              for label, runs in cells.items())]


def render_memory(data: dict) -> str:
    meta, model, rows, singles = data["meta"], data["model"], data["rows"], data["singles"]
    one = []
    for label in dict.fromkeys(s["label"] for s in singles):
        for request in ("cold", "warm"):
            runs = [r for s in singles if s["label"] == label for r in s["runs"] if r["request"] == request]
            idle, peak, ws, backend = (" / ".join(str(r[key]) for r in runs) for key in
                                       ("proxy_idle_mib", "proxy_peak_mib", "proxy_ws_mib", "backend_ws_mib"))
            one.append((label, request, idle, peak, f"**{ws}**", backend))

    def within(ratio_: float) -> str:
        return f"{ratio_:.2f} {'yes' if abs(ratio_ - 1) <= 0.20 else '**no**'}"

    cells = []
    for label, r in zip(memory_model.run_labels(rows), rows, strict=True):
        measured, bound, peak = r["proxy_hwm_mib"], r["static_bound_mib"]["total"], r["trace_peak"]
        payload = measured - model["baseline_cold_mib"]
        cells.append(
            f"| {label} | {r['ok']} / {r['requests']} | {r['n429']} | {fmt(r['req_per_s'])} "
            f"| {r['bodies']} × body + {r['decoding']} × decode | {fmt(r['predicted_mib'], 0)} "
            f"| **{fmt(measured, 0)}** | {within(measured / r['predicted_mib'])} "
            f"| {fmt(r['predicted_reading_mib'], 0)} | {within(measured / r['predicted_reading_mib'])} "
            f"| {fmt(payload, 0)} ≤ {bound:,.0f}: {'yes' if payload <= bound else '**no**'} "
            f"| {fmt(r['trace_max_media_live_mib'], 0)} | {f'{peak[0]:.1f} s, {peak[3]:.0f} MiB' if peak else '-'} "
            f"| {fmt(r['backend_hwm_mib'], 0)} | {fmt(r['cpu_during_run']['other_jobs_cpu_pct'], 0)} |")
    return "\n".join([
        *_heading("Peak RSS vs the memory model: gate off vs gate 2 (buffer lifetime)", "peak_rss", meta),
        f"All sent at once. mmgate: `--max-mm-concurrency K --max-queue Q --queue-timeout 600 --preprocess-timeout "
        f"{meta['preprocess_timeout']:g} --release-at {meta['release_at']} {' '.join(meta['memory_flags'])}` "
        f"(validate full, no resize, {model['decode_workers']} decode workers = usable CPUs, allocator tuning on as "
        "by default: MMGATE_MALLOC_TUNING). After the warm-up VmHWM is reset (`echo 5 > /proc/PID/clear_refs`), so "
        "each peak is the load's own.",
        "",
        "## One request alone: the working set",
        "",
        f"Fresh mmgate per line ({meta['one_repeats']} repeats, shown a / b); `cold` = its first request, `warm` = "
        "its second; working set = VmHWM during the request − idle RSS just before it.",
        "",
        text_table(ONE_COLUMNS, one),
        "",
        f"Terms (medians): body = {model['body_mib']} MiB; decode = ws(full) − ws(header) = "
        f"{model['ws_full_cold_mib']} − {model['ws_header_cold_mib']} = **{model['decode_mib']} MiB**; rest of one "
        f"request = ws(header) − body = {model['per_request_other_mib']} MiB (the read buffer, the "
        f"base64-decoded file, the forward); baseline = cold idle RSS {model['baseline_cold_mib']} MiB "
        f"(warm idle: {model['baseline_warm_mib']} MiB).",
        "",
        "## The formula",
        "",
        f"```\n{memory_model.FORMULA}\n```",
        "",
        f"With the gate off all {meta['clients']} are admitted, but only the pool's threads decode; with gate 2 the "
        f"other {meta['clients'] - 2} wait in the queue, each holding its body: the gate moves bodies from 'admitted' "
        "to 'queued', only the queue limit Q removes them (as 429s).",
        "",
        f"## {meta['clients']} clients at once",
        "",
        "| cell | ok / sent | 429 | req/s | model | predicted proxy peak MiB | measured proxy peak MiB | "
        "measured / predicted, within ±20 % | predicted, every body read counted MiB | measured / that "
        "| payload (peak − baseline) ≤ worst_case_memory_bytes() MiB | max media_bytes_live MiB "
        "| RSS first at peak: time, media_bytes_live | backend peak MiB | other jobs CPU % |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        *cells,
        "",
        "media_bytes_live: mmgate's gauge of request bodies it holds (after the parse, before the handoff), "
        "sampled every ~0.1 s with RSS; a body still being read is not in it yet.",
        "",
        "![measured vs predicted](peak_rss.png)",
        "",
        *memory_model.findings(data, [label for label, _gate, _queue in MEMORY_CELLS], MALLOC_LABEL),
    ])
