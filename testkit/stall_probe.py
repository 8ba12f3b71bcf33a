"""How long one request holds an event loop: probers that GET a health path every few ms until told to stop,
while bodies are sent one at a time; a body's figure is the longest probe that overlapped its handling
(``bench/loop_stall.py``, which measures a baseline revision's tree beside this one).

Every time is ``time.monotonic`` (CLOCK_MONOTONIC, shared by every process), so a probe recorded by the prober's
process and a body's window recorded here compare directly.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from testkit import load as L


def start_mmgate_from(tree: Path, upstream: str, *flags: str) -> tuple[subprocess.Popen[bytes], str]:
    """``python -m proxy`` run from ``tree`` (this repository or a revision's ``git archive``) with this
    interpreter, default settings but for ``flags``, the processed-media cache off."""
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
    """POST ``body`` over a fresh blocking connection; (first byte sent, answer read, status, error code)."""
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


def worst_ms(probes: list[list[float]], t0: float, t1: float) -> tuple[float, int]:
    """The longest latency among the probes that overlapped [t0, t1], in ms, and how many did."""
    overlapping = [b - a for a, b in probes if b >= t0 and a <= t1]
    return round(max(overlapping, default=float("nan")) * 1000, 2), len(overlapping)


def stalls(tree: Path, bodies: dict[tuple[str, int], bytes], interval: float,
           control_port: int) -> dict[str, dict[str, Any]]:
    """A fresh stub backend and mmgate of ``tree`` (``--max-media-item-mb 64``: a big image is decoded, not
    refused by size), every body sent in turn while its /mmgate/health and the control server's /health are
    probed every ``interval`` s: per body (``kind/size``), the worst probe of each in its window, how many probes
    overlapped it, how long it was handled and its answer; ``_log`` holds mmgate's log tail when it has a
    traceback."""
    stub, stub_url = L.start_stub()
    proc, url = start_mmgate_from(tree, stub_url, "--max-media-item-mb", "64")
    port = int(url.rsplit(":", 1)[1])
    scratch = Path(tempfile.mkdtemp(prefix="mmgate-stall-"))
    stop = scratch / "stop"
    probers = {name: (subprocess.Popen([sys.executable, "-m", "testkit.load", "probe-until", str(at), path,
                                        str(interval), str(stop), str(scratch / f"{name}.json")], cwd=L.REPO),
                      scratch / f"{name}.json")
               for name, at, path in (("mmgate", port, "/mmgate/health"), ("control", control_port, "/health"))}
    try:
        time.sleep(0.5)
        windows = {}
        for (kind, size), body in bodies.items():
            windows[f"{kind}/{size}"] = send(port, body)
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
    rows: dict[str, dict[str, Any]] = {}
    for name, (t0, t1, status, code) in windows.items():
        worst, n = worst_ms(probes["mmgate"], t0, t1)
        control, _ = worst_ms(probes["control"], t0, t1)
        rows[name] = {"worst_ms": worst, "probes": n, "control_worst_ms": control,
                      "handled_ms": round((t1 - t0) * 1000, 1), "status": status, "code": code}
    if "Traceback" in log:
        rows["_log"] = {"tail": log[-1500:]}
    return rows
