"""Text passthrough cost: direct vs nginx vs a minimal aiohttp proxy vs mmgate on both event loops, and SSE streams.

What a text-only request (no media marker: README "How a request flows", step 3) pays for going through mmgate
on asyncio's loop and on uvloop, against direct (wrk -> testkit/text_load.py's upstream), nginx and a ~30-line
aiohttp proxy, the anchor (nginx 7.4k req/s at 52 us CPU/request, minimal 3.0k at 243 us; 1 KB, 32 conns); on
loopback, proxies and upstream pinned to CPU 0, the load generator to CPU 1.

HTTP: wrk posts a 1 KB and a 4 MiB text chat body over 1 and 32 connections: req/s, p50/p99, and the CPU per
request of the proxy and of the upstream (/proc). SSE: a client process holds 64 streams: tokens/s, inter-token
gaps, proxy CPU per token. Targets take turns round after round, each run once the shared machine is near idle;
figures are medians over the rounds. py-spy profiles mmgate at 32 connections unless no_profile.

Goals, on the median of the per-round ratios: 1 KB, 32 conns: mmgate >= 0.6x nginx's req/s, mmgate-uvloop's CPU
per request <= 0.92x mmgate's on asyncio's loop; 4 MB: mmgate's CPU per MB <= 1.2x the minimal proxy's; SSE:
mmgate >= 0.95x direct tokens/s. Needs wrk and nginx (apt-get installs them when missing), py-spy to profile.
"""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import ExitStack
from functools import partial
from pathlib import Path
from typing import Any

import aiohttp

from bench import _results as R
from proxy.payload.locate import may_contain_media
from testkit import pyspy
from testkit.load import free_port, loadavg, machine_jiffies, stop, uptime, wait_http, wait_quiet
from testkit.procfs import CLK_TCK, cpu_ticks, descendants
from testkit.text_load import ANSWER, ROLE, text_body

REPO = Path(__file__).resolve().parent.parent
PROXY_CPU, LOAD_CPU = "0", "1"
TARGETS = ("direct", "nginx", "minimal", "mmgate", "mmgate-uvloop")
SSE_TARGETS = ("direct", "mmgate", "mmgate-uvloop", "minimal", "nginx")  # the order of the page's SSE table
# The event loop each mmgate target runs on (`--loop`); "mmgate" is asyncio's own, whatever is installed.
LOOP_OF = {"mmgate": "asyncio", "mmgate-uvloop": "uvloop"}
PROFILE_S = 8
NGINX = shutil.which("nginx") or "/usr/sbin/nginx"  # where apt-get puts it: off a plain user's PATH
WHAT = ("text-only requests with wrk: direct vs nginx vs a minimal aiohttp proxy vs mmgate on asyncio's loop and "
        "on uvloop (1 KB and 4 MB, 1 and 32 conns); 64 SSE streams")
GOAL_X_NGINX, GOAL_SSE_X_DIRECT, GOAL_TEXT_X_MINIMAL, GOAL_UVLOOP_CPU = 0.6, 0.95, 1.2, 0.92
# The upstream's CPU per request the anchor's numbers imply (CPU-bound, proxy and upstream sharing one core)
ANCHOR_UPSTREAM_US = 85
Row = dict[str, Any]


def ensure_tools(need_pyspy: bool) -> None:
    if shutil.which("wrk") is None or not Path(NGINX).exists():
        print("installing nginx and wrk with apt-get ...", flush=True)
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        subprocess.run(["apt-get", "update"], env=env, capture_output=True)
        subprocess.run(["apt-get", "install", "-y", "nginx", "wrk"], env=env, check=True, capture_output=True)
    if need_pyspy and not pyspy.pyspy_path():
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "py-spy"], check=True)
    if importlib.util.find_spec("uvloop") is None:  # mmgate's uvloop extra, for the mmgate-uvloop target
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "uvloop>=0.19"], check=True)


# A plain reverse proxy: HTTP/1.1 to a keep-alive upstream, the body buffered in memory as mmgate does; files: prefix
NGINX_CONF = """
worker_processes 1;
daemon off;
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
}}
"""


def start(stack: ExitStack, argv: list[str], cpu: str, **popen: Any) -> subprocess.Popen[bytes]:
    """``argv`` pinned to ``cpu``, stopped (by pid) when ``stack`` closes, whatever happens."""
    proc = subprocess.Popen(["taskset", "-c", cpu, *argv], **popen)
    stack.callback(stop, proc)
    return proc


