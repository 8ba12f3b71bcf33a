"""The defaults found from the machine: the CPUs this process may use, and what follows from them."""

from __future__ import annotations

import os
from typing import Literal

# From this many usable CPUs on, decode workers are processes by default (docs/tuning.md, "Decode mode", says why).
PROCESS_MODE_FROM_CPUS = 2

DecodeMode = Literal["thread", "process"]

# The fewest media requests MMGATE_MAX_MM_CONCURRENCY admits by default, whatever the decode workers: below it a
# backend that batches idles between admissions (docs/tuning.md, "Concurrency": the measurement on 2 cores).
MIN_DEFAULT_MM_CONCURRENCY = 4


def usable_cpus() -> int:
    """CPUs this process may really use: affinity mask and cgroup v2 quota, not ``os.cpu_count()``."""
    try:
        count = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        count = os.cpu_count() or 1
    try:
        with open("/sys/fs/cgroup/cpu.max") as f:
            quota, period = f.read().split()
        if quota != "max":
            count = min(count, max(1, int(int(quota) // int(period))))
    except (OSError, ValueError):
        pass
    return max(1, count)


def default_decode_mode(cpus: int) -> DecodeMode:
    """``thread`` with one usable CPU, where one worker's GIL holds cost the loop little and a process is not
    worth its memory and copies; ``process`` from PROCESS_MODE_FROM_CPUS on, where the threads' holds add up
    and the event loop queues behind them (docs/tuning.md: the measurements behind the threshold)."""
    return "process" if cpus >= PROCESS_MODE_FROM_CPUS else "thread"


def usable_decode_mode() -> DecodeMode:
    """``default_decode_mode`` of this machine: ``MMGATE_DECODE_MODE``'s default."""
    return default_decode_mode(usable_cpus())


def auto_processes(cpus: int, decode_workers: int) -> int:
    """``MMGATE_PROCESSES=auto``: one front process per usable CPU (one event loop uses at most one CPU, and
    more loops than CPUs only add memory and context switches), at most one per decode worker (each front
    decodes with its share of ``MMGATE_DECODE_WORKERS``, at least one)."""
    return max(1, min(cpus, decode_workers))


def default_mm_concurrency(decode_workers: int) -> int:
    """``MMGATE_MAX_MM_CONCURRENCY``'s default: one media request past admission a decode worker, so none waits
    idle while requests queue, and never under ``MIN_DEFAULT_MM_CONCURRENCY``, so a backend is kept busy while
    mmgate decodes the next request's images."""
    return max(MIN_DEFAULT_MM_CONCURRENCY, decode_workers)


def usable_mm_concurrency() -> int:
    """``default_mm_concurrency`` with the default decode workers (this machine's usable CPUs)."""
    return default_mm_concurrency(usable_cpus())
