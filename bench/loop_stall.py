"""Does one hostile body hold the event loop? /mmgate/health latency while mmgate handles each body, before
(a baseline tree, by default ``a573611``: the last main before the loop was bounded) and after (this tree),
side by side in one run.

Bodies, each at 8, 35 and 50 MB (decimal; under the default MMGATE_MAX_BODY_MB of 64 MiB), all on
``/v1/chat/completions`` and all naming "image" so the sniff sends them to the walk:

* ``image_flood``: one user message of as many tiny image parts (a 1x1 PNG data URI) as fit;
* ``text_flood``: as many small text parts whose text mentions "an image" as fit (a text-only body);
* ``deep``: an ``image_url`` whose value is arrays nested as deep as the size allows;
* ``invalid``: the text flood with its last byte cut off (JSON that is invalid only at its end);
* ``big_image``: one valid PNG (random pixels) whose data URI fills the body (``--max-media-item-mb 64`` so
  it is decoded, not refused by size).

Per round and tree: fresh stub backend (``python -m demo.backend``) and mmgate (``python -m proxy`` run from
that tree, default settings, processed-media cache off), then each body in turn, sent by this process over
a blocking socket, while a prober in its own process sends GET /mmgate/health every ``--interval`` (2 ms)
over one keep-alive connection, recording each probe's send and answer time (CLOCK_MONOTONIC, shared by all
processes). A body's figure is the longest health latency among the probes that overlapped its handling
(from its first byte sent to its answer read): the longest time the loop did not answer. A control server
(a bare aiohttp app in its own process) is probed the same way at the same time: its worst in the same
window is the machine's share (other jobs on the shared cores). The baseline tree is ``git archive`` of
``--baseline-ref`` into a temporary folder (nothing in a worktree is touched) and runs with this tree's
virtual environment. Goal: after, the worst body of each size within 100 ms (median over rounds of each
round's worst).

    python -m bench run loop_stall [--set KNOB=VALUE] [--rounds N] [--quick]
    python -m bench list loop_stall   # the knobs and their defaults
"""

from __future__ import annotations

import shutil
from typing import Any

from bench import _results as R
from testkit import load as L
from testkit.hostile_bodies import body_for
from testkit.stall_probe import stalls

GOAL_MS = 100.0
WHAT = "/mmgate/health latency while one hostile body (8, 35, 50 MB) is handled: before and after the stepped walk"


def goals(data: dict[str, Any]) -> list[R.Goal]:
    def worst(tree: str, size: int, key: str) -> list[float]:
        """Each round's worst body of ``size``."""
        return [max(r[f"{k}/{size}"][key] for k in data["kinds"]) for r in data["rounds"][tree]]

    out = []
    for size in data["sizes"]:
        out += [R.goal(f"worst health latency, {size} MB bodies, after", worst("after", size, "worst_ms"),
                       f"≤ {GOAL_MS:g}", lambda v: v <= GOAL_MS, unit="ms"),
                R.goal(f"control server's worst in the same windows, {size} MB bodies (the machine's share)",
                       worst("after", size, "control_worst_ms"), unit="ms"),
                R.goal(f"worst health latency, {size} MB bodies, before (baseline)",
                       worst("before", size, "worst_ms"), unit="ms")]
    return out


def report(data: dict[str, Any]) -> str:
    def cells(tree: str, name: str) -> str:
        rows = [r[name] for r in data["rounds"][tree]]
        answers = sorted({f"{r['status']}{' ' + r['code'] if r['code'] else ''}" for r in rows})
        control = R.summary(r["control_worst_ms"] for r in rows)["median"]
        handled = R.summary(r["handled_ms"] for r in rows)["median"]
        return (f"{R.spread_cell(r['worst_ms'] for r in rows)} | {R.number(control)} | {R.number(handled)} "
                f"| {', '.join(answers)}")

    lines = [
        f"Baseline `{data['baseline_ref']}` at `{(data['baseline_commit'] or '')[:10]}` against this tree; "
        f"{len(data['rounds']['after'])} rounds; probes every {data['interval'] * 1000:g} ms.",
        "",
        "Worst health latency: the longest /mmgate/health answer among the probes that overlapped the body's "
        "handling (first byte sent to answer read), median over rounds (min–max). Handled: how long that body "
        "took, median. Answer: status and error code. Control: a bare aiohttp server (its own process, doing "
        "nothing else) probed the same way in the same windows, median of its worst: what the shared machine's "
        "scheduling alone costs a loop that does nothing. Default settings, `--max-media-item-mb 64`, cache off, "
        "the machine's default decode mode.",
        "",
        "| body | MB | before: worst ms (spread) | control | before: handled ms | before: answer "
        "| after: worst ms (spread) | control | after: handled ms | after: answer |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        *(f"| {kind} | {size} | {cells('before', f'{kind}/{size}')} | {cells('after', f'{kind}/{size}')} |"
          for size in data["sizes"] for kind in data["kinds"]),
        "", f"Start: `{data['uptime_start']}`  ", f"End: `{data['uptime_end']}`", "",
    ]
    return "\n".join(lines)


def measure(args: R.Knobs) -> dict[str, Any]:
    stamp = R.stamp("loop_stall.py", WHAT)
    sizes = [int(s) for s in args.sizes.split(",")]
    kinds = args.kinds.split(",")
    bodies = {(kind, size): body_for(kind, size * 1_000_000) for size in sizes for kind in kinds}
    base = L.revision_tree(args.baseline_ref)
    data: dict[str, Any] = stamp | {
        "baseline_ref": args.baseline_ref, "baseline_commit": R.git("rev-parse", args.baseline_ref),
        "sizes": sizes, "kinds": kinds, "interval": args.interval, "uptime_start": L.uptime(),
        "body_bytes": {f"{k}/{s}": len(b) for (k, s), b in bodies.items()},
        "rounds": {"before": [], "after": []},
    }
    control, control_url = L.start_control()
    try:
        for rnd in range(args.rounds):
            for tree, where in {"before": base, "after": R.REPO}.items():  # interleaved: both see the same machine
                rows = stalls(where, bodies, args.interval, int(control_url.rsplit(":", 1)[1]))
                data["rounds"][tree].append(rows)
                for name, row in rows.items():
                    print(f"r{rnd} {tree:6s} {name:18s} {row}", flush=True)
    finally:
        L.stop(control)
        shutil.rmtree(base, ignore_errors=True)
    data["uptime_end"] = L.uptime()
    return data
