"""Text passthrough cost: direct vs nginx vs a minimal aiohttp proxy vs mmgate on both event loops, and SSE streams.

What a text-only request pays for going through mmgate (README "How a request flows", step 3: no media marker ->
bytes forwarded untouched). Everything runs on loopback, in separate processes:

  upstream  a raw asyncio Protocol (testkit/text_load.py) that reads the whole request body, then answers a fixed
            chat-completion JSON (~25 us CPU per 1 KB request), or streams SSE events when the request carries
            X-Bench-Stream. nginx `return 200 '...'` is cheaper (~15 us) but answers before it has read the
            body, and wrk then stalls on 4 MB bodies (one request per connection): a real inference server
            reads the whole body first, and so does this one.
  direct    wrk -> upstream
  nginx     wrk -> nginx (1 worker, plain reverse proxy: proxy_http_version 1.1, upstream keepalive 128, the
            request body buffered in memory like mmgate does: client_body_buffer_size 16m) -> upstream
  minimal   wrk -> a ~30-line aiohttp proxy (read the body, one pooled ClientSession, stream the answer back
            with iter_any; the anchor of the passthrough cost) -> upstream
  mmgate    wrk -> `python -m proxy --access-log off --loop asyncio` (defaults otherwise) -> upstream
  mmgate-uvloop  the same on uvloop (`--loop uvloop`; installed with pip when missing)

Proxy and upstream are pinned to CPU 0 and the load generator to CPU 1 (taskset), as in the anchor
measurement (nginx 7.4k req/s at 52 us CPU/request, minimal aiohttp 3.0k req/s at 243 us; 1 KB, 32 conns).
Cells: POST /v1/chat/completions with a 1 KB and a 4 MiB text-only chat body (no media marker: mmgate's fast
path), 1 and 32 connections. wrk (`--latency`, 1 thread) gives req/s and the p50/p99 latency; the proxy's CPU
per request is utime+stime from /proc/<pid>/stat before/after (nginx: master + workers), and the upstream's
likewise. Targets take turns inside each cell after a 1 s warm-up run each, --rounds rounds, each run
started once the machine is near idle (a bounded wait: other jobs share it); each figure shown is the
median over the target's rounds, every round is in the JSON. Goals (1 KB, 32 conns: mmgate >= 0.6x nginx's
req/s; 4 MB: mmgate's CPU per MB <= 1.2x the minimal proxy's; SSE: mmgate >= 0.95x direct tokens/s; 1 KB, 32
conns: mmgate-uvloop's CPU per request <= 0.92x mmgate's on asyncio's loop) are judged on the median of the per-round
ratios, printed and written with their min–max spread.

SSE: the same upstream (one event every --sse-delay s on an absolute schedule, --sse-tokens events per
response, OpenAI chunk format) and an asyncio/aiohttp client process holding 64 concurrent
streams (staggered, each starting a new request when one ends). tokens/s and the inter-token gap p99 seen by
the client, direct vs mmgate (and the minimal proxy and nginx for reference), plus proxy CPU per token.

    python -m bench run passthrough [--set KNOB=VALUE] [--rounds N] [--quick]
    python -m bench list passthrough   # the knobs and their defaults
Writes bench/results/passthrough.md and .json; with profiling (default) also runs py-spy on mmgate under
1 KB and 4 MB loads at 32 connections: bench/results/passthrough_profile.svg (1 KB) and self-time summaries
in the .md.
Needs wrk and nginx (installed with apt-get when missing) and py-spy (pip) for the profile.
"""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import re
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

from bench import _results as R
from testkit.procfs import CLK_TCK, cpu_ticks, descendants
from testkit.text_load import ANSWER, ROLE, text_body

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"
PROXY_CPU, LOAD_CPU = "0", "1"
TARGETS = ("direct", "nginx", "minimal", "mmgate", "mmgate-uvloop")
# The event loop each mmgate target runs on (MMGATE_LOOP); "mmgate" is asyncio's own, whatever is installed.
LOOP_OF = {"mmgate": "asyncio", "mmgate-uvloop": "uvloop"}


# ----------------------------------------------------------------------------------------------------------
# processes


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Procs:
    """Every process this bench starts, stopped (by pid) at the end whatever happens."""

    def __init__(self) -> None:
        self.started: list[subprocess.Popen[bytes]] = []

    def start(self, argv: list[str], cpu: str, **kw: Any) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(["taskset", "-c", cpu, *argv], **kw)
        self.started.append(proc)
        return proc

    def stop_all(self) -> None:
        for proc in reversed(self.started):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in reversed(self.started):
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def wait_http(url: str, timeout: float = 20.0, proc: subprocess.Popen[bytes] | None = None) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except Exception:
            pass
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{url}: the process exited with {proc.returncode}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url} did not answer 200 within {timeout} s")
        time.sleep(0.1)


def ensure_tools(need_pyspy: bool) -> None:
    missing = [tool for tool in ("wrk", "nginx")
               if shutil.which(tool) is None and not Path(f"/usr/sbin/{tool}").exists()]
    if missing:
        print(f"installing {' '.join(missing)} with apt-get ...", flush=True)
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        if subprocess.run(["apt-get", "install", "-y", "nginx", "wrk"], env=env, capture_output=True).returncode:
            subprocess.run(["apt-get", "update"], env=env, capture_output=True)
            subprocess.run(["apt-get", "install", "-y", "nginx", "wrk"], env=env, check=True, capture_output=True)
    if need_pyspy and not pyspy_path():
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "py-spy"], check=True)
    if importlib.util.find_spec("uvloop") is None:  # mmgate's uvloop extra, for the mmgate-uvloop target
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "uvloop>=0.19"], check=True)


