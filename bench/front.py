"""Front processes (MMGATE_PROCESSES): what 1, 2, 4 (and 8 on a big machine) processes on one port give.

One event loop is a ceiling for what does not decode: SSE events relayed, small requests, text bodies. With
``--processes N`` the supervisor runs N front processes sharing the port and one gate. Per cell (processes),
in each round, a fresh mmgate (``python -m proxy --processes N --decode-workers W``, W the same for every
cell: the largest N, at least the usable cores) in front of ``testkit.text_load``'s raw asyncio upstream
(its own processes, on one port with SO_REUSEPORT; it answers a fixed JSON or streams SSE events), driven by
load-generator processes of their own:

* **SSE events/s**: ``testkit.text_load``'s SSE client (each of --clients processes holds --streams streams,
  events every --sse-delay s, 100 per stream, each stream restarting when it ends), events counted by the
  clients over the window; while it runs, ``testkit.load``'s prober sends ``GET /mmgate/health`` every 10 ms
  (**health p99**);
* **1 KB requests/s** and **4 MB MB/s**: text-only chat bodies (no media marker) from aiohttp clients
  (--conns keep-alive connections over the client processes), answered by the upstream's fixed JSON;
* **cache-hit media requests/s**: one chat request with a 640×480 JPEG, the same bytes every time, the
  processed-media cache on (the default size, split over the fronts): after one miss per front, all hits;
* **CPU per event / per request**: CPU (utime + stime from /proc) of the supervisor, every front and every
  decode worker process, over the window, divided by the events or requests completed; judged at a paced
  load (--paced-streams SSE streams per client, --paced-rate 1 KB requests/s) that one process carries
  unsaturated, since a saturated loop batches more per system call and its CPU per event falls with load;
* **cache hit rate**: ``bench/cache.py``'s chat replay (the one-photo and the new-photo-each-turn
  conversations, 10 turns each, photos tagged per round so nothing is reused), each request on a fresh
  connection (the kernel picks the front: the worst case for per-front caches), hits ÷ (hits + misses)
  from /mmgate/metrics.

Cells take turns in each round; a figure is the median over rounds with its min–max spread, and ratios
(× one process) are taken within a round. The machine is shared: ``L.wait_quiet`` before each cell.

Goals: CPU per SSE event and per 1 KB request with N processes ≤ 1.1 × one process's (each N measured);
cache hit rate with N processes ≥ 0.9 × one process's; with 8 processes on ≥ 16 usable cores, SSE
events/s ≥ 6 × one process's and health p99 ≤ 10 ms (marked "not measured" where the machine has fewer
cores or 8 is not among its processes; ``front_16cores`` measures them there).

    python -m bench run front [--set KNOB=VALUE] [--rounds N] [--quick]
    python -m bench run front_16cores [--set KNOB=VALUE] [--rounds N] [--quick]
    python -m bench list front front_16cores   # the knobs and their defaults

Writes bench/results/front.md and .json.
"""

from __future__ import annotations

import asyncio
import io
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import _results as R
from testkit import load as L
from testkit.media import conversation, tagged, turns
from testkit.procfs import CLK_TCK, cpu_ticks, descendants
from testkit.text_load import ROLE, client_results, start_clients, text_body

WHAT = ("MMGATE_PROCESSES 1/2/4: SSE events/s, 1 KB req/s, 4 MB MB/s, cache-hit media req/s, CPU per "
        "event/request, health p99, cache hit rate on a chat replay")
BIG_CORES, BIG_PROCESSES = 16, 8
GOAL_CPU_RATIO, GOAL_HIT_RATIO, GOAL_SCALE, GOAL_HEALTH_P99_MS = 1.1, 0.9, 6.0, 10.0
SSE_TOKENS = 100


# --- mmgate and its process tree ---------------------------------------------------------------------------


class Window:
    """CPU of mmgate's whole tree over a measured window (pids read at its start: no restarts happen)."""

    def __init__(self, pid: int) -> None:
        self.pids = [pid, *descendants(pid)]
        self.t0 = cpu_ticks(self.pids)

    def cpu_s(self) -> float:
        return (cpu_ticks(self.pids) - self.t0) / CLK_TCK


