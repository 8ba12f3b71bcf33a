"""Soak: many mixed multimodal requests through mmgate; does its idle memory creep, do its gauges leak?

``clients`` coroutines send a reproducible mix back to back (``MIX``: small and ~1 MP images passed untouched,
4-12 MP ones resized to 1 MP, invalid media, client disconnects 0-150 ms after the whole request; half streamed;
OpenAI and Anthropic) to a stub backend streaming 16 tokens 2 ms apart. RSS under load measures which big images
happen to be in flight, so the leak test is at idle checkpoints: every ``checkpoint_every`` requests the clients
wait at a barrier until mmgate is idle and has trimmed (or, trim off, for ``settle`` s), then VmRSS and the
gauges are read. Goals: after warm-up (``warmup`` of the requests) the idle RSS stays within 10 % of the first
checkpoint after it (``default`` variant; the others are reported), and the ``MUST_BE_ZERO`` gauges are 0 at
every checkpoint. Also reported: RSS under load, counts by status, load averages (the machine may be shared) and
a chart. Each of ``variants`` runs its own mmgate process; ``append`` keeps the other variants' runs written.
"""

from __future__ import annotations

import json
from typing import Any

from bench import _results as R
from testkit import allocators as A
from testkit import memory_plots
from testkit.idle_checkpoints import GAUGES, MUST_BE_ZERO, idle_rss_at, soak_run, tenth_rss
from testkit.load import RESULTS, start_stub, stop, uptime
from testkit.mix import MIX, media_set

# mmgate tunes the allocators itself (MMGATE_MALLOC_TUNING, on by default) and trims after 1 s idle
# (MMGATE_TRIM_IDLE). Every other variant turns the tuning off first, so each one shows exactly its own
# environment's effect.
VARIANTS: dict[str, dict[str, str]] = {
    "default": {},
    "untuned": A.UNTUNED,
    "untuned-no-trim": A.UNTUNED | {"MMGATE_TRIM_IDLE": "0"},  # mmgate without its allocator remedies
    **A.SETTINGS,  # jemalloc: skipped where it is not installed
}
TOLERANCE_PCT = 10.0
MAX_SAMPLES_STORED = 1500  # per run, to keep the JSON small


def table(titles: list[str], rows: list[list[Any]], text: tuple[str, ...] = ("variant",)) -> list[str]:
    """``R.table`` of ready-made cells: the ``text`` columns left-aligned, the figures right."""
    return R.table([(title, title, "s" if title in text else "") for title in titles],
                   [dict(zip(titles, row, strict=True)) for row in rows], spaced=True)


def run_table(runs: list[dict[str, Any]], columns: dict[str, str], text: tuple[str, ...] = ("variant",)) -> list[str]:
    """One row per run, the cells filled in from its figures (``figures``) by each column's template."""
    return table(["variant", *columns], [[r["variant"], *(template.format_map(figures(r))
                                                          for template in columns.values())] for r in runs], text)


def figures(run: dict[str, Any]) -> dict[str, Any]:
    """A run's figures in one dict (its criterion's and under-load's too), with the cells made of several."""
    highest = {g: max(c["gauges"][g] for c in run["checkpoints"]) for g in GAUGES}
    leaks = ", ".join(f"{k}={v:g}" for k, v in run["gauges_not_zero_at_some_checkpoint"].items()) or "none"
    return run | run["criterion"] | run["under_load"] | highest | {
        "env_md": A.env_text(run["env"]), "trim_md": "on" if run["trim"] else "off", "leaks": leaks,
        "goal_md": {True: "met", False: "**not met**", None: "-"}[run["criterion"]["met"]]}


def run_lines(run: dict[str, Any]) -> list[str]:
    """RSS at the pause, when idle and after the trim at each checkpoint; waits, trims and load averages."""
    cps = run["checkpoints"]
    trims = f", trim seen at {sum(1 for c in cps if c['trim_seen'])}/{len(cps)} checkpoints" if run["trim"] else ""
    return [f"- **{run['variant']}**: " + "; ".join(
        f"{c['requests_done']}: {c['rss_at_pause_mib']:.0f} → {c['rss_when_idle_mib']:.0f} → {c['rss_idle_mib']:.0f}"
        + ("" if c["trim_seen"] in (True, None) else " (no trim seen)") + ("" if c["idle_reached"] else " (NOT idle)")
        for c in cps),
        f"  idle after {min(c['idle_wait_s'] for c in cps)}..{max(c['idle_wait_s'] for c in cps)} s; trims total "
        f"{cps[-1]['trims_total']:g}{trims}; load avg 1-min " + ", ".join(f"{c['loadavg'][0]:g}" for c in cps)]