def pyspy_path() -> str | None:
    local = Path(sys.executable).parent / "py-spy"
    return str(local) if local.exists() else shutil.which("py-spy")


def nginx_bin() -> str:
    return shutil.which("nginx") or "/usr/sbin/nginx"


NGINX_COMMON = """
worker_processes 1;
daemon off;
master_process on;
pid {prefix}/nginx.pid;
error_log {prefix}/error.log warn;
events {{ worker_connections 4096; }}
http {{
  access_log off;
  client_body_temp_path {prefix}/client_body;
  proxy_temp_path {prefix}/proxy;
  fastcgi_temp_path {prefix}/fastcgi;
  uwsgi_temp_path {prefix}/uwsgi;
  scgi_temp_path {prefix}/scgi;
  keepalive_requests 1000000;
  client_max_body_size 0;
{body}
}}
"""

NGINX_PROXY = """
  upstream backend {{
    server 127.0.0.1:{upstream};
    keepalive 128;
    keepalive_requests 1000000;
  }}
  server {{
    listen 127.0.0.1:{port};
    client_body_buffer_size 16m;
    location / {{
      proxy_pass http://backend;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
    }}
  }}
"""


def start_nginx(procs: Procs, name: str, body: str, workdir: Path) -> subprocess.Popen[bytes]:
    prefix = workdir / name
    prefix.mkdir(mode=0o755)
    (prefix / "nginx.conf").write_text(NGINX_COMMON.format(prefix=prefix, body=body))
    return procs.start([nginx_bin(), "-p", str(prefix), "-e", str(prefix / "error.log"),
                        "-c", str(prefix / "nginx.conf")],
                       PROXY_CPU, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


# ----------------------------------------------------------------------------------------------------------
# the minimal aiohttp proxy (the anchor's baseline), the SSE upstream, the SSE client: roles of this script


# ----------------------------------------------------------------------------------------------------------
# measuring


WRK_LUA = """
wrk.method = "POST"
wrk.path = "/v1/chat/completions"
wrk.headers["Content-Type"] = "application/json"
local f = assert(io.open("{body}", "rb"))
wrk.body = f:read("*a")
f:close()
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format('WRKJSON {{"requests":%d,"duration_us":%d,"bytes":%d,"p50_us":%d,"p90_us":%d,' ..
    '"p99_us":%d,"max_us":%d,"mean_us":%.1f,"connect":%d,"read":%d,"write":%d,"status":%d,"timeout":%d}}\\n',
    summary.requests, summary.duration, summary.bytes, latency:percentile(50), latency:percentile(90),
    latency:percentile(99), latency.max, latency.mean, e.connect, e.read, e.write, e.status, e.timeout))
end
"""


def run_wrk(url: str, script: Path, conns: int, seconds: float) -> dict[str, Any]:
    out = subprocess.run(
        ["taskset", "-c", LOAD_CPU, "wrk", "-t1", f"-c{conns}", f"-d{max(1, round(seconds))}s", "--latency",
         "--timeout", "20s",
         "-s", str(script), url],
        capture_output=True, text=True, timeout=seconds + 60,
    )
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("WRKJSON ")), None)
    if line is None:
        raise RuntimeError(f"wrk failed: {out.stdout}\n{out.stderr}")
    return json.loads(line[len("WRKJSON "):])


