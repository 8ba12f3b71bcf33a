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
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from bench import _results as R
from testkit.cold_start import POLL_S, Start, byte_compiled, take_turns
from testkit.load import revision_tree, start_stub, stop
from testkit.models import REAL_CHECKPOINTS

SCRIPT = "startup.py"
WHAT = "seconds from process start to /mmgate/health ready, and RSS then, with and without a model and at the base"
VARIANTS = ("base", "none", "auto-unknown", "auto-found", "explicit")


def measure(args: R.Knobs) -> dict[str, Any]:
    if args.checkpoint not in REAL_CHECKPOINTS:
        raise SystemExit(f"no checkpoint {args.checkpoint!r}; of {', '.join(sorted(REAL_CHECKPOINTS))}")
    data: dict[str, Any] = R.stamp(SCRIPT, WHAT)
    data["settings"] = {"rounds": args.rounds, "baseline_ref": args.baseline_ref, "checkpoint": args.checkpoint,
                        "baseline_commit": R.git("rev-parse", args.baseline_ref), "poll_s": POLL_S,
                        "byte_compiled": True}
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("MMGATE_", "HF_", "TRANSFORMERS_"))}
    clean["MMGATE_LOOP"] = "asyncio"  # what pip install mmgate runs on (the test extra's uvloop would be picked)
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
        starts = {  # in the order of VARIANTS
            "base": Start(base, plain_url, clean | {"PYTHONPATH": str(base)}),
            "none": Start(R.REPO, plain_url, clean | {"MMGATE_MODEL": "none"}),
            "auto-unknown": Start(R.REPO, plain_url, auto),
            "auto-found": Start(R.REPO, serving_url, auto),
            "explicit": Start(R.REPO, plain_url, clean, ("--model", str(folder))),
        }
        try:
            data["rows"] = take_turns(starts, args.rounds, wait_model="auto-found")
        finally:
            stop(plain)
            stop(serving)
            shutil.rmtree(base, ignore_errors=True)
    return data


def values(data: dict[str, Any], variant: str, key: str) -> dict[int, float]:
    """Round → the figure ``key`` of ``variant``'s start in that round."""
    return {r["round"]: r[key] for r in data["rows"] if r["variant"] == variant and key in r}


def over_base(data: dict[str, Any], variant: str, key: str) -> list[float | None]:
    base, mine = values(data, "base", key), values(data, variant, key)
    return [mine[r] / base[r] if r in mine and base[r] else None for r in base]


def goals(data: dict[str, Any]) -> list[R.Goal]:
    def seconds(name: str, variant: str, key: str) -> R.Goal:
        return R.goal(name, list(values(data, variant, key).values()), "≤ 2", lambda x: x <= 2, unit="s")

    def over(name: str, variant: str) -> R.Goal:
        return R.goal(name, over_base(data, variant, "ready_s"), "≤ 1.10", lambda x: x <= 1.10, unit="×")

    def rss(name: str, variant: str, key: str) -> R.Goal:
        return R.goal(name, list(values(data, variant, key).values()), unit="MB")

    return [
        seconds("model found, explicit --model: s to ready", "explicit", "ready_s"),
        seconds("model found, auto: s to the model in force", "auto-found", "model_s"),
        seconds("model found, auto: s to ready", "auto-found", "ready_s"),
        over("no model (none): s to ready ÷ base's", "none"),
        over("no model found (auto): s to ready ÷ base's", "auto-unknown"),
        *(rss(f"{variant}: RSS at ready", variant, "rss_mb") for variant in VARIANTS),
        rss("auto-found: RSS with the model in force", "auto-found", "model_rss_mb"),
        R.goal("explicit: RSS at ready ÷ base's", over_base(data, "explicit", "rss_mb"), unit="×"),
    ]


def report(data: dict[str, Any]) -> str:
    s = data["settings"]

    def cell(variant: str, key: str) -> str:
        return R.spread_cell(values(data, variant, key).values())

    return "\n".join([
        f"{s['rounds']} rounds; base = `{s['baseline_ref']}` (`{(s.get('baseline_commit') or '')[:10]}`); polled "
        f"every {s['poll_s'] * 1000:.0f} ms" + ("; both trees byte-compiled first" if s.get("byte_compiled") else "")
        + f"; model: {s['checkpoint']}'s own processor configuration. Median (min–max) of the rounds.",
        "",
        "| variant | s to ready | s to the model in force | RSS MB at ready (tree) | RSS MB with the model in force |",
        "| --- | ---: | ---: | ---: | ---: |",
        *(f"| {variant} | {cell(variant, 'ready_s')} | {cell(variant, 'model_s')} | {cell(variant, 'rss_mb')} "
          f"({cell(variant, 'tree_rss_mb')}) | {cell(variant, 'model_rss_mb')} |" for variant in VARIANTS),
    ]) + "\n"
