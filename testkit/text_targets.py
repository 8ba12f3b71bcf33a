"""The targets of the text passthrough bench (``bench/passthrough.py``) and their measurement: the upstream
("direct"), nginx, the minimal aiohttp proxy and mmgate on each event loop (and a baseline revision of mmgate),
each pinned to ``PROXY_CPU``; one wrk run or one window of the SSE client (pinned to ``LOAD_CPU``) against a
target, with the CPU the target, the upstream, the load generator and the rest of the machine spent; the targets
taking turns over those runs (``http_cells``, ``sse_rows``: medians over rounds, with ratios to direct and nginx);
and py-spy profiles of mmgate under wrk.
"""

from __future__ import annotations

import importlib.util
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from proxy.payload.locate import may_contain_media
from testkit import peers, pyspy
from testkit.load import Turns, free_port, stop, wait_http
from testkit.procfs import CLK_TCK, cpu_ticks, descendants, machine_jiffies
from testkit.text_load import ANSWER, REPO, ROLE, text_body

PROXY_CPU, LOAD_CPU = "0", "1"
TARGETS = ("direct", "nginx", "minimal", "mmgate", "mmgate-uvloop")
# The event loop each mmgate target runs on (`--loop`); "mmgate" is asyncio's own, whatever is installed.
LOOP_OF = {"mmgate": "asyncio", "mmgate-uvloop": "uvloop"}
Row = dict[str, Any]


def install_tools(profile: bool) -> None:
    """nginx and wrk (``peers.install``), py-spy where ``profile``, and uvloop (mmgate's uvloop extra, for the
    mmgate-uvloop target) where missing."""
    peers.install()
    if profile and not pyspy.pyspy_path():
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "py-spy"], check=True)
    if importlib.util.find_spec("uvloop") is None:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "uvloop>=0.19"], check=True)


@dataclass(frozen=True)
class Started:
    """The targets, running, and what wrk posts to them."""

    urls: dict[str, str]  # each target's chat URL
    pids: dict[str, list[int]]  # ``start_targets``'
    scripts: dict[str, Path]  # wrk's script posting each body: "1 KB", "4 MB"


def started(stack: ExitStack, targets: Sequence[str], sse_tokens: int, sse_delay: float, baseline: str) -> Started:
    """Every target started (``start_targets``) in a scratch folder that ``stack`` removes, each checked to relay
    the fixed answer to both text bodies, which must stay on mmgate's text fast path."""
    workdir = Path(tempfile.mkdtemp(prefix="mmgate-passthrough-"))
    stack.callback(shutil.rmtree, workdir, ignore_errors=True)
    workdir.chmod(0o755)  # nginx workers run as nobody
    bodies, scripts = {"1 KB": text_body(1024), "4 MB": text_body(4 << 20)}, {}
    for name, raw in bodies.items():
        assert not may_contain_media(raw), f"the {name} body would leave mmgate's text fast path"
        scripts[name] = peers.wrk_script(workdir, raw)
    urls, pids = start_targets(stack, targets, workdir, sse_tokens, sse_delay, baseline)
    for url in urls.values():
        for raw in bodies.values():
            check_answer(url, raw)
    return Started(urls, pids, scripts)


def start(stack: ExitStack, argv: list[str], cpu: str, **popen: Any) -> subprocess.Popen[bytes]:
    """``argv`` pinned to ``cpu``, stopped (by pid) when ``stack`` closes, whatever happens."""
    proc = subprocess.Popen(["taskset", "-c", cpu, *argv], **popen)
    stack.callback(stop, proc)
    return proc


def start_targets(stack: ExitStack, targets: Sequence[str], workdir: Path, sse_tokens: int, sse_delay: float,
                  baseline: str) -> tuple[dict[str, str], dict[str, list[int]]]:
    """The upstream ("direct") and every proxy, once each answers: each target's chat URL, and the pids whose
    CPU is the target's (direct: none; nginx: master and worker; and "upstream": the upstream's). With
    ``baseline``, the last target is that revision of mmgate, in a git worktree of its own."""
    ports = {target: free_port() for target in targets}
    upstream = f"http://127.0.0.1:{ports['direct']}"
    mmgate = [sys.executable, "-m", "proxy", "--upstream", upstream, "--host", "127.0.0.1", "--access-log", "off"]
    argv = {"direct": [*ROLE, "upstream", "--port", str(ports["direct"]), "--sse-tokens", str(sse_tokens),
                       "--sse-delay", str(sse_delay)],
            "nginx": peers.nginx_argv(workdir, ports["nginx"], ports["direct"]),
            "minimal": [*ROLE, "minimal-proxy", "--port", str(ports["minimal"]), "--upstream", upstream],
            **{target: [*mmgate, "--port", str(ports[target]), "--loop", loop] for target, loop in LOOP_OF.items()}}
    cwd = dict.fromkeys(argv, REPO)
    env: dict[str, dict[str, str] | None] = dict.fromkeys(argv)  # None: this process's
    if baseline:  # on the loop of the "mmgate" it is compared with
        last, worktree = targets[-1], workdir / "baseline"
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", "--force", str(worktree), baseline],
                       check=True, capture_output=True)
        stack.callback(subprocess.run, ["git", "-C", str(REPO), "worktree", "remove", "--force", str(worktree)],
                       capture_output=True)
        argv[last], cwd[last] = [*mmgate, "--port", str(ports[last])], worktree
        env[last] = {**os.environ, "MMGATE_LOOP": LOOP_OF["mmgate"]}  # a revision before the setting ignores it
    silent = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    procs: dict[str, subprocess.Popen[bytes]] = {}
    for target in targets:  # one by one, the upstream first: mmgate asks it what it serves as it starts
        procs[target] = start(stack, argv[target], PROXY_CPU, cwd=cwd[target], env=env[target],
                              **({} if target == "direct" else silent))
        wait_http(f"http://127.0.0.1:{ports[target]}/{'mmgate/health' if 'mmgate' in target else ''}", procs[target])
    pids = {target: [proc.pid] for target, proc in procs.items()}
    pids |= {"direct": [], "upstream": pids["direct"], "nginx": [procs["nginx"].pid, *descendants(procs["nginx"].pid)]}
    return {target: f"http://127.0.0.1:{port}/v1/chat/completions" for target, port in ports.items()}, pids


