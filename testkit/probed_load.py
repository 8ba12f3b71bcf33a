"""A window of latency probes while clients resend one media body (``testkit.health_under_load`` and
``testkit.cache_hit_load``, for ``bench/loop_latency.py`` and ``bench/pacing.py``): the warm-up, the background
load (``testkit.load.run_load``: one keep-alive connection per client, back to back), the probers
(``testkit.load``'s, each in its own process), what the proxy's process tree spent over the window (CPU and minor
page faults, from /proc), and the rounds in which the cases take turns.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any

from testkit import load as L
from testkit.procfs import tree_cpu_seconds, tree_minor_faults


async def warm_up(url: str, body: bytes, clients: int, requests_per_client: int, what: str) -> None:
    """Requests that start the decode threads, fill caches and warm connections; every one must answer 200."""
    warm = await L.run_load(url, body, clients, requests_per_client=requests_per_client)
    if warm.statuses() != {"200": clients * requests_per_client}:
        raise RuntimeError(f"{what}: warm-up answered {warm.statuses()}")


class MediaLoad:
    """``clients`` clients resending ``body`` until ``stop`` (none with 0 clients: an idle window)."""

    def __init__(self, url: str, body: bytes, clients: int) -> None:
        self.stopping = asyncio.Event()
        self.task = (asyncio.create_task(L.run_load(url, body, clients, stop_event=self.stopping))
                     if clients else None)

    async def stop(self) -> L.LoadRun | None:
        self.stopping.set()
        return await self.task if self.task else None


@dataclass
class Window:
    """Wall time, CPU seconds and minor page faults of a process tree over a window."""

    t0: float  # time.perf_counter, as ``testkit.load.Result.ended``
    t1: float
    cpu_s: float
    minor_faults: int

    @property
    def seconds(self) -> float:
        return self.t1 - self.t0

    def answered(self, run: L.LoadRun | None) -> list[L.Result]:
        """The load's 200s that ended inside the window."""
        return [r for r in run.ok() if self.t0 <= r.ended <= self.t1] if run else []

    def per_media_request(self, run: L.LoadRun | None, cpu_ms_digits: int) -> dict[str, float | None]:
        """Media requests answered per second in the window, the tree's CPU (percent of one core) and, per
        answered request, its CPU ms and minor page faults (None when none was answered)."""
        media = self.answered(run)
        return {"media_req_per_s": round(len(media) / self.seconds, 2),
                "cpu_pct": round(100 * self.cpu_s / self.seconds, 1),
                "cpu_ms_per_media_req": round(1000 * self.cpu_s / len(media), cpu_ms_digits) if media else None,
                "minor_faults_per_media_req": round(self.minor_faults / len(media)) if media else None}


class TreeUsage:
    """Opens a ``Window`` on ``root`` and every process below it (process mode's decode workers included)."""

    def __init__(self, root: int) -> None:
        self.root = root
        self.cpu0, self.t0 = tree_cpu_seconds(root), time.perf_counter()
        self.faults0 = tree_minor_faults(root)

    def close(self) -> Window:
        t1, cpu1, faults1 = time.perf_counter(), tree_cpu_seconds(self.root), tree_minor_faults(self.root)
        return Window(self.t0, t1, cpu1 - self.cpu0, faults1 - self.faults0)


async def probe_all(probers: dict[str, tuple[str, str, bytes | None]], seconds: float,
                    interval: float) -> dict[str, dict[str, Any]]:
    """Each prober, ``name: (url, path, body to POST or None to GET)``, started at once and run for ``seconds``,
    one probe every ``interval``; its result (``testkit.load.prober_result``) by name."""
    started = {name: L.start_prober(url, seconds, interval, path, body) for name, (url, path, body) in probers.items()}
    return {name: await asyncio.to_thread(L.prober_result, *prober) for name, prober in started.items()}


def log_problems(log: str, words: tuple[str, ...], last: int) -> list[str]:
    """The last ``last`` lines of a process's log holding any of ``words``."""
    return [line for line in log.splitlines() if any(w in line for w in words)][-last:]


def loop_lag(before: dict[Any, float], after: dict[Any, float]) -> dict[str, Any]:
    """mmgate's ``mmgate_event_loop_lag_seconds`` histogram (a 250 ms timer: bucket edges, not exact values)
    between two scrapes of /mmgate/metrics (``testkit.load.scrape``): samples, mean, the bucket upper edges of
    p50, p99 and the highest sample, in ms, and the buckets."""
    name = "mmgate_event_loop_lag_seconds"
    lag = L.histogram_diff(L.histogram(after, name), L.histogram(before, name))
    return {"samples": int(lag["count"]),
            "mean_ms": round(lag["sum"] / lag["count"] * 1000, 3) if lag["count"] else math.nan,
            "p50_le_ms": L.histogram_quantile(lag, 0.5) * 1000,
            "p99_le_ms": L.histogram_quantile(lag, 0.99) * 1000,
            "max_le_ms": L.histogram_max_bucket(lag) * 1000,
            "buckets": {str(k): v for k, v in lag["buckets"].items()}}


Row = dict[str, Any]


def in_turns(names: Sequence[str], rounds: int, run_case: Callable[[str], Coroutine[Any, Any, Row]],
             progress: Callable[[Row], str], width: int) -> list[dict[str, Row]]:
    """``rounds`` rounds in which every case runs in turn, each in an event loop of its own (so a burst of other
    work on the shared machine hits them all); each round's rows by case name, each row printed as it comes
    (``r<round> <name> <progress(row)>``, the name padded to ``width``)."""
    out: list[dict[str, Row]] = []
    for rnd in range(rounds):
        out.append({})
        for name in names:
            row = out[-1][name] = asyncio.run(run_case(name))
            print(f"r{rnd} {name:{width}s} {progress(row)}", flush=True)
    return out
