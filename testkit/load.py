"""Load generation for the benchmarks (loop_latency, gate_sweep, malloc_arenas, soak, default_limit, checkpoints...).

What is here: starting/stopping the stub backend and mmgate as separate processes (optionally with a
baseline decode pool from ``testkit.variants``: workers at niceness 0, or decoding on the loop; ``stub_and_gates``:
the stub with several mmgates in front), targets taking turns round by round (``turn``, ``Turns``), /proc readings
(VmHWM, RSS, per-thread niceness), Prometheus text parsing, an aiohttp load client, and a tiny blocking HTTP prober. The
photo and the request bodies they send are built by ``testkit.media``.

The prober runs in its own process: ``python -m testkit.load probe --host ... --port ... --seconds 10
--interval 0.01 --out result.json``. It sends one GET every ``interval`` seconds (fixed schedule) over one keep-alive
connection with blocking sockets (no event loop of its own to add noise) and records, per probe, the
time from send to the last response byte, and how late it was sent relative to its schedule.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from testkit.environment import mmgate_env
from testkit.procfs import cpu_ticks, machine_jiffies

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
K = TypeVar("K")
T = TypeVar("T")


# --- processes -----------------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, proc: subprocess.Popen[bytes], timeout: float = 30.0) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            path = getattr(proc, "log_path", None)
            err = Path(path).read_text(errors="replace")[-2000:] if path else ""
            raise RuntimeError(f"process exited with {proc.returncode} before {url} answered: {err}")
        try:
            with urllib.request.urlopen(url, timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.05)
    log = stop(proc)  # never left running behind the error: nobody else holds it
    raise RuntimeError(f"{url} did not answer within {timeout} s: {log[-2000:]}")


def _pin(cpus: set[int] | None) -> Callable[[], None] | None:
    """preexec_fn pinning the child (and every thread it will start) to ``cpus``."""
    return None if cpus is None else (lambda: os.sched_setaffinity(0, cpus))


def start_stub(*args: str, cpus: set[int] | None = None) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    with tempfile.NamedTemporaryFile(prefix="stub-bench-", suffix=".log", delete=False) as log:
        proc = subprocess.Popen([sys.executable, "-m", "demo.backend", "--host", "127.0.0.1", "--port", str(port),
                                 *args], cwd=REPO, stdout=subprocess.DEVNULL, stderr=log, preexec_fn=_pin(cpus))
    proc.log_path = log.name  # type: ignore[attr-defined]
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/health", proc)
    return proc, url


def start_mmgate(upstream: str, *flags: str, env: dict[str, str] | None = None,
                 variant: str | None = None, cpus: set[int] | None = None) -> tuple[subprocess.Popen[bytes], str]:
    """mmgate in its own process: ``python -m proxy``, or with ``variant`` (``"nice0"``, ``"loop"``) the
    baseline decode pool of ``python -m testkit.variants``. The processed-media cache is off unless ``flags``
    turn it on: benchmarks resend their images, and a cache would answer them without the work they measure
    (``bench/cache.py`` measures the cache). It runs on asyncio's own event loop, what ``pip install mmgate``
    gives, unless ``env`` names another (``MMGATE_LOOP``): the test extra installs uvloop, which ``auto`` would
    pick, and bench/passthrough.py measures uvloop beside asyncio."""
    port = free_port()
    full_env = mmgate_env(keep=(), **({"MMGATE_LOOP": "asyncio"} | (env or {})))
    cmd = [sys.executable, "-m", "proxy"] if variant is None else [sys.executable, "-m", "testkit.variants", variant]
    cmd += ["--upstream", upstream, "--port", str(port), "--host", "127.0.0.1", "--access-log", "off",
            "--drain-grace", "0", "--drain-timeout", "2", "--cache-mb", "0", *flags]
    with tempfile.NamedTemporaryFile(prefix="mmgate-bench-", suffix=".log", delete=False) as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=full_env, stdout=subprocess.DEVNULL, stderr=log,
                                preexec_fn=_pin(cpus))
    proc.log_path = log.name  # type: ignore[attr-defined]  # read it (never a pipe nobody drains)
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/mmgate/health", proc)
    return proc, url


@contextmanager
def stub_and_gates(stub_flags: Sequence[str], gates: Mapping[K, Sequence[str]]) -> Iterator[tuple[str, dict[K, str]]]:
    """The stub backend (``stub_flags``) and one mmgate in front of it for each of ``gates`` (name → its flags),
    all stopped after; yields the stub's URL and each mmgate's by name."""
    stub, stub_url = start_stub(*stub_flags)
    started: dict[K, tuple[subprocess.Popen[bytes], str]] = {}
    try:
        for name, flags in gates.items():
            started[name] = start_mmgate(stub_url, *flags)
        yield stub_url, {name: url for name, (_, url) in started.items()}
    finally:
        for proc, _ in started.values():
            stop(proc)
        stop(stub)


def stub_stats(url: str, reset: bool = False) -> dict[str, int]:
    """The stub's counters (``/stats``: requests, request body bytes...), or with ``reset`` zero them first."""
    import urllib.request

    request = urllib.request.Request(url + ("/stub/reset" if reset else "/stats"), method="POST" if reset else "GET")
    with urllib.request.urlopen(request, timeout=10) as answer:
        return dict(json.loads(answer.read()))


