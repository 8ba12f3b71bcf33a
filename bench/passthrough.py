"""Text passthrough cost: direct vs nginx vs a minimal aiohttp proxy vs mmgate on both event loops, and SSE streams.

What a text-only request (no media marker: README "How a request flows", step 3) pays for going through mmgate
on asyncio's loop and on uvloop, against direct (wrk -> testkit/text_load.py's upstream), nginx and a ~30-line
aiohttp proxy, the anchor (nginx 7.4k req/s at 52 us CPU/request, minimal 3.0k at 243 us; 1 KB, 32 conns); on
loopback, proxies and upstream pinned to CPU 0, the load generator to CPU 1.

HTTP: wrk posts a 1 KB and a 4 MiB text chat body over 1 and 32 connections: req/s, p50/p99, and the CPU per
request of the proxy and of the upstream (/proc). SSE: a client process holds 64 streams: tokens/s, inter-token
gaps, proxy CPU per token. Targets take turns round after round, each run once the shared machine is near idle;
figures are medians over the rounds. py-spy profiles mmgate at 32 connections unless no_profile.

Upstream: testkit/text_load.py's raw asyncio server: it reads the whole body, then answers a fixed 330-byte chat
completion (nginx's own ``return 200`` answers before reading a body, and wrk then stalls on 4 MB ones). nginx: one
worker, ``proxy_http_version 1.1``, upstream keep-alive, the body buffered in memory as mmgate does. mmgate:
``python -m proxy --access-log off``, defaults otherwise. Proxy CPU: utime + stime of the proxy's processes (nginx:
master and worker) per request. SSE: when a request carries ``X-Bench-Stream`` the upstream streams OpenAI chunk
events (~190 B) on an absolute schedule; the client (aiohttp, its own process, on the other CPU) staggers its
streams over one response's length, each restarting when it ends; a gap is the time between two events of one
stream as the client sees them. The schedule bounds tokens/s: a proxy lowers it through TTFT or by lagging.

Goals, on the median of the per-round ratios: 1 KB, 32 conns: mmgate >= 0.6x nginx's req/s, mmgate-uvloop's CPU
per request <= 0.92x mmgate's on asyncio's loop; 4 MB: mmgate's CPU per MB <= 1.2x the minimal proxy's; SSE:
mmgate >= 0.95x direct tokens/s. Needs wrk and nginx (apt-get installs them when missing), py-spy to profile.
"""

from __future__ import annotations

import os
import platform
import time
from contextlib import ExitStack
from typing import Any

import aiohttp

from bench import _results as R
from testkit import peers, pyspy, text_targets
from testkit.load import Turns, loadavg, uptime
from testkit.text_targets import LOAD_CPU, PROXY_CPU, TARGETS, dash, per_round

SSE_TARGETS = ("direct", "mmgate", "mmgate-uvloop", "minimal", "nginx")  # the order of the page's SSE table
PROFILE_S = 8
WHAT = ("text-only requests with wrk: direct vs nginx vs a minimal aiohttp proxy vs mmgate on asyncio's loop and "
        "on uvloop (1 KB and 4 MB, 1 and 32 conns); 64 SSE streams")
GOAL_X_NGINX, GOAL_SSE_X_DIRECT, GOAL_TEXT_X_MINIMAL, GOAL_UVLOOP_CPU = 0.6, 0.95, 1.2, 0.92
# The upstream's CPU per request the anchor's numbers imply (CPU-bound, proxy and upstream sharing one core)
ANCHOR_UPSTREAM_US = 85