def start_targets(stack: ExitStack, targets: Sequence[str], workdir: Path,
                  args: R.Knobs) -> tuple[dict[str, str], dict[str, list[int]]]:
    """The upstream ("direct") and every proxy, once each answers: each target's chat URL, and the pids whose
    CPU is the target's (direct: none; nginx: master and worker; and "upstream": the upstream's)."""
    ports = {target: free_port() for target in targets}
    upstream = f"http://127.0.0.1:{ports['direct']}"
    conf = workdir / "nginx.conf"
    conf.write_text(NGINX_CONF.format(prefix=workdir, port=ports["nginx"], upstream=ports["direct"]))
    mmgate = [sys.executable, "-m", "proxy", "--upstream", upstream, "--host", "127.0.0.1", "--access-log", "off"]
    argv = {"direct": [*ROLE, "upstream", "--port", str(ports["direct"]), "--sse-tokens", str(args.sse_tokens),
                       "--sse-delay", str(args.sse_delay)],
            "nginx": [NGINX, "-p", str(workdir), "-e", str(workdir / "error.log"), "-c", str(conf)],
            "minimal": [*ROLE, "minimal-proxy", "--port", str(ports["minimal"]), "--upstream", upstream],
            **{target: [*mmgate, "--port", str(ports[target]), "--loop", loop] for target, loop in LOOP_OF.items()}}
    cwd = dict.fromkeys(argv, REPO)
    if args.baseline:  # that revision in a worktree of its own, on its default loop (it may predate --loop)
        baseline, worktree = targets[-1], workdir / "baseline"
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", "--force", str(worktree), args.baseline],
                       check=True, capture_output=True)
        stack.callback(subprocess.run, ["git", "-C", str(REPO), "worktree", "remove", "--force", str(worktree)],
                       capture_output=True)
        argv[baseline], cwd[baseline] = [*mmgate, "--port", str(ports[baseline])], worktree
    silent = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    procs: dict[str, subprocess.Popen[bytes]] = {}
    for target in targets:  # one by one, the upstream first: mmgate asks it what it serves as it starts
        procs[target] = start(stack, argv[target], PROXY_CPU, cwd=cwd[target], **({} if target == "direct" else silent))
        wait_http(f"http://127.0.0.1:{ports[target]}/{'mmgate/health' if 'mmgate' in target else ''}", procs[target])
    pids = {target: [proc.pid] for target, proc in procs.items()}
    pids |= {"direct": [], "upstream": pids["direct"], "nginx": [procs["nginx"].pid, *descendants(procs["nginx"].pid)]}
    return {target: f"http://127.0.0.1:{port}/v1/chat/completions" for target, port in ports.items()}, pids


def check_answer(url: str, body: bytes) -> None:
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(request, timeout=10) as r:
        got = r.read()
    if r.status != 200 or got != ANSWER:
        raise RuntimeError(f"{url}: unexpected answer {r.status} {got[:200]!r}")


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


def wrk_argv(url: str, script: Path, conns: int, seconds: float) -> list[str]:
    return ["taskset", "-c", LOAD_CPU, "wrk", "-t1", f"-c{conns}", f"-d{max(1, round(seconds))}s", "--latency",
            "--timeout", "20s", "-s", str(script), url]


def run_wrk(url: str, script: Path, conns: int, seconds: float) -> dict[str, Any]:
    out = subprocess.run(wrk_argv(url, script, conns, seconds), capture_output=True, text=True, timeout=seconds + 60)
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("WRKJSON ")), None)
    if line is None:
        raise RuntimeError(f"wrk failed: {out.stdout}\n{out.stderr}")
    return json.loads(line[len("WRKJSON "):])


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
    w = run_wrk(url, script, conns, seconds)
    proxy_s, upstream_s, machine_s, wrk_s = spent()
    requests, wall, has_proxy = max(w["requests"], 1), w["duration_us"] / 1e6, bool(pids[target])
    return {"requests": w["requests"], "rps": w["requests"] / wall,
            **{f"{q}_ms": w[f"{q}_us"] / 1e3 for q in ("p50", "p90", "p99", "max")},
            "errors": sum(w[k] for k in ("connect", "read", "write", "status", "timeout")), "non_2xx": w["status"],
            "proxy_cpu_us_per_req": proxy_s / requests * 1e6 if has_proxy else None,
            "proxy_cpu_share": proxy_s / wall if has_proxy else None,
            "upstream_cpu_us_per_req": upstream_s / requests * 1e6, "load_cpu_share": wrk_s / wall,
            "other_load": max(0.0, (machine_s - proxy_s - upstream_s - wrk_s) / wall)}


