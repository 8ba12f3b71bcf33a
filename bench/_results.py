"""What every bench writes beside its own tables: a stamp, goal records, and the same lines printed and written.

Why one module: docs/benchmarks.md and the README's headline figures are generated from ``bench/results/*.json``
by ``bench/report.py``, so every result file must carry the same few fields, computed the same way:

* a **stamp**: the script that wrote it, what it measures, the commit it ran on (``git rev-parse HEAD``)
  and whether the measured paths had uncommitted changes, the machine (platform, CPU model, usable cores)
  and the date. The report compares the code the result measures (``bench.staleness``) at that commit and
  at HEAD to mark results older than the code they measure;
* **goals**: ``{name, target, unit, median, spread, n, over, met}``, the median of at least
  ``MIN_ROUNDS`` rounds and their spread (min–max), so one lucky or unlucky round cannot carry a claim.
  A goal without a target is a reported figure (``met`` is ``None``).

A bench module builds its goals from its JSON data with a function of its own (so ``--render`` can rebuild them
from a committed file without measuring again); the runner (``bench.harness``) prints them with ``print_goals``
and writes with ``write``.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import subprocess
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from bench import staleness

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
RESULTS = BENCH / "results"
MIN_ROUNDS = 3
STAMP_KEYS = ("script", "what", "measures", "commit", "dirty", "date", "machine")

Goal = dict[str, Any]
Knobs = SimpleNamespace  # one run's knobs (``bench.harness.Scenario.knobs_for``), with ``rounds`` and ``quick``


def git(*args: str) -> str | None:
    """Output of one git command in the repository, or None where git or the history is not available."""
    try:
        out = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, timeout=30,
                             check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def measured_paths(script: str) -> list[str]:
    """The paths whose code a result of ``script`` measures, at HEAD: its rooms and the script itself."""
    return list(staleness.measured_paths(script, REPO))


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (platform.processor() is empty on most Linux builds)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def usable_cores() -> int:
    """Cores this process may run on (affinity, not the machine's total: containers and taskset limit it)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def stamp(script: str, what: str) -> dict[str, Any]:
    """Who measured what, where and when. Take it when the measurement starts, not when it is written.

    ``dirty`` is whether the measured paths differ from the commit: a dirty result measured code that no
    commit holds, so the report treats it as stale.
    """
    paths = measured_paths(script)
    status = git("status", "--porcelain", "--", *paths)
    return {
        "script": script,
        "what": what,
        "measures": paths,
        "commit": git("rev-parse", "HEAD"),
        "dirty": None if status is None else bool(status),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "cpu": cpu_model(), "usable_cores": usable_cores(),
                    "python": platform.python_version()},
    }


def summary(values: Iterable[float | None]) -> dict[str, Any]:
    """Median, min–max spread and count of the rounds' values (None where there are none)."""
    vs = sorted(float(v) for v in values if v is not None)
    if not vs:
        return {"median": None, "spread": None, "n": 0}
    return {"median": statistics.median(vs), "spread": [vs[0], vs[-1]], "n": len(vs)}


def goal(name: str, values: Sequence[float | None], target: str | None = None,
         test: Callable[[float], bool] | None = None, unit: str = "", over: str = "rounds",
         met_on: str = "median") -> Goal:
    """One goal record from the rounds' values.

    ``target`` is what the claim says, in words (``"≤ 5"``); ``test`` decides it on the median (or, with
    ``met_on="every"``, on both ends of the spread, for claims about every round; ``"max"`` / ``"min"``: one end).
    Fewer than ``MIN_ROUNDS`` values still give a median, but the report flags it.
    """
    return record(name, summary(values), target, test, unit, over, met_on)


def record(name: str, s: dict[str, Any], target: str | None = None, test: Callable[[float], bool] | None = None,
           unit: str = "", over: str = "rounds", met_on: str = "median") -> Goal:
    """A goal record from a summary a script computed itself (``{median, spread: [lo, hi], n}``)."""
    met: bool | None = None
    if test is not None and s["median"] is not None:
        lo, hi = s["spread"] or (s["median"], s["median"])
        met = bool(test(lo) and test(hi)) if met_on == "every" else bool(
            test({"median": s["median"], "max": hi, "min": lo}[met_on]))
    return {"name": name, "target": target, "unit": unit, "median": s["median"], "spread": s["spread"],
            "n": s["n"], "over": over, "met_on": met_on, "met": met}