def revision_tree(ref: str) -> Path:
    """The files of revision ``ref`` (``git archive``) in a temporary folder, to run it beside this tree; nothing in
    any worktree is touched."""
    where = Path(tempfile.mkdtemp(prefix="mmgate-revision-"))
    archive = subprocess.run(["git", "-C", str(REPO), "archive", ref], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(where)], input=archive, check=True)
    return where


def stop(proc: subprocess.Popen[bytes] | None, timeout: float = 10.0, keep_log: bool = False) -> str:
    """SIGTERM the one process we started, then SIGKILL it if it does not leave in time. Returns the tail of
    its stderr log (and deletes the log unless ``keep_log``)."""
    if proc is None:
        return ""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
    path = getattr(proc, "log_path", None)
    if not path:
        return ""
    tail = Path(path).read_text(errors="replace")[-4000:]
    if not keep_log:
        Path(path).unlink(missing_ok=True)
    return tail


def thread_niceness(pid: int) -> dict[str, list[int]]:
    """Niceness of every thread of ``pid``, by thread name (comm), from /proc/PID/task/*/stat."""
    out: dict[str, list[int]] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except OSError:
            continue
        comm = stat[stat.index("(") + 1:stat.rindex(")")]
        nice = int(stat[stat.rindex(")") + 2:].split()[16])  # field 19 of stat
        out.setdefault(comm, []).append(nice)
    return out


class CpuWatch:
    """Machine-wide CPU use over a window, split into ours (``pids``) and everybody else's."""

    def __init__(self, pids: list[int]) -> None:
        self.pids = pids
        self.busy0, self.total0 = machine_jiffies()
        self.ours0 = cpu_ticks(pids)
        self.t0 = time.monotonic()

    def stop(self, extra_cpu_s: float = 0.0) -> dict[str, float]:
        """``extra_cpu_s``: CPU seconds of our processes that already exited (the probers report theirs)."""
        busy, _total = machine_jiffies()
        ours = cpu_ticks(self.pids)
        hz = os.sysconf("SC_CLK_TCK")
        wall = time.monotonic() - self.t0
        machine = (busy - self.busy0) / hz / wall * 100
        mine = ((ours - self.ours0) / hz + extra_cpu_s) / wall * 100
        return {"machine_cpu_pct": round(machine, 1), "bench_cpu_pct": round(mine, 1),
                "other_jobs_cpu_pct": round(max(0.0, machine - mine), 1)}


def wait_quiet(max_wait: float, busy_below: float = 0.15, sample: float = 1.0) -> dict[str, float]:
    """Wait (at most ``max_wait`` s) until the machine is nearly idle over a ``sample``-second window: the
    machine is shared, and a scenario started during somebody else's burst measures them, not us."""
    waited = 0.0
    while True:
        b0, t0 = machine_jiffies()
        time.sleep(sample)
        b1, t1 = machine_jiffies()
        busy = (b1 - b0) / max(1, t1 - t0)
        waited += sample
        if busy < busy_below or waited >= max_wait:
            return {"busy_before_pct": round(busy * 100, 1), "waited_s": round(waited, 1)}


def turn(targets: Sequence[T], round_: int) -> list[T]:
    """``targets`` in round ``round_``'s order: they take turns within a round, the order turning round by round,
    so none is always first (or always right after the same one) on a machine that warms up and is shared."""
    k = round_ % len(targets)
    return [*targets[k:], *targets[:k]]


