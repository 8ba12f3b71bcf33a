"""peak_rss's memory model (bench/gate_sweep.py): mmgate's peak RSS predicted from what one request alone costs.

``FORMULA`` is the model. ``run_model`` measures it: the one-request working sets (``memory_cell.
one_request_working_set``) give its terms (``terms``), then each cell (``memory_cell.run_cell`` with a memory trace)
gets its prediction (``predict``), the static bound of its settings (``static_bound_mib``) and where its RSS trace
first reached the peak. ``run_labels`` names repeated cells apart.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

from proxy.settings import Settings, usable_cpus
from testkit import memory_cell as cell
from testkit.memory_cell import MIB, OFF

FORMULA = """predicted proxy peak = baseline + bodies × body + decoding × decode
  bodies   = requests read but not yet handed upstream = min(clients, K + Q)   (queued or admitted alike)
  decoding = min(admitted, decode workers), admitted = min(clients, K)"""
FULL, HEADER = "validate full", "validate header"  # the working sets whose difference is the decode term
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
