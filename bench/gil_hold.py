"""How long media work holds the GIL: how late a thread that sleeps 1 ms wakes, beside media work.

A thread holding the GIL delays every other thread, the event loop included, as long as it holds it: that caps
mmgate's scaling and its health-check latency. The probe sleeps 1 ms in a loop (``time.sleep`` releases the GIL,
waking needs it back) and records how late it wakes: idle (the baseline), beside each step of a media job in a
loop (``steps()``, on a 12 MP photo-like JPEG bound for 1 MP; the maximum bounds the step's longest hold), and
beside pools of 1 and 2 saturated workers, thread and process mode, driven from an asyncio loop as mmgate drives
them (with their jobs/s). Also: the calls that never release the GIL, timed one by one, and process mode's cost
per job (one at a time on one worker, process vs thread: the IPC) with the bytes it copies and pickles.

Every figure is the median of ``--rounds`` rounds (min–max). Goals, each mode: beside 2 saturated workers the
probe's p99 is at most idle p99 + 1 ms; 2 workers make at least 1.9× the jobs/s of 1 (with 2 free cores). And
the calls that never release the GIL hold it at most 200 µs per job. The allocator tuning (knob
``malloc_tuning``) applies here and in the worker processes, as in ``mmgate serve``. About 3 minutes on 2 cores.
"""

from __future__ import annotations

import os
import pickle
import time
from dataclasses import replace
from typing import Any

import pybase64
from PIL import Image

from bench import _results as R
from preprocessors.base import AudioPolicy, ImagePolicy, no_checkpoint
from preprocessors.job import MediaJob, MediaTask, run_task
from proxy.runtime.memory import tune_process, worker_environment
from testkit.decode_pools import process_cost, saturated
from testkit.gil_probe import beside, held_us, job_steps, probe
from testkit.media import photo_jpeg

WHAT = "GIL held by media work: a 1 ms sleeper's late wake-ups beside each step and beside saturated pools"
TASK = MediaTask("image", "bench", 64 << 20, ImagePolicy(resize_max_pixels=1_000_000), AudioPolicy())
MODES = ("thread", "process")
LATENESS = ("p50", "p99", "max")
GOAL_EXTRA_P99_MS = 1.0
GOAL_SCALING = 1.9


def summarise(rounds: list[Any]) -> Any:
    """Each figure of the rounds as its ``R.summary`` over them, in the rounds' shape."""
    if isinstance(rounds[0], dict):
        return {key: summarise([r[key] for r in rounds]) for key in rounds[0]}
    return R.summary(rounds)


def measure(knobs: R.Knobs) -> dict[str, Any]:
    if knobs.malloc_tuning not in ("on", "off"):
        raise SystemExit("malloc_tuning is on or off")
    memory_first = knobs.malloc_tuning == "on"
    tuned = tune_process(os.environ, memory_first=memory_first, decode_threads=2)  # the most any pool here has
    workers_env = worker_environment(os.environ, memory_first=memory_first)  # the worker processes' tuning
    data = R.stamp("gil_hold.py", WHAT)
    seconds, sequential = knobs.seconds, knobs.sequential
    jpeg = photo_jpeg()
    encoded = pybase64.b64encode(jpeg)
    job = MediaJob(TASK, lambda: encoded)
    tiny = pybase64.b64encode(b"ID3" + bytes(7))  # an MP3 tag head: audio checked by its signature alone
    null_job = MediaJob(replace(TASK, kind="audio"), lambda: tiny)
    calls = job_steps(jpeg, encoded, TASK)
    token = run_task(TASK, lambda: encoded, no_checkpoint).encoded or b""
    rounds = []
    for r in range(knobs.rounds):
        print(f"round {r + 1}/{knobs.rounds}", flush=True)
        with probe() as idle:
            time.sleep(seconds)
        by_step = {name: beside(call, seconds) for name, call in calls.items()}
        pools = {f"{mode} × {n}": saturated(mode, n, job, seconds, workers_env) for mode in MODES for n in (1, 2)}
        cost = process_cost(job, null_job, sequential, workers_env, encoded, token)
        rounds.append({"idle": idle, "steps": by_step, "held_us": held_us(encoded, jpeg, sequential),
                       "pools": pools, "process_cost": cost})
    outcome = replace(run_task(TASK, lambda: encoded, no_checkpoint), encoded=None)
    figures = summarise(rounds)
    figures["process_cost"] |= {
        # parent pwrite of the payload; worker pwrite and parent pread of the answer (the worker maps the
        # payload: no copy there)
        "bytes_copied": len(encoded) + 2 * len(token),
        "bytes_pickled": len(pickle.dumps((TASK, len(encoded)))) + len(pickle.dumps(("done", outcome, len(token)))),
    }
    env = {"seconds": seconds, "rounds": knobs.rounds, "sequential_jobs": sequential, "jpeg_bytes": len(jpeg),
           "payload_bytes": len(encoded), "token_bytes": len(token), "pillow": Image.__version__,
           "load_avg": [round(v, 2) for v in os.getloadavg()], "malloc_tuning": tuned}
    return data | {"env": env} | figures


