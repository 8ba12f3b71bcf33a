"""One cold start of mmgate, timed: ``python -m proxy`` in a fresh process from a given tree, polled until it
serves, with its RSS then (``bench/startup.py``).

The time runs from just before the process is started to the first answer of a readiness probe (``get`` on a
fresh connection every ``POLL_S``), so it covers the interpreter, the imports and the app's start-up; the RSS is
read from /proc at that moment, of mmgate's own process and of its process tree (its decode workers).
``byte_compiled`` writes a tree's bytecode first, as an install leaves it: otherwise the start measures the
compiler too. ``take_turns`` starts several variants (a ``Start`` each) round after round.
"""

from __future__ import annotations

import http.client
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

from testkit import procfs
from testkit.load import free_port, stop

POLL_S = 0.005
TIMEOUT_S = 60.0
PACKAGES = ("proxy", "preprocessors")  # mmgate's own packages, byte-compiled before the starts


def get(port: int, path: str) -> tuple[int, Any]:
    """One GET on a fresh connection: (status, JSON body); (0, None) while nothing listens yet."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        body = response.read()
        return response.status, json.loads(body) if body else None
    except (OSError, ValueError, http.client.HTTPException):
        return 0, None
    finally:
        conn.close()


def rss_mb(pid: int) -> tuple[float, float]:
    """(mmgate's own RSS, its process tree's summed RSS) in MB."""
    own = procfs.memory(pid).get("VmRSS", 0) / 2**20
    return own, sum(procfs.memory(p).get("VmRSS", 0) for p in procfs.tree(pid)) / 2**20


def wait_until(proc: subprocess.Popen[bytes], log: Path, started: float, ok: Callable[[int, Any], bool], port: int,
               path: str) -> float:
    """Poll ``path`` until ``ok(status, body)``; the seconds since ``started``."""
    while time.monotonic() - started < TIMEOUT_S:
        if proc.poll() is not None:
            raise SystemExit(f"mmgate exited with {proc.returncode} before {path} was ready: "
                             f"{log.read_text(errors='replace')[-2000:]}")
        status, body = get(port, path)
        if ok(status, body):
            return time.monotonic() - started
        time.sleep(POLL_S)
    raise SystemExit(f"{path} not ready within {TIMEOUT_S} s")


def serving(status: int, body: Any) -> bool:
    """``/mmgate/health`` of an app that serves: 200 with ``draining: false`` (``proxy/admin/routes.health``)."""
    return status == 200 and isinstance(body, dict) and body.get("draining") is False


def model_in_force(status: int, body: Any) -> bool:
    """``/mmgate/stats`` once the served model's family is known."""
    return status == 200 and isinstance(body, dict) and bool((body.get("served_model") or {}).get("family"))


class Start(NamedTuple):
    """How one variant starts: from which tree, in front of which upstream, with which environment and flags."""

    tree: Path
    upstream: str
    env: dict[str, str]
    flags: tuple[str, ...] = ()


def start_once(tree: Path, upstream: str, env: dict[str, str], flags: tuple[str, ...],
               wait_model: bool) -> dict[str, float]:
    """One start of mmgate from ``tree``: seconds to ready (and, with ``wait_model``, to the model in force) and
    the RSS at each."""
    port = free_port()
    argv = [sys.executable, "-m", "proxy", "--upstream", upstream, "--port", str(port), "--host", "127.0.0.1",
            "--access-log", "off", "--drain-grace", "0", "--drain-timeout", "2", *flags]
    with tempfile.NamedTemporaryFile(prefix="mmgate-startup-", suffix=".log", delete=False) as log:
        started = time.monotonic()
        proc = subprocess.Popen(argv, cwd=tree, env=env, stdout=subprocess.DEVNULL, stderr=log)
    proc.log_path = log.name  # type: ignore[attr-defined]  # stop() reads and removes it
    try:
        out = {"ready_s": wait_until(proc, Path(log.name), started, serving, port, "/mmgate/health")}
        out["rss_mb"], out["tree_rss_mb"] = rss_mb(proc.pid)
        if wait_model:
            out["model_s"] = wait_until(proc, Path(log.name), started, model_in_force, port, "/mmgate/stats")
            out["model_rss_mb"], out["model_tree_rss_mb"] = rss_mb(proc.pid)
    finally:
        stop(proc)
    return out


def byte_compiled(tree: Path) -> Path:
    """``tree`` with its packages' bytecode written (``__pycache__``, ignored by git), as an install leaves them."""
    subprocess.run([sys.executable, "-m", "compileall", "-q", "-j", "0",
                    *(str(tree / package) for package in PACKAGES if (tree / package).is_dir())],
                   check=True, stdout=subprocess.DEVNULL)
    return tree


def take_turns(starts: Mapping[str, Start], rounds: int, wait_model: str) -> list[dict[str, Any]]:
    """``rounds`` starts of each variant, one fresh process each, taking turns within a round in an order that
    turns round by round (so no variant always follows the same one); the variant named ``wait_model`` is also
    timed to its model in force. A row per start, printed as it ends."""
    names = list(starts)
    rows: list[dict[str, Any]] = []
    for round_ in range(rounds):
        for variant in names[round_ % len(names):] + names[: round_ % len(names)]:
            times = start_once(*starts[variant], wait_model=variant == wait_model)
            row = {"variant": variant, "round": round_, **times}
            rows.append(row)
            print(f"r={round_} {variant:12} ready {row['ready_s']:.2f} s, RSS {row['rss_mb']:.0f} MB "
                  f"(tree {row['tree_rss_mb']:.0f})" + (f", model in force {row['model_s']:.2f} s, RSS "
                                                        f"{row['model_rss_mb']:.0f} MB" if "model_s" in row else ""),
                  flush=True)
    return rows
