"""How one mmgate process scales with its decode workers: throughput, cores used, and a responsive loop.

One mmgate process (``python -m proxy``, a subprocess) in front of a trivial upstream (``testkit.text_load``'s
raw asyncio upstream, its own process: it reads the whole body, then answers a fixed completion). Clients
send the same 12 MP photo-like JPEG (``testkit.media.photo_jpeg``, 3.5 MB as base64) in an OpenAI chat
request, back to back, from load-generator processes of their own (``multiprocessing``), enough of them to
keep every worker busy (2 × workers + 2 clients; the gate admits 2 × workers at once, the rest queue).

Cells: decode mode (the ``decode_mode`` setting, thread | process; a build that does not know it gets its
process rows marked "not available in this build") × resize on (``--resize-max-pixels 1000000``: decode,
resize, re-encode) and off (decode and check only, the original forwarded) × decode workers 1, 2, 4, 8 and
cores − 2, those that fit the usable cores. Each cell, in each round: fresh processes, a warm-up, a ramp,
then a measured window, during which

* **req/s**: 200 answers completed inside the window, and ``× 1 worker`` against the same mode and
  resize with one worker in the same round;
* **mmgate cores**: CPU (utime + stime, reaped children included) of mmgate and every process below it
  (process mode's workers), read from /proc, over the window's wall time; **CPU ms/request** the same
  CPU over the requests completed;
* **health p50/p99/max**: a prober in its own process sends ``GET /mmgate/health`` every 10 ms;
* **peak RSS**: VmHWM of mmgate and the sum of its worker processes' VmHWM, both reset at the window's start;
* **load generators' CPU**: their cores over the window, printed with a warning when one of them is
  close to a full core (then it, not mmgate, may be the limit).

The cells take turns round after round; each figure is the median of --rounds rounds with its min–max
spread. Goals: 16 cores, 14 workers (resize on): req/s ≥ 11 × one worker, health p99 ≤ 10 ms and max ≤
25 ms (marked "not yet measured" on a machine with fewer cores; the same command measures them there); 2
workers ≥ 1.9 × one worker; per validated (resize off) request, process mode's CPU ≤ 1.1 × thread mode's
(same worker count, same round).

**First request after a start** (``--first``, each mode, each round): a fresh mmgate with its defaults
(header validation: the 12 MP photo is checked from its header), and one with ``MMGATE_MODEL`` (an Idefics3
processor folder of ``testkit.models``: the photo is decoded and resized to the model's size), as soon as
``/mmgate/health`` answers, gets one request, then ``FIRST_WARM`` more one at a time, each on a new connection;
the figure is the first's latency over the median of the warm ones. Goal: ≤ 1.5 in every case (decode threads
and worker processes warm up, with the model's geometry, as mmgate starts).

    python -m bench run scale [--set KNOB=VALUE] [--rounds N] [--quick]
    python -m bench run scale_16cores [--set KNOB=VALUE] [--rounds N] [--quick]
    python -m bench list scale scale_16cores   # the knobs and their defaults
    (2 cores, defaults: about 6 minutes; 16 cores: about 11)

Writes bench/results/scale.md and .json.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

from bench import _results as R
from testkit.models import idefics3_folder
from testkit.worker_scaling import FIRST_WARM, PROBE_INTERVAL, first_request, loaded_cell, process_mode_available

MANY_CORES, MANY_WORKERS = 16, 14
GOAL_MANY_X, GOAL_P99_MS, GOAL_MAX_MS, GOAL_TWO_X = 11.0, 10.0, 25.0, 1.9
GOAL_PROCESS_CPU_X = 1.1  # process mode's CPU per validated request over thread mode's
GOAL_FIRST_X = 1.5  # the first request after a start over a warm one
MODEL_SUFFIX = ", MMGATE_MODEL"
NOT_AVAILABLE = "not available in this build"
FIGURES = ("rps", "cores", "cpu_ms_per_req", "health_p50_ms", "health_p99_ms", "health_max_ms", "rss_mmgate_mb",
           "rss_workers_mb")
Cell = tuple[str, bool, int]  # decode mode, resize, workers


def worker_counts(cores: int) -> list[int]:
    return sorted({w for w in (1, 2, 4, 8, cores - 2) if 1 <= w <= cores})


def measure(knobs: R.Knobs) -> dict[str, Any]:
    cores = R.usable_cores()
    if knobs.first not in ("on", "off", "only"):
        raise SystemExit("first is on, off or only")
    load_procs = knobs.load_procs or max(1, cores // 8)
    stamp = R.stamp("scale.py", "req/s, cores, CPU per request, health latency and peak RSS against decode workers")
    workers = sorted({int(w) for w in (knobs.workers or ",".join(map(str, worker_counts(cores)))).split(",")} | {1})
    resizes = [r == "on" for r in knobs.resize.split(",")]  # every ratio is against one worker: 1 is always in
    has_process = process_mode_available()
    modes = knobs.modes.split(",")
    cells = [(m, r, w) for m in modes for r in resizes for w in workers] if knobs.first != "only" else []
    rounds: dict[Cell, list[dict[str, Any]]] = {cell: [] for cell in cells}
    firsts: dict[str, list[dict[str, Any]]] = ({f"{m}{suffix}": [] for m in modes for suffix in ("", MODEL_SUFFIX)}
                                               if knobs.first != "off" else {})
    model_folder = idefics3_folder(Path(tempfile.mkdtemp(prefix="scale-model-"))) if firsts else None
    print(f"{cores} usable cores; workers {workers}; process mode "
          f"{'available' if has_process else NOT_AVAILABLE}", flush=True)
    began = time.monotonic()
    for n in range(knobs.rounds):
        for name in firsts:
            mode = name.removesuffix(MODEL_SUFFIX)
            if mode == "process" and not has_process:
                continue
            first = first_request(mode, has_process, model_folder if name.endswith(MODEL_SUFFIX) else None)
            firsts[name].append(first)
            print(f"  round {n + 1} {name:20} first request after start {first['first_ms']:.0f} ms, warm "
                  f"{first['warm_ms']:.0f} ms: {first['x_warm']:.2f} ×", flush=True)
        for mode, resize, count in cells:
            if mode == "process" and not has_process:
                continue
            row = loaded_cell(mode, resize, count, knobs.seconds, knobs.ramp, load_procs, mode_env=has_process)
            rounds[(mode, resize, count)].append(row)
            busy = max(row["load_cores"])
            print(f"  round {n + 1} {mode:7} resize {'on ' if resize else 'off'} {count:3} workers: "
                  f"{row['rps']:6.1f} req/s  {row['cores']:5.2f} cores  "
                  f"{R.number(row['cpu_ms_per_req'])} CPU ms/req  health p50 {row['health_p50_ms']:.1f} "
                  f"p99 {row['health_p99_ms']:.1f} max {row['health_max_ms']:.1f} ms  RSS "
                  f"{row['rss_mmgate_mb']:.0f}+{row['rss_workers_mb']:.0f} MB  load generators "
                  f"{'+'.join(f'{c:.2f}' for c in row['load_cores'])} cores"
                  f"{'  (a load generator near a full core: it may be the limit)' if busy > 0.8 else ''}"
                  f"{'  ' + str(row['not_ok']) + ' not 200' if row['not_ok'] else ''}", flush=True)
    return stamp | {"settings": {"seconds": knobs.seconds, "ramp_s": knobs.ramp, "rounds": knobs.rounds,
                                 "workers": workers, "load_procs": load_procs, "cores": cores,
                                 "probe_interval_s": PROBE_INTERVAL, "process_mode": has_process,
                                 "elapsed_s": round(time.monotonic() - began)},
                    "rows": summarise(rounds, has_process), "first_request": firsts}


def summarise(rounds: dict[Cell, list[dict[str, Any]]], has_process: bool) -> list[dict[str, Any]]:
    """A row per cell: each figure's summary over the rounds, and req/s over one worker's in the same round."""
    rows = []
    for (mode, resize, count), measured in rounds.items():
        row: dict[str, Any] = {"mode": mode, "resize": resize, "workers": count, "rounds": measured}
        if not measured:
            rows.append(row | {"note": NOT_AVAILABLE if mode == "process" and not has_process else "not measured"})
            continue
        one = rounds.get((mode, resize, 1), [])
        row["x_one_worker"] = R.summary(r["rps"] / o["rps"] for r, o in zip(measured, one, strict=False) if o["rps"])
        row |= {key: R.summary(r[key] for r in measured) for key in FIGURES}
        row["load_cores_max"] = max(max(r["load_cores"]) for r in measured)
        row["not_ok"] = sum(r["not_ok"] for r in measured)
        rows.append(row)
    return rows


def goals(data: dict[str, Any]) -> list[R.Goal]:
    settings, rows = data["settings"], data["rows"]
    cores, has_process = settings["cores"], settings["process_mode"]

    def row(mode: str, count: int) -> dict[str, Any] | None:
        return next((r for r in rows if r["mode"] == mode and r["resize"] and r["workers"] == count
                     and "rps" in r), None)

    empty = {"median": None, "spread": None, "n": 0}
    out = []
    for mode in dict.fromkeys(r["mode"] for r in rows):
        unavailable = mode == "process" and not has_process
        many = row(mode, MANY_WORKERS) if cores >= MANY_CORES else None
        where = f"{mode} mode, {MANY_CORES} cores, {MANY_WORKERS} workers, resize 1 MP"
        suffix = f" ({NOT_AVAILABLE})" if unavailable else "" if many else f" (not yet measured: {cores} cores here)"
        out.append(R.record(f"{where}: req/s ÷ one worker{suffix}", many["x_one_worker"] if many else empty,
                            f"≥ {GOAL_MANY_X:g}", lambda x: x >= GOAL_MANY_X))
        out.append(R.record(f"{where}: health p99{suffix}", many["health_p99_ms"] if many else empty,
                            f"≤ {GOAL_P99_MS:g}", lambda x: x <= GOAL_P99_MS, unit="ms"))
        out.append(R.record(f"{where}: health max{suffix}", many["health_max_ms"] if many else empty,
                            f"≤ {GOAL_MAX_MS:g}", lambda x: x <= GOAL_MAX_MS, unit="ms"))
        two = row(mode, 2)
        suffix = f" ({NOT_AVAILABLE})" if unavailable else "" if two else " (not measured)"
        out.append(R.record(f"{mode} mode, 2 workers on {cores} cores, resize 1 MP: req/s ÷ one worker{suffix}",
                            two["x_one_worker"] if two else empty, f"≥ {GOAL_TWO_X:g}", lambda x: x >= GOAL_TWO_X))
    # process mode's CPU per validated request over thread mode's, each round's pair
    rounds = {(r["mode"], r["resize"], r["workers"]): r["rounds"] for r in rows}
    for count in settings["workers"]:
        threads, processes = rounds.get(("thread", False, count), []), rounds.get(("process", False, count), [])
        ratios = [p["cpu_ms_per_req"] / t["cpu_ms_per_req"] for p, t in zip(processes, threads, strict=False)
                  if p["cpu_ms_per_req"] and t["cpu_ms_per_req"]]
        if ratios:
            out.append(R.goal(f"process mode, {count} worker(s), validated 12 MP (resize off): CPU per request ÷ "
                              "thread mode's", ratios, f"≤ {GOAL_PROCESS_CPU_X:g}",
                              lambda x: x <= GOAL_PROCESS_CPU_X, unit="×"))
    for name, measured in (data.get("first_request") or {}).items():
        if measured:
            mode, model = name.removesuffix(MODEL_SUFFIX), name.endswith(MODEL_SUFFIX)
            what = "resized to the model's size" if model else "header validation"
            out.append(R.goal(f"{mode} mode{MODEL_SUFFIX if model else ''}: first request after a start ÷ a warm "
                              f"one (12 MP, {what})", [m["x_warm"] for m in measured], f"≤ {GOAL_FIRST_X:g}",
                              lambda x: x <= GOAL_FIRST_X, unit="×"))
    return out


def report(data: dict[str, Any]) -> str:
    s, fig = data["settings"], R.summary_text
    lines = [
        f"{s['rounds']} rounds × {s['seconds']:g} s per cell (after a {s['ramp_s']:g} s "
        f"ramp), {s['cores']} usable cores, {s['load_procs']} load-generator process(es), clients = 2 × workers + 2, "
        f"gate = 2 × workers, a prober every {s['probe_interval_s'] * 1000:g} ms; {s['elapsed_s']} s in all. "
        "Each figure: median (min–max) of the rounds. `cores` and `CPU ms/req`: mmgate and every process below it. "
        "`RSS`: peak of mmgate + sum of its worker processes' peaks over the window.",
        "",
        "| mode | resize | workers | req/s | × 1 worker | mmgate cores | CPU ms/req | health p50 ms | p99 ms | "
        "max ms | peak RSS MB (mmgate + workers) | load gen. cores (max) | not 200 |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in data["rows"]:
        head = f"| {r['mode']} | {'1 MP' if r['resize'] else 'off'} | {r['workers']} |"
        if "rps" not in r:
            lines.append(head + f" {r['note']} |" + " |" * 9)
            continue
        figures = " | ".join(fig(r[key]) for key in ("rps", "x_one_worker", *FIGURES[1:6]))
        lines.append(f"{head} {figures} | {R.number(r['rss_mmgate_mb']['median'])} + "
                     f"{R.number(r['rss_workers_mb']['median'])} | {r['load_cores_max']:.2f} | {r['not_ok']} |")
    firsts = data.get("first_request") or {}
    if any(firsts.values()):
        lines += ["", "First request after a start (a 12 MP photo: mmgate's defaults, and with `MMGATE_MODEL` "
                  "resized to the model's size), then "
                  f"{FIRST_WARM} warm ones one at a time, each on a new connection:", "",
                  "| mode | first ms | warm ms (median) | first ÷ warm |", "|---|---:|---:|---:|",
                  *(f"| {mode} | " + " | ".join(fig(R.summary(m[key] for m in measured))
                                                for key in ("first_ms", "warm_ms", "x_warm")) + " |"
                    for mode, measured in firsts.items() if measured)]
    if s["cores"] < MANY_CORES:
        lines += ["", f"{MANY_CORES} cores, {MANY_WORKERS} workers: not yet measured (this machine has {s['cores']} "
                  "usable cores); the same command measures that row on a machine that has them."]
    return "\n".join(lines) + "\n"
