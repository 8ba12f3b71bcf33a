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

import asyncio
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import _results as R
from testkit import load as L
from testkit import procfs
from testkit.models import idefics3_folder
from testkit.text_load import ROLE

RESIZE_FLAGS = ("--resize-max-pixels", "1000000")
MANY_CORES, MANY_WORKERS = 16, 14
GOAL_MANY_X, GOAL_P99_MS, GOAL_MAX_MS, GOAL_TWO_X = 11.0, 10.0, 25.0, 1.9
GOAL_PROCESS_CPU_X = 1.1  # process mode's CPU per validated request over thread mode's
GOAL_FIRST_X = 1.5  # the first request after a start over a warm one
MODEL_SUFFIX = ", MMGATE_MODEL"
FIRST_WARM = 5
PROBE_INTERVAL = 0.01
PROBER_START_S = 0.5
NOT_AVAILABLE = "not available in this build"
# The variable of the decode_mode setting, spelt the way Settings derives it from the setting's name: a build
# without the setting must not list it among the variables the project uses.
MODE_VARIABLE = "MMGATE_" + "decode_mode".upper()


# ----------------------------------------------------------------------------------------------------------
# the process tree's CPU and memory, from /proc


def peaks(root: int) -> tuple[int, int]:
    """(VmHWM of mmgate, sum of its descendants' VmHWM), bytes."""
    return (procfs.memory(root).get("VmHWM", 0),
            sum(procfs.memory(pid).get("VmHWM", 0) for pid in procfs.descendants(root)))


# ----------------------------------------------------------------------------------------------------------
# load generators: processes of their own


def _load_generator(url: str, clients: int, stop_at: float, results: Any) -> None:
    """Runs in a child process: ``clients`` clients until ``stop_at`` (time.monotonic, shared by every process
    on Linux); sends back (monotonic end time, status) of each answer."""
    from testkit.media import chat_body, photo_jpeg

    body = chat_body(photo_jpeg())

    async def until_stop() -> L.LoadRun:
        stop = asyncio.Event()
        asyncio.get_running_loop().call_later(max(0.0, stop_at - time.monotonic()), stop.set)
        return await L.run_load(url, body, clients, stop_event=stop, timeout=120)

    offset = time.monotonic() - time.perf_counter()  # run_load stamps perf_counter
    run = asyncio.run(until_stop())
    results.send([(r.ended + offset, r.status if not r.error else 0) for r in run.results])
    results.close()


# ----------------------------------------------------------------------------------------------------------
# one cell, one round


