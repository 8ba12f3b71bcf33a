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
"""

from __future__ import annotations

import os
import platform
from typing import Any

import orjson

from bench import _results as R
from proxy.payload.locate import find_media, locate, looks_text_heavy, may_contain_media
from proxy.payload.rawjson import skeletonize
from testkit.call_timing import wall_ms_stats
from testkit.chat_bodies import history_then_image, images_chat, text_history

WHAT = "GIL time to find the media in a 20 MB body without parsing it (and in 1-3 MB text-heavy ones)"
GOAL_MS = 2.0


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
        "sniff (may_contain_media)": wall_ms_stats(lambda: may_contain_media(body), runs),
        "skeletonize": wall_ms_stats(lambda: skeletonize(body), runs),
        "locate": wall_ms_stats(lambda: locate("chat", skeleton), runs),
        "sniff + skeletonize + locate": wall_ms_stats(three_steps, runs),
        "find_media": wall_ms_stats(lambda: find_media("chat", body), runs),
        "orjson.loads(body) (yardstick)": wall_ms_stats(lambda: orjson.loads(body), max(3, runs // 3)),
        "one memchr pass (yardstick)": wall_ms_stats(lambda: body.find(b"\x01"), runs),
    }
    return {"body": name, "bytes": len(body), "string_tokens_placeholdered": len(skeleton.spans),
            "media_parts": len(parts), "sniff": may_contain_media(body), "text_heavy": looks_text_heavy(body),
            "rows": rows}


def measure(knobs: R.Knobs) -> dict[str, Any]:
    bodies = [("media-20MB", images_chat(10_000_000, 2)), ("text-1MB", text_history(1_000_000)),
              ("mixed-3MB", history_then_image(1_000_000, 2_000_000))]
    return R.stamp("locate.py", WHAT) | {
        "runs": knobs.runs, "python": platform.python_version(),
        "implementation": platform.python_implementation(), "orjson": orjson.__version__,
        "results": [measure_body(name, body, knobs.runs) for name, body in bodies], "loadavg": os.getloadavg()[0]}


def goals(data: dict[str, Any]) -> list[R.Goal]:
    """find_media on the 20 MB body against the design's 2 ms, and orjson.loads as the yardstick.

    The spread is min–max where the file has it, else min–p90 (older files recorded no max).
    """
    big = next((r for r in data["results"] if r["body"] == "media-20MB"), None)
    if big is None:
        return []
    out = []
    for step, name, target in (("find_media", "find_media, 20 MB body", f"≤ {GOAL_MS:g}"),
                               ("orjson.loads(body) (yardstick)", "orjson.loads, 20 MB body (yardstick)", None)):
        row = big["rows"][step]
        s = {"median": row["median_ms"], "spread": [row["min_ms"], row.get("max_ms", row["p90_ms"])],
             "n": row.get("runs", data["runs"])}
        over = "runs" if "max_ms" in row else "runs, min–p90"
        out.append(R.record(name, s, target, (lambda v: v <= GOAL_MS) if target else None, unit="ms", over=over))
    return out


def report(data: dict[str, Any]) -> str:
    results = data["results"]
    cell = "{median_ms:.3f} ({min_ms:.3f}–{p90_ms:.3f})"
    steps = R.table([("step", "step", "s"), *((f"{r['body']} ({int(r['bytes']) / 1e6:.1f} MB)", r["body"], "")
                                              for r in results)],
                    ({"step": step} | {r["body"]: cell.format(**r["rows"][step]) for r in results}
                     for step in results[0]["rows"]))
    bodies = R.table([("body", "body", "s"), ("media parts", "media_parts", ""),
                      ("placeholders", "string_tokens_placeholdered", ""), ("sniff says maybe", "sniff", "s"),
                      ("looks text-heavy", "text_heavy", "s")],
                     ({key: str(r[key]) for key in ("body", "media_parts", "string_tokens_placeholdered", "sniff",
                                                    "text_heavy")} for r in results))
    return "\n".join([
        f"{data['runs']} runs on {data.get('implementation', 'CPython')} "
        f"{data['python']}" + (f", orjson {data['orjson']}" if "orjson" in data else "") + ". "
        "Wall time of one call, single thread (= GIL time), in ms: median (min–p90). "
        + (f"Load average while running: {data['loadavg']:.1f}." if "loadavg" in data else ""),
        "", *steps, "", *bodies]) + "\n"
