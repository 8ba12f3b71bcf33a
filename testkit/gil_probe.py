"""How long other work holds the GIL, seen from a thread that sleeps 1 ms in a loop (``bench/gil_hold``).

``time.sleep`` releases the GIL and waking needs it back, so how late the sleeper wakes is how long some other
thread held the GIL at that moment: ``probe`` records it while a block runs, ``beside`` while a call runs in a
loop. ``job_steps`` are the steps of a media job (a 12 MP JPEG bound for 1 MP) as calls that each do one step
once; ``held_us`` times the calls of a job that never release the GIL one by one (their wall time is their hold).
"""

from __future__ import annotations

import io
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pybase64
from PIL import Image

from preprocessors.base import ImagePolicy, no_checkpoint
from preprocessors.image import GENERIC_JPEG_QUALITY, _encode, _orientation
from preprocessors.job import MediaTask, run_task
from testkit.load import percentile

SLEEP = 0.001
TARGET = 1_000_000
SMALL = (round(4000 * (TARGET / 12e6) ** 0.5), round(3000 * (TARGET / 12e6) ** 0.5))  # the 12 MP photo at 1 MP


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


def beside(call: Callable[[], object], seconds: float) -> dict[str, float]:
    """The probe's lateness while this thread runs ``call`` in a loop for ``seconds``, and its rate."""
    calls = 0
    with probe() as lateness:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            call()
            calls += 1
    return lateness | {"calls_per_s": calls / seconds}


def job_steps(jpeg: bytes, encoded: bytes, task: MediaTask) -> dict[str, Callable[[], object]]:
    """Each step of ``task`` (a media job of ``encoded``, the base64 of ``jpeg``) as a call that does exactly
    that step once, on prepared inputs."""
    policy = task.image_policy
    png = ImagePolicy(resize_max_pixels=TARGET, output_format="png")
    webp = ImagePolicy(resize_max_pixels=TARGET, output_format="webp")
    with Image.open(io.BytesIO(jpeg)) as img:
        draft = img.draft(None, (TARGET // 866, 866))
        img.load()
        decoded = img.copy()
    box = draft[1] if draft else None
    small = decoded.resize(SMALL, Image.Resampling.BICUBIC, box=box)
    small_rgba = small.convert("RGBA")
    small_rgba.putpixel((0, 0), (0, 0, 0, 0))  # not fully opaque: encoded with its alpha, as PNG
    out, _ = _encode(small, policy)

    def decode() -> None:
        im = Image.open(io.BytesIO(jpeg), formats=("JPEG",))
        im.draft(None, SMALL)
        im.load()
        im.close()

    def encode_bytesio() -> bytes:
        buf = io.BytesIO()
        small.save(buf, "JPEG", quality=policy.jpeg_quality or GENERIC_JPEG_QUALITY)
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
        "encode JPEG into memfd (mmgate)": lambda: _encode(small, policy),
        "encode PNG into memfd (alpha output)": lambda: _encode(small_rgba, png),
        "encode WEBP into memfd": lambda: _encode(small, webp),
        "base64 encode (1 MP JPEG)": lambda: pybase64.b64encode(out),
        "whole job (process_image + base64)": lambda: run_task(task, lambda: encoded, no_checkpoint),
    }


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
