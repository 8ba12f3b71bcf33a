"""mmgate's decode pools (``DecodePool``: threads; ``ProcessPool``: worker processes) driven outside mmgate, from
an asyncio loop of their own as the proxy drives them (``bench/gil_hold``): one job at a time for its cost, or
one client per worker for saturation (with ``testkit.gil_probe``'s sleeper beside it), and the copies process
mode's parent makes of a job's bytes; ``process_cost`` puts them together.
"""

from __future__ import annotations

import asyncio
import math
import os
import statistics
import time
from collections.abc import Callable, Coroutine, Mapping
from typing import Any

from preprocessors.job import MediaJob
from preprocessors.pool import DecodePool
from preprocessors.worker_handle import read_all
from preprocessors.worker_process import write_all
from preprocessors.workers import ProcessPool
from testkit.gil_probe import probe


def on_pool(mode: str, workers: int, work: Callable[[DecodePool], Coroutine[Any, Any, Any]],
            environment: Mapping[str, str]) -> Any:
    """``work`` on a fresh pool of ``mode`` (worker processes get ``environment``) in an asyncio loop of its
    own."""
    pool = ProcessPool(workers, environment=environment) if mode == "process" else DecodePool(workers)
    try:
        return asyncio.run(work(pool))
    finally:
        pool.shutdown()


async def one_at_a_time(pool: DecodePool, job: MediaJob, count: float, end: float = math.inf) -> list[float]:
    """``job`` on ``pool``, one at a time, ``count`` times or until ``end`` (``perf_counter``): each one's wall ms."""
    times: list[float] = []
    while len(times) < count and time.perf_counter() < end:
        t0 = time.perf_counter()
        await pool.batch().run([job], 60)
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def saturated(mode: str, workers: int, job: MediaJob, seconds: float,
              environment: Mapping[str, str]) -> dict[str, float]:
    """One client per worker, each running one job at a time for ``seconds``: the probe's lateness and jobs/s."""

    async def saturate(pool: DecodePool) -> dict[str, float]:
        await asyncio.gather(*(pool.batch().run([job], 60) for _ in range(workers)))  # workers started, warm
        with probe() as lateness:
            started = time.perf_counter()
            clients = [one_at_a_time(pool, job, math.inf, started + seconds) for _ in range(workers)]
            done = sum(len(times) for times in await asyncio.gather(*clients))
            wall = time.perf_counter() - started
        return lateness | {"jobs_per_s": done / wall}

    return on_pool(mode, workers, saturate, environment)


def sequential_ms(mode: str, job: MediaJob, count: int, environment: Mapping[str, str]) -> float:
    """Median wall ms of one job at a time on a one-worker pool of ``mode``, after one to start it."""

    async def after_one(pool: DecodePool) -> float:
        await pool.batch().run([job], 60)
        return statistics.median(await one_at_a_time(pool, job, count))

    return on_pool(mode, 1, after_one, environment)


def copies_us(payload: bytes, answer: bytes, count: int) -> float:
    """Median µs process mode's parent spends copying one job's bytes: the payload into a memfd, the answer out
    (the worker's write of the answer not timed: the worker makes it)."""
    fd = os.memfd_create("bench", os.MFD_CLOEXEC)
    try:
        times = []
        for _ in range(count):
            os.pwrite(fd, answer, 0)
            t0 = time.perf_counter()
            write_all(fd, payload)
            read_all(fd, len(answer))
            times.append((time.perf_counter() - t0) * 1e6)
            os.ftruncate(fd, 0)
        return statistics.median(times)
    finally:
        os.close(fd)


def process_cost(job: MediaJob, empty_job: MediaJob, count: int, environment: Mapping[str, str], payload: bytes,
                 answer: bytes) -> dict[str, Any]:
    """What process mode costs per job over thread mode, one job at a time on one worker: wall ms of ``job``
    (``payload`` in, ``answer`` out) in each mode and the difference; µs of ``empty_job`` (no media work: the
    IPC alone, ``count`` × 10 of them) in each mode and the difference; and the parent's copies of the bytes."""
    cost: dict[str, Any] = {}
    empty_us: dict[str, float] = {}
    for mode in ("thread", "process"):
        cost[f"{mode}_ms"] = sequential_ms(mode, job, count, environment)
        empty_us[mode] = sequential_ms(mode, empty_job, count * 10, environment) * 1e3
    return cost | {"extra_ms": cost["process_ms"] - cost["thread_ms"], "null_job_us": empty_us,
                   "ipc_us": empty_us["process"] - empty_us["thread"], "copies_us": copies_us(payload, answer, count)}