def busy_ticks() -> int:
    """CPU time used on the whole machine (all CPUs, every process and the kernel, steal included)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    return user + nice + system + irq + softirq + steal


class Quiet:
    """Before each measured run, wait (a bounded time) until the machine is near idle: other jobs share it."""

    def __init__(self, budget: float, threshold: float = 0.3) -> None:
        self.budget, self.threshold = budget, threshold
        self.waited = 0.0
        self.gave_up = 0

    def wait(self, per_call: float = 5.0) -> float:
        """Returns the load (cores busy) seen last."""
        limit = min(per_call, max(0.0, self.budget - self.waited))
        started = time.monotonic()
        while True:
            b0 = busy_ticks()
            time.sleep(0.3)
            load = (busy_ticks() - b0) / CLK_TCK / 0.3
            if load < self.threshold:
                break
            if time.monotonic() - started >= limit:
                self.gave_up += 1
                break
        self.waited += time.monotonic() - started
        return load


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def measure_http(url: str, script: Path, conns: int, seconds: int, proxy_pids: list[int],
                 upstream_pids: list[int]) -> dict[str, Any]:
    """One wrk run. ``other_load`` = CPU (in cores) used on the machine by anything but proxy, upstream and wrk:
    other jobs, plus kernel network work not charged to a process (so it is never quite 0 here)."""
    p0, u0, b0, c0 = cpu_ticks(proxy_pids), cpu_ticks(upstream_pids), busy_ticks(), children_cpu()
    w = run_wrk(url, script, conns, seconds)
    p1, u1, b1, c1 = cpu_ticks(proxy_pids), cpu_ticks(upstream_pids), busy_ticks(), children_cpu()
    requests = max(w["requests"], 1)
    wall = w["duration_us"] / 1e6
    errors = w["connect"] + w["read"] + w["write"] + w["status"] + w["timeout"]
    proxy_s, upstream_s = (p1 - p0) / CLK_TCK, (u1 - u0) / CLK_TCK
    return {
        "requests": w["requests"], "rps": w["requests"] / wall,
        "p50_ms": w["p50_us"] / 1e3, "p90_ms": w["p90_us"] / 1e3, "p99_ms": w["p99_us"] / 1e3,
        "max_ms": w["max_us"] / 1e3, "errors": errors, "non_2xx": w["status"],
        "proxy_cpu_us_per_req": proxy_s / requests * 1e6 if proxy_pids else None,
        "proxy_cpu_share": proxy_s / wall if proxy_pids else None,
        "upstream_cpu_us_per_req": upstream_s / requests * 1e6,
        "load_cpu_share": (c1 - c0) / wall,
        "other_load": max(0.0, ((b1 - b0) / CLK_TCK - proxy_s - upstream_s - (c1 - c0)) / wall),
    }


def measure_sse(procs: Procs, url: str, streams: int, warmup: float, seconds: float, period: float,
                proxy_pids: list[int], upstream_pids: list[int]) -> dict[str, Any]:
    client = procs.start([*ROLE, "sse-client", "--url", url, "--streams", str(streams),
                          "--warmup", str(warmup), "--duration", str(seconds), "--period", str(period)],
                         LOAD_CPU, stdout=subprocess.PIPE, cwd=REPO)
    assert client.stdout is not None
    line = client.stdout.readline()
    if line.strip() != b"START":
        raise RuntimeError(f"SSE client did not start: {line!r}")
    p0, u0, b0 = cpu_ticks(proxy_pids), cpu_ticks(upstream_pids), busy_ticks()
    line = client.stdout.readline()
    p1, u1, b1 = cpu_ticks(proxy_pids), cpu_ticks(upstream_pids), busy_ticks()
    client.wait(30)
    result = json.loads(line)
    tokens, wall = max(result["tokens"], 1), result["seconds"]
    proxy_s, upstream_s = (p1 - p0) / CLK_TCK, (u1 - u0) / CLK_TCK
    result["proxy_cpu_us_per_token"] = proxy_s / tokens * 1e6 if proxy_pids else None
    result["proxy_cpu_share"] = proxy_s / wall if proxy_pids else None
    result["upstream_cpu_us_per_token"] = upstream_s / tokens * 1e6
    result["other_load"] = max(0.0, ((b1 - b0) / CLK_TCK - proxy_s - upstream_s) / wall - result["client_cpu_share"])
    return result


def check_answer(url: str, body: bytes) -> None:
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(request, timeout=10) as r:
        got = r.read()
    if r.status != 200 or got != ANSWER:
        raise RuntimeError(f"{url}: unexpected answer {r.status} {got[:200]!r}")


# ----------------------------------------------------------------------------------------------------------
# profile


def profile_mmgate(url: str, script: Path, pid: int, seconds: int, svg: Path | None) -> dict[str, Any]:
    """py-spy (Python frames, blocking mode: non-blocking sampling of a busy process truncates about half of the
    stacks) on mmgate under wrk -c32: raw stacks summarised, then a flame graph when ``svg`` is given (py-spy
    writes one format per run, and two blocking samplers cannot share a process)."""
    pyspy = pyspy_path()
    assert pyspy is not None
    raw = Path(tempfile.mkstemp(suffix=".txt")[1])
    rate = 200
    outputs = [["--format", "raw", "-o", str(raw)]] + ([["-o", str(svg)]] if svg is not None else [])
    load = subprocess.Popen(["taskset", "-c", LOAD_CPU, "wrk", "-t1", "-c32", f"-d{len(outputs) * (seconds + 2) + 2}s",
                             "--timeout", "20s", "-s", str(script), url], stdout=subprocess.DEVNULL)
    try:
        time.sleep(1)
        for out in outputs:
            subprocess.run(["taskset", "-c", LOAD_CPU, pyspy, "record", "--pid", str(pid), "--duration", str(seconds),
                            "--rate", str(rate), *out], capture_output=True, timeout=seconds + 60)
    finally:
        load.wait(len(outputs) * (seconds + 2) + 60)
    summary = summarise_stacks(raw.read_text(), expected=rate * seconds)
    raw.unlink()
    return summary


def frame_name(frame: str) -> str:
    """'func (path/to/file.py:123)' -> 'func (pkg/file.py)' without the line number."""
    match = re.match(r"(.*) \((.*?)(?::\d+)?\)$", frame)
    if not match:
        return frame
    func, path = match.groups()
    for marker in ("site-packages/", "lib/python3.11/", "/work/main/"):
        if marker in path:
            path = path.split(marker, 1)[1]
            break
    return f"{func} ({path})"


def summarise_stacks(raw: str, expected: int) -> dict[str, Any]:
    self_time: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    by_area: Counter[str] = Counter()
    total = 0
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        frames = [frame_name(f) for f in stack.split(";")]
        if frames and frames[0].startswith("process "):  # py-spy prefixes the process/thread when asked to
            frames = frames[1:]
        frames = [f for f in frames if not f.startswith("thread ")]
        if not frames:
            continue
        total += n
        self_time[frames[-1]] += n
        for name in set(frames):
            inclusive[name] += n
        by_area[area_of(frames)] += n
    def top(counter: Counter[str], k: int) -> list[dict[str, Any]]:
        return [{"function": name, "samples": n, "percent": round(100 * n / max(total, 1), 1)}
                for name, n in counter.most_common(k)]
    return {"samples": total, "busy_share": round(total / max(expected, 1), 3), "self": top(self_time, 25),
            "inclusive": top(inclusive, 40), "areas": top(by_area, 12)}


def area_of(frames: list[str]) -> str:
    """Which part of the stack the leaf time belongs to: the innermost mmgate frame, else the leaf's module."""
    for frame in reversed(frames):
        if "(proxy/" in frame:
            return "mmgate " + frame
    leaf = frames[-1]
    module = leaf[leaf.find("(") + 1 : -1]
    return module.split("/")[0] + "/" + module.split("/")[-1] if "/" in module else module