def measure_sse(url: str, pid: int, args: R.Knobs, streams: int) -> dict[str, Any]:
    argv = [[*ROLE, "sse-client", "--url", url + "/v1/chat/completions", "--streams", str(streams),
             "--warmup", str(args.warmup), "--duration", str(args.seconds), "--period", "0.5"]
            for _ in range(args.clients)]
    clients = start_clients(argv)
    window = Window(pid)
    prober, out = L.start_prober(url, args.seconds, 0.01)
    results = client_results(clients)
    cpu = window.cpu_s()
    probes = L.prober_result(prober, out)
    events = sum(r["tokens"] for r in results)
    seconds = statistics.mean(r["seconds"] for r in results)
    return {"events_per_s": events / seconds, "cpu_us_per_event": cpu / max(events, 1) * 1e6,
            "errors": sum(r["errors"] for r in results),
            "health_p99_ms": L.percentile([v * 1000 for v in probes["latencies"]], 99),
            "health_probes": len(probes["latencies"])}


def measure_http(url: str, pid: int, body: bytes, conns: int, args: R.Knobs,
                 path: str = "/v1/chat/completions", rate: float = 0.0) -> dict[str, Any]:
    with tempfile.NamedTemporaryFile(prefix="front-body-", suffix=".json", delete=False) as f:
        f.write(body)
    per_client = max(1, conns // args.clients)
    argv = [[*ROLE, "http-client", "--url", url + path, "--body-file", f.name, "--conns", str(per_client),
             "--warmup", str(args.warmup), "--seconds", str(args.seconds), "--rate", str(rate / args.clients)]
            for _ in range(args.clients)]
    try:
        clients = start_clients(argv)
        window = Window(pid)
        results = client_results(clients)
        cpu = window.cpu_s()
    finally:
        Path(f.name).unlink(missing_ok=True)
    requests = sum(r["requests"] for r in results)
    seconds = statistics.mean(r["seconds"] for r in results)
    return {"requests_per_s": requests / seconds, "mb_per_s": requests * len(body) / seconds / 1e6,
            "cpu_us_per_request": cpu / max(requests, 1) * 1e6, "errors": sum(r["errors"] for r in results)}


async def chat_replay_hit_rate(url: str, photo: bytes, tag: str, count: int) -> dict[str, float]:
    """``bench/cache.py``'s conversations, each request on a fresh connection; hits ÷ (hits + misses)."""
    import aiohttp

    await _gate_idle(url)
    before = L.parse_prom(await _text(url + "/mmgate/metrics"))
    for name in ("one_photo", "new_photo_each_turn"):
        for body in turns(name, photo, tag, count):
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s, \
                    s.post(url + "/v1/chat/completions", data=body,
                           headers={"Content-Type": "application/json"}) as r:
                answer = await r.read()
                if r.status != 200:
                    raise RuntimeError(f"chat replay got {r.status}: {answer[:300]!r}")
    after = L.parse_prom(await _text(url + "/mmgate/metrics"))

    def delta(name: str) -> float:
        return after.get((name, ()), 0.0) - before.get((name, ()), 0.0)

    hits, misses = delta("mmgate_cache_hits_total"), delta("mmgate_cache_misses_total")
    return {"hits": hits, "misses": misses, "hit_rate": hits / max(hits + misses, 1)}


async def _gate_idle(url: str, within: float = 120.0) -> None:
    """Wait until the previous load's requests have left the gate: the replay measures hits, not a queue
    that clients killed at the end of a window left behind (each waits out its own deadline)."""
    deadline = time.monotonic() + within
    while True:
        gate = (await L.get_json(url, "/mmgate/stats"))["gate"]
        if gate["in_use"] == 0 and gate["waiting"] == 0:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"the gate is not idle {within:.0f} s after the load: {gate}")
        await asyncio.sleep(0.2)


async def _text(url: str) -> str:
    import aiohttp

    async with aiohttp.ClientSession() as s, s.get(url) as r:
        return await r.text()


