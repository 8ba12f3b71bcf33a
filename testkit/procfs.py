"""What the benchmarks read of the processes they start, from ``/proc``: CPU time in clock ticks, minor page
faults, resident memory and its peak, and the processes below one (mmgate's front processes, its decode worker
processes; vLLM's engine core), summed over the tree; the whole machine's busy time; and ``RssSampler``, one
process's RSS read every so often while a load runs (soak, malloc_arenas). A process gone meanwhile counts
nothing: a bench reads a tree that changes while it runs."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from types import TracebackType
from typing import Any

CLK_TCK = os.sysconf("SC_CLK_TCK")
# Fields of /proc/PID/stat after the command's closing parenthesis, counted from 0 (proc(5) numbers them from 1
# and counts the pid and the command: add 3).
PPID, MINFLT, UTIME, STIME, CUTIME, CSTIME = 1, 7, 11, 12, 13, 14  # cutime, cstime: of children reaped


def stat_fields(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command; None once the process is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def descendants(root: int) -> list[int]:
    """Every live process below ``root``, from /proc's parent pids."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            fields = stat_fields(int(entry.name))
            if fields is not None:
                children.setdefault(int(fields[PPID]), []).append(int(entry.name))
    out, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def tree(root: int) -> list[int]:
    """``root`` and every live process below it."""
    return [root, *descendants(root)]


def memory(pid: int, keys: tuple[str, ...] = ("VmHWM", "VmRSS")) -> dict[str, int]:
    """VmRSS and VmHWM (its peak) of ``pid``, or the other ``keys`` of /proc/PID/status (``RssAnon``...), bytes;
    empty once the process is gone."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return {}
    return {key: int(rest.split()[0]) * 1024 for key, _, rest in (line.partition(":") for line in lines)
            if key in keys}


class RssSampler:
    """A thread that reads ``pid``'s VmRSS every ``interval`` s while its ``with`` block runs (or until the process
    is gone) and keeps ``row(rss)`` of each reading in ``rows``. A thread, not a task: the load's event loop, busy
    sending, would delay the readings."""

    def __init__(self, pid: int, interval: float, row: Callable[[int], Any]) -> None:
        self.pid, self.interval, self.row = pid, interval, row
        self.rows: list[Any] = []
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self.stopped.is_set():
            rss = memory(self.pid).get("VmRSS")
            if rss is None:
                return
            self.rows.append(self.row(rss))
            self.stopped.wait(self.interval)

    def __enter__(self) -> list[Any]:
        self.thread.start()
        return self.rows

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self.stopped.set()
        self.thread.join()


def reset_peaks(pids: Iterable[int]) -> bool:
    """Reset VmHWM of each of ``pids`` to its current RSS (writing 5 to /proc/PID/clear_refs, Linux ≥ 4.0), so
    the next VmHWM reading is the peak of what happened since, not of the process's whole life. False if any
    was refused."""
    return all([_reset_peak(pid) for pid in pids])  # a list: every pid is reset, whatever one answers


def _reset_peak(pid: int) -> bool:
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
    except OSError:
        return False
    status = memory(pid)
    return bool(status) and status["VmHWM"] <= status["VmRSS"] + 64 * 1024  # a few pages may be touched meanwhile


def machine_jiffies() -> tuple[int, int]:
    """(busy, total) CPU jiffies of the whole machine since boot, from /proc/stat."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    total = sum(fields[:8])  # guest time is already counted in user
    return total - idle, total


def stat_sum(pids: list[int], *indices: int) -> int:
    """``indices`` of /proc/PID/stat summed over ``pids``."""
    total = 0
    for pid in pids:
        fields = stat_fields(pid)
        if fields is not None:
            total += sum(int(fields[i]) for i in indices)
    return total


def cpu_ticks(pids: list[int]) -> int:
    """utime + stime of ``pids`` (all their threads), clock ticks."""
    return stat_sum(pids, UTIME, STIME)


def tree_cpu_seconds(root: int, reaped: bool = False) -> float:
    """utime + stime of ``root`` and the live processes below it, seconds; with ``reaped``, also of the children
    they reaped (cutime, cstime: a worker recycled meanwhile still counts, through its parent)."""
    return stat_sum(tree(root), UTIME, STIME, *((CUTIME, CSTIME) if reaped else ())) / CLK_TCK


def tree_minor_faults(root: int) -> int:
    """Minor page faults of ``root`` and the live processes below it so far (fresh memory costs ~3 µs per 4 KiB
    page on these VMs)."""
    return stat_sum(tree(root), MINFLT)