class Turns:
    """Targets take turns, round after round, so a burst of other work on the shared machine hits all of them; each
    run starts once the machine is near idle (under 0.3 cores busy over 0.3 s, ``wait_quiet``), after at most 5 s
    of waiting and ``budget`` s in all (``waited``; ``gave_up``: the runs that started busy)."""

    def __init__(self, budget: float) -> None:
        self.budget, self.waited, self.gave_up = budget, 0.0, 0

    def take(self, runs: Mapping[str, Callable[[], dict[str, Any]]], rounds: int) -> dict[str, dict[str, Any]]:
        """Each target's figures as their medians over its rounds (not the best round: that flatters whoever got
        the quietest moment; a figure that is no number: the first round's), with the rounds (``rounds``)."""
        seen: dict[str, list[dict[str, Any]]] = {target: [] for target in runs}
        busy_below = 0.3 / (os.cpu_count() or 1)  # wait_quiet reads a share of the whole machine
        for _ in range(rounds):
            for target, run in runs.items():
                quiet = wait_quiet(min(5.0, max(0.0, self.budget - self.waited)), busy_below, sample=0.3)
                self.waited += quiet["waited_s"]
                self.gave_up += quiet["busy_before_pct"] >= busy_below * 100
                seen[target].append(run())
        medians: dict[str, dict[str, Any]] = {}
        for target, values in seen.items():
            medians[target] = {}
            for key in values[0]:
                column = [r[key] for r in values]
                numeric = all(isinstance(v, int | float) and not isinstance(v, bool) for v in column)
                medians[target][key] = statistics.median(column) if numeric else column[0]
            medians[target]["rounds"] = values
        return medians


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=5).stdout.strip()
    except OSError:
        return "load average: " + ", ".join(map(str, loadavg()))


# --- numbers -------------------------------------------------------------------------------------------

def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of ``values``; NaN when empty."""
    if not values:
        return math.nan
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))]


def parse_prom(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Prometheus text exposition → {(name, sorted labels): value} (enough for our own metrics)."""
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        name = head
        labels: tuple[tuple[str, str], ...] = ()
        if "{" in head:
            name, _, rest = head.partition("{")
            pairs: list[tuple[str, str]] = []
            for item in rest.rstrip("}").split('",'):
                if "=" in item:
                    k, _, v = item.partition("=")
                    pairs.append((k.strip(), v.strip().strip('"')))
            labels = tuple(sorted(pairs))
        try:
            out[(name, labels)] = float(value)
        except ValueError:
            pass
    return out


def histogram(prom: dict, name: str) -> dict[str, Any]:
    """Buckets (le → cumulative count), count and sum of one label-less histogram."""
    buckets = {}
    for (n, labels), v in prom.items():
        if n == name + "_bucket":
            le = dict(labels)["le"]
            buckets[math.inf if le == "+Inf" else float(le)] = v
    return {"buckets": dict(sorted(buckets.items())), "count": prom.get((name + "_count", ()), 0.0),
            "sum": prom.get((name + "_sum", ()), 0.0)}


def histogram_diff(after: dict, before: dict) -> dict[str, Any]:
    return {"buckets": {le: after["buckets"][le] - before["buckets"].get(le, 0.0) for le in after["buckets"]},
            "count": after["count"] - before["count"], "sum": after["sum"] - before["sum"]}


def histogram_quantile(h: dict, q: float) -> float:
    """Upper bound of the bucket holding quantile ``q`` (0..1); the bucket edge, not an interpolation."""
    total = h["count"]
    if not total:
        return math.nan
    for le, cum in h["buckets"].items():
        if cum >= q * total:
            return le
    return math.inf


def histogram_max_bucket(h: dict) -> float:
    """Upper edge of the highest non-empty bucket (an upper bound of the maximum)."""
    prev, top = 0.0, math.nan
    for le, cum in h["buckets"].items():
        if cum > prev:
            top = le
        prev = cum
    return top


async def scrape(url: str) -> dict:
    import aiohttp

    async with aiohttp.ClientSession() as s, s.get(url + "/mmgate/metrics") as r:
        return parse_prom(await r.text())


async def get_json(url: str, path: str, method: str = "GET") -> Any:
    import aiohttp

    async with aiohttp.ClientSession() as s, s.request(method, url + path) as r:
        return await r.json()


# --- load client ---------------------------------------------------------------------------------------