def measure_sse(stack: ExitStack, url: str, args: R.Knobs, seconds: float, pids: Mapping[str, list[int]],
                target: str) -> Row:
    """One window of the SSE client; ``other_load`` as in measure_http, less the CPU the client reports."""
    period = args.sse_tokens * args.sse_delay  # one response's length: the streams start staggered over it
    client = start(stack, [*ROLE, "sse-client", "--url", url, "--streams", str(args.sse_streams), "--warmup",
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


class Turns:
    """Targets take turns, round after round, so a burst of other work on the shared machine hits all of them; each
    run starts once the machine is near idle (under 0.3 cores busy over 0.3 s), after at most 5 s of waiting and
    ``budget`` s in all."""

    def __init__(self, budget: float) -> None:
        self.budget, self.waited, self.gave_up = budget, 0.0, 0

    def take(self, runs: Mapping[str, Callable[[], Row]], rounds: int) -> dict[str, Row]:
        """Each target's figures as their medians over its rounds (not the best round: that flatters whoever got
        the quietest moment), with the rounds."""
        seen: dict[str, list[Row]] = {target: [] for target in runs}
        busy_below = 0.3 / (os.cpu_count() or 1)  # wait_quiet reads a share of the whole machine
        for _ in range(rounds):
            for target, run in runs.items():
                quiet = wait_quiet(min(5.0, max(0.0, self.budget - self.waited)), busy_below, sample=0.3)
                self.waited += quiet["waited_s"]
                self.gave_up += quiet["busy_before_pct"] >= busy_below * 100
                seen[target].append(run())
        medians: dict[str, Row] = {}
        for target, values in seen.items():
            medians[target] = {}
            for key in values[0]:
                column = [r[key] for r in values]
                numeric = all(isinstance(v, int | float) and not isinstance(v, bool) for v in column)
                medians[target][key] = statistics.median(column) if numeric else column[0]
            medians[target]["rounds"] = values
        return medians


def environment() -> dict[str, Any]:
    nginx = subprocess.run([NGINX, "-v"], capture_output=True, text=True).stderr.strip()
    wrk = subprocess.run(["wrk", "-v"], capture_output=True, text=True).stdout.split()
    return {"python": platform.python_version(), "aiohttp": aiohttp.__version__, "nginx": nginx.split("/")[-1],
            "wrk": wrk[1] if len(wrk) > 1 else "?", "cpu": R.cpu_model(), "cpus": os.cpu_count(),
            "kernel": platform.release(), "load_avg_before": loadavg(), "uptime_before": uptime()}


def measure(args: R.Knobs) -> dict[str, Any]:
    began, stamp = time.monotonic(), R.stamp("passthrough.py", WHAT)
    ensure_tools(need_pyspy=not args.no_profile)
    env = environment()
    print(f"# passthrough bench: {env['uptime_before']}", flush=True)

    targets = [*TARGETS, *([f"mmgate@{args.baseline}"] if args.baseline else [])]
    round_s = max(1, round(args.duration / args.rounds))
    round_s_4mb = max(round_s, 5)  # 32 concurrent 4 MB requests take ~2 s through a Python proxy: longer runs
    sse_round_s = max(2.0, args.duration / args.sse_rounds)
    turns, cells = Turns(args.quiet_budget), list[Row]()
    profile: dict[str, Any] = {}  # by body; None in the JSON when not profiled
    with ExitStack() as stack:
        workdir = Path(tempfile.mkdtemp(prefix="mmgate-passthrough-"))
        stack.callback(shutil.rmtree, workdir, ignore_errors=True)
        workdir.chmod(0o755)  # nginx workers run as nobody
        bodies, scripts = {"1 KB": text_body(1024), "4 MB": text_body(4 << 20)}, dict[str, Path]()
        for name, raw in bodies.items():
            assert not may_contain_media(raw), f"the {name} body would leave mmgate's text fast path"
            (workdir / f"body-{len(raw)}.json").write_bytes(raw)
            scripts[name] = workdir / f"post-{len(raw)}.lua"
            scripts[name].write_text(WRK_LUA.format(body=workdir / f"body-{len(raw)}.json"))
        urls, pids = start_targets(stack, targets, workdir, args)
        for url in urls.values():
            for raw in bodies.values():
                check_answer(url, raw)

        for body, conns in ((body, conns) for body in bodies for conns in (1, 32)):
            for target in targets:
                run_wrk(urls[target], scripts[body], conns, 1)  # warm-up: connections, pools, caches
            seconds = round_s if body == "1 KB" else round_s_4mb
            runs = {target: partial(measure_http, urls[target], scripts[body], conns, seconds, pids, target)
                    for target in targets}
            medians = turns.take(runs, args.rounds)
            direct, nginx = medians["direct"], medians["nginx"]
            for target, row in medians.items():
                cells.append({"body": body, "conns": conns, "target": target, **row,
                              "rps_x_direct": row["rps"] / direct["rps"], "rps_x_nginx": row["rps"] / nginx["rps"],
                              "cpu_x_nginx": row["proxy_cpu_us_per_req"] / nginx["proxy_cpu_us_per_req"]
                              if row["proxy_cpu_us_per_req"] is not None and nginx["proxy_cpu_us_per_req"] else None})
                print(f"  {body:5} c={conns:<3} {target:8} {row['rps']:9.0f} req/s  p50 {row['p50_ms']:.2f} ms  p99 "
                      f"{row['p99_ms']:.2f} ms  proxy CPU {fmt(row['proxy_cpu_us_per_req'])} us/req  other load "
                      f"{row['other_load']:.2f}", flush=True)

        # SSE through the same processes (the upstream streams when asked to by X-Bench-Stream)
        runs = {target: partial(measure_sse, stack, urls[target], args, sse_round_s, pids, target)
                for target in (*SSE_TARGETS, *targets[len(TARGETS):])}
        medians = turns.take(runs, args.sse_rounds)
        direct_mean = statistics.fmean(r["tokens_per_s"] for r in medians["direct"]["rounds"])
        sse = [{"target": target, **row, "x_direct": row["tokens_per_s"] / medians["direct"]["tokens_per_s"],
                "mean_tokens_per_s": (mean := statistics.fmean(r["tokens_per_s"] for r in row["rounds"])),
                "mean_x_direct": mean / direct_mean} for target, row in medians.items()]
        for row in sse:
            print(f"  SSE {row['target']:8} {row['tokens_per_s']:8.0f} tok/s  gap p50 {row['gap_p50_ms']:.2f} ms  p99 "
                  f"{row['gap_p99_ms']:.2f} ms  proxy CPU {fmt(row['proxy_cpu_us_per_token'])} us/token  other load "
                  f"{row['other_load']:.2f}", flush=True)

        if not args.no_profile:
            for body, svg in (("1 KB", R.RESULTS / "passthrough_profile.svg"), ("4 MB", None)):
                print(f"  profiling mmgate (py-spy, {body}, 32 connections) ...", flush=True)
                busy_s = (2 if svg else 1) * (PROFILE_S + 2) + 2  # wrk outlasts the py-spy runs (svg: one more)
                with subprocess.Popen(wrk_argv(urls["mmgate"], scripts[body], 32, busy_s), stdout=subprocess.DEVNULL):
                    time.sleep(1)
                    profile[body] = pyspy.record(pids["mmgate"][0], PROFILE_S, svg, cpu=LOAD_CPU)

    env |= {"load_avg_after": loadavg(), "uptime_after": uptime(), "seconds": round(time.monotonic() - began, 1),
            "quiet_wait_s": round(turns.waited, 1), "quiet_gave_up": turns.gave_up}
    settings = {"duration_s": args.duration, "rounds": args.rounds, "round_s": round_s, "rounds_4mb": args.rounds,
                "round_s_4mb": round_s_4mb, "sse_rounds": args.sse_rounds, "sse_round_s": sse_round_s,
                "sse_streams": args.sse_streams, "sse_tokens": args.sse_tokens, "sse_delay_s": args.sse_delay,
                "proxy_cpu": PROXY_CPU, "load_cpu": LOAD_CPU, "baseline": args.baseline}
    return stamp | {"environment": env, "settings": settings, "http": cells, "sse": sse, "profile": profile or None}


def per_round(numerator: Row, denominator: Row, key: str) -> list[float]:
    """``key``'s ratio round by round: targets took turns within a round, so a round's ratio compares like with
    like. A CPU reading can be missing or zero: that round has no CPU ratio."""
    pairs = zip(numerator["rounds"], denominator["rounds"], strict=False)
    if key.startswith("proxy_cpu"):
        return [n[key] / d[key] for n, d in pairs if n[key] and d[key]]
    return [n[key] / d[key] for n, d in pairs]


def goals(data: dict[str, Any]) -> list[R.Goal]:
    by = {(c["body"], c["conns"], c["target"]): c for c in data["http"]}
    sse, out = {r["target"]: r for r in data["sse"]}, list[R.Goal]()
    mm, ng, uv = by.get(("1 KB", 32, "mmgate")), by.get(("1 KB", 32, "nginx")), by.get(("1 KB", 32, "mmgate-uvloop"))
    if mm and ng:
        out += [R.goal("1 KB, 32 conns: mmgate req/s ÷ nginx", per_round(mm, ng, "rps"), f"≥ {GOAL_X_NGINX:g}",
                       lambda v: v >= GOAL_X_NGINX, unit="×"),
                R.goal("1 KB, 32 conns: mmgate CPU per request", [r["proxy_cpu_us_per_req"] for r in mm["rounds"]],
                       unit="µs")]
    if mm and uv:
        out.append(R.goal("1 KB, 32 conns: mmgate CPU per request, uvloop ÷ asyncio's loop",
                          per_round(uv, mm, "proxy_cpu_us_per_req"), f"≤ {GOAL_UVLOOP_CPU:g}",
                          lambda v: v <= GOAL_UVLOOP_CPU, unit="×"))
    for conns in sorted({c["conns"] for c in data["http"] if c["body"] == "4 MB"}):
        if (mm4 := by.get(("4 MB", conns, "mmgate"))) and (mini := by.get(("4 MB", conns, "minimal"))):
            out.append(R.goal(f"4 MB text, {conns} conns: mmgate CPU per MB ÷ minimal aiohttp",
                              per_round(mm4, mini, "proxy_cpu_us_per_req"), f"≤ {GOAL_TEXT_X_MINIMAL:g}",
                              lambda v: v <= GOAL_TEXT_X_MINIMAL, unit="×"))
    if "mmgate" in sse and "direct" in sse:
        out.append(R.goal("SSE, 64 streams: mmgate tokens/s ÷ direct",
                          per_round(sse["mmgate"], sse["direct"], "tokens_per_s"), f"≥ {GOAL_SSE_X_DIRECT:g}",
                          lambda v: v >= GOAL_SSE_X_DIRECT, unit="×"))
    return out


def fmt(value: float | None, digits: int = 0) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def table(columns: Sequence[tuple[str, str, str]], rows: Iterable[Row]) -> list[str]:
    """A Markdown table of ``rows``: ``columns`` are (title, key, format spec); text ("s") is left-aligned,
    figures right-aligned, and a missing figure (None) is –."""
    return ["| " + " | ".join(title for title, _, _ in columns) + " |",
            "|" + "|".join("---" if spec == "s" else "---:" for _, _, spec in columns) + "|",
            *("| " + " | ".join("–" if row[key] is None else format(row[key], spec) for _, key, spec in columns) + " |"
              for row in rows)]


HTTP_COLUMNS = (("body", "body", "s"), ("conns", "conns", ""), ("target", "target", "s"), ("req/s", "rps", ".0f"),
                ("x direct", "rps_x_direct", ".2f"), ("x nginx", "rps_x_nginx", ".2f"), ("p50 ms", "p50_ms", ".2f"),
                ("p99 ms", "p99_ms", ".2f"), ("proxy CPU us/req", "proxy_cpu_us_per_req", ".0f"),
                ("CPU x nginx", "cpu_x_nginx", ".2f"), ("proxy CPU share", "proxy_cpu_share", ".2f"),
                ("upstream us/req", "upstream_cpu_us_per_req", ".0f"), ("other load", "other_load", ".2f"),
                ("errors", "errors", ""))
BEFORE_AFTER_COLUMNS = (("body", "body", "s"), ("conns", "conns", ""), ("req/s before", "rps_before", ".0f"),
                        ("req/s after", "rps", ".0f"), ("after ÷ before", "rps_ratio", ".2f"),
                        ("CPU us/req before", "cpu_before", ".0f"), ("after", "proxy_cpu_us_per_req", ".0f"),
                        ("after ÷ before", "cpu_ratio", ".2f"))
SSE_COLUMNS = (("target", "target", "s"), ("tokens/s", "tokens_per_s", ".0f"), ("x direct", "x_direct", ".3f"),
               ("gap p50 ms", "gap_p50_ms", ".2f"), ("gap p99 ms", "gap_p99_ms", ".2f"),
               ("gap max ms", "gap_max_ms", ".1f"), ("TTFT p50 ms", "ttft_p50_ms", ".2f"),
               ("TTFT p99 ms", "ttft_p99_ms", ".2f"), ("proxy CPU us/token", "proxy_cpu_us_per_token", ".1f"),
               ("proxy CPU share", "proxy_cpu_share", ".2f"), ("upstream us/token", "upstream_cpu_us_per_token", ".1f"),
               ("client CPU share", "client_cpu_share", ".2f"), ("other load", "other_load", ".2f"),
               ("errors", "errors", ""))


def report(data: dict[str, Any]) -> str:
    env, settings, cells, sse = data["environment"], data["settings"], data["http"], data["sse"]
    lines = [
        "# passthrough: text-only requests and SSE streams, direct vs nginx vs minimal aiohttp vs mmgate",
        "",
        f"`python -m bench run passthrough` ({settings['rounds']} rounds x {settings['round_s']} s per cell and "
        f"target, 4 MB: {settings['rounds_4mb']} x {settings['round_s_4mb']} s, "
        f"SSE {settings['sse_rounds']} x {settings['sse_round_s']:g} s; {env['seconds']} s in all) -- Python "
        f"{env['python']}, aiohttp {env['aiohttp']}, nginx {env['nginx']}, wrk {env['wrk']}, {env['cpus']} CPUs "
        f"({env['cpu']}), kernel {env['kernel']}.",
        "",
        f"Machine: 2 cores, shared. Proxy and upstream on CPU {settings['proxy_cpu']}, the load generator (wrk -t1, "
        f"or the SSE client) on CPU {settings['load_cpu']}. Load average {env['load_avg_before']} at start, "
        f"{env['load_avg_after']} at end (`uptime`: `{env['uptime_before']}`; `{env['uptime_after']}`). Each run "
        f"waited for the machine to be near idle ({env['quiet_wait_s']} s in all; {env['quiet_gave_up']} run(s) "
        "started anyway after 5 s); targets take turns round after round, each figure is the median over the "
        "target's rounds (every round is in the JSON). `other load` = cores the rest of the machine used during the "
        "run (other jobs, kernel network work not charged to a process): read a row with a high value with care.",
        "",
        "Upstream: testkit/text_load.py's raw asyncio server: it reads the whole body, then answers a fixed 330-byte "
        "chat completion (~25 us CPU per 1 KB request; nginx `return 200`, ~15 us, answers before reading the body, "
        "and wrk then stalls on 4 MB bodies: 0.7 req/s direct). nginx: 1 worker, `proxy_http_version 1.1`, upstream "
        "keepalive, the body buffered in memory as mmgate does (`client_body_buffer_size 16m`). minimal: the "
        "anchor's ~30-line aiohttp proxy. mmgate: `python -m proxy --access-log off`, defaults otherwise. Proxy CPU "
        "= utime+stime of the proxy process(es) (nginx: master + worker) / requests.",
        "",
    ]
    by = {(c["body"], c["conns"], c["target"]): c for c in cells}
    if ("1 KB", 32, "mmgate") in by:
        mm, ng, mini = (by[("1 KB", 32, target)] for target in ("mmgate", "nginx", "minimal"))
        mm_cpu, ng_cpu, mini_cpu = (c["proxy_cpu_us_per_req"] for c in (mm, ng, mini))
        up_cpu = ng["upstream_cpu_us_per_req"]
        lines.append(f"1 KB, 32 conns (medians): mmgate {mm['rps']:.0f} req/s = {mm['rps_x_nginx']:.2f}x nginx; "
                     f"mmgate CPU {fmt(mm_cpu)} us/request vs nginx {fmt(ng_cpu)} and minimal aiohttp {fmt(mini_cpu)}; "
                     f"minimal reaches {mini['rps_x_nginx']:.2f}x nginx.")
        anchor = ANCHOR_UPSTREAM_US
        lines.append(
            f"The req/s ratio depends on the upstream's own CPU (it shares the core): with CPU alone deciding, "
            f"req/s ~ 1 / (proxy + upstream CPU). Here the upstream costs ~{up_cpu:.0f} us/request (at nginx's rate), "
            f"so the ratio is ~(nginx + upstream) / (mmgate + upstream) = {(ng_cpu + up_cpu) / (mm_cpu + up_cpu):.2f}x;"
            f" with the ~{anchor} us/request upstream the anchor's numbers imply it would be "
            f"{(ng_cpu + anchor) / (mm_cpu + anchor):.2f}x (minimal aiohttp "
            f"{(ng_cpu + anchor) / (mini_cpu + anchor):.2f}x). For 0.6x nginx here mmgate needs <= "
            f"{(ng_cpu + up_cpu) / 0.6 - up_cpu:.0f} us/request (<= {(ng_cpu + anchor) / 0.6 - anchor:.0f} us with the "
            "anchor's upstream).")
        uv = by.get(("1 KB", 32, "mmgate-uvloop"))
        if uv is not None and uv["proxy_cpu_us_per_req"] and mm_cpu:
            lines.append(f"On uvloop (mmgate-uvloop): {fmt(uv['proxy_cpu_us_per_req'])} us/request, "
                         f"{uv['proxy_cpu_us_per_req'] / mm_cpu:.2f}x mmgate on asyncio's loop, {uv['rps']:.0f} req/s.")
        lines.append("")
    if sse:
        m = next(r for r in sse if r["target"] == "mmgate")
        lines.append(f"SSE, {settings['sse_streams']} streams (medians): mmgate {m['tokens_per_s']:.0f} tokens/s = "
                     f"{m['x_direct']:.3f}x direct; inter-token p99 {m['gap_p99_ms']:.2f} ms vs direct "
                     f"{sse[0]['gap_p99_ms']:.2f} ms.")
    lines += ["", *table(HTTP_COLUMNS, cells)]
    if settings.get("baseline"):
        before, rows = f"mmgate@{settings['baseline']}", []
        for c in (c for c in cells if c["target"] == "mmgate"):
            b = by[(c["body"], c["conns"], before)]
            cpu, cpu_before = c["proxy_cpu_us_per_req"], b["proxy_cpu_us_per_req"]
            rows.append(c | {"rps_before": b["rps"], "rps_ratio": c["rps"] / b["rps"], "cpu_before": cpu_before,
                             "cpu_ratio": cpu / cpu_before if cpu and cpu_before else None})
        lines += ["", f"Before/after in this run: mmgate (working tree) vs {before}, medians over the rounds.", "",
                  *table(BEFORE_AFTER_COLUMNS, rows)]
    if four := [c for c in cells if c["body"] == "4 MB" and c["proxy_cpu_us_per_req"]]:
        lines += ["", "Proxy CPU per MB (4 MB bodies, 1 / 32 conns): " + ", ".join(
            f"{c['target']} c={c['conns']} {c['proxy_cpu_us_per_req'] / 4 / 1000:.2f} ms" for c in four) + "."]
    if sse:
        lines += [
            "",
            f"## SSE: {settings['sse_streams']} concurrent streams, {settings['sse_tokens']} events per response, one "
            f"every {settings['sse_delay_s'] * 1000:g} ms",
            "",
            "The upstream streams OpenAI chunk events (~190 B, chunked) on an absolute schedule when the request "
            "carries `X-Bench-Stream`; the client (aiohttp, its own process, on the other CPU) staggers its "
            f"{settings['sse_streams']} streams over one response's length, each restarting when it ends. Gap = time "
            "between consecutive events of one stream as the client sees them (events arriving in one read count 0 "
            "after the first). The upstream's schedule bounds tokens/s: a proxy lowers it through TTFT or by lagging.",
            "",
            *table(SSE_COLUMNS, sse),
        ]
    for body, prof in (data.get("profile") or {}).items():
        lines += ["", f"## Where mmgate's time goes (py-spy, {body}, 32 connections)", "",
                  f"py-spy record --rate 200 (blocking mode), Python frames only (C code is charged to the Python "
                  f"function calling it), {prof['samples']} samples over {PROFILE_S} s."
                  + (" Flame graph: `bench/results/passthrough_profile.svg`." if body == "1 KB" else ""),
                  "", *pyspy.tables(prof)]
    return "\n".join(lines) + "\n"
