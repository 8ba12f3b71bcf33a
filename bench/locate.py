"""How long the event loop holds the GIL to find the media in a request body (steps 3-4).

Measures, on bodies built here (no network):

* ``media-20MB``: a chat request with two ~10 MB base64 images (20 MB), the case the design budgets
  at <= 2 ms;
* ``text-1MB``: a text-only chat history of ~1 MB with many messages, serialised like Python's json
  (``ensure_ascii``: non-ASCII becomes ``\\u`` escapes), whose words name images and videos, so the
  sniff says "maybe" and the walk must find out;
* ``mixed-3MB``: that history followed by one ~2 MB image.

For each: the designed steps one by one (sniff, skeletonize, locate), their sum, ``find_media``
(the same answer by the cheaper road), and as yardsticks orjson.loads of the whole body and one
memchr pass (``bytes.find`` of an absent byte) over it. Median, min–p90 and max of wall time over N
runs, single thread: wall time here is GIL time. Goal: ``find_media`` (what the proxy runs) on the 20 MB
body within the design's 2 ms.

    python -m bench run locate [--set KNOB=VALUE] [--rounds N] [--quick]
    python -m bench list locate   # the knobs and their defaults
    python -m bench list locate   # the knobs and their defaults
"""

from __future__ import annotations

import json
import os
import platform
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import pybase64

from bench import _results as R
from proxy.payload.locate import find_media, locate, looks_text_heavy, may_contain_media
from proxy.payload.rawjson import skeletonize

RESULTS = Path(__file__).resolve().parent / "results"
WORDS = [
    "the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "an", "image", "of", "a", "video",
    "plays;", "café", "naïve", "lorem", "ipsum", "dolor", "sit", "amet,", "consectetur", "adipiscing", "elit"
]


def media_body(image_bytes: int, images: int) -> bytes:
    blob = pybase64.b64encode(os.urandom(image_bytes * 3 // 4)).decode()
    content: list[dict[str, object]] = [{"type": "text", "text": "Compare these pictures.\nWhat changed?"}]
    for n in range(images):
        mime = "image/jpeg" if n % 2 == 0 else "image/png"
        content.append({"type": "image_url", "image_url": {"url": f"data:{mime};base64,{blob}", "detail": "auto"}})
    doc = {"model": "qwen2-vl", "messages": [{"role": "system", "content": "You are a careful assistant.\n"},
                                             {"role": "user", "content": content}],
           "max_tokens": 256, "temperature": 0.2, "stream": True}
    return json.dumps(doc).encode()


def history(size: int, rng: random.Random) -> list[dict[str, object]]:
    messages: list[dict[str, object]] = [{"role": "system", "content": "You are a helpful assistant."}]
    total = 0
    while total < size:
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(10, 120)))
        if rng.random() < 0.3:
            text = text.replace(" lorem", "\nlorem")
        messages.append({"role": "user" if len(messages) % 2 else "assistant", "content": text})
        total += len(text) + 40
    return messages


def text_body(size: int) -> bytes:
    return json.dumps({"model": "m", "messages": history(size, random.Random(7)), "stream": False}).encode()


