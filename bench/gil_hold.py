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

import asyncio
import io
import math
import os
import pickle
import statistics
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from contextlib import contextmanager
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
from testkit.load import percentile
from testkit.media import photo_jpeg

WHAT = "GIL held by media work: a 1 ms sleeper's late wake-ups beside each step and beside saturated pools"
TARGET = 1_000_000
POLICY = ImagePolicy(resize_max_pixels=TARGET)
PNG = ImagePolicy(resize_max_pixels=TARGET, output_format="png")
WEBP = ImagePolicy(resize_max_pixels=TARGET, output_format="webp")
SMALL = (round(4000 * (TARGET / 12e6) ** 0.5), round(3000 * (TARGET / 12e6) ** 0.5))  # the 12 MP photo at 1 MP
TASK = MediaTask("image", "bench", 64 << 20, POLICY, AudioPolicy())
SLEEP = 0.001
MODES = ("thread", "process")
LATENESS = ("p50", "p99", "max")
GOAL_EXTRA_P99_MS = 1.0
GOAL_SCALING = 1.9
WORKER_ENVIRONMENT: dict[str, str] = {}  # set by measure(): the worker processes' allocator tuning


@contextmanager
def probe() -> Iterator[dict[str, float]]:
    """A thread that sleeps 1 ms in a loop while the block runs; after it, how late it woke (ms): p50, p99, max."""
    late: list[float] = []
    lateness: dict[str, float] = {}
    stop = threading.Event()

    def run() -> None:
        clock = time.perf_counter
        while not stop.is_set():
            t0 = clock()
            time.sleep(SLEEP)
            late.append((clock() - t0 - SLEEP) * 1e3)

    thread = threading.Thread(target=run, name="probe", daemon=True)
    thread.start()
    try:
        yield lateness
    finally:
        stop.set()
        thread.join()
    lateness |= {"p50": percentile(late, 50), "p99": percentile(late, 99), "max": percentile(late, 100)}