def process_mode_available() -> bool:
    """Whether this build knows the decode mode ``process`` (an unknown variable is warned about, not refused)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MMGATE_")} | {MODE_VARIABLE: "process"}
    out = subprocess.run([sys.executable, "-m", "proxy", "--print-config", "--upstream", "http://127.0.0.1:9"],
                         cwd=R.REPO, env=env,
                         capture_output=True, text=True, timeout=60)
    return out.returncode == 0 and MODE_VARIABLE not in out.stderr


def measure_cell(mode: str, resize: bool, workers: int, args: R.Knobs, mode_env: bool) -> dict[str, Any]:
    from testkit.media import chat_body, photo_jpeg

    clients = 2 * workers + 2
    # --validate full: with resize off each image is still decoded and checked, the pool's work being measured
    flags = ["--validate", "full", "--decode-workers", str(workers), "--max-mm-concurrency", str(2 * workers),
             "--max-queue", str(4 * clients), "--queue-timeout", "120", "--max-inflight-media-mb", "8192",
             *(RESIZE_FLAGS if resize else ())]
    env = {MODE_VARIABLE: mode} if mode_env else {}
    upstream_port = L.free_port()
    upstream = subprocess.Popen([*ROLE, "upstream", "--port", str(upstream_port)], cwd=R.REPO,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    gate = None
    generators: list[tuple[Any, Any]] = []  # (process, the end of its pipe)
    try:
        upstream_url = f"http://127.0.0.1:{upstream_port}"
        gate, url = L.start_mmgate(upstream_url, *flags, env=env)
        warm = asyncio.run(L.run_load(url, chat_body(photo_jpeg()), workers, requests_per_client=1))
        if warm.statuses() != {"200": workers}:
            raise RuntimeError(f"{mode}/{workers}: the warm-up answered {warm.statuses()}")
        procs = max(1, min(args.load_procs, clients))
        ctx = multiprocessing.get_context("spawn")
        window_start = time.monotonic() + args.ramp + 1.0  # the generators need about a second to start
        window_end = window_start + args.seconds
        for n in range(procs):
            receive, send = ctx.Pipe(duplex=False)
            share = clients // procs + (1 if n < clients % procs else 0)
            proc = ctx.Process(target=_load_generator, args=(url, share, window_end, send), daemon=True)
            proc.start()
            send.close()
            generators.append((proc, receive))
        # The prober starts a little early (its interpreter takes a moment to start), so every probe falls
        # while the load runs.
        time.sleep(max(0.0, window_start - PROBER_START_S - time.monotonic()))
        prober, out = L.start_prober(url, args.seconds, PROBE_INTERVAL)
        time.sleep(max(0.0, window_start - time.monotonic()))
        procfs.reset_peaks(procfs.tree(gate.pid))
        load_pids = [[p.pid] for p, _ in generators]
        cpu0 = procfs.tree_cpu_seconds(gate.pid, reaped=True)
        load0 = [procfs.cpu_ticks(pids) / procfs.CLK_TCK for pids in load_pids]
        t0 = time.monotonic()
        probe = L.prober_result(prober, out)
        time.sleep(max(0.0, window_end - time.monotonic()))
        wall = time.monotonic() - t0
        cpu1 = procfs.tree_cpu_seconds(gate.pid, reaped=True)
        load1 = [procfs.cpu_ticks(pids) / procfs.CLK_TCK for pids in load_pids]
        rss_gate, rss_workers = peaks(gate.pid)
        answers: list[tuple[float, int]] = []
        for proc, receive in generators:
            answers += receive.recv()
            proc.join(30)
    finally:
        for proc, _ in generators:
            if proc.is_alive():
                proc.terminate()
        L.stop(gate)
        L.stop(upstream)
    inside = [status for ended, status in answers if window_start <= ended < window_end]
    ok = sum(1 for status in inside if status == 200)
    health = L.summarize_ms(probe["latencies"])
    used = cpu1 - cpu0
    load_cores = [(b - a) / wall for a, b in zip(load0, load1, strict=True)]
    return {"rps": ok / args.seconds, "cores": used / wall, "cpu_ms_per_req": used * 1000 / ok if ok else None,
            "health_p50_ms": health["p50"], "health_p99_ms": health["p99"], "health_max_ms": health["max"],
            "probes": health["n"], "rss_mmgate_mb": rss_gate / 2**20, "rss_workers_mb": rss_workers / 2**20,
            "load_cores": load_cores, "clients": clients, "not_ok": len(inside) - ok}


def _timed_post(url: str, body: bytes) -> float:
    """One request on a new connection: seconds from connect to the last byte of a 200 answer."""
    import http.client
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    started = time.perf_counter()
    conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port, timeout=120)
    try:
        conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
        answer = conn.getresponse()
        answer.read()
    finally:
        conn.close()
    if answer.status != 200:
        raise RuntimeError(f"the request answered {answer.status}")
    return time.perf_counter() - started


def first_request(mode: str, mode_env: bool, model: Path | None = None) -> dict[str, Any]:
    """A fresh mmgate (defaults, or with ``model``), its first request and ``FIRST_WARM`` warm ones, one at a
    time."""
    from testkit.media import chat_body, photo_jpeg

    body = chat_body(photo_jpeg())
    upstream_port = L.free_port()
    upstream = subprocess.Popen([*ROLE, "upstream", "--port", str(upstream_port)], cwd=R.REPO,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    gate = None
    try:
        time.sleep(0.5)  # the upstream's interpreter; mmgate's start-up does not wait for it
        env = ({MODE_VARIABLE: mode} if mode_env else {}) | ({"MMGATE_MODEL": str(model)} if model else {})
        gate, url = L.start_mmgate(f"http://127.0.0.1:{upstream_port}", env=env)
        first = _timed_post(url, body)
        warm = [_timed_post(url, body) for _ in range(FIRST_WARM)]
    finally:
        L.stop(gate)
        L.stop(upstream)
    warm_ms = sorted(w * 1000 for w in warm)[len(warm) // 2]
    return {"first_ms": first * 1000, "warm_ms": warm_ms, "x_warm": first * 1000 / warm_ms}


# ----------------------------------------------------------------------------------------------------------
# the run


def worker_counts(cores: int) -> list[int]:
    return sorted({w for w in (1, 2, 4, 8, cores - 2) if 1 <= w <= cores})


def measure(knobs: R.Knobs) -> dict[str, Any]:
    cores = R.usable_cores()
    if knobs.first not in ("on", "off", "only"):
        raise SystemExit("first is on, off or only")
    args = R.Knobs(**vars(knobs) | {"workers": knobs.workers or ",".join(map(str, worker_counts(cores))),
                                    "load_procs": knobs.load_procs or max(1, cores // 8)})
    stamp = R.stamp("scale.py", "req/s, cores, CPU per request, health latency and peak RSS against decode workers")
    workers = sorted({int(w) for w in args.workers.split(",")})
    if 1 not in workers:
        workers.insert(0, 1)  # every ratio is against one worker
    resizes = [r == "on" for r in args.resize.split(",")]
    has_process = process_mode_available()
    modes = args.modes.split(",")
    cells = [(m, r, w) for m in modes for r in resizes for w in workers] if args.first != "only" else []
    rounds: dict[tuple[str, bool, int], list[dict[str, Any]]] = {cell: [] for cell in cells}
    firsts: dict[str, list[dict[str, Any]]] = ({f"{m}{suffix}": [] for m in modes for suffix in ("", MODEL_SUFFIX)}
                                               if args.first != "off" else {})
    model_folder = idefics3_folder(Path(tempfile.mkdtemp(prefix="scale-model-"))) if firsts else None
    print(f"{cores} usable cores; workers {workers}; process mode "
          f"{'available' if has_process else NOT_AVAILABLE}", flush=True)
    began = time.monotonic()
    for n in range(args.rounds):
        for name in firsts:
            mode = name.removesuffix(MODEL_SUFFIX)
            if mode == "process" and not has_process:
                continue
            first = first_request(mode, has_process, model_folder if name.endswith(MODEL_SUFFIX) else None)
            firsts[name].append(first)
            print(f"  round {n + 1} {name:20} first request after start {first['first_ms']:.0f} ms, warm "
                  f"{first['warm_ms']:.0f} ms: {first['x_warm']:.2f} ×", flush=True)
        for cell in cells:
            mode, resize, count = cell
            if mode == "process" and not has_process:
                continue
            row = measure_cell(mode, resize, count, args, mode_env=has_process)
            rounds[cell].append(row)
            busy = max(row["load_cores"])
            print(f"  round {n + 1} {mode:7} resize {'on ' if resize else 'off'} {count:3} workers: "
                  f"{row['rps']:6.1f} req/s  {row['cores']:5.2f} cores  "
                  f"{R.number(row['cpu_ms_per_req'])} CPU ms/req  health p50 {row['health_p50_ms']:.1f} "
                  f"p99 {row['health_p99_ms']:.1f} max {row['health_max_ms']:.1f} ms  RSS "
                  f"{row['rss_mmgate_mb']:.0f}+{row['rss_workers_mb']:.0f} MB  load generators "
                  f"{'+'.join(f'{c:.2f}' for c in row['load_cores'])} cores"
                  f"{'  (a load generator near a full core: it may be the limit)' if busy > 0.8 else ''}"
                  f"{'  ' + str(row['not_ok']) + ' not 200' if row['not_ok'] else ''}", flush=True)
    rows = summarise(rounds, has_process)
    data = stamp | {"settings": {"seconds": args.seconds, "ramp_s": args.ramp, "rounds": args.rounds,
                                 "workers": workers, "load_procs": args.load_procs, "cores": cores,
                                 "probe_interval_s": PROBE_INTERVAL, "process_mode": has_process,
                                 "elapsed_s": round(time.monotonic() - began)},
                    "rows": rows, "first_request": firsts}
    return data


def summarise(rounds: dict[tuple[str, bool, int], list[dict[str, Any]]], has_process: bool) -> list[dict[str, Any]]:
    rows = []
    for (mode, resize, count), measured in rounds.items():
        row: dict[str, Any] = {"mode": mode, "resize": resize, "workers": count, "rounds": measured}
        if not measured:
            row["note"] = NOT_AVAILABLE if mode == "process" and not has_process else "not measured"
            rows.append(row)
            continue
        one = rounds.get((mode, resize, 1), [])
        ratios = [r["rps"] / o["rps"] for r, o in zip(measured, one, strict=False) if o["rps"]]
        row["x_one_worker"] = R.summary(ratios)
        for key in ("rps", "cores", "cpu_ms_per_req", "health_p50_ms", "health_p99_ms", "health_max_ms",
                    "rss_mmgate_mb", "rss_workers_mb"):
            row[key] = R.summary(r[key] for r in measured)
        row["load_cores_max"] = max(max(r["load_cores"]) for r in measured)
        row["not_ok"] = sum(r["not_ok"] for r in measured)
        rows.append(row)
    return rows


def goals(data: dict[str, Any]) -> list[R.Goal]:
    settings, rows = data["settings"], data["rows"]
    rounds = {(r["mode"], r["resize"], r["workers"]): r["rounds"] for r in rows}
    return (_goals(rows, settings["cores"], settings["process_mode"], list(dict.fromkeys(r["mode"] for r in rows)))
            + cost_goals(rounds, data.get("first_request") or {}, settings["workers"]))


def _goals(rows: list[dict[str, Any]], cores: int, has_process: bool, modes: list[str]) -> list[R.Goal]:
    def row(mode: str, count: int) -> dict[str, Any] | None:
        return next((r for r in rows if r["mode"] == mode and r["resize"] and r["workers"] == count
                     and "rps" in r), None)

    empty = {"median": None, "spread": None, "n": 0}
    out = []
    for mode in modes:
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
    return out


def cost_goals(rounds: dict[tuple[str, bool, int], list[dict[str, Any]]], firsts: dict[str, list[dict[str, Any]]],
               workers: list[int]) -> list[R.Goal]:
    """Process mode's CPU per validated request over thread mode's (each round's pair), and the first request
    after a start over a warm one."""
    out = []
    for count in workers:
        threads, processes = rounds.get(("thread", False, count), []), rounds.get(("process", False, count), [])
        ratios = [p["cpu_ms_per_req"] / t["cpu_ms_per_req"] for p, t in zip(processes, threads, strict=False)
                  if p["cpu_ms_per_req"] and t["cpu_ms_per_req"]]
        if ratios:
            out.append(R.goal(f"process mode, {count} worker(s), validated 12 MP (resize off): CPU per request ÷ "
                              "thread mode's", ratios, f"≤ {GOAL_PROCESS_CPU_X:g}",
                              lambda x: x <= GOAL_PROCESS_CPU_X, unit="×"))
    for name, measured in firsts.items():
        if measured:
            mode, model = name.removesuffix(MODEL_SUFFIX), name.endswith(MODEL_SUFFIX)
            what = "resized to the model's size" if model else "header validation"
            out.append(R.goal(f"{mode} mode{MODEL_SUFFIX if model else ''}: first request after a start ÷ a warm "
                              f"one (12 MP, {what})", [m["x_warm"] for m in measured], f"≤ {GOAL_FIRST_X:g}",
                              lambda x: x <= GOAL_FIRST_X, unit="×"))
    return out


def report(data: dict[str, Any]) -> str:
    s = data["settings"]
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

    def fig(summary: dict[str, Any]) -> str:
        if summary["median"] is None:
            return "–"
        lo, hi = summary["spread"]
        return f"{R.number(summary['median'])} ({R.number(lo)}–{R.number(hi)})"

    for r in data["rows"]:
        head = f"| {r['mode']} | {'1 MP' if r['resize'] else 'off'} | {r['workers']} |"
        if "rps" not in r:
            lines.append(head + f" {r['note']} |" + " |" * 9)
            continue
        lines.append(
            head + f" {fig(r['rps'])} | {fig(r['x_one_worker'])} | {fig(r['cores'])} | {fig(r['cpu_ms_per_req'])} | "
            f"{fig(r['health_p50_ms'])} | {fig(r['health_p99_ms'])} | {fig(r['health_max_ms'])} | "
            f"{R.number(r['rss_mmgate_mb']['median'])} + {R.number(r['rss_workers_mb']['median'])} | "
            f"{r['load_cores_max']:.2f} | {r['not_ok']} |")
    firsts = data.get("first_request") or {}
    if any(firsts.values()):
        lines += ["", "First request after a start (a 12 MP photo: mmgate's defaults, and with `MMGATE_MODEL` "
                  "resized to the model's size), then "
                  f"{FIRST_WARM} warm ones one at a time, each on a new connection:", "",
                  "| mode | first ms | warm ms (median) | first ÷ warm |", "|---|---:|---:|---:|"]
        for mode, measured in firsts.items():
            if measured:
                lines.append(f"| {mode} | {fig(R.summary(m['first_ms'] for m in measured))} | "
                             f"{fig(R.summary(m['warm_ms'] for m in measured))} | "
                             f"{fig(R.summary(m['x_warm'] for m in measured))} |")
    if s["cores"] < MANY_CORES:
        lines += ["", f"{MANY_CORES} cores, {MANY_WORKERS} workers: not yet measured (this machine has {s['cores']} "
                  "usable cores); the same command measures that row on a machine that has them."]
    return "\n".join(lines) + "\n"
