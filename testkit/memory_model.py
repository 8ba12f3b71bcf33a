"""peak_rss's memory model (bench/gate_sweep.py): mmgate's peak RSS predicted from what one request alone costs.

``FORMULA`` is the model. ``run_model`` measures it: the one-request working sets (``memory_cell.
one_request_working_set``) give its terms (``terms``), then each cell (``memory_cell.run_cell`` with a memory trace)
gets its prediction (``predict``), the static bound of its settings (``static_bound_mib``) and where its RSS trace
first reached the peak. ``run_labels`` names repeated cells apart; ``findings`` says what the cells say about the
model, in the words of peak_rss's page.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Callable, Sequence
from operator import itemgetter
from types import SimpleNamespace
from typing import Any

from proxy.settings import Settings, usable_cpus
from testkit import memory_cell as cell
from testkit.memory_cell import MIB, OFF

FORMULA = """predicted proxy peak = baseline + bodies × body + decoding × decode
  bodies   = requests read but not yet handed upstream = min(clients, K + Q)   (queued or admitted alike)
  decoding = min(admitted, decode workers), admitted = min(clients, K)"""
FULL, HEADER = "validate full", "validate header"  # the working sets whose difference is the decode term
BURST_S = 2.0  # all 128 bodies are in within ~1.5 s here; a peak after that is not the read burst
Cell = tuple[str, str, int, dict[str, str] | None]  # (label, gate, max queue, mmgate's environment or None)


def _median_of(singles: list[dict], label: str, request: str, key: str) -> float:
    return statistics.median(r[key] for s in singles if s["label"] == label
                             for r in s["runs"] if r["request"] == request)


def terms(singles: list[dict], body_bytes: int, decode_workers: int) -> dict[str, float]:
    """The terms of ``FORMULA`` from the one-request working sets (medians over the repeats; peak_rss's page says
    what each holds). The baseline is the cold one: the warm one already holds one decode's buffers that the
    allocators kept, which a concurrent peak reuses for one decode only."""
    ws_full = _median_of(singles, FULL, "cold", "proxy_ws_mib")
    ws_header = _median_of(singles, HEADER, "cold", "proxy_ws_mib")
    return {"baseline_cold_mib": _median_of(singles, FULL, "cold", "proxy_idle_mib"),
            "baseline_warm_mib": _median_of(singles, FULL, "warm", "proxy_idle_mib"),
            "body_mib": round(body_bytes / MIB, 2), "ws_full_cold_mib": ws_full, "ws_header_cold_mib": ws_header,
            "ws_full_warm_mib": _median_of(singles, FULL, "warm", "proxy_ws_mib"),
            "decode_mib": round(ws_full - ws_header, 1),
            "per_request_other_mib": round(ws_header - body_bytes / MIB, 1),
            "decode_workers": decode_workers}


def predict(model: dict[str, float], clients: int, limit: int, queue: int) -> dict[str, float]:
    """``FORMULA`` for ``clients`` sent at once (K = ``limit``, Q = ``queue``): the requests beyond K + Q get 429s,
    and an admitted request holds pixel buffers only while a decode thread works on it."""
    admitted = min(clients, limit)
    bodies = min(clients, limit + queue)
    decoding = min(admitted, int(model["decode_workers"]))
    base, body, decode = model["baseline_cold_mib"], model["body_mib"], model["decode_mib"]
    return {"bodies": bodies, "decoding": decoding, "admitted": admitted, "queued": bodies - admitted,
            "predicted_mib": round(base + bodies * body + decoding * decode, 1),
            # Revised after the short-queue cell missed: mmgate reads a body whole before the queue limit is
            # checked, so with every client sending at once all their bodies are in memory together.
            "predicted_reading_mib": round(base + clients * body + decoding * decode, 1)}


def static_bound_mib(flags: list[str]) -> dict[str, float]:
    """Settings.worst_case_memory_bytes() for the cell's own flags (payload only: add the baseline)."""
    overrides = {flags[i].removeprefix("--").replace("-", "_"): flags[i + 1] for i in range(0, len(flags), 2)}
    bound = Settings.from_env({}, upstream="http://127.0.0.1:1", **overrides).worst_case_memory_bytes()
    return {k: round(v / MIB, 1) for k, v in bound.items()}


async def run_model(body: bytes, args: SimpleNamespace, cells: Sequence[Cell], flags: tuple[str, ...],
                    resize_flags: tuple[str, ...]) -> dict[str, Any]:
    """``args.one_repeats`` × one request alone (gate 2, mmgate with ``flags``: validate full, header, full +
    ``resize_flags``), the model's terms from those, then ``cells`` with ``args.clients`` at once, each with its
    prediction: {"model", "singles", "rows"}. Each row keeps its whole ``trace`` (the caller may thin it out)."""
    base = cell.mmgate_flags(2, OFF, args.release_at, args.preprocess_timeout, flags)
    variants = ((FULL, base), (HEADER, (*base, "--validate", "header")),
                ("validate full + resize to 1 MP", (*base, *resize_flags)))
    singles = []
    for _ in range(args.one_repeats):
        for label, variant_flags in variants:
            singles.append(single := await cell.one_request_working_set(body, label, variant_flags, args))
            print(f"one request, {label}: " + "; ".join(
                f"{r['request']} proxy {r['proxy_idle_mib']} → {r['proxy_peak_mib']} MiB (+{r['proxy_ws_mib']}), "
                f"backend +{r['backend_ws_mib']}" for r in single["runs"]), flush=True)
    model = terms(singles, len(body), usable_cpus())
    rows = []
    for label, gate, queue, env in cells:
        row = await cell.run_cell(gate, args.release_at, body, args, queue=queue, extra_flags=flags, env=env,
                                  memory_trace=True)
        trace = row["trace"]
        top = max((t[1] for t in trace), default=math.nan)
        row |= {"label": label, "env": env or {}, **predict(model, args.clients, row["limit"], row["max_queue"]),
                "static_bound_mib": static_bound_mib(row["flags"]),
                "trace_peak": next((t for t in trace if t[1] >= 0.99 * top), []),  # when RSS first got there
                "trace_max_media_live_mib": max((t[3] for t in trace if not math.isnan(t[3])), default=math.nan)}
        rows.append(row)
        cell.progress(label, row)
    return {"model": model, "singles": singles, "rows": rows}


