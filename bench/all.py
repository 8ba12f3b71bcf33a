"""Run every benchmark that writes a result file, one after another, then regenerate docs/benchmarks.md.

Each entry below is one result file and the command that writes it, as the bench's own ``--help`` describes.
Results are written where each bench writes them (``bench/results/``); ``--quick`` instead runs each bench's own
smoke mode with its output sent to a temporary folder, so a quick run proves the benches work and changes no
result. ``--stale`` runs only the entries whose result is stale: the code it measures changed since it ran
(``bench.report.freshness``, the rule docs/benchmarks.md marks rows by).

    python -m bench.all --list            # every entry, its command, and whether its result is stale
    python -m bench.all --stale           # refresh what is stale, then python -m bench.report
    python -m bench.all --quick           # smoke-run every bench, write nothing
    python -m bench.all --only scale,gil_hold

Entries marked ``vllm`` start the real vLLM of ``tests/e2e`` and need ``bash tests/e2e/setup_vllm.sh`` first;
``--no-vllm`` skips them. Entries marked with a core count measure goals that need that many usable cores; a
smaller machine skips them and keeps their last result. The benches run one at a time: they measure a shared
machine, and two at once would measure each other.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench import _results as R
from bench.report import freshness


@dataclass(frozen=True)
class Entry:
    """One result file and how to write it (``{out}`` in ``quick`` becomes a temporary path)."""

    result: str
    module: str
    args: tuple[str, ...] = ()
    quick: tuple[str, ...] | None = ("--quick",)
    vllm: bool = False
    cores: int = 1  # the usable cores its goals need: a smaller machine skips it, and its result stays as it was
    notes: str = field(default="", compare=False)

    def argv(self, quick: bool, scratch: Path) -> list[str] | None:
        args = self.quick if quick else self.args
        if args is None:
            return None
        return [sys.executable, "-m", self.module,
                *(a.replace("{out}", str(scratch / self.result)) for a in args)]


ENTRIES: tuple[Entry, ...] = (
    Entry("sniff", "bench.sniff", quick=None, notes="always writes its result: no smoke mode"),
    Entry("locate", "bench.locate", quick=None, notes="always writes its result: no smoke mode"),
    Entry("image_pipeline", "bench.image_pipeline"),
    Entry("fidelity", "bench.fidelity", quick=("--quick", "--out", "{out}"), notes="needs the model extra"),
    Entry("gil_hold", "bench.gil_hold", quick=("--smoke",)),
    Entry("fuzz", "bench.fuzz", ("--examples", "3000"), quick=None, notes="always writes its result: no smoke mode"),
    Entry("loop_latency", "bench.loop_latency", quick=("--seconds", "1", "--rounds", "1", "--no-write")),
    Entry("pacing", "bench.pacing", quick=("--quick",)),
    Entry("loop_stall", "bench.loop_stall", quick=("--quick",),
          notes="measures main (git archive) beside this tree"),
    Entry("metrics_flood", "bench.metrics_flood", quick=("--quick",)),
    Entry("scale", "bench.scale", quick=("--seconds", "1", "--rounds", "1", "--out", "{out}"),
          notes="the 14-worker goals need 16 cores: scale_16cores measures them"),
    Entry("scale_16cores", "bench.scale",
          ("--workers", "1,14", "--resize", "on", "--first", "off", "--out", "bench/results/scale_16cores"),
          quick=None, cores=16, notes="the 16-core cells alone: the whole bench there takes about 11 minutes"),
    Entry("cache", "bench.cache", quick=("--small", "--rounds", "1", "--no-write")),
    Entry("front", "bench.front", quick=("--quick", "--out", "{out}"),
          notes="the 8-process goals need 16 cores: front_16cores measures them"),
    Entry("front_16cores", "bench.front", ("--processes", "1,8", "--out", "bench/results/front_16cores"),
          quick=None, cores=16),
    Entry("passthrough", "bench.passthrough", quick=("--quick", "--out", "{out}"),
          notes="needs nginx and wrk (Debian packages)"),
    Entry("gate_sweep", "bench.gate_sweep", quick=("--rounds", "1", "--gates", "off,2", "--no-write")),
    Entry("peak_rss", "bench.gate_sweep", ("--memory-model",),
          quick=("--memory-model", "--rounds", "1", "--no-write")),
    Entry("malloc_arenas", "bench.malloc_arenas", quick=None, notes="no smoke mode"),
    Entry("soak", "bench.soak", ("--variants", "default,untuned,untuned-no-trim"), quick=None,
          notes="no smoke mode"),
    Entry("soak_cost", "bench.soak", ("--requests", "3000", "--checkpoint-every", "1000", "--variants",
                                      "default,untuned", "--out", "soak_cost"), quick=None),
    Entry("soak_long", "bench.soak", ("--requests", "30000", "--variants", "default", "--out", "soak_long"),
          quick=None),
    Entry("video_probe", "bench.video_probe", quick=("--quick", "--out", "{out}")),
    Entry("checkpoints", "bench.checkpoints", quick=("--quick", "--out", "{out}"),
          notes="the model mode with real checkpoints' configurations against the stub, 6 to 10 minutes on 2 cores"),
    Entry("default_limit", "bench.default_limit", quick=("--quick", "--out", "{out}"),
          notes="the default MMGATE_MAX_MM_CONCURRENCY against 2 to 16, about 9 minutes on 2 cores"),
    Entry("startup", "bench.startup", quick=("--quick", "--out", "{out}"),
          notes="measures the base commit (git archive) beside this tree"),
    Entry("fleet", "bench.fleet", quick=("--quick", "--out", "{out}")),
    Entry("fleet_vllm", "bench.fleet_vllm", vllm=True, quick=("--quick", "--out", "{out}")),
    Entry("model_tokens", "bench.model_tokens", ("--vllm",), vllm=True, quick=("--quick", "--out", "{out}")),
    Entry("real_vllm", "bench.real_vllm", vllm=True, quick=("--quick", "--out", "{out}")),
    Entry("real_vllm_tiles", "bench.real_vllm", ("--profile", "tiles"), vllm=True,
          quick=("--profile", "tiles", "--quick", "--out", "{out}")),
    Entry("peer_client", "bench.peer_client", vllm=True,
          quick=("--quick", "--rounds", "1", "--clients", "1", "--out", "{out}"),
          notes="vllm bench serve, the peer client, from the real vLLM's venv"),
)


def is_stale(entry: Entry) -> bool:
    path = R.RESULTS / f"{entry.result}.json"
    return not path.exists() or freshness(json.loads(path.read_text()))[0]


def chosen(args: argparse.Namespace) -> list[Entry]:
    only = {n for n in args.only.split(",") if n}
    skip = {n for n in args.skip.split(",") if n}
    unknown = (only | skip) - {e.result for e in ENTRIES}
    if unknown:
        raise SystemExit(f"unknown result name(s): {', '.join(sorted(unknown))}; see --list")
    picked = [e for e in ENTRIES if (not only or e.result in only) and e.result not in skip]
    if args.no_vllm:
        picked = [e for e in picked if not e.vllm]
    if args.stale:
        picked = [e for e in picked if is_stale(e)]
    return picked


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="each bench's smoke mode; writes no result")
    ap.add_argument("--stale", action="store_true", help="only stale results (the code they measure changed since)")
    ap.add_argument("--only", default="", help="comma-separated result names")
    ap.add_argument("--skip", default="", help="comma-separated result names")
    ap.add_argument("--no-vllm", action="store_true", help="skip the entries that start a real vLLM")
    ap.add_argument("--list", action="store_true", help="print the entries and exit")
    args = ap.parse_args()
    entries = chosen(args)
    if args.list:
        for e in entries:
            cmd = " ".join(["python -m", e.module, *e.args])
            needs = f"  [{e.cores} cores]" if e.cores > 1 else ""
            print(f"{e.result:16} {'stale' if is_stale(e) else 'fresh':5}  {cmd}"
                  f"{'  [vllm]' if e.vllm else ''}{needs}{'  (' + e.notes + ')' if e.notes else ''}")
        return 0
    failed: list[str] = []
    with tempfile.TemporaryDirectory(prefix="bench-all-") as tmp:
        for e in entries:
            argv = e.argv(args.quick, Path(tmp))
            if argv is None:
                print(f"== {e.result}: no smoke mode, skipped", flush=True)
                continue
            if e.cores > R.usable_cores():
                print(f"== {e.result}: needs {e.cores} usable cores, this machine has {R.usable_cores()}: skipped "
                      f"(run `python -m bench.all --only {e.result}` on one that has them)", flush=True)
                continue
            print(f"== {e.result}: {' '.join(argv[1:])}", flush=True)
            t0 = time.monotonic()
            rc = subprocess.run(argv, cwd=R.REPO, check=False).returncode
            print(f"== {e.result}: exit {rc} after {time.monotonic() - t0:.0f} s", flush=True)
            if rc:
                failed.append(e.result)
    if not args.quick:
        subprocess.run([sys.executable, "-m", "bench.report"], cwd=R.REPO, check=False, stdout=subprocess.DEVNULL)
    if failed:
        print(f"failed: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
