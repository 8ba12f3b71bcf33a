"""One cell of ``bench/fleet_vllm.py``: an mmgate at one concurrency limit in front of a real vLLM, ``vllm bench
serve`` through it (``testkit.bench_serve.run_once``), and, with ``auto``, its limit read over HTTP while the load
runs (``LimitTrace``: the gate's limit and the controller's limit between probes, from ``/mmgate/stats``)."""

from __future__ import annotations

import json
import statistics
import threading
import time
from pathlib import Path
from typing import Any

from testkit import vllm as h
from testkit.bench_serve import run_once

POLL_SECONDS = 0.5


class LimitTrace(threading.Thread):
    """Reads the gate's limit and the controller's limit between probes from ``/mmgate/stats`` every
    ``POLL_SECONDS`` until ``stopped`` is set, and keeps the controller's last moves (each with why)."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.points: list[tuple[float, int, int | None]] = []  # (seconds since created, gate's limit, cruise limit)
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
        """The median limit between probes over the second half of the trace (the limit it settled on; the
        gate's limit moves with each probe)."""
        if not self.points:
            return None
        half = self.points[-1][0] / 2
        return statistics.median(cruise if cruise is not None else limit
                                 for t, limit, cruise in self.points if t >= half)


def limit_cell(vllm: h.Server, limit: str, prompts: int, concurrency: int, seed: int, workdir: Path) -> dict[str, Any]:
    """``prompts`` requests from ``concurrency`` clients through a fresh mmgate with ``limit`` (released at
    completion, as ``auto`` is, so a fixed limit bounds the backend the same way) in front of ``vllm``: vLLM's own
    figures, and mmgate's limit at the end and, with ``auto``, over the run."""
    gate = h.start_mmgate(vllm.url, "--access-log", "off", "--max-mm-concurrency", limit, "--release-at", "complete",
                          "--max-queue", "1000", "--queue-timeout", "600", "--min-mm-concurrency", "1",
                          "--max-mm-concurrency-auto", "64", "--cache-mb", "0")
    trace = LimitTrace(gate.url)
    try:
        started = time.monotonic()
        if limit == "auto":
            trace.start()
        result = run_once(gate.url, prompts, concurrency, seed, workdir / f"{limit}-{seed}.json")
        metrics = gate.metrics("/mmgate/metrics")
    finally:
        trace.stopped.set()
        gate.stop()
    return {"limit": limit, "seconds": time.monotonic() - started,
            "request_throughput": result["request_throughput"], "completed": result["completed"],
            "failed": result.get("failed", prompts - result["completed"]),
            "median_ttft_ms": result["median_ttft_ms"], "median_e2el_ms": result["median_e2el_ms"],
            "final_limit": metrics.get("mmgate_gate_limit"), "settled_limit": trace.settled(),
            "trace": trace.points, "moves": trace.moves}