def small_photo() -> bytes:
    from testkit.media import photo_sized

    out = io.BytesIO()
    photo_sized(640, 480).save(out, "JPEG", quality=85)
    return out.getvalue()


def one_cell(processes: int, upstream: str, args: R.Knobs, round_no: int,
             photo: bytes) -> dict[str, Any]:
    L.wait_quiet(10)
    # --validate full: the media requests are decoded once and then cached (a header-judged image never is)
    flags = ["--processes", str(processes), "--decode-workers", str(args.decode_workers), "--validate", "full",
             "--max-body-mb", "16", "--max-connections", "4096", "--drain-timeout", "5"]
    proc, url = L.start_mmgate(upstream, *flags, "--cache-mb", "256")
    try:
        L.wait_http(url + "/mmgate/stats", proc)
        for _ in range(600):  # every front ready before any window opens
            stats = asyncio.run(L.get_json(url, "/mmgate/stats"))
            if stats.get("processes") == processes:
                break
            time.sleep(0.05)
        cell: dict[str, Any] = {"processes": processes}
        cell["sse"] = measure_sse(url, proc.pid, args, args.streams)
        cell["sse_paced"] = measure_sse(url, proc.pid, args, args.paced_streams)
        cell["text_1k"] = measure_http(url, proc.pid, text_body(1024), args.conns, args)
        cell["text_1k_paced"] = measure_http(url, proc.pid, text_body(1024), args.conns, args, rate=args.paced_rate)
        cell["text_4m"] = measure_http(url, proc.pid, text_body(4 << 20), max(2, args.clients * 2), args)
        media = conversation([tagged(photo, f"hit/{round_no}")])
        cell["media_hit"] = measure_http(url, proc.pid, media, args.conns, args)
        cell["chat_replay"] = asyncio.run(chat_replay_hit_rate(url, photo, f"replay/{round_no}/{processes}",
                                                               args.turns))
        return cell
    finally:
        tail = L.stop(proc, timeout=30)
        if proc.returncode not in (0, None):
            print(tail, file=sys.stderr)


# --- figures -------------------------------------------------------------------------------------------------


def figures(rounds: list[dict[int, dict[str, Any]]], processes: list[int]) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}

    def add(key: str, value: float) -> None:
        out.setdefault(key, []).append(value)

    for cells in rounds:
        one = cells.get(1)
        for n, cell in cells.items():
            add(f"{n}/events_per_s", cell["sse"]["events_per_s"])
            add(f"{n}/cpu_us_per_event", cell["sse_paced"]["cpu_us_per_event"])
            add(f"{n}/cpu_us_per_event_saturated", cell["sse"]["cpu_us_per_event"])
            add(f"{n}/paced_events_per_s", cell["sse_paced"]["events_per_s"])
            add(f"{n}/health_p99_ms", cell["sse"]["health_p99_ms"])
            add(f"{n}/rps_1k", cell["text_1k"]["requests_per_s"])
            add(f"{n}/cpu_us_per_1k", cell["text_1k_paced"]["cpu_us_per_request"])
            add(f"{n}/cpu_us_per_1k_saturated", cell["text_1k"]["cpu_us_per_request"])
            add(f"{n}/paced_rps_1k", cell["text_1k_paced"]["requests_per_s"])
            add(f"{n}/mb_per_s_4m", cell["text_4m"]["mb_per_s"])
            add(f"{n}/cpu_us_per_4m", cell["text_4m"]["cpu_us_per_request"])
            add(f"{n}/rps_media_hit", cell["media_hit"]["requests_per_s"])
            add(f"{n}/cpu_us_per_media_hit", cell["media_hit"]["cpu_us_per_request"])
            add(f"{n}/hit_rate", cell["chat_replay"]["hit_rate"])
            if one is not None and n != 1:
                add(f"{n}/events_ratio", cell["sse"]["events_per_s"] / one["sse"]["events_per_s"])
                add(f"{n}/cpu_event_ratio", cell["sse_paced"]["cpu_us_per_event"]
                    / one["sse_paced"]["cpu_us_per_event"])
                add(f"{n}/cpu_1k_ratio", cell["text_1k_paced"]["cpu_us_per_request"]
                    / one["text_1k_paced"]["cpu_us_per_request"])
                add(f"{n}/rps_1k_ratio", cell["text_1k"]["requests_per_s"] / one["text_1k"]["requests_per_s"])
                add(f"{n}/hit_rate_ratio", cell["chat_replay"]["hit_rate"] / one["chat_replay"]["hit_rate"])
    del processes
    return out