def number(value: float | None) -> str:
    """A figure with about three significant digits: enough for a ratio or a latency, no false precision."""
    if value is None:
        return "–"
    a = abs(value)
    if a >= 100 or a == int(a):
        return f"{value:.0f}"
    if a >= 10:
        return f"{value:.1f}"
    if a >= 1:
        return f"{value:.2f}"
    return f"{value:.3g}"


def summary_text(s: dict[str, Any], unit: str = "") -> str:
    """A summary as a table cell: ``median (min–max)``, – without any value."""
    if s["median"] is None:
        return "–"
    lo, hi = s["spread"]
    return f"{number(s['median'])}{unit} ({number(lo)}–{number(hi)})"


def spread_cell(values: Iterable[float | None], unit: str = "") -> str:
    """The rounds' values as a table cell: ``median (min–max)``, – without any."""
    return summary_text(summary(values), unit)


def spread_text(g: Goal) -> str:
    """``lo–hi``, or why there is none (older files recorded only the median)."""
    if not g["spread"]:
        return "spread not recorded"
    lo, hi = g["spread"]
    return f"{number(lo)}–{number(hi)}"


def goal_text(g: Goal) -> str:
    """``name: median unit (min–max over n rounds); target → met`` as printed, written and in the README."""
    unit = f" {g['unit']}" if g["unit"] else ""
    if g["median"] is None:
        return f"{g['name']}: not measured"
    text = f"{g['name']}: {number(g['median'])}{unit} ({spread_text(g)} over {g['n']} {g['over']})"
    if g["target"] is not None:
        on = "" if g["met_on"] == "median" else f" ({g['met_on']})"
        text += f"; goal {g['target']}{unit}{on}: {'met' if g['met'] else 'NOT met'}"
    if g["n"] < MIN_ROUNDS and g["over"] == "rounds":
        text += f" [only {g['n']} rounds, < {MIN_ROUNDS}]"
    return text


def table(columns: Sequence[tuple[str, str, str]], rows: Iterable[Mapping[str, Any]],
          spaced: bool = False) -> list[str]:
    """A Markdown table of ``rows``: ``columns`` are (title, key, format spec); text ("s") is left-aligned,
    figures right-aligned, and a missing figure (None) is –. ``spaced``: the separator row as ``| --- | ---: |``."""
    aligns = ["---" if spec == "s" else "---:" for _, _, spec in columns]
    return ["| " + " | ".join(title for title, _, _ in columns) + " |",
            "| " + " | ".join(aligns) + " |" if spaced else "|" + "|".join(aligns) + "|",
            *("| " + " | ".join("–" if row[key] is None else format(row[key], spec) for _, key, spec in columns) + " |"
              for row in rows)]


def goal_lines(goals: Sequence[Goal]) -> list[str]:
    """One Markdown bullet per goal, the same lines the script prints."""
    return [f"- {goal_text(g)}" for g in goals]


def stamp_line(data: dict[str, Any]) -> str:
    """The provenance line at the top of a result's .md."""
    commit = data.get("commit")
    where = f"commit `{commit[:10]}`" + (" (uncommitted changes)" if data.get("dirty") else "") if commit \
        else "commit unknown"
    machine = data.get("machine") or {}
    box = ", ".join([*(str(machine[k]) for k in ("platform", "cpu") if machine.get(k)),
                     *([f"{machine['usable_cores']} usable cores"] if machine.get("usable_cores") else [])])
    box = box or "machine not recorded"
    return f"Measured at {where}, {data.get('date') or 'date unknown'}, {box}."


USAGE = "\n    python -m bench"  # where a bench module's docstring starts saying how to run it


