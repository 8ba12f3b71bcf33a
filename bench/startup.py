"""Start-up time and RSS of mmgate with and without a model, and of the round's base commit without one.

Each start is ``python -m proxy`` in a fresh process in front of the stub backend (``demo.backend``). The time is
from just before the process is started to the first ``GET /mmgate/health`` that answers 200 with
``draining: false`` (what the app answers once it serves: ``proxy/admin/routes.health``), polled every 5 ms; the RSS
is read from /proc at that moment, of mmgate's own process and of its whole process tree (its decode workers).
With ``MMGATE_MODEL=auto`` readiness never waits on the model (it is looked for in the background), so a found
model's start-up is also timed to the moment ``/mmgate/stats`` shows its family in force, with the RSS then.

Variants, one fresh process each, taking turns within a round (the order turns round by round):

* ``base``: the round's base commit (``--baseline-ref``, ``git archive`` into a temporary folder, run with
  ``PYTHONPATH`` set to it), as installed then: no model;
* ``none``: ``MMGATE_MODEL=none``;
* ``auto-unknown``: ``MMGATE_MODEL=auto`` (the default), the stub serving a model found nowhere (an empty
  Hugging Face cache, ``MMGATE_MODEL_DIRS`` holding another model);
* ``auto-found``: ``auto``, a second stub serving the model folder inside ``MMGATE_MODEL_DIRS``;
* ``explicit``: ``--model`` naming that folder.

Both trees are byte-compiled first (``compileall``), as ``pip install`` leaves an installed package: a start that
compiles mmgate's own modules from source (a source checkout under ``PYTHONDONTWRITEBYTECODE``, as on this
project's machines) measures the compiler, about a second of it on 2 cores, and more for the tree with more code.

The model folder is a real checkpoint's processor configuration (``testkit.models.REAL_CHECKPOINTS``, Idefics3's
by default), built offline. Every variant starts ``--rounds`` times (≥ 5); ratios to ``base`` are round by round.

    python -m bench run startup [--set KNOB=VALUE] [--rounds N] [--quick]
    python -m bench list startup   # the knobs and their defaults

Writes bench/results/startup.md/.json.
"""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import _results as R
from testkit import procfs
from testkit.load import free_port, revision_tree, start_stub, stop
from testkit.models import REAL_CHECKPOINTS

SCRIPT = "startup.py"
WHAT = "seconds from process start to /mmgate/health ready, and RSS then, with and without a model and at the base"
VARIANTS = ("base", "none", "auto-unknown", "auto-found", "explicit")
BASELINE = "ed6881d"  # the round's base commit: "today's" start-up without a model
POLL_S = 0.005
PACKAGES = ("proxy", "preprocessors")  # mmgate's own packages, byte-compiled before the rounds
TIMEOUT_S = 60.0


