"""Processed-media cache: a 10-turn chat replay with one 12 MP photo, cache on vs off, side by side.

Why: chats resend their images every turn, and without a cache mmgate decodes and resizes each copy again.
Here turn N of a conversation carries the photo once per user turn so far (N copies of the same image); a
second conversation adds a new photo each turn (turn N: photos 1..N, one of them new); a third sends a new
photo in every request (all misses: what the cache costs when it never helps).

Per round, for each mode (cache off: MMGATE_CACHE_MB=0; on: the default) a fresh mmgate (so every
conversation starts cold and VmHWM is the mode's own), decode + resize to 1 MP (--resize-max-pixels 1000000),
in front of a sink upstream (own process: reads the body, answers a small JSON; no decode, so latency is
mmgate's). Requests are sent one at a time, so the CPU mmgate burns between sending a request and reading its
answer (every thread, and its decode worker processes', from /proc/PID/task/*/schedstat, nanoseconds) is that
request's. "Media CPU" is that
minus the CPU of the same body sent to a path that is no media route (read and forwarded untouched, measured
in the same process): what the media step costs. Photos differ by a JPEG comment segment only (same decode
work, different bytes), tagged per round and mode so nothing is reused across conversations.

Also measured, in this process: what hashing a 12 MP photo's base64 costs the event loop when it is handed to
the cache's hasher threads, against hashing on the loop (µs of loop-thread CPU per MB), and the hasher's
throughput.

Goals: turns 2–10 of the one-photo chat each cost at most 10 % of turn 1's media CPU (cache on); a miss
(the all-new conversation) costs at most 3 % more CPU per request with the cache on than off.

    python -m bench run cache [--set KNOB=VALUE] [--rounds N] [--quick]
    python -m bench list cache   # the knobs and their defaults
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time
from datetime import UTC, datetime
from typing import Any

from bench import _results as R
from proxy.settings import setting_default
from testkit import load as L
from testkit.cache_hashing import hash_cost
from testkit.media import PHOTO_QUALITY, PHOTO_SIZE, conversation, encoded, photo_jpeg, photo_sized, tagged, turns
from testkit.serial_replay import media_cost, replay

WHAT = "10-turn chat replay with one 12 MP photo (and with new photos): mmgate CPU, latency, RSS, cache on vs off"
FLAGS = ("--resize-max-pixels", "1000000", "--max-body-mb", "256", "--max-inflight-media-mb", "4096",
         "--max-media-per-request", "64")
MODES = {"off": ("--cache-mb", "0"), "on": ("--cache-mb", str(setting_default('cache_mb')))}
CONVERSATIONS = ("one_photo", "new_photo_each_turn", "all_new")
CHAT, NO_MEDIA_ROUTE = "/v1/chat/completions", "/v1/bench-no-media-route"
GOAL_REPEAT_SHARE = 0.10
GOAL_MISS_RATIO = 1.03


async def one_mode(mode: str, sink_url: str, photo: bytes, tag: str, count: int) -> dict[str, Any]:
    """A fresh mmgate in ``mode``: every conversation replayed, then each body again on a non-media path."""
    proc, url = L.start_mmgate(sink_url, *FLAGS, *MODES[mode])
    try:
        warm = conversation([tagged(photo, f"{tag}/warm")])
        await replay(url, proc.pid, [warm, warm], CHAT)  # pool threads, imports, connections
        out: dict[str, Any] = {name: await media_cost(url, proc.pid, turns(name, photo, f"{tag}/{mode}", count),
                                                      CHAT, NO_MEDIA_ROUTE) for name in CONVERSATIONS}
        prom = await L.scrape(url)
        out["cache_metrics"] = {k[0]: v for k, v in prom.items() if k[0].startswith("mmgate_cache_")}
        return out
    finally:
        log = L.stop(proc)
        if "Traceback" in log:
            print(log, file=sys.stderr)


def measure(knobs: R.Knobs) -> dict[str, Any]:
    started = time.monotonic()
    stamp = R.stamp("cache.py", WHAT)
    up_start = L.uptime()
    if knobs.small:
        photo = encoded(photo_sized(1200, 900, 7), "JPEG", quality=PHOTO_QUALITY)
        described = "1200x900 JPEG (smoke)"
    else:
        photo = photo_jpeg()
        described = f"{PHOTO_SIZE[0]}x{PHOTO_SIZE[1]} JPEG q{PHOTO_QUALITY}, {len(photo) / 1e6:.2f} MB"
    sink_proc, sink_url = L.start_sink()
    rounds: list[dict[str, Any]] = []
    try:
        for rnd in range(knobs.rounds):
            order = list(MODES) if rnd % 2 == 0 else list(reversed(MODES))  # drift hits both modes alike
            result = {mode: asyncio.run(one_mode(mode, sink_url, photo, f"r{rnd}", knobs.turns)) for mode in order}
            rounds.append(result)
            for mode in MODES:
                one = result[mode]["one_photo"]["turns"]
                new = statistics.fmean(t["cpu_ms"] for t in result[mode]["all_new"]["turns"])
                print(f"r{rnd} {mode:3s} one photo media CPU ms per turn: "
                      + " ".join(f"{t['media_cpu_ms']:.1f}" for t in one) + f" | all new CPU ms/req {new:.1f}",
                      flush=True)
    finally:
        L.stop(sink_proc)
    meta = {"date": datetime.now(UTC).isoformat(timespec="seconds"), "python": stamp["machine"]["python"],
            "usable_cpus": R.usable_cores(), "rounds": knobs.rounds, "turns": knobs.turns, "photo": described,
            "hash": hash_cost(3.5),
            "uptime_start": up_start, "uptime_end": L.uptime(), "wall_s": round(time.monotonic() - started, 1)}
    return stamp | {"meta": meta, "figures": per_round(rounds), "rounds": rounds}


def per_round(rounds: list[dict[str, Any]]) -> dict[str, list[float]]:
    """The figures each round gives, for the goals and the table."""
    out: dict[str, list[float]] = {}

    def add(key: str, value: float) -> None:
        out.setdefault(key, []).append(value)

    for rnd in rounds:
        for mode in MODES:
            for name in CONVERSATIONS:
                ts = rnd[mode][name]["turns"]
                lat = [t["latency_ms"] for t in ts]
                add(f"{mode}/{name}/cpu_ms_per_request", statistics.fmean(t["cpu_ms"] for t in ts))
                add(f"{mode}/{name}/media_cpu_ms_per_request", statistics.fmean(t["media_cpu_ms"] for t in ts))
                add(f"{mode}/{name}/latency_p50_ms", L.percentile(lat, 50))
                add(f"{mode}/{name}/latency_p99_ms", L.percentile(lat, 99))
                add(f"{mode}/{name}/peak_rss_mb", rnd[mode][name]["peak_rss_mb"])
            ts = rnd[mode]["one_photo"]["turns"]
            first = ts[0]["media_cpu_ms"]
            if len(ts) > 1 and first > 0:
                add(f"{mode}/one_photo/later_turn_share_max", max(t["media_cpu_ms"] for t in ts[1:]) / first)
                add(f"{mode}/one_photo/later_turn_share_mean", statistics.fmean(t["media_cpu_ms"] for t in ts[1:])
                    / first)
            add(f"{mode}/one_photo/last_turn_media_cpu_ms", ts[-1]["media_cpu_ms"])
        off, on = rnd["off"]["all_new"]["turns"], rnd["on"]["all_new"]["turns"]
        # The median request: one slow request (a page fault storm, a neighbour's burst) must not decide it.
        add("miss_cpu_ratio", statistics.median(t["cpu_ms"] for t in on) / statistics.median(t["cpu_ms"] for t in off))
        for name in ("one_photo", "new_photo_each_turn"):
            add(f"{name}/cpu_on_over_off", out[f"on/{name}/cpu_ms_per_request"][-1]
                / out[f"off/{name}/cpu_ms_per_request"][-1])
    return out


def goals(data: dict[str, Any]) -> list[R.Goal]:
    figures = data["figures"]
    return [
        R.goal("one photo, cache on: the costliest of turns 2–10, media CPU ÷ turn 1's",
               figures.get("on/one_photo/later_turn_share_max", []), f"≤ {GOAL_REPEAT_SHARE:g}",
               lambda v: v <= GOAL_REPEAT_SHARE),
        R.goal("one photo, cache on: turns 2–10 on average, media CPU ÷ turn 1's",
               figures.get("on/one_photo/later_turn_share_mean", [])),
        R.goal("all new photos: CPU of the median request, cache on ÷ off", figures["miss_cpu_ratio"],
               f"≤ {GOAL_MISS_RATIO:g}", lambda v: v <= GOAL_MISS_RATIO),
        R.goal("one photo: CPU per request over the chat, cache on ÷ off", figures["one_photo/cpu_on_over_off"]),
        R.goal("new photo each turn: CPU per request, cache on ÷ off", figures["new_photo_each_turn/cpu_on_over_off"]),
    ]


def row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def report(data: dict[str, Any]) -> str:
    meta, rounds, figures, h = data["meta"], data["rounds"], data["figures"], data["meta"]["hash"]
    columns = ("cpu_ms_per_request", "media_cpu_ms_per_request", "latency_p50_ms", "latency_p99_ms", "peak_rss_mb")
    count = len(rounds[0]["off"]["one_photo"]["turns"])
    per_turn = {mode: [statistics.median(r[mode]["one_photo"]["turns"][t]["media_cpu_ms"] for r in rounds)
                       for t in range(count)] for mode in MODES}  # median over rounds
    return "\n".join([
        f"{meta['rounds']} rounds of {meta['turns']} turns, {meta['wall_s']} s in all; photo: {meta['photo']}; mmgate "
        f"flags: `{' '.join(FLAGS)}`. Load average at the start: `{meta['uptime_start']}`; at the end: "
        f"`{meta['uptime_end']}`. Each cell: median over rounds (min–max); a hit's media CPU can come out below 0 "
        "where it is under the noise; peak RSS: mmgate's VmHWM over one conversation.",
        "",
        row(["conversation", "cache", "mmgate CPU ms / request", "media CPU ms / request", "latency p50 ms",
             "latency p99 ms", "peak RSS MB"]),
        row(["---"] * 7),
        *(row([name, mode, *(R.spread_cell(figures.get(f"{mode}/{name}/{key}", [])) for key in columns)])
          for name in CONVERSATIONS for mode in MODES),
        "",
        "One photo, turn by turn (turn N carries the photo N times):",
        "",
        row(["turn", "copies of the photo", "media CPU ms, off", "media CPU ms, on", "on ÷ turn 1 on"]),
        row(["---"] * 5),
        *(row([str(t + 1), str(t + 1), R.number(per_turn["off"][t]), R.number(per_turn["on"][t]),
               R.number(per_turn["on"][t] / per_turn["on"][0] if per_turn["on"][0] else float("nan"))])
          for t in range(count)),
        "",
        f"Hashing ({h['payload_mb']} MB of base64, median of 5): handed to the hasher threads the loop spends "
        f"{R.number(h['loop_us_per_call_handed_off'])} µs of CPU per payload, "
        f"{R.number(h['loop_us_per_mb_handed_off'])} µs per MB; hashing on the loop would cost "
        f"{R.number(h['loop_us_per_mb_inline'])} µs per MB; the hasher takes {R.number(h['hasher_wall_us_per_mb'])} "
        "µs per MB (wall, SHA-256).",
    ])