def _figures(data: dict[str, Any]) -> dict[str, list[float]]:
    """Each figure's values over the rounds, from the rounds the result keeps."""
    return figures([{int(k): v for k, v in cells.items()} for cells in data["rounds"]], data["processes"])


def goals(data: dict[str, Any]) -> list[R.Goal]:
    figs, processes, cores = _figures(data), data["processes"], data["machine"]["usable_cores"]
    out: list[R.Goal] = []
    for n in processes:
        if n == 1:
            continue
        out.append(R.goal(f"{n} processes: CPU per SSE event ÷ one process's", figs.get(f"{n}/cpu_event_ratio", []),
                          f"≤ {GOAL_CPU_RATIO}", lambda v: v <= GOAL_CPU_RATIO, "×"))
        out.append(R.goal(f"{n} processes: CPU per 1 KB request ÷ one process's", figs.get(f"{n}/cpu_1k_ratio", []),
                          f"≤ {GOAL_CPU_RATIO}", lambda v: v <= GOAL_CPU_RATIO, "×"))
        out.append(R.goal(f"{n} processes: chat-replay cache hit rate ÷ one process's",
                          figs.get(f"{n}/hit_rate_ratio", []), f"≥ {GOAL_HIT_RATIO}",
                          lambda v: v >= GOAL_HIT_RATIO, "×"))
    big = cores >= BIG_CORES and BIG_PROCESSES in processes and 1 in processes
    out.append(R.goal(f"{BIG_PROCESSES} processes on ≥ {BIG_CORES} cores: SSE events/s ÷ one process's",
                      figs.get(f"{BIG_PROCESSES}/events_ratio", []) if big else [], f"≥ {GOAL_SCALE:g}",
                      lambda v: v >= GOAL_SCALE, "×"))
    out.append(R.goal(f"{BIG_PROCESSES} processes on ≥ {BIG_CORES} cores: health p99 under SSE load",
                      figs.get(f"{BIG_PROCESSES}/health_p99_ms", []) if big else [], f"≤ {GOAL_HEALTH_P99_MS:g}",
                      lambda v: v <= GOAL_HEALTH_P99_MS, "ms"))
    return out


def table(figs: dict[str, list[float]], processes: list[int]) -> str:
    def cell(key: str) -> str:
        return R.spread_cell(figs.get(key, []))

    rows = [
        ("SSE events/s", "events_per_s"), ("× one process", "events_ratio"),
        ("health p99 under SSE, ms", "health_p99_ms"),
        ("CPU µs per event, saturated", "cpu_us_per_event_saturated"),
        ("paced SSE: events/s", "paced_events_per_s"),
        ("paced SSE: CPU µs per event", "cpu_us_per_event"), ("× one process", "cpu_event_ratio"),
        ("1 KB requests/s", "rps_1k"), ("× one process", "rps_1k_ratio"),
        ("CPU µs per 1 KB request, saturated", "cpu_us_per_1k_saturated"),
        ("paced 1 KB: requests/s", "paced_rps_1k"),
        ("paced 1 KB: CPU µs per request", "cpu_us_per_1k"), ("× one process", "cpu_1k_ratio"),
        ("4 MB text MB/s", "mb_per_s_4m"), ("CPU µs per 4 MB request", "cpu_us_per_4m"),
        ("cache-hit media requests/s", "rps_media_hit"), ("CPU µs per cache-hit request", "cpu_us_per_media_hit"),
        ("chat replay hit rate", "hit_rate"), ("× one process", "hit_rate_ratio"),
    ]
    head = "| | " + " | ".join(f"{n} process{'es' if n > 1 else ''}" for n in processes) + " |"
    lines = [head, "|---" * (len(processes) + 1) + "|"]
    for label, key in rows:
        lines.append(f"| {label} | " + " | ".join(cell(f"{n}/{key}") for n in processes) + " |")
    return "\n".join(lines)