def report(data: dict[str, Any]) -> str:
    runs, args = data["runs"], data["args"]
    name = args.get("name") or args.get("out", "soak")  # older results recorded ``out``
    every = runs[0]["checkpoint_every"] if runs else "?"
    done = sorted({c["requests_done"] for r in runs for c in r["checkpoints"]})
    lines = [
        *(["With `append`: earlier variants' rows kept from the previous JSON.", ""] if args["append"] else []),
        "Requests per run: " + ", ".join(f"{r['variant']} {r['requests']}" for r in runs) + f"; {args['clients']} "
        "clients; mmgate `--resize-max-pixels 1000000`, otherwise its defaults (4 media slots, decode workers = "
        "usable CPUs, `MMGATE_TRIM_IDLE=1` unless the variant says otherwise); stub backend (2 workers) streaming 16 "
        "tokens 2 ms apart; 2 cores shared with other benchmarks (load averages below).", "",
        "Planned mix (request kinds): " + ", ".join(f"{k} {v:g}" for k, v in data["mix_weights"].items()) + ". "
        "Half stream (SSE); 80 % OpenAI chat, 20 % Anthropic messages; disconnects close a raw socket 0-150 ms after "
        "sending the whole request.", "",
        "## Criterion: idle RSS at checkpoints", "",
        "RSS under load swings by tens of MiB with the big images being decoded at that moment (docs/tuning.md bounds "
        f"it); a leak is what remains when nothing is in flight. So every {every} requests the clients wait until "
        "mmgate is idle (`gate_in_use`, `gate_waiting`, `media_bytes_live`, `media_buffers_live` all 0) and has "
        f"trimmed (at most {args['trim_timeout']:g} s) or, trim off, for {args['settle']:g} s; then VmRSS and the "
        "gauges are read.", "",
        f"**Goal**: the idle RSS at every checkpoint after warm-up stays within {TOLERANCE_PCT:g} % of the first "
        f"checkpoint after warm-up (at {args['warmup']:.0%} of the requests).", "",
        *run_table(runs, {"env": "{env_md}", "trim": "{trim_md}", "req/s (sending)": "{req_per_s}",
                          "reference (MiB)": "{reference_rss_mib} @ {reference_requests}",
                          "idle RSS min..max after warm-up": "{idle_rss_min_mib}..{idle_rss_max_mib}",
                          "max deviation": "{max_deviation_pct:+} %", "largest increase": "{max_increase_pct:+} %",
                          "goal": "{goal_md}"}, text=("variant", "env", "trim", "goal")),
        "", "Idle RSS (MiB) per checkpoint, deviation from the reference in brackets:", "",
        *table(["requests done", *(r["variant"] for r in runs)],
               [[d, *(idle_rss_at(r, d) for r in runs)] for d in done], text=()),
        "", "Per checkpoint: RSS when the clients stopped, when mmgate was idle, and after the trim (or the settle "
        "time); seconds until idle; trims so far; 1-min load average.", "",
        *(line for r in runs for line in run_lines(r)),
        "", "## Gauges at every checkpoint", "",
        f"Must be 0 when idle: {', '.join(MUST_BE_ZERO)}. Max seen at any checkpoint:", "",
        *run_table(runs, {g.removeprefix("mmgate_"): f"{{{g}:g}}" for g in GAUGES} | {"leak?": "{leaks}"},
                   text=("variant", "leak?")),
        "", "## RSS under load (not the leak criterion)", "",
        "Samples every 0.5 s while the clients were sending (checkpoint pauses excluded), bounded by what is in flight "
        "(docs/tuning.md). Warm-up sample = first sample once 10 % of the requests are done; drift = (max - warm-up) "
        "/ warm-up; slope = least-squares fit after warm-up.", "",
        *run_table(runs, {"start": "{rss_start_mib}", "warm-up sample": "{rss_warm_mib}",
                          "median after warm-up": "{rss_median_after_warm_mib}",
                          "max after warm-up": "{rss_max_after_warm_mib}", "peak (VmHWM)": "{rss_peak_mib}",
                          "drift of max": "{drift_max_pct:+} %", "slope MiB/1k req": "{slope_mib_per_1000_requests}"}),
        "", "Windows: samples while requests 10-20 % finished (early) vs during the last 10 % (late).", "",
        *run_table(runs, {"early median": "{window_median_early_mib}", "late median": "{window_median_late_mib}",
                          "drift of medians": "{drift_window_median_pct:+} %", "early max": "{window_max_early_mib}",
                          "late max": "{window_max_late_mib}", "drift of maxima": "{drift_window_max_pct:+} %"}),
        "", "Per tenth of the run (samples under load): median / max RSS in MiB; a leak climbs steadily.", "",
        *table(["variant", *(f"{10 * q}-{10 * q + 10} %" for q in range(10))],
               [[r["variant"], *(tenth_rss(r, q) for q in range(10))] for r in runs]),
        "", "## Counts by status", "",
        "Client side (`disconnect` = we hung up; `disconnect_too_late` = the answer ended before we did) and proxy "
        "side (`mmgate_requests` by status; 499 = client went away).", "",
        *(line for r in runs for line in (
            f"- **{r['variant']}** client: " + ", ".join(f"{k}: {v}" for k, v in r["client_statuses"].items()),
            "  proxy: " + ", ".join(f"{k}: {v:.0f}" for k, v in r["proxy_statuses"].items()))),
        "", "## Load", "",
        *(f"- {r['variant']} ({r['sending_s']} s sending, {r['wall_s']} s with pauses): before `{r['uptime_before']}`; "
          f"after `{r['uptime_after']}`" for r in runs),
        "", f"Plot: `bench/results/{name}.png` (left: RSS vs requests; right: RSS vs time).", ""]
    return "\n".join(lines)