def check_answer(url: str, body: bytes) -> None:
    """The target relays the upstream's fixed answer to ``body``."""
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(request, timeout=10) as r:
        got = r.read()
    if r.status != 200 or got != ANSWER:
        raise RuntimeError(f"{url}: unexpected answer {r.status} {got[:200]!r}")


def cpu_meter(pids: Mapping[str, list[int]], target: str) -> Callable[[], list[float]]:
    """The CPU seconds spent from now by the target's proxy, the upstream, the whole machine (every process and the
    kernel, steal included) and this process's reaped children (wrk, once it has exited)."""
    def now() -> list[float]:
        children = resource.getrusage(resource.RUSAGE_CHILDREN)
        return [cpu_ticks(pids[target]) / CLK_TCK, cpu_ticks(pids["upstream"]) / CLK_TCK,
                machine_jiffies()[0] / CLK_TCK, children.ru_utime + children.ru_stime]

    start = now()
    return lambda: [later - then for then, later in zip(start, now(), strict=True)]


def measure_http(url: str, script: Path, conns: int, seconds: int, pids: Mapping[str, list[int]],
                 target: str) -> Row:
    """One wrk run. ``other_load`` = CPU (in cores) used on the machine by anything but proxy, upstream and wrk:
    other jobs, plus kernel network work not charged to a process (so it is never quite 0 here)."""
    spent = cpu_meter(pids, target)
    w = peers.run_wrk(url, script, conns, seconds, LOAD_CPU)
    proxy_s, upstream_s, machine_s, wrk_s = spent()
    requests, wall, has_proxy = max(w["requests"], 1), w["duration_us"] / 1e6, bool(pids[target])
    return {"requests": w["requests"], "rps": w["requests"] / wall,
            **{f"{q}_ms": w[f"{q}_us"] / 1e3 for q in ("p50", "p90", "p99", "max")},
            "errors": sum(w[k] for k in ("connect", "read", "write", "status", "timeout")), "non_2xx": w["status"],
            "proxy_cpu_us_per_req": proxy_s / requests * 1e6 if has_proxy else None,
            "proxy_cpu_share": proxy_s / wall if has_proxy else None,
            "upstream_cpu_us_per_req": upstream_s / requests * 1e6, "load_cpu_share": wrk_s / wall,
            "other_load": max(0.0, (machine_s - proxy_s - upstream_s - wrk_s) / wall)}


def measure_sse(stack: ExitStack, url: str, streams: int, period: float, seconds: float,
                pids: Mapping[str, list[int]], target: str) -> Row:
    """One window of the SSE client, ``streams`` streams staggered over ``period`` (one response's length);
    ``other_load`` as in measure_http, less the CPU the client reports."""
    client = start(stack, [*ROLE, "sse-client", "--url", url, "--streams", str(streams), "--warmup",
                           str(max(1.5, period * 1.2)), "--duration", str(seconds), "--period", str(period)],
                   LOAD_CPU, stdout=subprocess.PIPE, cwd=REPO)
    assert client.stdout is not None
    if (line := client.stdout.readline()).strip() != b"START":
        raise RuntimeError(f"SSE client did not start: {line!r}")
    spent = cpu_meter(pids, target)
    line = client.stdout.readline()
    proxy_s, upstream_s, machine_s, _ = spent()
    client.wait(30)
    result = json.loads(line)
    tokens, wall, has_proxy = max(result["tokens"], 1), result["seconds"], bool(pids[target])
    return result | {"proxy_cpu_us_per_token": proxy_s / tokens * 1e6 if has_proxy else None,
                     "proxy_cpu_share": proxy_s / wall if has_proxy else None,
                     "upstream_cpu_us_per_token": upstream_s / tokens * 1e6,
                     "other_load": max(0.0, (machine_s - proxy_s - upstream_s) / wall - result["client_cpu_share"])}