@dataclass
class Result:
    status: int
    latency: float  # seconds from send to the last response byte
    started: float
    ended: float
    retry_after: str | None = None
    error: str | None = None
    server_timing: str | None = None


@dataclass
class LoadRun:
    results: list[Result] = field(default_factory=list)
    started: float = 0.0
    ended: float = 0.0

    def statuses(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for r in self.results:
            key = str(r.status) if not r.error else f"error:{r.error}"
            out[key] = out.get(key, 0) + 1
        return dict(sorted(out.items()))

    def ok(self) -> list[Result]:
        return [r for r in self.results if r.status == 200 and not r.error]


async def run_load(url: str, body: bytes, clients: int, *, requests_per_client: int | None = None,
                   stop_event: asyncio.Event | None = None, path: str = "/v1/chat/completions",
                   timeout: float = 600.0) -> LoadRun:
    """``clients`` concurrent clients, each with its own keep-alive connection, each sending ``body`` again
    and again: ``requests_per_client`` times, or until ``stop_event`` is set. A response is read to its
    last byte (SSE included). A refused request (429) is recorded and the client moves on (no retry)."""
    import aiohttp

    run = LoadRun()
    headers = {"Content-Type": "application/json"}

    async def client(session: aiohttp.ClientSession) -> None:
        n = 0
        while (requests_per_client is None or n < requests_per_client) and not (stop_event and stop_event.is_set()):
            n += 1
            t0 = time.perf_counter()
            try:
                async with session.post(url + path, data=body, headers=headers) as r:
                    async for _ in r.content.iter_any():
                        pass
                    t1 = time.perf_counter()
                    run.results.append(Result(r.status, t1 - t0, t0, t1, r.headers.get("Retry-After"),
                                              server_timing=r.headers.get("Server-Timing")))
            except (TimeoutError, aiohttp.ClientError) as exc:
                t1 = time.perf_counter()
                run.results.append(Result(0, t1 - t0, t0, t1, error=type(exc).__name__))

    timeouts = aiohttp.ClientTimeout(total=timeout)
    sessions = [aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1, force_close=False), timeout=timeouts,
                                      auto_decompress=False) for _ in range(clients)]
    try:
        run.started = time.perf_counter()
        await asyncio.gather(*(client(s) for s in sessions))
        run.ended = time.perf_counter()
    finally:
        for s in sessions:
            await s.close()
    return run