def goals(data: dict[str, Any]) -> list[R.Goal]:
    """Per variant, over its idle checkpoints after warm-up: the RSS deviation from the first (``default``, mmgate's
    own tuning, must stay within ±10 % at every one; the others are reported); the idle gauges, every variant."""
    runs = data["runs"]
    out = []
    for r in runs:
        deviations = list((r["criterion"].get("deviations_pct") or {}).values())
        target = f"within ±{TOLERANCE_PCT:g}" if r["variant"] == "default" else None
        out.append(R.goal(f"{r['variant']}: idle RSS vs first warm checkpoint", deviations, target,
                          (lambda v: abs(v) <= TOLERANCE_PCT) if target else None, unit="%", over="checkpoints",
                          met_on="every"))
    leaks = [sum(1 for g in MUST_BE_ZERO if cp["gauges"].get(g, 0)) for r in runs for cp in r["checkpoints"]]
    out.append(R.goal("idle gauges not 0 (all variants)", leaks, "= 0", lambda v: v == 0, over="checkpoints",
                      met_on="every"))
    return out


def measure(knobs: R.Knobs) -> dict[str, Any]:
    stamp = R.stamp("soak.py", f"{knobs.requests:,} mixed media requests (invalid ones and disconnects included), "
                               "idle RSS and gauges at checkpoints")
    media = media_set()
    stub, stub_url = start_stub("--workers", "2", "--tokens", "16", "--token-delay", "0.002")
    json_path = RESULTS / f"{knobs.name}.json"
    # With ``append``, the other variants' runs are kept from the result already written.
    kept = json.loads(json_path.read_text())["runs"] if knobs.append and json_path.exists() else []
    data = stamp | {"args": vars(knobs), "mix_weights": dict(MIX), "runs": kept}
    try:
        for name in knobs.variants.split(","):
            if lib := A.missing(VARIANTS[name]):
                print(f"skip {name}: {lib} missing")
                continue
            print(f"[{name}] {knobs.requests} requests, {knobs.clients} clients ... {uptime()}", flush=True)
            r = soak_run(stub_url, name, VARIANTS[name], knobs, media, TOLERANCE_PCT)
            r["samples"] = R.downsample(r["samples"], column=2, points=MAX_SAMPLES_STORED)  # keeps each bucket's peak
            print(f"[{name}] {r['sending_s']} s sending, {r['req_per_s']} req/s, {r['client_statuses']}", flush=True)
            data["runs"] = [run for run in data["runs"] if run["variant"] != name] + [r]
            if not knobs.quick:  # written after every variant: a later crash or time-out keeps the finished runs
                R.write(knobs.name, data | {"goals": goals(data)}, report(data))
    finally:
        stop(stub)
    if not knobs.quick:
        memory_plots.soak(data["runs"], TOLERANCE_PCT, RESULTS / f"{knobs.name}.png")
    return data
