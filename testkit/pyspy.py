"""Where a running process's Python time goes, sampled with py-spy: self and inclusive time per function, and
time by area (the innermost mmgate frame, else the leaf's module), as a bench reports it beside its figures.

py-spy samples in blocking mode (non-blocking sampling of a busy process truncates about half of the stacks) and
records Python frames only: C code is charged to the Python function calling it. Keep the process under load
while ``record`` runs; it takes ``seconds`` (twice that, plus a little, with a flame graph).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def pyspy_path() -> str | None:
    """py-spy beside this interpreter (a venv's), else on PATH."""
    local = Path(sys.executable).parent / "py-spy"
    return str(local) if local.exists() else shutil.which("py-spy")


def record(pid: int, seconds: int, svg: Path | None = None, rate: int = 200, cpu: str | None = None) -> dict[str, Any]:
    """Sample ``pid`` for ``seconds``, summarised (``summarise_stacks``); then, with ``svg``, a second run writes a
    flame graph there (py-spy writes one format per run, and two blocking samplers cannot share a process).
    ``cpu``: the CPU py-spy runs on (taskset), away from the one it measures."""
    pyspy = pyspy_path()
    if pyspy is None:
        raise RuntimeError("py-spy is not installed (pip install py-spy)")
    fd, name = tempfile.mkstemp(prefix="pyspy-", suffix=".txt")
    os.close(fd)
    raw = Path(name)
    pinned = ["taskset", "-c", cpu] if cpu is not None else []
    try:
        for out in [["--format", "raw", "-o", str(raw)]] + ([["-o", str(svg)]] if svg is not None else []):
            subprocess.run([*pinned, pyspy, "record", "--pid", str(pid), "--duration", str(seconds),
                            "--rate", str(rate), *out], capture_output=True, timeout=seconds + 60)
        return summarise_stacks(raw.read_text(), expected=rate * seconds)
    finally:
        raw.unlink()


def frame_name(frame: str) -> str:
    """'func (path/to/file.py:123)' -> 'func (pkg/file.py)' without the line number."""
    match = re.match(r"(.*) \((.*?)(?::\d+)?\)$", frame)
    if not match:
        return frame
    func, path = match.groups()
    marker = next((m for m in ("site-packages/", "lib/python3.11/", f"{REPO}/") if m in path), None)
    return f"{func} ({path.split(marker, 1)[1] if marker else path})"


def area_of(frames: list[str]) -> str:
    """Which part of the stack the leaf time belongs to: the innermost mmgate frame, else the leaf's module."""
    for frame in reversed(frames):
        if "(proxy/" in frame:
            return "mmgate " + frame
    module = frames[-1][frames[-1].find("(") + 1 : -1]
    return module.split("/")[0] + "/" + module.split("/")[-1] if "/" in module else module


def summarise_stacks(raw: str, expected: int) -> dict[str, Any]:
    """py-spy's raw output (``frame;frame;... count`` lines) -> samples, the share of ``expected`` samples taken
    (how busy the process was), and the top functions by self and inclusive time and the top areas, each with its
    samples and percent of all."""
    self_time: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    by_area: Counter[str] = Counter()
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = [frame_name(f) for f in stack.split(";")]
        if frames and frames[0].startswith("process "):  # py-spy prefixes the process/thread when asked to
            frames = frames[1:]
        if frames := [f for f in frames if not f.startswith("thread ")]:
            self_time[frames[-1]] += int(count)
            inclusive.update(dict.fromkeys(frames, int(count)))  # once per sample, however deep it recurses
            by_area[area_of(frames)] += int(count)
    total = self_time.total()

    def top(counter: Counter[str], k: int) -> list[dict[str, Any]]:
        return [{"function": name, "samples": n, "percent": round(100 * n / max(total, 1), 1)}
                for name, n in counter.most_common(k)]

    return {"samples": total, "busy_share": round(total / max(expected, 1), 3), "self": top(self_time, 25),
            "inclusive": top(inclusive, 40), "areas": top(by_area, 12)}


# The frames every sample of an asyncio server has (interpreter start-up down to the event loop): they would top an
# inclusive table at ~100 %, so it leaves them out.
OUTER_FRAMES = {"run", "<module>", "main", "_run_module_as_main", "_run_code", "Runner.run",
                "BaseEventLoop.run_forever", "BaseEventLoop.run_until_complete", "BaseEventLoop._run_once"}


def tables(summary: dict[str, Any], self_rows: int = 20, inclusive_rows: int = 22) -> list[str]:
    """A summary's Markdown: the top functions by self time, then by inclusive time below the event loop."""
    below_loop = [row for row in summary["inclusive"] if row["function"].split(" (")[0] not in OUTER_FRAMES]
    return ["| self time: function (file) | % |", "|---|---:|",
            *(f"| `{row['function']}` | {row['percent']} |" for row in summary["self"][:self_rows]),
            "", "| inclusive (below the event loop): function (file) | % |", "|---|---:|",
            *(f"| `{row['function']}` | {row['percent']} |" for row in below_loop[:inclusive_rows])]
