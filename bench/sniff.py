"""The sniff's ways side by side: how much CPU per MB it costs to learn that a body holds no media marker.

Every text-only body on a media route is scanned once for the markers (``proxy.payload.locate.MARKERS``) before it
is forwarded untouched, so the scan is the part of mmgate's text path that grows with the body. Compared
in one run, each on the same bodies, single thread (wall time here is CPU time):

* ``hyperscan``: what mmgate runs (``may_contain_media``): every marker in one SIMD pass;
* ``bytes.find x5``: one stdlib ``find`` pass per marker (CPython's search for a short needle is a
  byte loop, not memchr);
* ``re alternation``: one ``re`` pass for all markers (sre tests every byte against the first letters);
* ``memchr`` (yardstick): ``bytes.find`` of one absent byte, the speed of a pass that does nothing.

Bodies (all without a marker, the case that pays the whole pass): the 4 MiB text chat of
``testkit.text_load.text_body``; a ~4 MiB English chat written by Python's json (``ensure_ascii``: accented letters
become ``\\u00e9`` escapes); a ~4 MiB Chinese chat, every character an escape. The last two were "maybe
media" for the previous markers (any ``\\u``) and paid a whole JSON parse: the ``old markers`` column says
what the previous sniff answered. Each figure is the median of --rounds rounds (each the best of 3 runs)
with its spread.

    python -m bench run sniff [--set KNOB=VALUE] [--rounds N] [--quick]
    python -m bench list sniff   # the knobs and their defaults
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import Any

from bench import _results as R
from proxy.payload.locate import MARKERS, may_contain_media
from testkit.chat_bodies import words_chat
from testkit.text_load import text_body

MiB = 1 << 20
OLD_MARKERS = (b"image", b"audio", b"video", b"\\u")
OURS = "hyperscan (mmgate)"
ENGLISH = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "café", "naïve", "thinking", "about",
           "language", "models", "serving", "requests", "with", "latency", "budget", "résumé"]
CHINESE = ["中文", "模型", "服务", "请求", "延迟", "你好", "世界", "文本"]


def bodies() -> dict[str, bytes]:
    return {"text 4 MiB (passthrough's)": text_body(4 * MiB), "English, json-escaped": words_chat(ENGLISH, 4 * MiB, 1),
            "Chinese, json-escaped": words_chat(CHINESE, 4 * MiB, 2)}


def candidates() -> dict[str, Callable[[bytes], bool]]:
    alternation = re.compile(b"|".join(re.escape(m) for m in MARKERS))
    return {OURS: may_contain_media,
            f"bytes.find x{len(MARKERS)}": lambda body: any(body.find(marker) >= 0 for marker in MARKERS),
            "re alternation": lambda body: alternation.search(body) is not None,
            "memchr (yardstick)": lambda body: body.find(b"\x00") >= 0}


def ms_per_mib(fn: Callable[[bytes], bool], body: bytes) -> float:
    """The best of 3 runs' wall time (single thread: its CPU time), per MiB of ``body``."""
    best = float("inf")
    for _ in range(3):
        started = time.perf_counter()
        fn(body)
        best = min(best, time.perf_counter() - started)
    return best * 1000 / (len(body) / MiB)


def measure(knobs: R.Knobs) -> dict[str, Any]:
    stamp = R.stamp("sniff.py", "CPU per MB of the sniff's ways on text bodies without a marker")
    ways = candidates()
    rows: list[dict[str, Any]] = []
    for name, body in bodies().items():
        answers = {way: fn(body) for way, fn in ways.items() if not way.startswith("memchr")}
        assert not any(answers.values()), (name, answers)  # every way agrees: no marker
        rounds: dict[str, list[float]] = {way: [] for way in ways}
        for _ in range(knobs.rounds):
            for way, fn in ways.items():  # the ways take turns, round after round
                rounds[way].append(ms_per_mib(fn, body))
        old = any(marker in body for marker in OLD_MARKERS)
        for way, values in rounds.items():
            s = R.summary(values)
            rows.append({"body": name, "size": len(body), "way": way, "old_markers_maybe": old, **s})
            print(f"  {name:28} {way:20} {s['median']:8.3f} ms/MiB  ({R.number(s['spread'][0])}–"
                  f"{R.number(s['spread'][1])})", flush=True)
    return stamp | {"rows": rows, "settings": {"rounds": knobs.rounds}}


def goals(data: dict[str, Any]) -> list[R.Goal]:
    rows = data["rows"]
    out = []
    for body in dict.fromkeys(r["body"] for r in rows):
        by = {r["way"]: r for r in rows if r["body"] == body}
        ours = by[OURS]
        finds = next(r for way, r in by.items() if way.startswith("bytes.find"))
        out.append(R.record(f"{body}: hyperscan ms/MiB", {"median": ours["median"], "spread": ours["spread"],
                                                           "n": ours["n"]}, unit="ms/MiB"))
        out.append(R.record(f"{body}: bytes.find passes ÷ hyperscan",
                            {"median": finds["median"] / ours["median"], "spread": None, "n": ours["n"]},
                            over="rounds (ratio of medians)"))
    return out


def report(data: dict[str, Any]) -> str:
    rows = data["rows"]
    ours = {r["body"]: r["median"] for r in rows if r["way"] == OURS}
    table = R.table([("body", "body", "s"), ("way", "way", "s"), ("ms/MiB", "median", ".3f"),
                     ("spread", "spread", "s"), ("× hyperscan", "times", ".2f"), ("old markers", "old", "s")],
                    (r | {"spread": f"{R.number(r['spread'][0])}–{R.number(r['spread'][1])}",
                          "times": r["median"] / ours[r["body"]], "old": "maybe" if r["old_markers_maybe"] else "no"}
                     for r in rows))
    return "\n".join([f"{data['settings']['rounds']} rounds. `old markers`: what the previous sniff answered for the "
                      "body (`maybe`: a whole JSON parse).", "", *table]) + "\n"
