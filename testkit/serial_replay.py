"""Requests sent to an mmgate process one at a time, each with the CPU its process tree spent on it
(``bench/cache``).

One at a time, the CPU mmgate burns between sending a request and reading its answer is that request's: every
thread of the process and of the processes below it (decode worker processes), read from
``/proc/PID/task/*/schedstat`` in nanoseconds (finer than the 10 ms ticks of ``/proc/PID/stat``). The media
step's own cost is that less the CPU of the same body sent to a path that is no media route (read and forwarded
untouched): ``media_cost``.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from testkit import procfs


def tree_cpu_ns(pid: int) -> int:
    """CPU time of every thread of ``pid`` and of the processes below it so far, in ns (0 once it is gone)."""
    total = 0
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return 0
    for task in tasks:
        try:
            total += int((task / "schedstat").read_text().split()[0])
            children = (task / "children").read_text().split()
        except (OSError, ValueError, IndexError):
            continue
        total += sum(tree_cpu_ns(int(child)) for child in children)
    return total


async def replay(url: str, pid: int, bodies: list[bytes], path: str) -> list[dict[str, float]]:
    """Each body once, in order, one at a time, to mmgate (``pid``) at ``url + path``: latency and CPU of each;
    any answer but 200 raises."""
    import aiohttp

    out = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as client:
        for body in bodies:
            cpu0, t0 = tree_cpu_ns(pid), time.perf_counter()
            async with client.post(url + path, data=body, headers={"Content-Type": "application/json"}) as r:
                await r.read()
                status = r.status
            t1, cpu1 = time.perf_counter(), tree_cpu_ns(pid)
            if status != 200:
                raise RuntimeError(f"{path}: HTTP {status}")
            out.append({"cpu_ms": (cpu1 - cpu0) / 1e6, "latency_ms": (t1 - t0) * 1e3, "body_mb": len(body) / 1e6})
    return out


async def media_cost(url: str, pid: int, bodies: list[bytes], media_path: str, plain_path: str) -> dict[str, Any]:
    """``bodies`` replayed on ``media_path``, each request with its ``media_cpu_ms`` (less its CPU on
    ``plain_path``, which is no media route) and ``plain_cpu_ms``; and mmgate's peak RSS (VmHWM, MB) over the
    media replay."""
    procfs.reset_peaks([pid])
    media = await replay(url, pid, bodies, media_path)
    peak = procfs.memory(pid)["VmHWM"]
    plain = await replay(url, pid, bodies, plain_path)
    for m, p in zip(media, plain, strict=True):
        m["media_cpu_ms"] = m["cpu_ms"] - p["cpu_ms"]  # may come out below 0: the noise, shown as it is
        m["plain_cpu_ms"] = p["cpu_ms"]
    return {"turns": media, "peak_rss_mb": peak / 1e6}