def steps(jpeg: bytes, encoded: bytes) -> dict[str, Callable[[], object]]:
    """Each step of a media job as a call that does exactly that step once, on prepared inputs."""
    with Image.open(io.BytesIO(jpeg)) as img:
        draft = img.draft(None, (TARGET // 866, 866))
        img.load()
        decoded = img.copy()
    box = draft[1] if draft else None
    small = decoded.resize(SMALL, Image.Resampling.BICUBIC, box=box)
    small_rgba = small.convert("RGBA")
    small_rgba.putpixel((0, 0), (0, 0, 0, 0))  # not fully opaque: encoded with its alpha, as PNG
    out, _ = _encode(small, POLICY)

    def decode() -> None:
        im = Image.open(io.BytesIO(jpeg), formats=("JPEG",))
        im.draft(None, SMALL)
        im.load()
        im.close()

    def encode_bytesio() -> bytes:
        buf = io.BytesIO()
        small.save(buf, "JPEG", quality=POLICY.jpeg_quality or GENERIC_JPEG_QUALITY)
        return buf.getvalue()

    return {
        "base64 decode (12 MP JPEG)": lambda: pybase64.b64decode(encoded, validate=True),
        "open (header only)": lambda: Image.open(io.BytesIO(jpeg), formats=("JPEG",)).size,
        "decode (draft + load + close)": decode,
        "orientation (EXIF)": lambda: _orientation(Image.open(io.BytesIO(jpeg), formats=("JPEG",))),
        "resize → 1 MP": lambda: decoded.resize(SMALL, Image.Resampling.BICUBIC, box=box),
        "transpose 1 MP": lambda: small.transpose(Image.Transpose.ROTATE_270),
        "convert 1 MP RGBA → RGB": lambda: small_rgba.convert("RGB"),
        "encode JPEG into BytesIO (Pillow default)": encode_bytesio,
        "encode JPEG into memfd (mmgate)": lambda: _encode(small, POLICY),
        "encode PNG into memfd (alpha output)": lambda: _encode(small_rgba, PNG),
        "encode WEBP into memfd": lambda: _encode(small, WEBP),
        "base64 encode (1 MP JPEG)": lambda: pybase64.b64encode(out),
        "whole job (process_image + base64)": lambda: run_task(TASK, lambda: encoded, no_checkpoint),
    }


def beside(call: Callable[[], object], seconds: float) -> dict[str, float]:
    """The probe's lateness while this thread runs ``call`` in a loop for ``seconds``, and its rate."""
    calls = 0
    with probe() as lateness:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            call()
            calls += 1
    return lateness | {"calls_per_s": calls / seconds}


def held_us(encoded: bytes, jpeg: bytes, count: int) -> dict[str, float]:
    """Median µs of the calls of a job that hold the GIL throughout (pure Python, or a free under the GIL),
    timed one by one on this thread: their wall time is their hold."""
    times: dict[str, list[float]] = {"open (header)": [], "orientation": [], "close a decoded 3 MP image": [],
                                     "free a resized 1 MP image": [], "free the decoded JPEG bytes": []}
    for _ in range(count):
        data = pybase64.b64decode(encoded, validate=True)
        t0 = time.perf_counter()
        del data
        t1 = time.perf_counter()
        im = Image.open(io.BytesIO(jpeg), formats=("JPEG",))
        t2 = time.perf_counter()
        _orientation(im)
        t3 = time.perf_counter()
        im.draft(None, SMALL)
        im.load()
        small = im.resize(SMALL, Image.Resampling.BICUBIC)
        t4 = time.perf_counter()
        im.close()
        t5 = time.perf_counter()
        del small
        t6 = time.perf_counter()
        for name, took in zip(times, (t2 - t1, t3 - t2, t5 - t4, t6 - t5, t1 - t0), strict=True):
            times[name].append(took * 1e6)
    return {name: statistics.median(values) for name, values in times.items()}


def on_pool(mode: str, workers: int, work: Callable[[DecodePool], Coroutine[Any, Any, Any]]) -> Any:
    """``work`` on a fresh pool of ``mode`` in an asyncio loop of its own, as mmgate drives a pool."""
    pool = ProcessPool(workers, environment=WORKER_ENVIRONMENT) if mode == "process" else DecodePool(workers)
    try:
        return asyncio.run(work(pool))
    finally:
        pool.shutdown()


async def one_at_a_time(pool: DecodePool, job: MediaJob, count: float, end: float = math.inf) -> list[float]:
    """``job`` on ``pool``, one at a time, ``count`` times or until ``end`` (``perf_counter``): each one's wall ms."""
    times: list[float] = []
    while len(times) < count and time.perf_counter() < end:
        t0 = time.perf_counter()
        await pool.batch().run([job], 60)
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def saturated(mode: str, workers: int, job: MediaJob, seconds: float) -> dict[str, float]:
    """One client per worker, each running one job at a time for ``seconds``: the probe's lateness and jobs/s."""

    async def saturate(pool: DecodePool) -> dict[str, float]:
        await asyncio.gather(*(pool.batch().run([job], 60) for _ in range(workers)))  # workers started, warm
        with probe() as lateness:
            started = time.perf_counter()
            clients = [one_at_a_time(pool, job, math.inf, started + seconds) for _ in range(workers)]
            done = sum(len(times) for times in await asyncio.gather(*clients))
            wall = time.perf_counter() - started
        return lateness | {"jobs_per_s": done / wall}

    return on_pool(mode, workers, saturate)


def sequential_ms(mode: str, job: MediaJob, count: int) -> float:
    """Median wall ms of one job at a time on a one-worker pool of ``mode``, after one to start it."""

    async def after_one(pool: DecodePool) -> float:
        await pool.batch().run([job], 60)
        return statistics.median(await one_at_a_time(pool, job, count))

    return on_pool(mode, 1, after_one)


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
    WORKER_ENVIRONMENT.update(worker_environment(os.environ, memory_first=memory_first))
    data = R.stamp("gil_hold.py", WHAT)
    seconds, sequential = knobs.seconds, knobs.sequential
    jpeg = photo_jpeg()
    encoded = pybase64.b64encode(jpeg)
    job = MediaJob(TASK, lambda: encoded)
    tiny = pybase64.b64encode(b"ID3" + bytes(7))  # an MP3 tag head: audio checked by its signature alone
    null_job = MediaJob(replace(TASK, kind="audio"), lambda: tiny)
    calls = steps(jpeg, encoded)
    token = run_task(TASK, lambda: encoded, no_checkpoint).encoded or b""
    rounds = []
    for r in range(knobs.rounds):
        print(f"round {r + 1}/{knobs.rounds}", flush=True)
        with probe() as idle:
            time.sleep(seconds)
        by_step = {name: beside(call, seconds) for name, call in calls.items()}
        pools = {f"{mode} × {n}": saturated(mode, n, job, seconds) for mode in MODES for n in (1, 2)}
        cost: dict[str, Any] = {}
        null_us: dict[str, float] = {}
        for mode in MODES:
            cost[f"{mode}_ms"] = sequential_ms(mode, job, sequential)
            null_us[mode] = sequential_ms(mode, null_job, sequential * 10) * 1e3
        cost |= {"extra_ms": cost["process_ms"] - cost["thread_ms"], "null_job_us": null_us,
                 "ipc_us": null_us["process"] - null_us["thread"], "copies_us": copies_us(encoded, token, sequential)}
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
