"""What a liveness prober of mmgate sees while clients send photos (``bench/loop_latency.py``): one case is a fresh
stub backend and mmgate (as shipped, with other flags, or a decode-pool variant of ``testkit.variants``; optionally
pinned apart from everything else), /mmgate/health and a control server probed over one window of
``testkit.probed_load``, and the row of that round; ``aggregate`` pools a case's rounds.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import subprocess
from collections.abc import Iterable
from dataclasses import dataclass
from types import SimpleNamespace

from testkit import load as L
from testkit import procfs
from testkit.probed_load import MediaLoad, Row, TreeUsage, log_problems, loop_lag, probe_all, warm_up

GATE_CPUS, REST_CPUS = {0}, {1}  # pinned: mmgate alone on CPU 0; stub, clients, probers and control on CPU 1
# What a case's row says of the case (its first round's, in the aggregate)
CASE_KEYS = ("name", "label", "loaded", "flags", "env", "variant", "worker_niceness_requested", "thread_niceness",
             "pinned")


@dataclass(frozen=True)
class Case:
    name: str
    label: str
    loaded: bool
    flags: tuple[str, ...] = ()
    variant: str | None = None  # None: mmgate as shipped (workers at niceness 10); else a testkit.variants pool
    pinned: bool = False  # mmgate alone on CPU 0; stub, clients, probers and control on CPU 1


async def run_case(sc: Case, body: bytes, knobs: SimpleNamespace, control: subprocess.Popen[bytes],
                   control_url: str) -> Row:
    """One round of one case: fresh stub and mmgate, the probe window, and its row. ``knobs``: seconds, interval,
    clients, ramp and quiet_wait (``bench/scenarios.py``)."""
    stub = gate = None
    quiet = await asyncio.to_thread(L.wait_quiet, knobs.quiet_wait)
    all_cpus = os.sched_getaffinity(0)
    gate_cpus = rest_cpus = None
    if sc.pinned:
        gate_cpus, rest_cpus = GATE_CPUS, REST_CPUS
        os.sched_setaffinity(0, rest_cpus)  # this thread (the clients' loop), and the probers it starts
        os.sched_setaffinity(control.pid, rest_cpus)
    try:
        stub, stub_url = L.start_stub(cpus=rest_cpus)
        # --validate full: every image is decoded, in the pool or on the loop, which is what the scenarios compare
        gate, url = L.start_mmgate(stub_url, "--validate", "full", *sc.flags, variant=sc.variant, cpus=gate_cpus)
        await warm_up(url, body, 1, 2, sc.name)  # starts the decode threads, warms caches
        nice = {k: sorted(set(v)) for k, v in L.thread_niceness(gate.pid).items()}
        load = MediaLoad(url, body, knobs.clients if sc.loaded else 0)
        if sc.loaded:
            await asyncio.sleep(knobs.ramp)
        before = await L.scrape(url)
        load_before = L.loadavg()
        usage = TreeUsage(gate.pid)
        watch = L.CpuWatch([gate.pid, *procfs.descendants(gate.pid), stub.pid, control.pid, os.getpid()])
        probes = await probe_all({"health": (url, "/mmgate/health", None), "control": (control_url, "/health", None)},
                                 knobs.seconds, knobs.interval)
        window = usage.close()
        probe, ctl = probes["health"], probes["control"]
        machine = watch.stop(extra_cpu_s=probe["cpu_s"] + ctl["cpu_s"])
        after = await L.scrape(url)
        run = await load.stop()
        status = procfs.memory(gate.pid)
    finally:
        log_tail = L.stop(gate)
        L.stop(stub)
        if sc.pinned:
            os.sched_setaffinity(0, all_cpus)
            os.sched_setaffinity(control.pid, all_cpus)

    spent = window.per_media_request(run, cpu_ms_digits=1)
    late = [x for x in probe["lateness"] if x > probe["interval"]]
    return {
        "name": sc.name, "label": sc.label, "loaded": sc.loaded, "flags": list(sc.flags), "env": {},
        "variant": sc.variant, "worker_niceness_requested": 0 if sc.variant == "nice0" else None,
        "thread_niceness": nice, "pinned": sc.pinned,
        "mmgate_threads": sum(len(v) for v in nice.values()),
        "health": L.summarize_ms(probe["latencies"]), "health_statuses": probe["statuses"],
        "control": L.summarize_ms(ctl["latencies"]),
        "probes_sent_late": len(late),
        "skipped_slots": probe["skipped_slots"],
        "probe_elapsed_s": round(probe["elapsed"], 2),
        "lateness_ms": L.summarize_ms(probe["lateness"]),
        "loop_lag": loop_lag(before, after),
        "media_req_per_s": spent["media_req_per_s"],
        "load_statuses": run.statuses() if run else {},
        "load_latency_ms": L.summarize_ms([r.latency for r in run.ok()]) if run else {},
        **{f"mmgate_{key}": spent[key] for key in ("cpu_pct", "cpu_ms_per_media_req", "minor_faults_per_media_req")},
        "mmgate_vmhwm_mib": round(status.get("VmHWM", 0) / 2**20, 1),
        "loadavg_during": [load_before, L.loadavg()],
        "quiet_wait": quiet, "cpu_during_window": machine,
        "mmgate_log_problems": log_problems(log_tail, ("ERROR", "WARNING", "Traceback", "Error"), 20),
        "_latencies": probe["latencies"], "_control": ctl["latencies"],
    }


def progress(row: Row) -> str:
    """A round's row in one line, as it is measured."""
    h, c, m = row["health"], row["control"], row["cpu_during_window"]
    return (f"p50 {h['p50']:7.2f} p99 {h['p99']:7.2f} max {h['max']:8.2f} ms n {h['n']} (control p99 {c['p99']:.2f} "
            f"max {c['max']:.2f})  lag p99<= {row['loop_lag']['p99_le_ms']} ms  {row['media_req_per_s']} req/s  "
            f"mmgate CPU {row['mmgate_cpu_pct']}% ({row['mmgate_cpu_ms_per_media_req']} ms, "
            f"{row['mmgate_minor_faults_per_media_req']} faults /req)  others CPU {m['other_jobs_cpu_pct']}%  "
            f"quiet {row['quiet_wait']}  load {row['load_statuses']}  nice {row['thread_niceness']}"
            + (f"  LOG {row['mmgate_log_problems']}" if row["mmgate_log_problems"] else ""))


