"""Timing calls in this process, as the single-threaded image and payload benches time their steps.

Thread CPU time (``time.thread_time``) is the steady figure on a shared machine: other load moves it little, where
it moves wall time a lot. Wall time of a call that holds the GIL throughout is how long it holds it. Used by
``bench/image_pipeline``, ``fidelity``, ``testkit.handoff_calibration``, ``video_probe`` and ``locate``.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any


def _wall_ms(call: Callable[[], object]) -> float:
    started = time.perf_counter()  # alone: a CPU clock read beside it would weigh on a call of a few µs
    call()
    return (time.perf_counter() - started) * 1000


def thread_cpu_ms(call: Callable[[], object]) -> float:
    """This thread's CPU milliseconds for one call."""
    started = time.thread_time()
    call()
    return (time.thread_time() - started) * 1000


def wall_and_cpu_ms(call: Callable[[], object]) -> tuple[float, float]:
    """(wall ms, this thread's CPU ms) of one call."""
    wall, cpu = time.perf_counter(), time.thread_time()
    call()
    return (time.perf_counter() - wall) * 1000, (time.thread_time() - cpu) * 1000


def cpu_runs_ms(call: Callable[[], object], runs: int) -> list[float]:
    """Each of ``runs`` calls' thread CPU milliseconds."""
    return [thread_cpu_ms(call) for _ in range(runs)]


def median_cpu_ms(call: Callable[[], object], runs: int) -> float:
    """The median thread CPU milliseconds of ``runs`` calls."""
    return statistics.median(cpu_runs_ms(call, runs))


def interleaved(calls: Mapping[str, Callable[[], object]], runs: int) -> dict[str, list[tuple[float, float]]]:
    """Each call's (wall ms, thread CPU ms) over ``runs`` rounds, the calls taking turns within a round so that
    background load hits them alike."""
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in calls}
    for _ in range(runs):
        for name, call in calls.items():
            times[name].append(wall_and_cpu_ms(call))
    return times


def per_second(call: Callable[[Any], object], argument: Any, threads: int, calls: int) -> float:
    """Calls per second of ``call(argument)`` run ``calls`` times on a pool of ``threads`` threads."""
    with ThreadPoolExecutor(threads) as pool:
        start = time.perf_counter()
        list(pool.map(call, [argument] * calls))
        return calls / (time.perf_counter() - start)


def wall_ms_stats(call: Callable[[], object], runs: int) -> dict[str, float]:
    """Wall milliseconds of ``runs`` calls after one to warm up: median, min, p90 (nearest rank below), max."""
    call()
    samples = sorted(_wall_ms(call) for _ in range(runs))
    return {"median_ms": statistics.median(samples), "min_ms": samples[0],
            "p90_ms": samples[int(0.9 * (len(samples) - 1))], "max_ms": samples[-1], "runs": len(samples)}