def mixed_body(size: int, image_bytes: int) -> bytes:
    messages = history(size, random.Random(8))
    blob = pybase64.b64encode(os.urandom(image_bytes * 3 // 4)).decode()
    messages.append({"role": "user", "content": [
        {"type": "text", "text": "and this one?"},
        {"type": "image_url", "image_url": {"url": "data:image/jpeg;base64," + blob}}]})
    return json.dumps({"model": "m", "messages": messages}).encode()


def timed(fn: Callable[[], object], runs: int) -> dict[str, float]:
    fn()  # warm up
    samples = []
    for _ in range(runs):
        started = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - started)
    samples.sort()
    return {
        "median_ms": statistics.median(samples) * 1e3,
        "min_ms": samples[0] * 1e3,
        "p90_ms": samples[int(0.9 * (len(samples) - 1))] * 1e3,
        "max_ms": samples[-1] * 1e3,
        "runs": len(samples),
    }


def measure_body(name: str, body: bytes, runs: int) -> dict[str, Any]:
    def three_steps() -> object:
        if not may_contain_media(body):
            return []
        return locate("chat", skeletonize(body))

    skeleton = skeletonize(body)
    parts = locate("chat", skeleton)
    _, found = find_media("chat", body)
    assert [p.path for p in found] == [p.path for p in parts]
    rows = {
        "sniff (may_contain_media)": timed(lambda: may_contain_media(body), runs),
        "skeletonize": timed(lambda: skeletonize(body), runs),
        "locate": timed(lambda: locate("chat", skeleton), runs),
        "sniff + skeletonize + locate": timed(three_steps, runs),
        "find_media": timed(lambda: find_media("chat", body), runs),
        "orjson.loads(body) (yardstick)": timed(lambda: orjson.loads(body), max(3, runs // 3)),
        "one memchr pass (yardstick)": timed(lambda: body.find(b"\x01"), runs),
    }
    return {
        "body": name,
        "bytes": len(body),
        "string_tokens_placeholdered": len(skeleton.spans),
        "media_parts": len(parts),
        "sniff": may_contain_media(body),
        "text_heavy": looks_text_heavy(body),
        "rows": rows,
    }


WHAT = "GIL time to find the media in a 20 MB body without parsing it (and in 1-3 MB text-heavy ones)"
GOAL_MS = 2.0


def goals(data: dict[str, Any]) -> list[R.Goal]:
    """find_media on the 20 MB body against the design's 2 ms, and orjson.loads as the yardstick.

    The spread is min–max where the file has it, else min–p90 (older files recorded no max).
    """
    out: list[dict] = []
    big = next((r for r in data["results"] if r["body"] == "media-20MB"), None)
    if big is None:
        return out
    for step, name, target in (("find_media", "find_media, 20 MB body", f"≤ {GOAL_MS:g}"),
                               ("orjson.loads(body) (yardstick)", "orjson.loads, 20 MB body (yardstick)", None)):
        row = big["rows"][step]
        high = row.get("max_ms", row["p90_ms"])
        s = {"median": row["median_ms"], "spread": [row["min_ms"], high], "n": row.get("runs", data["runs"])}
        over = "runs" if "max_ms" in row else "runs, min–p90"
        out.append(R.record(name, s, target, (lambda v: v <= GOAL_MS) if target else None, unit="ms", over=over))
    return out


def report(data: dict[str, Any]) -> str:
    results = data["results"]
    lines = [
        f"{data['runs']} runs on {data.get('implementation', 'CPython')} "
        f"{data['python']}" + (f", orjson {data['orjson']}" if "orjson" in data else "") + ". "
        "Wall time of one call, single thread (= GIL time), in ms: median (min–p90). "
        + (f"Load average while running: {data['loadavg']:.1f}." if "loadavg" in data else ""),
        "",
    ]
    names = list(results[0]["rows"])
    header = "| step | " + " | ".join(f"{r['body']} ({int(r['bytes']) / 1e6:.1f} MB)" for r in results) + " |"
    lines += [header, "|---|" + "---:|" * len(results)]
    for step in names:
        cells = []
        for r in results:
            row = r["rows"][step]
            cells.append(f"{row['median_ms']:.3f} ({row['min_ms']:.3f}–{row['p90_ms']:.3f})")
        lines.append(f"| {step} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "| body | media parts | placeholders | sniff says maybe | looks text-heavy |",
        "|---|---:|---:|---|---|",
    ]
    for r in results:
        lines.append(f"| {r['body']} | {r['media_parts']} | {r['string_tokens_placeholdered']} | "
                     f"{r['sniff']} | {r['text_heavy']} |")
    return "\n".join(lines) + "\n"


def measure(knobs: R.Knobs) -> dict[str, Any]:
    bodies = [
        ("media-20MB", media_body(10_000_000, 2)),
        ("text-1MB", text_body(1_000_000)),
        ("mixed-3MB", mixed_body(1_000_000, 2_000_000)),
    ]
    return R.stamp("locate.py", WHAT) | {
        "runs": knobs.runs, "python": platform.python_version(),
        "implementation": platform.python_implementation(), "orjson": orjson.__version__,
        "results": [measure_body(name, body, knobs.runs) for name, body in bodies], "loadavg": os.getloadavg()[0]}