def _mean(values: Iterable[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return round(statistics.fmean(vals), 1) if vals else None


def aggregate(runs: list[Row]) -> Row:
    """One case over its rounds: probes pooled (p50/p99/max over all of them), per-round p99 kept."""
    return {key: runs[0][key] for key in CASE_KEYS} | {
        "health": L.summarize_ms([x for r in runs for x in r["_latencies"]]),
        "health_p99_per_round": [r["health"]["p99"] for r in runs],
        "control": L.summarize_ms([x for r in runs for x in r["_control"]]),
        "control_p99_per_round": [r["control"]["p99"] for r in runs],
        "loop_lag_p99_le_ms_per_round": [r["loop_lag"]["p99_le_ms"] for r in runs],
        "loop_lag_max_le_ms": max(r["loop_lag"]["max_le_ms"] for r in runs),
        "media_req_per_s": round(statistics.fmean(r["media_req_per_s"] for r in runs), 2),
        "mmgate_cpu_pct": round(statistics.fmean(r["mmgate_cpu_pct"] for r in runs), 1),
        "mmgate_cpu_ms_per_media_req": _mean(r["mmgate_cpu_ms_per_media_req"] for r in runs),
        "mmgate_minor_faults_per_media_req": _mean(r["mmgate_minor_faults_per_media_req"] for r in runs),
        "other_jobs_cpu_pct_per_round": [r["cpu_during_window"]["other_jobs_cpu_pct"] for r in runs],
        "rounds": [{k: v for k, v in r.items() if not k.startswith("_")} for r in runs],
    }