# ----------------------------------------------------------------------------------------------------------
# the run


def environment(load_before: tuple[float, ...]) -> dict[str, Any]:
    import aiohttp

    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.processor())
    nginx_v = subprocess.run([nginx_bin(), "-v"], capture_output=True, text=True).stderr.strip()
    wrk_v = subprocess.run(["wrk", "-v"], capture_output=True, text=True).stdout.splitlines()[0:1]
    return {"python": platform.python_version(), "aiohttp": aiohttp.__version__, "nginx": nginx_v.split("/")[-1],
            "wrk": (wrk_v[0].split()[1] if wrk_v else "?"), "cpu": cpu, "cpus": os.cpu_count(),
            "kernel": platform.release(), "load_avg_before": [round(x, 2) for x in load_before]}


def median_of_rounds(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Every numeric figure as its median over the rounds (not the best round: that flatters whoever got the
    quietest moment on a shared machine); the rounds themselves are kept."""
    out: dict[str, Any] = {}
    for key in rounds[0]:
        values = [r.get(key) for r in rounds]
        numbers = [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
        out[key] = statistics.median(numbers) if numbers and len(numbers) == len(values) else values[0]
    return {**out, "rounds": rounds}


WHAT = ("text-only requests with wrk: direct vs nginx vs a minimal aiohttp proxy vs mmgate on asyncio's loop and "
        "on uvloop (1 KB and 4 MB, 1 and 32 conns); 64 SSE streams")
GOAL_X_NGINX, GOAL_SSE_X_DIRECT, GOAL_TEXT_X_MINIMAL, GOAL_UVLOOP_CPU = 0.6, 0.95, 1.2, 0.92


def goals(data: dict[str, Any]) -> list[R.Goal]:
    """Per-round ratios (targets took turns within a round, so a round's ratio compares like with like)."""
    cells, sse = data["http"], data["sse"]
    by = {(c["body"], c["conns"], c["target"]): c for c in cells}
    out = []
    mm, ng = by.get(("1 KB", 32, "mmgate")), by.get(("1 KB", 32, "nginx"))
    if mm and ng:
        out.append(R.goal("1 KB, 32 conns: mmgate req/s ÷ nginx", [m["rps"] / n["rps"] for m, n in
                                                                   zip(mm["rounds"], ng["rounds"], strict=False)],
                          f"≥ {GOAL_X_NGINX:g}", lambda v: v >= GOAL_X_NGINX, unit="×"))
        out.append(R.goal("1 KB, 32 conns: mmgate CPU per request", [r["proxy_cpu_us_per_req"] for r in mm["rounds"]],
                          unit="µs"))
    uv = by.get(("1 KB", 32, "mmgate-uvloop"))
    if mm and uv:
        out.append(R.goal("1 KB, 32 conns: mmgate CPU per request, uvloop ÷ asyncio's loop",
                          [u["proxy_cpu_us_per_req"] / m["proxy_cpu_us_per_req"]
                           for u, m in zip(uv["rounds"], mm["rounds"], strict=False)
                           if u["proxy_cpu_us_per_req"] and m["proxy_cpu_us_per_req"]],
                          f"≤ {GOAL_UVLOOP_CPU:g}", lambda v: v <= GOAL_UVLOOP_CPU, unit="×"))
    for conns in sorted({c["conns"] for c in cells if c["body"] == "4 MB"}):
        mm, mini = by.get(("4 MB", conns, "mmgate")), by.get(("4 MB", conns, "minimal"))
        if mm and mini:
            ratios = [m["proxy_cpu_us_per_req"] / n["proxy_cpu_us_per_req"]
                      for m, n in zip(mm["rounds"], mini["rounds"], strict=False)
                      if m["proxy_cpu_us_per_req"] and n["proxy_cpu_us_per_req"]]
            out.append(R.goal(f"4 MB text, {conns} conns: mmgate CPU per MB ÷ minimal aiohttp", ratios,
                              f"≤ {GOAL_TEXT_X_MINIMAL:g}", lambda v: v <= GOAL_TEXT_X_MINIMAL, unit="×"))
    sse_by = {r["target"]: r for r in sse}
    if "mmgate" in sse_by and "direct" in sse_by:
        out.append(R.goal("SSE, 64 streams: mmgate tokens/s ÷ direct",
                          [m["tokens_per_s"] / d["tokens_per_s"] for m, d in
                           zip(sse_by["mmgate"]["rounds"], sse_by["direct"]["rounds"], strict=False)],
                          f"≥ {GOAL_SSE_X_DIRECT:g}", lambda v: v >= GOAL_SSE_X_DIRECT, unit="×"))
    return out


def sse_ratios(sse: list[dict[str, Any]]) -> None:
    direct = next(r for r in sse if r["target"] == "direct")
    for row in sse:
        row["x_direct"] = row["tokens_per_s"] / direct["tokens_per_s"]
        row["mean_tokens_per_s"] = statistics.fmean(r["tokens_per_s"] for r in row["rounds"])
    for row in sse:
        row["mean_x_direct"] = row["mean_tokens_per_s"] / direct["mean_tokens_per_s"]


def measure(args: R.Knobs) -> dict[str, Any]:
    began = time.monotonic()
    stamp = R.stamp("passthrough.py", WHAT)
    ensure_tools(need_pyspy=not args.no_profile)
    uptime_before = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    env = environment(os.getloadavg())
    env["uptime_before"] = uptime_before
    print(f"# passthrough bench: {uptime_before}", flush=True)

    from proxy.payload.locate import may_contain_media  # the bodies must take mmgate's text fast path; not in the roles

    procs = Procs()
    workdir = Path(tempfile.mkdtemp(prefix="mmgate-passthrough-"))
    workdir.chmod(0o755)  # nginx workers run as nobody
    cells: list[dict[str, Any]] = []
    sse: list[dict[str, Any]] = []
    profile: dict[str, Any] | None = None
    round_s = max(1, round(args.duration / args.rounds))
    round_s_big = max(round_s, 5)
    quiet = Quiet(budget=args.quiet_budget)
    try:
        bodies = {"1 KB": text_body(1024), "4 MB": text_body(4 << 20)}
        scripts = {}
        for name, raw in bodies.items():
            assert not may_contain_media(raw), f"the {name} body would leave mmgate's text fast path"
            path = workdir / f"body-{len(raw)}.json"
            path.write_bytes(raw)
            scripts[name] = workdir / f"post-{len(raw)}.lua"
            scripts[name].write_text(WRK_LUA.format(body=path))

        # the upstream and the proxies, all on CPU 0
        targets = list(TARGETS)
        if args.baseline:
            baseline = f"mmgate@{args.baseline}"
            targets.append(baseline)
            baseline_repo = workdir / "baseline"
            subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", "--force", str(baseline_repo),
                            args.baseline], check=True, capture_output=True)
        ports = {target: free_port() for target in targets}
        upstream = procs.start([*ROLE, "upstream", "--port", str(ports["direct"]),
                                "--sse-tokens", str(args.sse_tokens), "--sse-delay", str(args.sse_delay)], PROXY_CPU,
                               cwd=REPO)
        upstream_url = f"http://127.0.0.1:{ports['direct']}"
        wait_http(upstream_url + "/", proc=upstream)
        nginx = start_nginx(procs, "proxy", NGINX_PROXY.format(port=ports["nginx"], upstream=ports["direct"]), workdir)
        minimal = procs.start([*ROLE, "minimal-proxy", "--port", str(ports["minimal"]),
                               "--upstream", upstream_url], PROXY_CPU, cwd=REPO, stderr=subprocess.DEVNULL)
        mmgates = {target: procs.start([sys.executable, "-m", "proxy", "--upstream", upstream_url, "--port",
                                        str(ports[target]), "--host", "127.0.0.1", "--access-log", "off", "--loop",
                                        loop], PROXY_CPU, cwd=REPO, stderr=subprocess.DEVNULL)
                   for target, loop in LOOP_OF.items()}
        mmgate = mmgates["mmgate"]
        wait_http(f"http://127.0.0.1:{ports['nginx']}/", proc=nginx)
        wait_http(f"http://127.0.0.1:{ports['minimal']}/", proc=minimal)
        for target, proc in mmgates.items():
            wait_http(f"http://127.0.0.1:{ports[target]}/mmgate/health", proc=proc)
        upstream_pids = [upstream.pid]
        pids = {"direct": [], "nginx": [nginx.pid, *descendants(nginx.pid)], "minimal": [minimal.pid],
                **{target: [proc.pid] for target, proc in mmgates.items()}}
        if args.baseline:
            before = procs.start([sys.executable, "-m", "proxy", "--upstream", upstream_url, "--port",
                                  str(ports[baseline]), "--host", "127.0.0.1", "--access-log", "off"], PROXY_CPU,
                                 cwd=baseline_repo, stderr=subprocess.DEVNULL)
            wait_http(f"http://127.0.0.1:{ports[baseline]}/mmgate/health", proc=before)
            pids[baseline] = [before.pid]
        urls = {target: f"http://127.0.0.1:{port}/v1/chat/completions" for target, port in ports.items()}
        for url in urls.values():
            for raw in bodies.values():
                check_answer(url, raw)

        # Targets take turns, round after round, so a burst of other work on the machine hits all of them; each
        # target's medians over its rounds are reported, every round is in the JSON.
        for body_name in bodies:
            for conns in (1, 32):
                rounds: dict[str, list[dict[str, Any]]] = {target: [] for target in targets}
                for target in targets:
                    run_wrk(urls[target], scripts[body_name], conns, 1)  # warm-up: connections, pools, caches
                # 32 concurrent 4 MB requests take ~2 s to complete through a Python proxy: longer runs, as many
                n_rounds, seconds = (args.rounds, round_s) if body_name == "1 KB" else (args.rounds, round_s_big)
                for _ in range(n_rounds):
                    for target in targets:
                        quiet.wait()
                        rounds[target].append(measure_http(urls[target], scripts[body_name], conns, seconds,
                                                           pids[target], upstream_pids))
                for target in targets:
                    result = median_of_rounds(rounds[target])
                    cells.append({"body": body_name, "conns": conns, "target": target, **result})
                    print(f"  {body_name:5} c={conns:<3} {target:8} {result['rps']:9.0f} req/s  "
                          f"p50 {result['p50_ms']:.2f} ms"
                          f"  p99 {result['p99_ms']:.2f} ms  proxy CPU {fmt(result['proxy_cpu_us_per_req'])} us/req"
                          f"  other load {result['other_load']:.2f}", flush=True)
        add_ratios(cells)

        # SSE through the same processes (the upstream streams when asked to by X-Bench-Stream)
        period = args.sse_tokens * args.sse_delay
        sse_targets = ("direct", "mmgate", "mmgate-uvloop", "minimal", "nginx", *targets[len(TARGETS):])
        sse_rounds: dict[str, list[dict[str, Any]]] = {target: [] for target in sse_targets}
        sse_round_s = max(2.0, args.duration / args.sse_rounds)
        for _ in range(args.sse_rounds):
            for target in sse_targets:
                quiet.wait()
                sse_rounds[target].append(measure_sse(procs, urls[target], args.sse_streams, max(1.5, period * 1.2),
                                                      sse_round_s, period, pids[target], upstream_pids))
        for target in sse_targets:
            result = median_of_rounds(sse_rounds[target])
            sse.append({"target": target, **result})
            print(f"  SSE {target:8} {result['tokens_per_s']:8.0f} tok/s  gap p50 {result['gap_p50_ms']:.2f} ms  "
                  f"p99 {result['gap_p99_ms']:.2f} ms  proxy CPU {fmt(result['proxy_cpu_us_per_token'])} us/token"
                  f"  other load {result['other_load']:.2f}", flush=True)
        sse_ratios(sse)

        if not args.no_profile:
            print("  profiling mmgate (py-spy, 1 KB, 32 connections) ...", flush=True)
            profile = {"1 KB": profile_mmgate(urls["mmgate"], scripts["1 KB"], mmgate.pid, 8,
                                             RESULTS / "passthrough_profile.svg")}
            print("  profiling mmgate (py-spy, 4 MB, 32 connections) ...", flush=True)
            profile["4 MB"] = profile_mmgate(urls["mmgate"], scripts["4 MB"], mmgate.pid, 8, None)
    finally:
        procs.stop_all()
        if args.baseline:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(workdir / "baseline")],
                           capture_output=True)
        shutil.rmtree(workdir, ignore_errors=True)

    env["load_avg_after"] = [round(x, 2) for x in os.getloadavg()]
    env["uptime_after"] = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    env["seconds"] = round(time.monotonic() - began, 1)
    env["quiet_wait_s"] = round(quiet.waited, 1)
    env["quiet_gave_up"] = quiet.gave_up
    settings = {"duration_s": args.duration, "rounds": args.rounds, "round_s": round_s,
                "rounds_4mb": args.rounds, "round_s_4mb": round_s_big, "sse_rounds": args.sse_rounds,
                "sse_round_s": sse_round_s, "sse_streams": args.sse_streams, "sse_tokens": args.sse_tokens,
                "sse_delay_s": args.sse_delay, "proxy_cpu": PROXY_CPU, "load_cpu": LOAD_CPU,
                "baseline": args.baseline}
    return stamp | {"environment": env, "settings": settings, "http": cells, "sse": sse, "profile": profile}