def goals(data: dict[str, Any]) -> list[R.Goal]:
    pools, idle_p99 = data["pools"], data["idle"]["p99"]["median"]
    lateness, scaling = [], []
    for mode in MODES:
        p99, one, two = pools[f"{mode} × 2"]["p99"], *(pools[f"{mode} × {n}"]["jobs_per_s"] for n in (1, 2))
        extra = {"median": p99["median"] - idle_p99, "n": p99["n"], "spread": [v - idle_p99 for v in p99["spread"]]}
        lateness.append(R.record(f"{mode} mode, 2 saturated workers: probe p99 lateness over idle", extra,
                                 f"≤ {GOAL_EXTRA_P99_MS:g}", lambda v: v <= GOAL_EXTRA_P99_MS, unit="ms"))
        ratio = {"median": two["median"] / one["median"], "n": min(one["n"], two["n"]),
                 "spread": [two["spread"][0] / one["spread"][1], two["spread"][1] / one["spread"][0]]}
        scaling.append(R.record(f"{mode} mode: jobs/s with 2 workers × 1 worker", ratio, f"≥ {GOAL_SCALING:g}",
                                lambda v: v >= GOAL_SCALING, unit="×"))
    held = data["held_us"].values()
    total = {"median": sum(s["median"] for s in held), "n": min(s["n"] for s in held),
             "spread": [sum(s["spread"][end] for s in held) for end in (0, 1)]}
    cost = data["process_cost"]
    return [*lateness, *scaling,
            R.record("thread mode: GIL held per 12 MP job by calls that never release it", total, "≤ 200",
                     lambda v: v <= 200, unit="µs"),
            R.record("process mode: extra wall time per job (one at a time)", cost["extra_ms"], unit="ms"),
            R.record("process mode: IPC per job (an empty job, process − thread)", cost["ipc_us"], unit="µs"),
            R.record("process mode: parent's copies per 12 MP job (payload in, answer out)", cost["copies_us"],
                     unit="µs")]


def _row(name: str, s: dict[str, Any], rate: str = "", per_call: str = "") -> str:
    """A row of the lateness table: p50, p99 and max, then the rate and µs per call where there are some."""
    cells = [name, *(R.summary_text(s[key]) for key in LATENESS), rate, per_call]
    return "|" + "".join(f" {cell} |" if cell else " |" for cell in cells)


def report(data: dict[str, Any]) -> str:
    env, cost = data["env"], data["process_cost"]
    lines = [
        f"A thread sleeping 1 ms, late wake-ups in ms: median of {env['rounds']} rounds of {env['seconds']:g} s "
        f"(min–max). 12 MP JPEG ({env['jpeg_bytes'] / 1e6:.1f} MB) → 1 MP, Pillow {env['pillow']}.",
        "",
        "| beside | p50 | p99 | max | rate | µs per call |",
        "| --- | --- | --- | --- | --- | --- |",
        _row("idle", data["idle"]),
        *(_row(name, s, f"{R.summary_text(s['calls_per_s'])} /s", R.number(1e6 / s["calls_per_s"]["median"]))
          for name, s in data["steps"].items()),
        *(_row(f"{name} saturated", s, f"{R.summary_text(s['jobs_per_s'])} jobs/s")
          for name, s in data["pools"].items()),
        "",
        "Calls that hold the GIL throughout, timed one by one (µs, their wall time is their hold): "
        + ", ".join(f"{name} {R.summary_text(s)}" for name, s in data["held_us"].items())
        + f". Allocator tuning: {', '.join(env.get('malloc_tuning') or ['none'])}.",
        "",
        "A step whose p50 stays near idle releases the GIL while it works; one whose p50 jumps to the switch "
        "interval (5 ms) holds it, and in a loop it then holds it for whole intervals: its own hold per image is "
        "at most its µs per call.",
        "",
        f"Process mode's cost per job, one job at a time on one worker: thread {R.summary_text(cost['thread_ms'])} ms, "
        f"process {R.summary_text(cost['process_ms'])} ms, extra {R.summary_text(cost['extra_ms'])} ms; "
        f"{cost['bytes_copied']:,} bytes copied (payload {env['payload_bytes']:,} once, answer "
        f"{env['token_bytes']:,} twice), {cost['bytes_pickled']:,} bytes pickled.",
        "",
        "An empty job (a few bytes of audio: no image work) takes "
        f"{R.summary_text(cost['null_job_us']['thread'])} µs on a thread and "
        f"{R.summary_text(cost['null_job_us']['process'])} µs on a process: IPC "
        f"{R.summary_text(cost['ipc_us'])} µs per job. The parent's copies of a 12 MP job's bytes (pwrite of the "
        "payload, pread of the answer, GIL "
        f"released): {R.summary_text(cost['copies_us'])} µs.",
    ]
    return "\n".join(lines) + "\n"
