"""What the benchmarks read of the processes they start, from ``/proc``: CPU time in clock ticks, minor page
faults, and the processes below one (mmgate's front processes, its decode worker processes), summed over the
tree. A process gone meanwhile counts nothing: a bench reads a tree that changes while it runs."""

from __future__ import annotations

import os
from pathlib import Path

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


def tree_cpu_seconds(root: int) -> float:
    """utime + stime of ``root`` and the live processes below it, seconds."""
    return cpu_ticks([root, *descendants(root)]) / CLK_TCK


def tree_minor_faults(root: int) -> int:
    """Minor page faults of ``root`` and the live processes below it so far (fresh memory costs ~3 µs per 4 KiB
    page on these VMs)."""
    return stat_sum([root, *descendants(root)], MINFLT)