def add_ratios(cells: list[dict[str, Any]]) -> None:
    index = {(c["body"], c["conns"], c["target"]): c for c in cells}
    for c in cells:
        direct, nginx = index[(c["body"], c["conns"], "direct")], index[(c["body"], c["conns"], "nginx")]
        c["rps_x_direct"] = c["rps"] / direct["rps"]
        c["rps_x_nginx"] = c["rps"] / nginx["rps"]
        c["cpu_x_nginx"] = (c["proxy_cpu_us_per_req"] / nginx["proxy_cpu_us_per_req"]
                            if c["proxy_cpu_us_per_req"] is not None and nginx["proxy_cpu_us_per_req"] else None)


def fmt(value: float | None, digits: int = 0) -> str:
    if value is None:
        return "–"
    return f"{value:.{digits}f}"


# the frames every sample has (interpreter start-up down to the event loop): left out of the inclusive table
ROOT_FRAMES = {"run", "<module>", "main", "_run_module_as_main", "_run_code", "Runner.run", "BaseEventLoop.run_forever",
               "BaseEventLoop.run_until_complete", "BaseEventLoop._run_once"}


def report(data: dict[str, Any]) -> str:
    env, settings, cells, sse, profile = (data["environment"], data["settings"], data["http"], data["sse"],
                                          data.get("profile"))
    lines = [
        "# passthrough: text-only requests and SSE streams, direct vs nginx vs minimal aiohttp vs mmgate",
        "",
        f"`python -m bench run passthrough` ({settings['rounds']} rounds x {settings['round_s']} s per cell and "
        "target, "
        f"4 MB: {settings['rounds_4mb']} x {settings['round_s_4mb']} s, "
        f"SSE {settings['sse_rounds']} x {settings['sse_round_s']:g} s; {env['seconds']} s in all) -- Python "
        f"{env['python']}, aiohttp {env['aiohttp']}, nginx {env['nginx']}, wrk {env['wrk']}, {env['cpus']} CPUs "
        f"({env['cpu']}), kernel {env['kernel']}.",
        "",
        f"Machine: 2 cores, shared with other jobs. Proxy and upstream pinned to CPU {settings['proxy_cpu']}, load "
        f"generator (wrk -t1, or the SSE client) to CPU {settings['load_cpu']}. Load average at start "
        f"{env['load_avg_before']}, at end {env['load_avg_after']} (`uptime` at start: `{env['uptime_before']}`; at "
        f"end: `{env['uptime_after']}`). Before each run the bench waited for the machine to be near idle "
        f"({env['quiet_wait_s']} s waited in all, {env['quiet_gave_up']} run(s) started anyway after 5 s); "
        "targets take turns round after round and each figure is the median over the target's rounds; every round "
        "is in the JSON. `other load` = CPU (cores) the rest of the machine "
        "used during the shown run (other jobs, plus kernel network work not charged to a process): read a row "
        "with a high value with care.",
        "",
        "Upstream: a raw asyncio Protocol (testkit/text_load.py) that reads the whole body, then answers a fixed "
        "330-byte chat-completion JSON (~25 us CPU per 1 KB request, `upstream us/req`). nginx `return 200` was tried "
        "first and is cheaper (~15 us) but answers before it has read the body: wrk then stalls on 4 MB bodies "
        "(0.7 req/s direct). nginx proxy: 1 worker, `proxy_http_version 1.1`, upstream keepalive, the body "
        "buffered in memory (`client_body_buffer_size 16m`, as mmgate does). minimal: a ~30-line aiohttp proxy "
        "(the anchor's baseline). mmgate: `python -m proxy --access-log off`, defaults otherwise. Proxy CPU = "
        "utime+stime of the proxy process(es) (nginx: master + worker) over the run / requests.",
        "",
    ]
    by = {(c["body"], c["conns"], c["target"]): c for c in cells}
    if ("1 KB", 32, "mmgate") in by:
        c = by[("1 KB", 32, "mmgate")]
        lines.append(f"1 KB, 32 conns (medians): mmgate {c['rps']:.0f} req/s = {c['rps_x_nginx']:.2f}x nginx; "
                     f"mmgate CPU {fmt(c['proxy_cpu_us_per_req'])} "
                     f"us/request vs nginx {fmt(by[('1 KB', 32, 'nginx')]['proxy_cpu_us_per_req'])} and minimal "
                     f"aiohttp {fmt(by[('1 KB', 32, 'minimal')]['proxy_cpu_us_per_req'])}; minimal reaches "
                     f"{by[('1 KB', 32, 'minimal')]['rps_x_nginx']:.2f}x nginx.")
        # The proxy and the upstream share one CPU, so the req/s ratio depends on what the upstream costs; the
        # anchor's numbers (nginx 7.4k req/s at 52 us, minimal 3.0k at 243 us, CPU-bound) imply ~85 us.
        nginx_row = by[("1 KB", 32, "nginx")]
        nginx_cpu, up_cpu = nginx_row["proxy_cpu_us_per_req"], nginx_row["upstream_cpu_us_per_req"]
        mm_cpu, min_cpu = c["proxy_cpu_us_per_req"], by[("1 KB", 32, "minimal")]["proxy_cpu_us_per_req"]
        lines.append(
            f"The req/s ratio depends on the upstream's own CPU (it shares the core): with CPU alone deciding, "
            f"req/s ~ 1 / (proxy + upstream CPU). Here the upstream costs ~{up_cpu:.0f} us/request (at nginx's rate), "
            f"so the ratio is "
            f"~(nginx + upstream) / (mmgate + upstream) = {(nginx_cpu + up_cpu) / (mm_cpu + up_cpu):.2f}x; with the "
            f"~85 us/request upstream the anchor's numbers imply it would be {(nginx_cpu + 85) / (mm_cpu + 85):.2f}x "
            f"(minimal aiohttp {(nginx_cpu + 85) / (min_cpu + 85):.2f}x). For 0.6x nginx here mmgate needs <= "
            f"{(nginx_cpu + up_cpu) / 0.6 - up_cpu:.0f} us/request (<= {(nginx_cpu + 85) / 0.6 - 85:.0f} us with the "
            f"anchor's upstream).")
        uv = by.get(("1 KB", 32, "mmgate-uvloop"))
        if uv is not None and uv["proxy_cpu_us_per_req"] and mm_cpu:
            lines.append(f"On uvloop (mmgate-uvloop): {fmt(uv['proxy_cpu_us_per_req'])} us/request, "
                         f"{uv['proxy_cpu_us_per_req'] / mm_cpu:.2f}x mmgate on asyncio's loop, "
                         f"{uv['rps']:.0f} req/s.")
        lines.append("")
    if sse:
        m = next(r for r in sse if r["target"] == "mmgate")
        lines.append(f"SSE, {settings['sse_streams']} streams (medians): mmgate {m['tokens_per_s']:.0f} tokens/s = "
                     f"{m['x_direct']:.3f}x direct; inter-token p99 "
                     f"{m['gap_p99_ms']:.2f} ms vs direct {sse[0]['gap_p99_ms']:.2f} ms.")
    lines += [
        "",
        "| body | conns | target | req/s | x direct | x nginx | p50 ms | p99 ms | proxy CPU us/req | CPU x nginx | "
        "proxy CPU share | upstream us/req | other load | errors |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in cells:
        lines.append(
            f"| {c['body']} | {c['conns']} | {c['target']} | {c['rps']:.0f} | {c['rps_x_direct']:.2f} | "
            f"{c['rps_x_nginx']:.2f} | {c['p50_ms']:.2f} | {c['p99_ms']:.2f} | {fmt(c['proxy_cpu_us_per_req'])} | "
            f"{fmt(c['cpu_x_nginx'], 2)} | {fmt(c['proxy_cpu_share'], 2)} | {c['upstream_cpu_us_per_req']:.0f} | "
            f"{c['other_load']:.2f} | {c['errors']} |")
    if settings.get("baseline"):
        before_name = f"mmgate@{settings['baseline']}"
        lines += ["", f"Before/after in this run: mmgate (working tree) vs {before_name}, medians over the rounds.", "",
                  "| body | conns | req/s before | req/s after | after ÷ before | CPU us/req before | after | "
                  "after ÷ before |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
        for c in cells:
            if c["target"] != "mmgate":
                continue
            b = by[(c["body"], c["conns"], before_name)]
            cpu_ratio = (c["proxy_cpu_us_per_req"] / b["proxy_cpu_us_per_req"]
                         if c["proxy_cpu_us_per_req"] and b["proxy_cpu_us_per_req"] else None)
            lines.append(f"| {c['body']} | {c['conns']} | {b['rps']:.0f} | {c['rps']:.0f} "
                         f"| {c['rps'] / b['rps']:.2f} | "
                         f"{fmt(b['proxy_cpu_us_per_req'])} | {fmt(c['proxy_cpu_us_per_req'])} | {fmt(cpu_ratio, 2)} |")
    four = [c for c in cells if c["body"] == "4 MB" and c["proxy_cpu_us_per_req"]]
    if four:
        lines += ["", "Proxy CPU per MB (4 MB bodies, 1 / 32 conns): " + ", ".join(
            f"{c['target']} c={c['conns']} {c['proxy_cpu_us_per_req'] / 4 / 1000:.2f} ms" for c in four) + "."]
    if sse:
        lines += [
            "",
            f"## SSE: {settings['sse_streams']} concurrent streams, {settings['sse_tokens']} events per response, one "
            f"every {settings['sse_delay_s'] * 1000:g} ms",
            "",
            "Upstream: the same process, streaming when the request carries `X-Bench-Stream` (absolute schedule, "
            "OpenAI chunk events ~190 B, chunked). Client: aiohttp in its own process on the other CPU, 64 streams "
            "staggered over one response's length, each starting a new request when one ends. Gap = time between "
            "consecutive events of one stream as the client sees them (events that arrive in one read count 0 "
            "after the first). tokens/s is bounded by the upstream's schedule: a proxy lowers it through TTFT "
            "(each response takes longer) or by falling behind.",
            "",
            "| target | tokens/s | x direct | gap p50 ms | gap p99 ms | gap max ms | TTFT p50 ms | TTFT p99 ms | "
            "proxy CPU us/token | proxy CPU share | upstream us/token | client CPU share | other load | errors |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in sse:
            lines.append(
                f"| {r['target']} | {r['tokens_per_s']:.0f} | {r['x_direct']:.3f} | {r['gap_p50_ms']:.2f} | "
                f"{r['gap_p99_ms']:.2f} | {r['gap_max_ms']:.1f} | {r['ttft_p50_ms']:.2f} | {r['ttft_p99_ms']:.2f} | "
                f"{fmt(r['proxy_cpu_us_per_token'], 1)} | {fmt(r['proxy_cpu_share'], 2)} | "
                f"{r['upstream_cpu_us_per_token']:.1f} | {r['client_cpu_share']:.2f} | {r['other_load']:.2f} | "
                f"{r['errors']} |")
    for body, prof in (profile or {}).items():
        lines += [
            "",
            f"## Where mmgate's time goes (py-spy, {body}, 32 connections)",
            "",
            f"py-spy record --rate 200 (blocking mode), Python frames only (C code is charged to the Python function "
            f"calling it), {prof['samples']} samples over 8 s."
            + (" Flame graph: `bench/results/passthrough_profile.svg`." if body == "1 KB" else ""),
            "",
            "| self time: function (file) | % |",
            "|---|---:|",
        ]
        lines += [f"| `{row['function']}` | {row['percent']} |" for row in prof["self"][:20]]
        lines += ["", "| inclusive (below the event loop): function (file) | % |", "|---|---:|"]
        below_loop = [row for row in prof["inclusive"] if row["function"].split(" (")[0] not in ROOT_FRAMES]
        lines += [f"| `{row['function']}` | {row['percent']} |" for row in below_loop[:22]]
    return "\n".join(lines) + "\n"