def get(port: int, path: str) -> tuple[int, Any]:
    """One GET on a fresh connection: (status, JSON body); (0, None) while nothing listens yet."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        body = response.read()
        return response.status, json.loads(body) if body else None
    except (OSError, ValueError, http.client.HTTPException):
        return 0, None
    finally:
        conn.close()


def rss_mb(pid: int) -> tuple[float, float]:
    """(mmgate's own RSS, its process tree's summed RSS) in MB."""
    own = procfs.memory(pid).get("VmRSS", 0) / 2**20
    return own, sum(procfs.memory(p).get("VmRSS", 0) for p in procfs.tree(pid)) / 2**20


def wait_until(proc: subprocess.Popen[bytes], started: float, ok: Any, port: int, path: str) -> float:
    """Poll ``path`` until ``ok(status, body)``; the seconds since ``started``."""
    while time.monotonic() - started < TIMEOUT_S:
        if proc.poll() is not None:
            raise SystemExit(f"mmgate exited with {proc.returncode} before {path} was ready: "
                             f"{Path(proc.log_path).read_text(errors='replace')[-2000:]}")  # type: ignore[attr-defined]
        status, body = get(port, path)
        if ok(status, body):
            return time.monotonic() - started
        time.sleep(POLL_S)
    raise SystemExit(f"{path} not ready within {TIMEOUT_S} s")


def start_once(tree: Path, upstream: str, env: dict[str, str], flags: tuple[str, ...],
               wait_model: bool) -> dict[str, float]:
    """One start of mmgate from ``tree``: seconds to ready (and to the model in force) and RSS then."""
    port = free_port()
    argv = [sys.executable, "-m", "proxy", "--upstream", upstream, "--port", str(port), "--host", "127.0.0.1",
            "--access-log", "off", "--drain-grace", "0", "--drain-timeout", "2", *flags]
    with tempfile.NamedTemporaryFile(prefix="mmgate-startup-", suffix=".log", delete=False) as log:
        started = time.monotonic()
        proc = subprocess.Popen(argv, cwd=tree, env=env, stdout=subprocess.DEVNULL, stderr=log)
    proc.log_path = log.name  # type: ignore[attr-defined]
    try:
        out: dict[str, float] = {"ready_s": wait_until(
            proc, started, lambda s, b: s == 200 and isinstance(b, dict) and b.get("draining") is False,
            port, "/mmgate/health")}
        out["rss_mb"], out["tree_rss_mb"] = rss_mb(proc.pid)
        if wait_model:
            out["model_s"] = wait_until(proc, started, lambda s, b: s == 200 and isinstance(b, dict) and bool(
                (b.get("served_model") or {}).get("family")), port, "/mmgate/stats")
            out["model_rss_mb"], out["model_tree_rss_mb"] = rss_mb(proc.pid)
    finally:
        stop(proc)
    return out


def byte_compiled(tree: Path) -> Path:
    """``tree`` with its packages' bytecode written (``__pycache__``, ignored by git), as an install leaves them."""
    subprocess.run([sys.executable, "-m", "compileall", "-q", "-j", "0",
                    *(str(tree / package) for package in PACKAGES if (tree / package).is_dir())],
                   check=True, stdout=subprocess.DEVNULL)
    return tree


def measure(args: R.Knobs) -> dict[str, Any]:
    if args.checkpoint not in REAL_CHECKPOINTS:
        raise SystemExit(f"no checkpoint {args.checkpoint!r}; of {', '.join(sorted(REAL_CHECKPOINTS))}")
    data: dict[str, Any] = R.stamp(SCRIPT, WHAT)
    data["settings"] = {"rounds": args.rounds, "baseline_ref": args.baseline_ref, "checkpoint": args.checkpoint,
                        "baseline_commit": R.git("rev-parse", args.baseline_ref), "poll_s": POLL_S,
                        "byte_compiled": True}
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("MMGATE_", "HF_", "TRANSFORMERS_"))}
    clean["MMGATE_LOOP"] = "asyncio"  # what pip install mmgate runs on (the test extra's uvloop would be picked)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="mmgate-startup-") as tmp:
        scratch = Path(tmp)
        models = scratch / "models"
        folder = REAL_CHECKPOINTS[args.checkpoint](models / "checkpoint")
        (scratch / "hf").mkdir()
        base = byte_compiled(revision_tree(args.baseline_ref))
        byte_compiled(R.REPO)
        plain, plain_url = start_stub()  # serves "stub-vlm", found nowhere
        serving, serving_url = start_stub("--model", str(folder))  # serves the folder's path, as vLLM's root
        auto = clean | {"HF_HOME": str(scratch / "hf"), "MMGATE_MODEL_DIRS": str(models)}
        plans: dict[str, tuple[Path, str, dict[str, str], tuple[str, ...]]] = {
            "base": (base, plain_url, clean | {"PYTHONPATH": str(base)}, ()),
            "none": (R.REPO, plain_url, clean | {"MMGATE_MODEL": "none"}, ()),
            "auto-unknown": (R.REPO, plain_url, auto, ()),
            "auto-found": (R.REPO, serving_url, auto, ()),
            "explicit": (R.REPO, plain_url, clean, ("--model", str(folder))),
        }
        try:
            for round_ in range(args.rounds):
                order = VARIANTS[round_ % len(VARIANTS):] + VARIANTS[: round_ % len(VARIANTS)]
                for variant in order:
                    tree, upstream, env, flags = plans[variant]
                    row = {"variant": variant, "round": round_,
                           **start_once(tree, upstream, env, flags, wait_model=variant == "auto-found")}
                    rows.append(row)
                    print(f"r={round_} {variant:12} ready {row['ready_s']:.2f} s, RSS {row['rss_mb']:.0f} MB "
                          f"(tree {row['tree_rss_mb']:.0f})" + (f", model in force {row['model_s']:.2f} s, RSS "
                                                                f"{row['model_rss_mb']:.0f} MB" if "model_s" in row
                                                                else ""), flush=True)
        finally:
            stop(plain)
            stop(serving)
            subprocess.run(["rm", "-rf", str(base)], check=False)
    data["rows"] = rows
    return data