def report(data: dict[str, Any]) -> str:
    meta, figs, processes = data["settings"], _figures(data), data["processes"]
    return "\n".join([
        f"{meta['rounds']} rounds × processes {', '.join(map(str, processes))}; windows of {meta['seconds']} s; "
        f"{meta['clients']} load-generator process(es), {meta['streams']} SSE streams each (an event every "
        f"{meta['sse_delay']} s per stream), {meta['conns']} connections for the request loads; decode workers "
        f"{meta['decode_workers']} in every cell; {meta['upstreams']} upstream process(es). Median (min–max) "
        "over rounds; ratios within a round.",
        "",
        "Throughput rows saturate mmgate. CPU per event and per request are judged at a paced load that one "
        f"process carries without saturating ({meta['paced_streams']} streams per client; "
        f"{meta['paced_rate']:g} 1 KB requests/s): a saturated loop batches more events per system call, so "
        "at saturation CPU per event falls as load rises and says more about load than about the process "
        "count (both are shown).",
        "",
        table(figs, processes),
        "",
        f"The {BIG_PROCESSES}-process goals need ≥ {BIG_CORES} usable cores: `python -m bench run front_16cores` "
        "measures them there. On a machine shared with other jobs, throughput figures are "
        "bounded by the load generators and the other jobs as much as by mmgate; CPU per event and per request "
        "are what the goals judge here.",
    ]) + "\n"


def measure(knobs: R.Knobs) -> dict[str, Any]:
    processes = [int(n) for n in knobs.processes.split(",")]
    cores = R.usable_cores()
    args = R.Knobs(**vars(knobs) | {"clients": knobs.clients or max(1, min(8, cores // 2)),
                                    "upstreams": knobs.upstreams or max(1, cores // 8),
                                    "decode_workers": max(max(processes), cores)})
    stamp = R.stamp("front.py", WHAT)
    port = L.free_port()
    upstreams = [subprocess.Popen([*ROLE, "upstream", "--port", str(port), "--sse-tokens", str(SSE_TOKENS),
                                   "--sse-delay", str(args.sse_delay)], cwd=R.REPO) for _ in range(args.upstreams)]
    upstream = f"http://127.0.0.1:{port}"
    try:
        L.wait_http(upstream + "/health", upstreams[0])
        photo = small_photo()
        rounds: list[dict[int, dict[str, Any]]] = []
        for round_no in range(args.rounds):
            cells = {}
            for n in processes:
                cells[n] = one_cell(n, upstream, args, round_no, photo)
                print(f"round {round_no + 1}, {n} process(es): "
                      f"{cells[n]['sse']['events_per_s']:.0f} events/s at {cells[n]['sse']['cpu_us_per_event']:.1f} "
                      f"µs; 1 KB {cells[n]['text_1k']['requests_per_s']:.0f} req/s at "
                      f"{cells[n]['text_1k']['cpu_us_per_request']:.0f} µs; hit rate "
                      f"{cells[n]['chat_replay']['hit_rate']:.3f}", flush=True)
            rounds.append(cells)
    finally:
        for p in upstreams:
            p.terminate()
            p.wait(10)
    meta = {"rounds": args.rounds, "seconds": args.seconds, "clients": args.clients, "streams": args.streams,
            "paced_streams": args.paced_streams, "paced_rate": args.paced_rate, "sse_delay": args.sse_delay,
            "conns": args.conns, "decode_workers": args.decode_workers, "upstreams": args.upstreams}
    return stamp | {"settings": meta, "processes": processes,
                    "figures": {k: R.summary(v) for k, v in figures(rounds, processes).items()},
                    "rounds": [{str(k): v for k, v in c.items()} for c in rounds]}
