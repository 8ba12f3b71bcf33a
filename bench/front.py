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

from typing import Any

from bench import _results as R
from testkit import load as L
from testkit.front_load import Loads, front_cell, small_photo
from testkit.text_load import start_role

WHAT = ("MMGATE_PROCESSES 1/2/4: SSE events/s, 1 KB req/s, 4 MB MB/s, cache-hit media req/s, CPU per "
        "event/request, health p99, cache hit rate on a chat replay")
BIG_CORES, BIG_PROCESSES = 16, 8
GOAL_CPU_RATIO, GOAL_HIT_RATIO, GOAL_SCALE, GOAL_HEALTH_P99_MS = 1.1, 0.9, 6.0, 10.0
SSE_TOKENS = 100
# Each figure of a cell: (the load, its field). CPU per event and per request are judged at the paced loads.
CELL_FIGURES = {
    "events_per_s": ("sse", "events_per_s"), "cpu_us_per_event": ("sse_paced", "cpu_us_per_event"),
    "cpu_us_per_event_saturated": ("sse", "cpu_us_per_event"), "paced_events_per_s": ("sse_paced", "events_per_s"),
    "health_p99_ms": ("sse", "health_p99_ms"), "rps_1k": ("text_1k", "requests_per_s"),
    "cpu_us_per_1k": ("text_1k_paced", "cpu_us_per_request"),
    "cpu_us_per_1k_saturated": ("text_1k", "cpu_us_per_request"),
    "paced_rps_1k": ("text_1k_paced", "requests_per_s"), "mb_per_s_4m": ("text_4m", "mb_per_s"),
    "cpu_us_per_4m": ("text_4m", "cpu_us_per_request"), "rps_media_hit": ("media_hit", "requests_per_s"),
    "cpu_us_per_media_hit": ("media_hit", "cpu_us_per_request"), "hit_rate": ("chat_replay", "hit_rate"),
}
# N processes' figure over one process's in the same round
RATIOS = {"events_ratio": ("sse", "events_per_s"), "cpu_event_ratio": ("sse_paced", "cpu_us_per_event"),
          "cpu_1k_ratio": ("text_1k_paced", "cpu_us_per_request"), "rps_1k_ratio": ("text_1k", "requests_per_s"),
          "hit_rate_ratio": ("chat_replay", "hit_rate")}
TABLE_ROWS = (
    ("SSE events/s", "events_per_s"), ("× one process", "events_ratio"),
    ("health p99 under SSE, ms", "health_p99_ms"), ("CPU µs per event, saturated", "cpu_us_per_event_saturated"),
    ("paced SSE: events/s", "paced_events_per_s"),
    ("paced SSE: CPU µs per event", "cpu_us_per_event"), ("× one process", "cpu_event_ratio"),
    ("1 KB requests/s", "rps_1k"), ("× one process", "rps_1k_ratio"),
    ("CPU µs per 1 KB request, saturated", "cpu_us_per_1k_saturated"), ("paced 1 KB: requests/s", "paced_rps_1k"),
    ("paced 1 KB: CPU µs per request", "cpu_us_per_1k"), ("× one process", "cpu_1k_ratio"),
    ("4 MB text MB/s", "mb_per_s_4m"), ("CPU µs per 4 MB request", "cpu_us_per_4m"),
    ("cache-hit media requests/s", "rps_media_hit"), ("CPU µs per cache-hit request", "cpu_us_per_media_hit"),
    ("chat replay hit rate", "hit_rate"), ("× one process", "hit_rate_ratio"),
)


def figures(rounds: list[dict[int, dict[str, Any]]]) -> dict[str, list[float]]:
    """Each figure's values over the rounds, keyed ``N/figure``."""
    out: dict[str, list[float]] = {}
    for cells in rounds:
        one = cells.get(1)
        for n, cell in cells.items():
            for key, (load, field) in CELL_FIGURES.items():
                out.setdefault(f"{n}/{key}", []).append(cell[load][field])
            if one is not None and n != 1:
                for key, (load, field) in RATIOS.items():
                    out.setdefault(f"{n}/{key}", []).append(cell[load][field] / one[load][field])
    return out


def _figures(data: dict[str, Any]) -> dict[str, list[float]]:
    """Each figure's values over the rounds, from the rounds the result keeps."""
    return figures([{int(k): v for k, v in cells.items()} for cells in data["rounds"]])


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
        "| | " + " | ".join(f"{n} process{'es' if n > 1 else ''}" for n in processes) + " |",
        "|---" * (len(processes) + 1) + "|",
        *(f"| {label} | " + " | ".join(R.spread_cell(figs.get(f"{n}/{key}", [])) for n in processes) + " |"
          for label, key in TABLE_ROWS),
        "",
        f"The {BIG_PROCESSES}-process goals need ≥ {BIG_CORES} usable cores: `python -m bench run front_16cores` "
        "measures them there. On a machine shared with other jobs, throughput figures are "
        "bounded by the load generators and the other jobs as much as by mmgate; CPU per event and per request "
        "are what the goals judge here.",
    ]) + "\n"


def measure(knobs: R.Knobs) -> dict[str, Any]:
    processes = [int(n) for n in knobs.processes.split(",")]
    cores = R.usable_cores()
    upstreams = knobs.upstreams or max(1, cores // 8)
    loads = Loads(clients=knobs.clients or max(1, min(8, cores // 2)), warmup=knobs.warmup, seconds=knobs.seconds,
                  streams=knobs.streams, paced_streams=knobs.paced_streams, conns=knobs.conns,
                  paced_rate=knobs.paced_rate, turns=knobs.turns, decode_workers=max(max(processes), cores))
    stamp = R.stamp("front.py", WHAT)
    port = L.free_port()  # the upstream processes share it (SO_REUSEPORT)
    servers = [start_role("upstream", "--sse-tokens", str(SSE_TOKENS), "--sse-delay", str(knobs.sse_delay),
                          port=port)[0] for _ in range(upstreams)]
    try:
        photo = small_photo()
        rounds: list[dict[int, dict[str, Any]]] = []
        for round_no in range(knobs.rounds):
            cells = {}
            for n in processes:
                cells[n] = cell = front_cell(n, f"http://127.0.0.1:{port}", loads, round_no, photo)
                print(f"round {round_no + 1}, {n} process(es): "
                      f"{cell['sse']['events_per_s']:.0f} events/s at {cell['sse']['cpu_us_per_event']:.1f} "
                      f"µs; 1 KB {cell['text_1k']['requests_per_s']:.0f} req/s at "
                      f"{cell['text_1k']['cpu_us_per_request']:.0f} µs; hit rate "
                      f"{cell['chat_replay']['hit_rate']:.3f}", flush=True)
            rounds.append(cells)
    finally:
        for server in servers:
            L.stop(server)
    meta = {"rounds": knobs.rounds, "seconds": knobs.seconds, "clients": loads.clients, "streams": knobs.streams,
            "paced_streams": knobs.paced_streams, "paced_rate": knobs.paced_rate, "sse_delay": knobs.sse_delay,
            "conns": knobs.conns, "decode_workers": loads.decode_workers, "upstreams": upstreams}
    return stamp | {"settings": meta, "processes": processes,
                    "figures": {k: R.summary(v) for k, v in figures(rounds).items()},
                    "rounds": [{str(k): v for k, v in c.items()} for c in rounds]}