def profile_under_wrk(url: str, script: Path, pid: int, seconds: int, svg: Path | None) -> dict[str, Any]:
    """``pyspy.record`` of ``pid`` for ``seconds`` (and a flame graph to ``svg``) while wrk keeps 32 connections
    busy; py-spy runs on the load generator's CPU."""
    busy_s = (2 if svg else 1) * (seconds + 2) + 2  # wrk outlasts the py-spy runs (svg: one more)
    with subprocess.Popen(peers.wrk_argv(url, script, 32, busy_s, LOAD_CPU), stdout=subprocess.DEVNULL):
        time.sleep(1)
        return pyspy.record(pid, seconds, svg, cpu=LOAD_CPU)


def http_cells(turns: Turns, run: Started, targets: Sequence[str], seconds: Mapping[str, int],
               rounds: int) -> list[Row]:
    """Each body over 1 and 32 connections: every target warmed up by a 1 s wrk run (connections, pools, caches),
    then the targets taking turns for ``rounds`` wrk runs of ``seconds[body]``; a cell per target, its medians
    (``Turns.take``) with its req/s over direct's and nginx's and its proxy CPU over nginx's, printed as they come."""
    cells: list[Row] = []
    for body, conns in ((body, conns) for body in run.scripts for conns in (1, 32)):
        for target in targets:
            peers.run_wrk(run.urls[target], run.scripts[body], conns, 1, LOAD_CPU)
        medians = turns.take({target: partial(measure_http, run.urls[target], run.scripts[body], conns, seconds[body],
                                              run.pids, target) for target in targets}, rounds)
        direct, nginx = medians["direct"], medians["nginx"]
        for target, row in medians.items():
            cells.append({"body": body, "conns": conns, "target": target, **row,
                          "rps_x_direct": row["rps"] / direct["rps"], "rps_x_nginx": row["rps"] / nginx["rps"],
                          "cpu_x_nginx": row["proxy_cpu_us_per_req"] / nginx["proxy_cpu_us_per_req"]
                          if row["proxy_cpu_us_per_req"] is not None and nginx["proxy_cpu_us_per_req"] else None})
            print(f"  {body:5} c={conns:<3} {target:8} {row['rps']:9.0f} req/s  p50 {row['p50_ms']:.2f} ms  p99 "
                  f"{row['p99_ms']:.2f} ms  proxy CPU {dash(row['proxy_cpu_us_per_req'])} us/req  other load "
                  f"{row['other_load']:.2f}", flush=True)
    return cells


def sse_rows(turns: Turns, stack: ExitStack, run: Started, targets: Sequence[str], streams: int, period: float,
             seconds: float, rounds: int) -> list[Row]:
    """The SSE client against each target (the upstream streams when asked to by X-Bench-Stream), the targets
    taking turns for ``rounds`` windows of ``seconds``; a row per target, its medians with its tokens/s over
    direct's (the medians' ratio, and the ratio of the means over rounds), printed as they come."""
    medians = turns.take({target: partial(measure_sse, stack, run.urls[target], streams, period, seconds, run.pids,
                                          target) for target in targets}, rounds)
    direct_mean = statistics.fmean(r["tokens_per_s"] for r in medians["direct"]["rounds"])
    rows = [{"target": target, **row, "x_direct": row["tokens_per_s"] / medians["direct"]["tokens_per_s"],
             "mean_tokens_per_s": (mean := statistics.fmean(r["tokens_per_s"] for r in row["rounds"])),
             "mean_x_direct": mean / direct_mean} for target, row in medians.items()]
    for row in rows:
        print(f"  SSE {row['target']:8} {row['tokens_per_s']:8.0f} tok/s  gap p50 {row['gap_p50_ms']:.2f} ms  p99 "
              f"{row['gap_p99_ms']:.2f} ms  proxy CPU {dash(row['proxy_cpu_us_per_token'])} us/token  other load "
              f"{row['other_load']:.2f}", flush=True)
    return rows


def profiles(run: Started, seconds: int, svg: Path) -> dict[str, Any]:
    """``profile_under_wrk`` of mmgate with each body at 32 connections, by body; the 1 KB one's flame graph to
    ``svg``."""
    out = {}
    for body, to in (("1 KB", svg), ("4 MB", None)):
        print(f"  profiling mmgate (py-spy, {body}, 32 connections) ...", flush=True)
        out[body] = profile_under_wrk(run.urls["mmgate"], run.scripts[body], run.pids["mmgate"][0], seconds, to)
    return out


def per_round(numerator: Row, denominator: Row, key: str) -> list[float]:
    """``key``'s ratio round by round: targets took turns within a round, so a round's ratio compares like with
    like. A CPU reading can be missing or zero: that round has no CPU ratio."""
    pairs = zip(numerator["rounds"], denominator["rounds"], strict=False)
    if key.startswith("proxy_cpu"):
        return [n[key] / d[key] for n, d in pairs if n[key] and d[key]]
    return [n[key] / d[key] for n, d in pairs]


def dash(value: float | None, digits: int = 0) -> str:
    """A figure, or – when there is none (direct has no proxy CPU)."""
    return "–" if value is None else f"{value:.{digits}f}"