def measure(args: R.Knobs) -> dict[str, Any]:
    began, stamp = time.monotonic(), R.stamp("passthrough.py", WHAT)
    text_targets.install_tools(profile=not args.no_profile)
    env: dict[str, Any] = {"python": platform.python_version(), "aiohttp": aiohttp.__version__, **peers.versions(),
                           "cpu": R.cpu_model(), "cpus": os.cpu_count(), "kernel": platform.release(),
                           "load_avg_before": loadavg(), "uptime_before": uptime()}
    print(f"# passthrough bench: {env['uptime_before']}", flush=True)

    targets = [*TARGETS, *([f"mmgate@{args.baseline}"] if args.baseline else [])]
    round_s = max(1, round(args.duration / args.rounds))
    round_s_4mb = max(round_s, 5)  # 32 concurrent 4 MB requests take ~2 s through a Python proxy: longer runs
    sse_round_s = max(2.0, args.duration / args.sse_rounds)
    period = args.sse_tokens * args.sse_delay  # one response's length: the SSE streams start staggered over it
    turns = Turns(args.quiet_budget)
    with ExitStack() as stack:
        run = text_targets.started(stack, targets, args.sse_tokens, args.sse_delay, args.baseline)
        cells = text_targets.http_cells(turns, run, targets, {"1 KB": round_s, "4 MB": round_s_4mb}, args.rounds)
        sse = text_targets.sse_rows(turns, stack, run, (*SSE_TARGETS, *targets[len(TARGETS):]), args.sse_streams,
                                    period, sse_round_s, args.sse_rounds)
        profile = None if args.no_profile else text_targets.profiles(run, PROFILE_S,
                                                                     R.RESULTS / "passthrough_profile.svg")

    env |= {"load_avg_after": loadavg(), "uptime_after": uptime(), "seconds": round(time.monotonic() - began, 1),
            "quiet_wait_s": round(turns.waited, 1), "quiet_gave_up": turns.gave_up}
    settings = {"duration_s": args.duration, "rounds": args.rounds, "round_s": round_s, "rounds_4mb": args.rounds,
                "round_s_4mb": round_s_4mb, "sse_rounds": args.sse_rounds, "sse_round_s": sse_round_s,
                "sse_streams": args.sse_streams, "sse_tokens": args.sse_tokens, "sse_delay_s": args.sse_delay,
                "proxy_cpu": PROXY_CPU, "load_cpu": LOAD_CPU, "baseline": args.baseline}
    return stamp | {"environment": env, "settings": settings, "http": cells, "sse": sse, "profile": profile}


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
    st, e = settings, env
    lines = [
        f"{st['rounds']} rounds × {st['round_s']} s a cell and target (4 MB: {st['rounds_4mb']} × "
        f"{st['round_s_4mb']} s; SSE: {st['sse_rounds']} × {st['sse_round_s']:g} s), {e['seconds']} s in all; "
        f"Python {e['python']}, aiohttp {e['aiohttp']}, nginx {e['nginx']}, wrk {e['wrk']}, kernel {e['kernel']}. "
        f"Proxies and upstream on CPU {st['proxy_cpu']}, the load generator on CPU {st['load_cpu']}; load average "
        f"{e['load_avg_before']} at the start, {e['load_avg_after']} at the end; {e['quiet_wait_s']} s waited for a "
        f"quiet machine ({e['quiet_gave_up']} run(s) started anyway). Each figure: the median of the target's rounds "
        "(every round is in the JSON); `other load`: the cores the rest of the machine used during the run.",
        "",
    ]
    by = {(c["body"], c["conns"], c["target"]): c for c in cells}
    if ("1 KB", 32, "mmgate") in by:
        mm, ng, mini = (by[("1 KB", 32, target)] for target in ("mmgate", "nginx", "minimal"))
        mm_cpu, ng_cpu, mini_cpu = (c["proxy_cpu_us_per_req"] for c in (mm, ng, mini))
        up_cpu = ng["upstream_cpu_us_per_req"]
        lines.append(f"1 KB, 32 conns (medians): mmgate {mm['rps']:.0f} req/s = {mm['rps_x_nginx']:.2f}x nginx; "
                     f"mmgate CPU {dash(mm_cpu)} us/request vs nginx {dash(ng_cpu)} and minimal aiohttp "
                     f"{dash(mini_cpu)}; minimal reaches {mini['rps_x_nginx']:.2f}x nginx.")
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
            lines.append(f"On uvloop (mmgate-uvloop): {dash(uv['proxy_cpu_us_per_req'])} us/request, "
                         f"{uv['proxy_cpu_us_per_req'] / mm_cpu:.2f}x mmgate on asyncio's loop, {uv['rps']:.0f} req/s.")
        lines.append("")
    if sse:
        m = next(r for r in sse if r["target"] == "mmgate")
        lines.append(f"SSE, {settings['sse_streams']} streams (medians): mmgate {m['tokens_per_s']:.0f} tokens/s = "
                     f"{m['x_direct']:.3f}x direct; inter-token p99 {m['gap_p99_ms']:.2f} ms vs direct "
                     f"{sse[0]['gap_p99_ms']:.2f} ms.")
    lines += ["", *R.table(HTTP_COLUMNS, cells)]
    if settings.get("baseline"):
        before, rows = f"mmgate@{settings['baseline']}", []
        for c in (c for c in cells if c["target"] == "mmgate"):
            b = by[(c["body"], c["conns"], before)]
            cpu, cpu_before = c["proxy_cpu_us_per_req"], b["proxy_cpu_us_per_req"]
            rows.append(c | {"rps_before": b["rps"], "rps_ratio": c["rps"] / b["rps"], "cpu_before": cpu_before,
                             "cpu_ratio": cpu / cpu_before if cpu and cpu_before else None})
        lines += ["", f"Before/after in this run: mmgate (working tree) vs {before}, medians over the rounds.", "",
                  *R.table(BEFORE_AFTER_COLUMNS, rows)]
    if four := [c for c in cells if c["body"] == "4 MB" and c["proxy_cpu_us_per_req"]]:
        lines += ["", "Proxy CPU per MB (4 MB bodies, 1 / 32 conns): " + ", ".join(
            f"{c['target']} c={c['conns']} {c['proxy_cpu_us_per_req'] / 4 / 1000:.2f} ms" for c in four) + "."]
    if sse:
        lines += [
            "",
            f"## SSE: {settings['sse_streams']} concurrent streams, {settings['sse_tokens']} events per response, one "
            f"every {settings['sse_delay_s'] * 1000:g} ms",
            "",
            *R.table(SSE_COLUMNS, sse),
        ]
    for body, prof in (data.get("profile") or {}).items():
        lines += ["", f"## Where mmgate's time goes (py-spy, {body}, 32 connections)", "",
                  f"py-spy record --rate 200 (blocking mode), Python frames only (C code is charged to the Python "
                  f"function calling it), {prof['samples']} samples over {PROFILE_S} s."
                  + (" Flame graph: `bench/results/passthrough_profile.svg`." if body == "1 KB" else ""),
                  "", *pyspy.tables(prof)]
    return "\n".join(lines) + "\n"