def run_labels(rows: list[dict]) -> list[str]:
    """Cell labels, with " #n" added where a cell ran more than once."""
    runs, counted = Counter(r["label"] for r in rows), Counter[str]()
    out = []
    for r in rows:
        counted[r["label"]] += 1
        out.append(r["label"] + (f" #{counted[r['label']]}" if runs[r["label"]] > 1 else ""))
    return out


def findings(data: dict[str, Any], labels: Sequence[str], malloc_label: str) -> list[str]:
    """What peak_rss's cells say about the model, with this run's numbers: a section of its page. ``labels``: the
    cells gate off, gate 2 with a long queue and with a short one; ``malloc_label``: the suffix of those run with
    glibc's and Pillow's defaults."""
    rows, model = data["rows"], data["model"]

    def span(label: str, value: Callable[[dict], float], nd: int = 2) -> str:
        values = [value(r) for r in rows if r["label"] == label]
        return f"{min(values):.{nd}f}" + (f"-{max(values):.{nd}f}" if len(values) > 1 else "")

    def over_predicted(label: str) -> str:
        return span(label, lambda r: r["proxy_hwm_mib"] / r["predicted_mib"])

    off, two, short = labels
    proxy_peak, backend_peak = itemgetter("proxy_hwm_mib"), itemgetter("backend_hwm_mib")
    peak_times = [r["trace_peak"][0] for r in rows if r["trace_peak"]]
    late = "".join(f"; in `{label}` ({r['cpu_during_run']['other_jobs_cpu_pct']:.0f} % other jobs' CPU) only at "
                   f"{r['trace_peak'][0]:.0f} s, creeping up after the burst"
                   for label, r in zip(run_labels(rows), rows, strict=True)
                   if r["trace_peak"] and r["trace_peak"][0] > BURST_S)
    misses = [r["proxy_hwm_mib"] - r["predicted_mib"] for r in rows if r["label"] in (off, two)]
    short_rows = [r for r in rows if r["label"] == short]
    payload = [r["proxy_hwm_mib"] - model["baseline_cold_mib"] for r in short_rows]
    per_refused = [(r["proxy_hwm_mib"] - r["predicted_mib"]) / 110 for r in short_rows]  # 110 refused, see 3.
    return [
        "## What the numbers say",
        "",
        f"1. **Gate off and gate 2 with a long queue fit the formula within ±20 %, but always above it**: measured / "
        f"predicted {over_predicted(off)} (gate off) and {over_predicted(two)} (gate 2). RSS peaked within "
        f"{BURST_S:g} s, at the end of the send burst with nearly every body in media_bytes_live, in "
        f"{sum(t <= BURST_S for t in peak_times)} of {len(peak_times)} runs{late}. The {min(misses):.0f}-"
        f"{max(misses):.0f} MiB the formula misses (≈ {min(misses) / model['body_mib']:.0f}-"
        f"{max(misses) / model['body_mib']:.0f} bodies) are most likely that burst's per-request transients, not "
        f"bodies held longer: one request alone holds {model['per_request_other_mib']} MiB beyond its body at its "
        "peak (the base64-decoded file, the forward's send buffer; no allocation tracing under load). With glibc's "
        f"and Pillow's defaults (`{malloc_label.strip()}`) the peak is {over_predicted(off + malloc_label)} and "
        f"{over_predicted(two + malloc_label)} of the prediction.",
        f"2. **The gate does not lower mmgate's own peak here** ({span(off, proxy_peak, 0)} vs "
        f"{span(two, proxy_peak, 0)} MiB): with a queue of 10000 the 126 requests that wait hold their bodies as "
        f"admitted ones would. It lowers the backend's: {span(off, backend_peak, 0)} → {span(two, backend_peak, 0)} "
        "MiB.",
        f"3. **A short queue bounds the peak** (measured / predicted {over_predicted(short)}; before big bodies took "
        "a place in line, commit 50d4b71: 2.61-2.68 with 512-526 MiB). A body whose first 64 KiB name media takes a "
        "place in line before the rest is read: the 110 requests that find slots and queue taken get 429 queue_full, "
        "the rest of their body unread, and media_bytes_live never exceeds "
        f"{max(r['trace_max_media_live_mib'] for r in short_rows):.0f} MiB (16 queued + 2 admitted). What remains "
        "above the model is per connection (a refused one's first 64 KiB and aiohttp's read buffer, up to 128 KiB), "
        f"about {min(per_refused):.2f}-{max(per_refused):.2f} MiB each; so the payload ({min(payload):.0f}-"
        f"{max(payload):.0f} MiB) can pass worst_case_memory_bytes() "
        f"({short_rows[0]['static_bound_mib']['total']:.0f} MiB), which has no term for connections: no setting "
        "limits them (docs/tuning.md).",
        f"4. Warm vs cold: after the first 12 MP decode idle RSS is "
        f"{model['baseline_warm_mib'] - model['baseline_cold_mib']:+.0f} MiB from the cold baseline (Pillow's default "
        f"block cache kept ~46 MiB), and a second request alone costs {model['ws_full_warm_mib']:.1f} MiB; the formula "
        "counts from the cold baseline with the cold decode term.",
        "",
    ]