def closed_loop_cell(url: str, body: bytes, clients: int, requests: int) -> tuple[dict[str, Any], LoadRun]:
    """About ``requests`` requests of ``body`` from ``clients`` closed-loop clients (``run_load``): req/s of the
    answered ones, how many were sent and answered, the statuses; and the run itself."""
    run = asyncio.run(run_load(url, body, clients, requests_per_client=max(1, requests // clients)))
    ok = run.ok()
    return {"rps": len(ok) / (run.ended - run.started), "sent": len(run.results), "ok": len(ok),
            "statuses": run.statuses()}, run


# --- prober (own process) ------------------------------------------------------------------------------

def probe(host: str, port: int, path: str, seconds: float, interval: float,
          body: bytes | None = None) -> dict[str, Any]:
    """GET ``path`` every ``interval`` s for ``seconds`` over one keep-alive connection (blocking sockets); with
    ``body``, POST it as JSON instead (a small text request, answered with a Content-Length)."""
    sock = socket.create_connection((host, port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if body is None:
        request = f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode()
    else:
        request = (f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
                   f"Content-Length: {len(body)}\r\n\r\n").encode() + body
    latencies: list[float] = []
    lateness: list[float] = []
    statuses: dict[int, int] = {}
    buf = b""

    def read_response() -> int:
        nonlocal buf
        while b"\r\n\r\n" not in buf:
            chunk = sock.recv(65536)
            if not chunk:
                raise ConnectionError("closed")
            buf += chunk
        head, _, rest = buf.partition(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        status = int(lines[0].split()[1])
        length = 0
        for line in lines[1:]:
            k, _, v = line.partition(b":")
            if k.strip().lower() == b"content-length":
                length = int(v)
        while len(rest) < length:
            chunk = sock.recv(65536)
            if not chunk:
                raise ConnectionError("closed")
            rest += chunk
        buf = rest[length:]
        return status

    start = time.perf_counter()
    k = 0
    skipped = 0
    while True:
        scheduled = start + k * interval
        now = time.perf_counter()
        if now - start >= seconds:
            break
        if scheduled > now:
            time.sleep(scheduled - now)
        t0 = time.perf_counter()
        sock.sendall(request)
        status = read_response()
        t1 = time.perf_counter()
        latencies.append(t1 - t0)
        lateness.append(max(0.0, t0 - scheduled))
        statuses[status] = statuses.get(status, 0) + 1
        # Fixed schedule: slots that passed while this probe was waiting are skipped (counted), and the
        # next probe goes out at once; its lateness is recorded. The window ends on wall time.
        next_k = max(k + 1, math.ceil((t1 - start) / interval))
        skipped += next_k - k - 1
        k = next_k
    sock.close()
    return {"latencies": latencies, "lateness": lateness, "statuses": statuses, "skipped_slots": skipped,
            "cpu_s": time.process_time(),
            "elapsed": time.perf_counter() - start, "interval": interval}


def start_prober(url: str, seconds: float, interval: float, path: str = "/mmgate/health",
                 body: bytes | None = None) -> tuple[subprocess.Popen[bytes], Path]:
    """The prober in its own process; read its result with ``prober_result``. With ``body``, it POSTs that."""
    host, port = url.removeprefix("http://").split(":")
    out = Path(tempfile.mkstemp(prefix="mmgate-probe-", suffix=".json")[1])
    argv = [sys.executable, "-m", "testkit.load", "probe", "--host", host, "--port", port,
            "--path", path, "--seconds", str(seconds), "--interval", str(interval), "--out", str(out)]
    if body is not None:
        argv += ["--body", body.decode()]
    proc = subprocess.Popen(argv, cwd=REPO)
    return proc, out


def prober_result(proc: subprocess.Popen[bytes], out: Path, timeout: float = 120.0) -> dict[str, Any]:
    proc.wait(timeout)
    if proc.returncode:
        raise RuntimeError(f"prober exited with {proc.returncode}")
    data = json.loads(out.read_text())
    out.unlink(missing_ok=True)
    return data


def summarize_ms(values: list[float]) -> dict[str, float]:
    ms = [v * 1000 for v in values]
    return {"n": len(ms), "p50": round(percentile(ms, 50), 3), "p99": round(percentile(ms, 99), 3),
            "max": round(max(ms), 3) if ms else math.nan,
            "mean": round(statistics.fmean(ms), 3) if ms else math.nan}


def serve_control(port: int) -> None:
    """A minimal aiohttp app answering GET /health, doing nothing else: the control for the prober.

    Probed at the same time as mmgate, it shows what the machine's CPU scheduling alone costs a process that
    does no work at all (its own loop is always idle), so mmgate's numbers can be read against it.
    """
    from aiohttp import web

    async def health(_request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    app = web.Application()
    app.router.add_get("/health", health)
    web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None)


def start_server(role: str) -> tuple[subprocess.Popen[bytes], str]:
    """One of this module's servers (``control-server``, ``sink``) in a process of its own, once it answers."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "testkit.load", role, "--port", str(port)], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/health", proc)
    return proc, url


def start_control() -> tuple[subprocess.Popen[bytes], str]:
    return start_server("control-server")


def serve_sink(port: int) -> None:
    """An upstream that reads any request's body whole and answers a small chat completion (``bench/cache.py``)."""
    from aiohttp import web

    answer = {"id": "c", "object": "chat.completion", "model": "stub-vlm",
              "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}]}

    async def any_request(request: web.Request) -> web.Response:
        await request.read()
        return web.json_response(answer)

    app = web.Application(client_max_size=1 << 30)
    app.router.add_route("*", "/{tail:.*}", any_request)
    web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None)


def start_sink() -> tuple[subprocess.Popen[bytes], str]:
    return start_server("sink")


def exposition(size: int) -> bytes:
    """A vLLM-shaped Prometheus text exposition of about ``size`` bytes: histogram buckets of many label sets,
    with the queue gauge mmgate merges near the top, as vLLM writes it."""
    head = (b"# HELP vllm:num_requests_waiting Number of requests waiting to be processed.\n"
            b"# TYPE vllm:num_requests_waiting gauge\n"
            b'vllm:num_requests_waiting{engine="0",model_name="stub-vlm"} 2.0\n'
            b"# HELP vllm:e2e_request_latency_seconds Histogram of end to end request latency in seconds.\n"
            b"# TYPE vllm:e2e_request_latency_seconds histogram\n")
    rows = (f'vllm:e2e_request_latency_seconds_bucket{{engine="0",model_name="stub-vlm",lora="a{i // 20}",'
            f'le="{0.01 * (1 + i % 20):.2f}"}} {i * 3}.0\n'.encode() for i in range(max(1, (size - len(head)) // 105)))
    return head + b"".join(rows)


async def serve_metrics_backend(size: int) -> None:
    """The scriptable upstream with ``/metrics`` answering ``exposition(size)``; its port on stdout."""
    from testkit.servers import start_upstream

    body = exposition(size)

    from aiohttp import web

    async def metrics(_request: web.Request) -> web.Response:
        return web.Response(body=body, content_type="text/plain", charset="utf-8")

    upstream = await start_upstream()
    upstream.keep_bodies = False
    upstream.route("/metrics", metrics)
    print(upstream.url.rsplit(":", 1)[1], flush=True)
    await asyncio.Event().wait()


def start_metrics_backend(size: int) -> tuple[subprocess.Popen[bytes], str]:
    """``serve_metrics_backend`` in a process of its own (``bench/metrics_flood.py``'s upstream)."""
    proc = subprocess.Popen([sys.executable, "-m", "testkit.load", "metrics-backend", "--size", str(size)],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    if proc.stdout is None:
        raise RuntimeError("no pipe to the metrics backend")
    url = f"http://127.0.0.1:{int(proc.stdout.readline())}"
    wait_http(url + "/health", proc)
    return proc, url


def probe_until(host: str, port: int, path: str, interval: float, stop: Path, out: Path, limit: float) -> None:
    """GET ``path`` every ``interval`` s over one keep-alive connection until ``stop`` exists; writes
    ``[[sent, answered], ...]`` (time.monotonic) to ``out``."""
    sock = socket.create_connection((host, port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    request = f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode()
    times: list[tuple[float, float]] = []
    buf = b""
    start = time.monotonic()
    while not stop.exists() and time.monotonic() - start < limit:
        t0 = time.monotonic()
        sock.sendall(request)
        while True:
            head, sep, rest = buf.partition(b"\r\n\r\n")
            if sep:
                length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                if len(rest) >= length:
                    buf = rest[length:]
                    break
            chunk = sock.recv(65536)
            if not chunk:
                raise ConnectionError("mmgate closed the probe connection")
            buf += chunk
        t1 = time.monotonic()
        times.append((t0, t1))
        pause = interval - (t1 - t0)
        if pause > 0:
            time.sleep(pause)
    sock.close()
    out.write_text(json.dumps(times))


def _main() -> None:
    p = argparse.ArgumentParser(description="bench helpers")
    sub = p.add_subparsers(dest="cmd", required=True)
    pr = sub.add_parser("probe")
    pr.add_argument("--host", required=True)
    pr.add_argument("--port", type=int, required=True)
    pr.add_argument("--path", default="/mmgate/health")
    pr.add_argument("--seconds", type=float, default=10.0)
    pr.add_argument("--interval", type=float, default=0.01)
    pr.add_argument("--out", required=True)
    pr.add_argument("--body", default=None, help="POST this (JSON text) instead of a GET")
    sub.add_parser("photo")
    for name in ("control-server", "sink"):
        sub.add_parser(name).add_argument("--port", type=int, required=True)
    until = sub.add_parser("probe-until", help="GET a path until a file exists; the times to a file")
    for name in ("port", "path", "interval", "stop", "out"):
        until.add_argument(name)
    sub.add_parser("metrics-backend").add_argument("--size", type=int, required=True, help="exposition bytes")
    args = p.parse_args()
    if args.cmd == "control-server":
        serve_control(args.port)
    elif args.cmd == "sink":
        serve_sink(args.port)
    elif args.cmd == "probe-until":
        probe_until("127.0.0.1", int(args.port), args.path, float(args.interval), Path(args.stop), Path(args.out),
                    limit=3600)
    elif args.cmd == "metrics-backend":
        asyncio.run(serve_metrics_backend(args.size))
    elif args.cmd == "probe":
        Path(args.out).write_text(json.dumps(probe(args.host, args.port, args.path, args.seconds, args.interval,
                                                  None if args.body is None else args.body.encode())))
    else:
        from .media import photo_jpeg  # only here: the prober and control server stay light processes

        data = photo_jpeg()
        print(f"{len(data)} bytes")


if __name__ == "__main__":
    _main()
