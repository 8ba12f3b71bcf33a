"""How long media work holds the GIL: a thread that sleeps 1 ms, and how late it wakes, beside media work.

A thread that holds the GIL delays every other thread of the process, the event loop included, by as long as
it holds it; on a many-core server that is what caps mmgate's scaling and its health-check latency. The probe
is a thread that sleeps 1 ms in a loop and records how late it wakes (``time.sleep`` releases the GIL; waking
needs it back). Beside:

* **idle**: nothing else runs (the baseline: timer slack and the scheduler);
* **each step** of a media job, alone in a loop in one thread, on a 12 MP photo-like JPEG bound for 1 MP:
  base64 decode, open (header), decode (draft + load + close), orientation, resize, transpose, convert,
  encode into a BytesIO (Pillow holds the GIL for the whole compression) and into a memfd (what
  ``preprocessors/image.py`` does: Pillow's ``encode_to_file`` releases it), base64 encode, and the whole job.
  The step's late-wake maximum bounds its longest single GIL hold;
* **saturated pools**: ``--workers`` clients keep a pool of 1 and of 2 workers busy with whole jobs
  (12 MP JPEG → 1 MP), in thread mode (``DecodePool``) and process mode (``ProcessPool``), driven from an
  asyncio loop in this process as mmgate drives them: jobs/s and the probe's lateness.

And process mode's cost per job: one job at a time on one worker, thread vs process (the difference is the
IPC: pickled task and reply, memfd writes and reads, socket round trip, waking a thread), with the bytes each
job copies and pickles.

Every figure is the median of ``--rounds`` rounds (min–max spread). Goals: beside 2 saturated workers the
probe's p99 lateness is at most idle p99 + 1 ms (each mode); 2 workers make at least 1.9× the jobs/s of 1
(each mode, on a machine with 2 free cores). The allocator tuning is mmgate's default (``--malloc-tuning``),
applied here and in the worker processes as ``mmgate serve`` does. Default run: about 3 minutes on 2 cores;
``--smoke`` proves the bench works in seconds (its figures mean nothing, and nothing is written).

    python -m bench run gil_hold [--set KNOB=VALUE] [--rounds N] [--quick]
    python -m bench list gil_hold   # the knobs and their defaults
    python -m bench list gil_hold   # the knobs and their defaults
"""

from __future__ import annotations

import asyncio
import io
import os
import pickle
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pybase64
from PIL import Image

from bench import _results as R
from preprocessors.base import AudioPolicy, ImagePolicy, no_checkpoint
from preprocessors.image import GENERIC_JPEG_QUALITY, _encode, _orientation
from preprocessors.job import MediaJob, MediaTask, run_task
from preprocessors.pool import DecodePool
from preprocessors.worker_handle import read_all as _read_all
from preprocessors.worker_process import write_all as _write_all
from preprocessors.workers import ProcessPool
from proxy.runtime.memory import tune_process, worker_environment
from testkit.media import photo_jpeg

WHAT = "GIL held by media work: a 1 ms sleeper's late wake-ups beside each step and beside saturated pools"
TARGET = 1_000_000
POLICY = ImagePolicy(resize_max_pixels=TARGET)
PNG = ImagePolicy(resize_max_pixels=TARGET, output_format="png")
WEBP = ImagePolicy(resize_max_pixels=TARGET, output_format="webp")
SLEEP = 0.001
GOAL_EXTRA_P99_MS = 1.0
GOAL_SCALING = 1.9


# ----- the probe -----