def page(doc: str, data: dict[str, Any], body: str) -> str:
    """A result's page before its stamp and goals go in (``with_goals``): the bench module's docstring (``doc``)
    gives its title (the first paragraph) and what it measures (the rest, up to how to run it), then the knobs the run
    had (``knobs`` in the data: the harness records them), then ``body``, the module's ``report``: its tables and
    what it computes of them. A ``body`` that is a page already (it starts with its ``# `` title) stays as it is."""
    if body.startswith("# "):
        return body
    title, _, about = doc.strip().partition("\n\n")
    lines = [f"# {' '.join(title.split()).rstrip('.')}", "", about.split(USAGE)[0].strip(), ""]
    if data.get("knobs"):
        lines += ["Knobs: " + ", ".join(f"`{name}={value}`" for name, value in data["knobs"].items()) + ".", ""]
    return "\n".join([*lines, body.strip("\n")]) + "\n"


def with_goals(md: str, data: dict[str, Any]) -> str:
    """The script's own Markdown, after a heading line, the stamp line and the goals."""
    head, _, rest = md.partition("\n")
    lines = [head, "", stamp_line(data), "", "## Goals", "", *goal_lines(data.get("goals", [])), "", rest.strip("\n")]
    return "\n".join(lines).rstrip("\n") + "\n"


def texts(data: dict[str, Any], md: str) -> tuple[str, str]:
    """A result's ``.json`` and ``.md`` as written: the JSON starts with the stamp and the goals so a reader (or
    the report) finds them first; the page is ``with_goals``."""
    first = {k: data[k] for k in (*STAMP_KEYS, "goals") if k in data}
    rest = {k: v for k, v in data.items() if k not in first}
    return json.dumps(first | rest, indent=1, default=str) + "\n", with_goals(md, data)


def write(name: str, data: dict[str, Any], md: str, out: Path | None = None) -> None:
    """Write ``<name>.json`` and ``<name>.md`` (``texts``) under bench/results (or ``out`` without suffix)."""
    path = out or RESULTS / name
    path.parent.mkdir(parents=True, exist_ok=True)
    json_text, page = texts(data, md)
    path.with_suffix(".json").write_text(json_text)
    path.with_suffix(".md").write_text(page)


def print_goals(goals: Sequence[Goal]) -> None:
    """Every goal as met / not met, with its median and spread, on stdout."""
    print("goals:")
    for line in goal_lines(goals):
        print(" ", line)


def downsample(series: Sequence[Sequence[float]], column: int, points: int = 120) -> list[list[float]]:
    """At most ``points`` rows of a time series, keeping the highest ``column`` value of each bucket.

    Why the maximum: these series are RSS samples whose peaks are the finding; a plain stride could drop
    them. Plots read from the JSON stay readable with ~100 points, and the JSON stays small enough for git.
    """
    rows = [list(r) for r in series]
    if len(rows) <= points:
        return rows
    size = len(rows) / points
    out = []
    for b in range(points):
        bucket = rows[int(b * size):int((b + 1) * size)] or rows[-1:]
        out.append(max(bucket, key=lambda r: (r[column] if r[column] == r[column] else float("-inf"))))
    return out


def rows_of(data: dict[str, Any]) -> dict[tuple[str, str, int], dict[str, dict[int, dict[str, Any]]]]:
    """(backend, images, clients) → mode → round → cell."""
    rows: dict[tuple[str, str, int], dict[str, dict[int, dict[str, Any]]]] = {}
    for cell in data["cells"]:
        rows.setdefault((cell["backend"], cell["images"], cell["clients"]), {}).setdefault(
            cell["mode"], {})[cell["round"]] = cell
    return rows


def ratios(modes: dict[str, dict[int, dict[str, Any]]], mode: str, key: str) -> list[float | None]:
    """Through mmgate ÷ direct for ``key``, round by round."""
    out: list[float | None] = []
    for round_, direct in modes.get("direct", {}).items():
        cell = modes.get(mode, {}).get(round_)
        if cell is None or not direct.get(key) or cell.get(key) is None or cell.get("completed") != direct.get(
                "completed"):
            out.append(None)
        else:
            out.append(cell[key] / direct[key])
    return out
