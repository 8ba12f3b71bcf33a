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

import io
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import _results as R
from testkit import load as L

GOAL_MS = 100.0
KINDS = ("image_flood", "text_flood", "deep", "invalid", "big_image")
WHAT = "/mmgate/health latency while one hostile body (8, 35, 50 MB) is handled: before and after the stepped walk"


# --- bodies -------------------------------------------------------------------------------------------------

def _tiny_png_uri() -> bytes:
    import base64

    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (1, 1), "red").save(out, "PNG")
    return b"data:image/png;base64," + base64.b64encode(out.getvalue())


def _parts_body(part: bytes, size: int) -> bytes:
    head, tail = b'{"model":"m","messages":[{"role":"user","content":[', b"]}]}"
    n = max(1, (size - len(head) - len(tail)) // (len(part) + 1))
    return head + b",".join([part] * n) + tail


def big_png_uri(size: int) -> bytes:
    """A data URI of about ``size`` bytes: a PNG of random pixels (incompressible, so its size is its pixels)."""
    import base64

    import numpy as np
    from PIL import Image

    side = int((size * 3 / 4 / 3) ** 0.5)
    pixels = np.random.default_rng(7).integers(0, 256, (side, side, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "PNG", compress_level=0)
    return b"data:image/png;base64," + base64.b64encode(out.getvalue())


def body_for(kind: str, size: int) -> bytes:
    if kind == "image_flood":
        return _parts_body(b'{"type":"image_url","image_url":{"url":"' + _tiny_png_uri() + b'"}}', size)
    if kind in ("text_flood", "invalid"):
        body = _parts_body(b'{"type":"text","text":"an image of a cat"}', size)
        return body[:-1] if kind == "invalid" else body
    if kind == "deep":
        head = b'{"model":"m","messages":[{"role":"user","content":[{"type":"image_url","image_url":'
        tail = b"}]}]}"
        depth = (size - len(head) - len(tail)) // 2
        return head + b"[" * depth + b"]" * depth + tail
    if kind == "big_image":
        head = b'{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"what is this?"},' \
               b'{"type":"image_url","image_url":{"url":"'
        return head + big_png_uri(size - len(head) - 8) + b'"}}]}]}'
    raise ValueError(kind)


# --- one tree, one round ------------------------------------------------------------------------------------

def start_mmgate(tree: Path, upstream: str, *flags: str) -> tuple[subprocess.Popen[bytes], str]:
    port = L.free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("MMGATE_")}
    env["PYTHONPATH"] = str(tree)
    cmd = [sys.executable, "-m", "proxy", "--upstream", upstream, "--port", str(port), "--host", "127.0.0.1",
           "--access-log", "off", "--drain-grace", "0", "--drain-timeout", "2", "--cache-mb", "0", *flags]
    with tempfile.NamedTemporaryFile(prefix="mmgate-stall-", suffix=".log", delete=False) as log:
        proc = subprocess.Popen(cmd, cwd=tree, env=env, stdout=subprocess.DEVNULL, stderr=log)
    proc.log_path = log.name  # type: ignore[attr-defined]
    url = f"http://127.0.0.1:{port}"
    L.wait_http(url + "/mmgate/health", proc)
    return proc, url


def send(port: int, body: bytes) -> tuple[float, float, int, str]:
    """POST ``body`` over a fresh connection; (first byte sent, answer read, status, error code)."""
    with socket.create_connection(("127.0.0.1", port)) as sock:
        head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
        t0 = time.monotonic()
        sock.sendall(head)
        sock.sendall(body)
        chunks = []
        while chunk := sock.recv(1 << 16):
            chunks.append(chunk)
        t1 = time.monotonic()
    answer = b"".join(chunks)
    status = int(answer.split(b" ", 2)[1]) if answer else 0
    code = ""
    if status != 200:
        try:
            code = json.loads(answer.partition(b"\r\n\r\n")[2])["error"]["code"]
        except (ValueError, KeyError, TypeError):
            code = "?"
    return t0, t1, status, code


def _worst_ms(probes: list[list[float]], t0: float, t1: float) -> tuple[float, int]:
    """The longest latency among the probes that overlapped [t0, t1], in ms, and how many did."""
    overlapping = [b - a for a, b in probes if b >= t0 and a <= t1]
    return round(max(overlapping, default=float("nan")) * 1000, 2), len(overlapping)


def run_tree(tree: Path, bodies: dict[tuple[str, int], bytes], interval: float,
             control_port: int) -> dict[str, dict[str, Any]]:
    stub, stub_url = L.start_stub()
    proc, url = start_mmgate(tree, stub_url, "--max-media-item-mb", "64")
    port = int(url.rsplit(":", 1)[1])
    scratch = Path(tempfile.mkdtemp(prefix="mmgate-stall-"))
    stop = scratch / "stop"
    probers = {name: (subprocess.Popen([sys.executable, "-m", "testkit.load", "probe-until", str(at), path,
                                        str(interval), str(stop), str(scratch / f"{name}.json")], cwd=R.REPO),
                      scratch / f"{name}.json")
               for name, at, path in (("mmgate", port, "/mmgate/health"), ("control", control_port, "/health"))}
    rows: dict[str, dict[str, Any]] = {}
    try:
        time.sleep(0.5)
        windows = {}
        for (kind, size), body in bodies.items():
            t0, t1, status, code = send(port, body)
            windows[f"{kind}/{size}"] = (t0, t1, status, code)
            time.sleep(0.3)
        stop.touch()
        probes = {}
        for name, (prober, out) in probers.items():
            prober.wait(60)
            probes[name] = json.loads(out.read_text())
    finally:
        for prober, _out in probers.values():
            if prober.poll() is None:
                prober.kill()
        log = L.stop(proc)
        L.stop(stub)
    for name, (t0, t1, status, code) in windows.items():
        worst, n = _worst_ms(probes["mmgate"], t0, t1)
        control, _ = _worst_ms(probes["control"], t0, t1)
        rows[name] = {"worst_ms": worst, "probes": n, "control_worst_ms": control,
                      "handled_ms": round((t1 - t0) * 1000, 1), "status": status, "code": code}
    if "Traceback" in log:
        rows["_log"] = {"tail": log[-1500:]}
    return rows


# The last main before a single body was kept from holding the loop: "before" for every later run.
BASELINE = "a573611"


# --- results ------------------------------------------------------------------------------------------------

def goals(data: dict[str, Any]) -> list[R.Goal]:
    out = []
    for size in data["sizes"]:
        for tree, words in (("after", "after"), ("before", "before (baseline)")):
            worst = [max(r[f"{k}/{size}"]["worst_ms"] for k in data["kinds"]) for r in data["rounds"][tree]]
            if tree == "after":
                out.append(R.goal(f"worst health latency, {size} MB bodies, {words}", worst, f"≤ {GOAL_MS:g}",
                                  lambda v: v <= GOAL_MS, unit="ms"))
                control = [max(r[f"{k}/{size}"]["control_worst_ms"] for k in data["kinds"])
                           for r in data["rounds"][tree]]
                out.append(R.goal(f"control server's worst in the same windows, {size} MB bodies (the machine's "
                                  "share)", control, unit="ms"))
            else:
                out.append(R.goal(f"worst health latency, {size} MB bodies, {words}", worst, unit="ms"))
    return out


def report(data: dict[str, Any]) -> str:
    def cell(tree: str, name: str) -> str:
        answers = sorted({f"{r[name]['status']}{' ' + r[name]['code'] if r[name]['code'] else ''}"
                          for r in data["rounds"][tree]})
        handled = R.summary(r[name]["handled_ms"] for r in data["rounds"][tree])
        control = R.summary(r[name]["control_worst_ms"] for r in data["rounds"][tree])
        worst = R.spread_cell(r[name]["worst_ms"] for r in data["rounds"][tree])
        return (f"{worst} | {R.number(control['median'])} | {R.number(handled['median'])} | {', '.join(answers)}")

    lines = [
        f"Baseline `{data['baseline_ref']}` at "
        f"`{(data['baseline_commit'] or '')[:10]}`"
        f" against this tree; {len(data['rounds']['after'])} rounds; probes every {data['interval'] * 1000:g} ms.",
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
    ]
    for size in data["sizes"]:
        for kind in data["kinds"]:
            name = f"{kind}/{size}"
            lines.append(f"| {kind} | {size} | {cell('before', name)} | {cell('after', name)} |")
    lines += ["", f"Start: `{data['uptime_start']}`  ", f"End: `{data['uptime_end']}`", ""]
    return "\n".join(lines)


def measure(args: R.Knobs) -> dict[str, Any]:
    stamp = R.stamp("loop_stall.py", WHAT)
    sizes = [int(s) for s in args.sizes.split(",")]
    kinds = args.kinds.split(",")
    bodies = {(kind, size): body_for(kind, size * 1_000_000) for size in sizes for kind in kinds}
    base = L.revision_tree(args.baseline_ref)
    trees = {"before": base, "after": R.REPO}
    data: dict[str, Any] = stamp | {
        "baseline_ref": args.baseline_ref, "baseline_commit": R.git("rev-parse", args.baseline_ref),
        "sizes": sizes, "kinds": kinds, "interval": args.interval, "uptime_start": L.uptime(),
        "body_bytes": {f"{k}/{s}": len(b) for (k, s), b in bodies.items()},
        "rounds": {"before": [], "after": []},
    }
    control, control_url = L.start_control()
    control_port = int(control_url.rsplit(":", 1)[1])
    try:
        for rnd in range(args.rounds):
            for tree, where in trees.items():  # interleaved: both trees see the same machine in each round
                rows = run_tree(where, bodies, args.interval, control_port)
                data["rounds"][tree].append(rows)
                for name, row in rows.items():
                    print(f"r{rnd} {tree:6s} {name:18s} {row}", flush=True)
    finally:
        L.stop(control)
        subprocess.run(["rm", "-rf", str(base)], check=False)
    data["uptime_end"] = L.uptime()
    return data