class Probe:
    """A thread that sleeps 1 ms in a loop and records how late each wake-up is (ms)."""

    def __init__(self) -> None:
        self.late: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="probe", daemon=True)

    def _run(self) -> None:
        clock, late = time.perf_counter, self.late
        while not self._stop.is_set():
            t0 = clock()
            time.sleep(SLEEP)
            late.append((clock() - t0 - SLEEP) * 1e3)

    def __enter__(self) -> Probe:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def percentiles(late: list[float]) -> dict[str, float]:
    if not late:
        return {"p50": float("nan"), "p99": float("nan"), "max": float("nan"), "n": 0}
    ordered = sorted(late)
    return {"p50": ordered[len(ordered) // 2], "p99": ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))],
            "max": ordered[-1], "n": len(ordered)}


# ----- the steps -----


def steps(jpeg: bytes) -> dict[str, Callable[[], object]]:
    """Each step of a media job as a call that does exactly that step once, on prepared inputs."""
    encoded = pybase64.b64encode(jpeg)
    with Image.open(io.BytesIO(jpeg)) as img:
        draft = img.draft(None, (TARGET // 866, 866))
        img.load()
        decoded = img.copy()
    box = draft[1] if draft else None
    size = (round(4000 * (TARGET / 12e6) ** 0.5), round(3000 * (TARGET / 12e6) ** 0.5))
    small = decoded.resize(size, Image.Resampling.BICUBIC, box=box)
    small_rgba = small.convert("RGBA")
    small_rgba.putpixel((0, 0), (0, 0, 0, 0))  # not fully opaque: encoded with its alpha, as PNG
    out, _ = _encode(small, POLICY)

    def open_header() -> object:
        with Image.open(io.BytesIO(jpeg), formats=("JPEG",)) as im:
            return im.size

    def decode() -> object:
        im = Image.open(io.BytesIO(jpeg), formats=("JPEG",))
        im.draft(None, size)
        im.load()
        im.close()
        return None

    def orientation() -> object:
        with Image.open(io.BytesIO(jpeg), formats=("JPEG",)) as im:
            return _orientation(im)

    def encode_bytesio() -> object:
        buf = io.BytesIO()
        small.save(buf, "JPEG", quality=POLICY.jpeg_quality or GENERIC_JPEG_QUALITY)
        return buf.getvalue()

    task = MediaTask("image", "bench", 64 << 20, POLICY, AudioPolicy())
    return {
        "base64 decode (12 MP JPEG)": lambda: pybase64.b64decode(encoded, validate=True),
        "open (header only)": open_header,
        "decode (draft + load + close)": decode,
        "orientation (EXIF)": orientation,
        "resize → 1 MP": lambda: decoded.resize(size, Image.Resampling.BICUBIC, box=box),
        "transpose 1 MP": lambda: small.transpose(Image.Transpose.ROTATE_270),
        "convert 1 MP RGBA → RGB": lambda: small_rgba.convert("RGB"),
        "encode JPEG into BytesIO (Pillow default)": encode_bytesio,
        "encode JPEG into memfd (mmgate)": lambda: _encode(small, POLICY),
        "encode PNG into memfd (alpha output)": lambda: _encode(small_rgba, PNG),
        "encode WEBP into memfd": lambda: _encode(small, WEBP),
        "base64 encode (1 MP JPEG)": lambda: pybase64.b64encode(out),
        "whole job (process_image + base64)": lambda: run_task(task, lambda: encoded, no_checkpoint),
    }


def held_us(jpeg: bytes, count: int) -> dict[str, float]:
    """Median µs of the calls of a job that hold the GIL throughout (pure Python, or a free under the GIL),
    timed one by one on this thread: their wall time is their hold."""
    times: dict[str, list[float]] = {"open (header)": [], "orientation": [], "close a decoded 3 MP image": [],
                                     "free a resized 1 MP image": [], "free the decoded JPEG bytes": []}
    size = (1155, 866)
    encoded = pybase64.b64encode(jpeg)
    for _ in range(count):
        data = pybase64.b64decode(encoded, validate=True)
        t_free = time.perf_counter()
        del data
        freed = time.perf_counter() - t_free
        t0 = time.perf_counter()
        im = Image.open(io.BytesIO(jpeg), formats=("JPEG",))
        t1 = time.perf_counter()
        _orientation(im)
        t2 = time.perf_counter()
        im.draft(None, size)
        im.load()
        small = im.resize(size, Image.Resampling.BICUBIC)
        t3 = time.perf_counter()
        im.close()
        t4 = time.perf_counter()
        del small
        t5 = time.perf_counter()
        for name, took in zip(times, (t1 - t0, t2 - t1, t4 - t3, t5 - t4, freed), strict=True):
            times[name].append(took * 1e6)
    return {name: statistics.median(values) for name, values in times.items()}


def step_round(call: Callable[[], object], seconds: float) -> dict[str, float]:
    """``call`` in a loop in one thread for ``seconds`` beside the probe."""
    stop = threading.Event()
    calls = [0]

    def loop() -> None:
        while not stop.is_set():
            call()
            calls[0] += 1

    worker = threading.Thread(target=loop, daemon=True)
    with Probe() as probe:
        worker.start()
        time.sleep(seconds)
        stop.set()
        worker.join()
    return percentiles(probe.late) | {"calls_per_s": calls[0] / seconds}


def idle_round(seconds: float) -> dict[str, float]:
    with Probe() as probe:
        time.sleep(seconds)
    return percentiles(probe.late)


# ----- saturated pools -----


WORKER_ENVIRONMENT: dict[str, str] = {}  # set by main(): the worker processes' allocator tuning


def make_pool(mode: str, workers: int) -> DecodePool:
    return ProcessPool(workers, environment=WORKER_ENVIRONMENT) if mode == "process" else DecodePool(workers)


async def saturate(pool: DecodePool, job: MediaJob, clients: int, seconds: float) -> tuple[int, float]:
    """``clients`` loops each running one job at a time on ``pool`` for ``seconds``: (jobs done, wall s)."""
    done = [0]
    end = time.perf_counter() + seconds

    async def client() -> None:
        while time.perf_counter() < end:
            await pool.batch().run([job], 60)
            done[0] += 1

    started = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    return done[0], time.perf_counter() - started


def pool_round(mode: str, workers: int, job: MediaJob, seconds: float) -> dict[str, float]:
    pool = make_pool(mode, workers)

    async def run() -> tuple[int, float]:
        await asyncio.gather(*(pool.batch().run([job], 60) for _ in range(workers)))  # workers started, warm
        with Probe() as probe:
            result = await saturate(pool, job, workers, seconds)
        stats.update(percentiles(probe.late))
        return result

    stats: dict[str, float] = {}
    try:
        jobs, wall = asyncio.run(run())
    finally:
        pool.shutdown()
    return stats | {"jobs_per_s": jobs / wall}


def sequential_ms(mode: str, job: MediaJob, count: int) -> float:
    """Median wall ms of one job at a time on a one-worker pool of ``mode``."""
    pool = make_pool(mode, 1)

    async def run() -> list[float]:
        await pool.batch().run([job], 60)
        times = []
        for _ in range(count):
            t0 = time.perf_counter()
            await pool.batch().run([job], 60)
            times.append((time.perf_counter() - t0) * 1e3)
        return times

    try:
        return statistics.median(asyncio.run(run()))
    finally:
        pool.shutdown()


def copies_us(payload: bytes, token: bytes, count: int) -> float:
    """Median µs the parent spends copying one job's bytes: the payload into a memfd, the answer out."""
    fd = os.memfd_create("bench", os.MFD_CLOEXEC)
    try:
        times = []
        for _ in range(count):
            os.pwrite(fd, token, 0)  # the worker's answer, not timed: the worker writes it
            t0 = time.perf_counter()
            _write_all(fd, payload)
            _read_all(fd, len(token))
            times.append((time.perf_counter() - t0) * 1e6)
            os.ftruncate(fd, 0)
        return statistics.median(times)
    finally:
        os.close(fd)


# ----- the run -----


def summarise(rounds: list[dict[str, float]], keys: tuple[str, ...]) -> dict[str, Any]:
    return {k: R.summary(r[k] for r in rounds) for k in keys}


def measure_modes(seconds: float, rounds: int, sequential: int) -> dict[str, Any]:
    jpeg = photo_jpeg()
    encoded = pybase64.b64encode(jpeg)
    task = MediaTask("image", "bench", 64 << 20, POLICY, AudioPolicy())
    job = MediaJob(task, lambda: encoded)
    calls = steps(jpeg)
    lateness = ("p50", "p99", "max")
    idle_rounds: list[dict[str, float]] = []
    step_rounds: dict[str, list[dict[str, float]]] = {name: [] for name in calls}
    pool_rounds: dict[str, list[dict[str, float]]] = {f"{m} × {w}": [] for m in ("thread", "process") for w in (1, 2)}
    seq: dict[str, list[float]] = {"thread": [], "process": []}
    tiny = pybase64.b64encode(b"ID3" + bytes(7))  # an MP3 tag head: audio checked by its signature alone
    null_job = MediaJob(MediaTask("audio", "bench", 64 << 20, POLICY, AudioPolicy()), lambda: tiny)
    null: dict[str, list[float]] = {"thread": [], "process": []}
    copies: list[float] = []
    held: list[dict[str, float]] = []
    token = run_task(task, lambda: encoded, no_checkpoint).encoded or b""
    for r in range(rounds):
        print(f"round {r + 1}/{rounds}", flush=True)
        idle_rounds.append(idle_round(seconds))
        for name, call in calls.items():
            step_rounds[name].append(step_round(call, seconds))
        for key in pool_rounds:
            mode, workers = key.split(" × ")
            pool_rounds[key].append(pool_round(mode, int(workers), job, seconds))
        for mode in seq:
            seq[mode].append(sequential_ms(mode, job, sequential))
            null[mode].append(sequential_ms(mode, null_job, sequential * 10) * 1e3)
        copies.append(copies_us(encoded, token, sequential))
        held.append(held_us(jpeg, sequential))
    outcome = replace(run_task(task, lambda: encoded, no_checkpoint), encoded=None)
    return {
        "env": {"seconds": seconds, "rounds": rounds, "sequential_jobs": sequential, "jpeg_bytes": len(jpeg),
                "payload_bytes": len(encoded), "token_bytes": len(token), "pillow": Image.__version__,
                "load_avg": [round(v, 2) for v in os.getloadavg()]},
        "idle": summarise(idle_rounds, lateness),
        "steps": {name: summarise(rs, (*lateness, "calls_per_s")) for name, rs in step_rounds.items()},
        "held_us": summarise(held, tuple(held[0])),
        "pools": {key: summarise(rs, (*lateness, "jobs_per_s")) for key, rs in pool_rounds.items()},
        "process_cost": {
            "thread_ms": R.summary(seq["thread"]), "process_ms": R.summary(seq["process"]),
            "extra_ms": R.summary(p - t for p, t in zip(seq["process"], seq["thread"], strict=True)),
            "null_job_us": {mode: R.summary(values) for mode, values in null.items()},
            "ipc_us": R.summary(p - t for p, t in zip(null["process"], null["thread"], strict=True)),
            "copies_us": R.summary(copies),
            # parent pwrite of the payload; worker pwrite and parent pread of the answer (the worker maps
            # the payload: no copy there)
            "bytes_copied": len(encoded) + 2 * len(token),
            "bytes_pickled": len(pickle.dumps((task, len(encoded)))) + len(pickle.dumps(("done", outcome, len(token)))),
        },
    }


def goals(data: dict[str, Any]) -> list[R.Goal]:
    out = []
    idle_p99 = data["idle"]["p99"]["median"]
    for mode in ("thread", "process"):
        p99 = data["pools"][f"{mode} × 2"]["p99"]
        extra = {"median": p99["median"] - idle_p99, "n": p99["n"],
                 "spread": [p99["spread"][0] - idle_p99, p99["spread"][1] - idle_p99]}
        out.append(R.record(f"{mode} mode, 2 saturated workers: probe p99 lateness over idle", extra,
                            f"≤ {GOAL_EXTRA_P99_MS:g}", lambda v: v <= GOAL_EXTRA_P99_MS, unit="ms"))
    for mode in ("thread", "process"):
        one, two = data["pools"][f"{mode} × 1"]["jobs_per_s"], data["pools"][f"{mode} × 2"]["jobs_per_s"]
        ratio = {"median": two["median"] / one["median"], "n": min(one["n"], two["n"]),
                 "spread": [two["spread"][0] / one["spread"][1], two["spread"][1] / one["spread"][0]]}
        out.append(R.record(f"{mode} mode: jobs/s with 2 workers × 1 worker", ratio, f"≥ {GOAL_SCALING:g}",
                            lambda v: v >= GOAL_SCALING, unit="×"))
    cost = data["process_cost"]
    held = data["held_us"]
    total = {"median": sum(s["median"] for s in held.values()), "n": min(s["n"] for s in held.values()),
             "spread": [sum(s["spread"][0] for s in held.values()), sum(s["spread"][1] for s in held.values())]}
    out.append(R.record("thread mode: GIL held per 12 MP job by calls that never release it", total, "≤ 200",
                        lambda v: v <= 200, unit="µs"))
    out.append(R.record("process mode: extra wall time per job (one at a time)", cost["extra_ms"], unit="ms"))
    out.append(R.record("process mode: IPC per job (an empty job, process − thread)", cost["ipc_us"], unit="µs"))
    out.append(R.record("process mode: parent's copies per 12 MP job (payload in, answer out)", cost["copies_us"],
                        unit="µs"))
    return out


def _cell(s: dict[str, Any]) -> str:
    if s["median"] is None:
        return "–"
    lo, hi = s["spread"]
    return f"{R.number(s['median'])} ({R.number(lo)}–{R.number(hi)})"


def report(data: dict[str, Any]) -> str:
    env = data["env"]
    lines = [
        "# GIL held by media work (bench/gil_hold.py)",
        "",
        f"A thread sleeping 1 ms, late wake-ups in ms: median of {env['rounds']} rounds of {env['seconds']:g} s "
        f"(min–max). 12 MP JPEG ({env['jpeg_bytes'] / 1e6:.1f} MB) → 1 MP, Pillow {env['pillow']}.",
        "",
        "| beside | p50 | p99 | max | rate | µs per call |",
        "| --- | --- | --- | --- | --- | --- |",
        f"| idle | {_cell(data['idle']['p50'])} | {_cell(data['idle']['p99'])} | {_cell(data['idle']['max'])} | | |",
    ]
    for name, s in data["steps"].items():
        lines.append(f"| {name} | {_cell(s['p50'])} | {_cell(s['p99'])} | {_cell(s['max'])} | "
                     f"{_cell(s['calls_per_s'])} /s | {R.number(1e6 / s['calls_per_s']['median'])} |")
    for name, s in data["pools"].items():
        lines.append(f"| {name} saturated | {_cell(s['p50'])} | {_cell(s['p99'])} | {_cell(s['max'])} | "
                     f"{_cell(s['jobs_per_s'])} jobs/s | |")
    lines += ["", "Calls that hold the GIL throughout, timed one by one (µs, their wall time is their hold): "
              + ", ".join(f"{name} {_cell(s)}" for name, s in data["held_us"].items())
              + f". Allocator tuning: {', '.join(env.get('malloc_tuning') or ['none'])}."]
    cost = data["process_cost"]
    lines += [
        "",
        "A step whose p50 stays near idle releases the GIL while it works; one whose p50 jumps to the switch "
        "interval (5 ms) holds it, and in a loop it then holds it for whole intervals: its own hold per image is "
        "at most its µs per call.",
        "",
        f"Process mode's cost per job, one job at a time on one worker: thread {_cell(cost['thread_ms'])} ms, "
        f"process {_cell(cost['process_ms'])} ms, extra {_cell(cost['extra_ms'])} ms; "
        f"{cost['bytes_copied']:,} bytes copied (payload {env['payload_bytes']:,} once, answer "
        f"{env['token_bytes']:,} twice), {cost['bytes_pickled']:,} bytes pickled.",
        "",
        f"An empty job (a few bytes of audio: no image work) takes {_cell(cost['null_job_us']['thread'])} µs on a "
        f"thread and {_cell(cost['null_job_us']['process'])} µs on a process: IPC {_cell(cost['ipc_us'])} µs per "
        f"job. The parent's copies of a 12 MP job's bytes (pwrite of the payload, pread of the answer, GIL "
        f"released): {_cell(cost['copies_us'])} µs.",
    ]
    return "\n".join(lines) + "\n"


def measure(knobs: R.Knobs) -> dict[str, Any]:
    if knobs.malloc_tuning not in ("on", "off"):
        raise SystemExit("malloc_tuning is on or off")
    memory_first = knobs.malloc_tuning == "on"
    tuned = tune_process(os.environ, memory_first=memory_first, decode_threads=2)  # the most any pool here has
    WORKER_ENVIRONMENT.update(worker_environment(os.environ, memory_first=memory_first))
    data = R.stamp("gil_hold.py", WHAT) | measure_modes(knobs.seconds, knobs.rounds, knobs.sequential)
    data["env"]["malloc_tuning"] = tuned
    return data