def values(data: dict[str, Any], variant: str, key: str) -> dict[int, float]:
    """Round → the figure ``key`` of ``variant``'s start in that round."""
    return {r["round"]: r[key] for r in data["rows"] if r["variant"] == variant and key in r}


def over_base(data: dict[str, Any], variant: str, key: str) -> list[float | None]:
    base, mine = values(data, "base", key), values(data, variant, key)
    return [mine[r] / base[r] if r in mine and base[r] else None for r in base]


def goals(data: dict[str, Any]) -> list[R.Goal]:
    def v(variant: str, key: str) -> list[float]:
        return list(values(data, variant, key).values())

    return [
        R.goal("model found, explicit --model: s to ready", v("explicit", "ready_s"), "≤ 2", lambda x: x <= 2,
               unit="s"),
        R.goal("model found, auto: s to the model in force", v("auto-found", "model_s"), "≤ 2", lambda x: x <= 2,
               unit="s"),
        R.goal("model found, auto: s to ready", v("auto-found", "ready_s"), "≤ 2", lambda x: x <= 2, unit="s"),
        R.goal("no model (none): s to ready ÷ base's", over_base(data, "none", "ready_s"), "≤ 1.10",
               lambda x: x <= 1.10, unit="×"),
        R.goal("no model found (auto): s to ready ÷ base's", over_base(data, "auto-unknown", "ready_s"), "≤ 1.10",
               lambda x: x <= 1.10, unit="×"),
        *(R.goal(f"{variant}: RSS at ready", v(variant, "rss_mb"), unit="MB") for variant in VARIANTS),
        R.goal("auto-found: RSS with the model in force", v("auto-found", "model_rss_mb"), unit="MB"),
        R.goal("explicit: RSS at ready ÷ base's", over_base(data, "explicit", "rss_mb"), unit="×"),
    ]


def report(data: dict[str, Any]) -> str:
    s = data["settings"]
    lines = [
        f"{s['rounds']} rounds; base = `{s['baseline_ref']}` (`{(s.get('baseline_commit') or '')[:10]}`); polled "
        f"every {s['poll_s'] * 1000:.0f} ms" + ("; both trees byte-compiled first" if s.get("byte_compiled") else "")
        + f"; model: {s['checkpoint']}'s own processor configuration. Median (min–max) of the rounds.",
        "",
        "| variant | s to ready | s to the model in force | RSS MB at ready (tree) | RSS MB with the model in force |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]

    def cell(variant: str, key: str) -> str:
        return R.spread_cell(values(data, variant, key).values())

    for variant in VARIANTS:
        lines.append(f"| {variant} | {cell(variant, 'ready_s')} | {cell(variant, 'model_s')} | "
                     f"{cell(variant, 'rss_mb')} ({cell(variant, 'tree_rss_mb')}) | {cell(variant, 'model_rss_mb')} |")
    return "\n".join(lines) + "\n"
