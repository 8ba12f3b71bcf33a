"""The seed and the corpus: one minimal failing input per fault, kept and replayed.

The seed is reproducible per commit (``MMGATE_FUZZ_SEED`` overrides it), so every commit tries new inputs and a
failure reruns as it was. ``tests/fuzz_corpus/*.json`` holds one input per fault signature (format in its
README.md); ``keep_failures`` writes hypothesis' final, minimal example there when ``MMGATE_FUZZ_SAVE=1``, and
``replay_http`` runs a kept input through the property it came from.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import os
import re
import subprocess
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from ..servers import Proxy, Upstream
from .faults import FaultLog, Harness
from .properties import PROPERTIES, Property

REPO = Path(__file__).resolve().parents[2]
CORPUS = REPO / "tests" / "fuzz_corpus"  # beside the test that replays it
SAVE_ENV = "MMGATE_FUZZ_SAVE"
SEED_ENV = "MMGATE_FUZZ_SEED"


def commit() -> str:
    """``git rev-parse HEAD`` of this checkout ("unknown" outside git): recorded in results and corpus files."""
    try:
        done = subprocess.run(["git", "rev-parse", "HEAD"], check=False, cwd=REPO, capture_output=True, text=True,
                              timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return done.stdout.strip() or "unknown"


def ci_seed() -> int | None:
    """The hypothesis seed CI uses: ``MMGATE_FUZZ_SEED`` (an integer, or ``random`` for none), else derived
    from the commit. The same commit always replays the same inputs (a red run reproduces by re-running it);
    every new commit explores new ones. None means hypothesis picks a random seed (and prints it on failure).
    """
    raw = os.environ.get(SEED_ENV, "").strip()
    if raw.lower() == "random":
        return None
    if raw:
        return int(raw)
    head = commit()
    return int(head[:12], 16) if re.fullmatch(r"[0-9a-f]{40}", head) else 0


# the corpus


def signature_of(exc: BaseException) -> str:
    """The ``[signature]`` an AssertionError from ``fail`` starts with; else the exception type."""
    match = re.match(r"\[([^\]]+)\]", str(exc))
    return match.group(1) if match else f"raised:{type(exc).__name__}"


def corpus_files() -> list[Path]:
    return sorted(CORPUS.glob("*.json"))


def corpus_signatures() -> set[tuple[str, str]]:
    """(property, signature) of every kept input: a new find with the same pair is not written twice."""
    found = set()
    for path in corpus_files():
        with contextlib.suppress(ValueError, KeyError, OSError):
            record = json.loads(path.read_text())
            found.add((record["property"], record["signature"]))
    return found


def corpus_text(entry: dict[str, Any]) -> str:
    """One top-level field per line, each value compact (a 1000-level JSON path stays one line)."""
    lines = [f" {json.dumps(key)}: {json.dumps(value, ensure_ascii=False)}" for key, value in entry.items()]
    return "{\n" + ",\n".join(lines) + "\n}\n"


def save_to_corpus(prop: str, record: dict[str, Any], signature: str, note: str, env: dict[str, str], *,
                   by: str = "hypothesis", force: bool = False) -> Path | None:
    """Write one failing input as ``tests/fuzz_corpus/<property>-<hash>.json``, unless an input with the same
    property and signature is already kept (then None; ``force`` keeps it anyway: another way to the same
    symptom)."""
    if not force and (prop, signature) in corpus_signatures():
        return None
    entry = {"property": prop, "signature": signature, "note": note[:2000], "env": env, **record,
             "found": {"commit": commit(), "date": datetime.date.today().isoformat(), "by": by}}
    digest = hashlib.sha1(json.dumps(record, sort_keys=True).encode()).hexdigest()[:10]
    CORPUS.mkdir(exist_ok=True)
    path = CORPUS / f"{prop}-{digest}.json"
    path.write_text(corpus_text(entry))
    return path


def _is_final_example() -> bool:
    """True while hypothesis replays the minimal failing example after shrinking (its last call)."""
    try:
        from hypothesis.control import current_build_context

        return bool(current_build_context().is_final)
    except Exception:
        return True


@dataclass
class Tally:
    """Counts for one property run (the bench prints them): inputs run, distinct failures found."""

    inputs: int = 0
    failures: dict[str, str] = field(default_factory=dict)  # signature -> note of its minimal example
    saved: list[str] = field(default_factory=list)


@contextlib.contextmanager
def keep_failures(prop: str, case: Any, tally: Tally | None = None, *, save: bool | None = None) -> Iterator[None]:
    """Around one example: count it; when it fails during hypothesis' final (minimal) replay, remember it
    and, with ``MMGATE_FUZZ_SAVE=1`` (or ``save=True``), write it to the corpus. Re-raises always."""
    if tally is not None:
        tally.inputs += 1
    try:
        yield
    except Exception as exc:
        if _is_final_example():
            signature = signature_of(exc)
            note = str(exc).split("\n", 1)[0]
            if tally is not None:
                tally.failures.setdefault(signature, note)
            if save if save is not None else os.environ.get(SAVE_ENV) == "1":
                written = save_to_corpus(prop, case.record(), signature, note, PROPERTIES[prop].env)
                if written is not None and tally is not None:
                    tally.saved.append(written.name)
        raise


async def replay_http(prop: Property, case: Any, upstream: Upstream,
                      start: Callable[..., Awaitable[Proxy]]) -> None:
    """Run one HTTP case through a proxy started with the property's env (corpus replay)."""
    proxy = await start(upstream.url, **prop.env)
    faults = FaultLog()
    with faults.installed():
        async with aiohttp.ClientSession() as session:
            await prop.check(Harness(proxy.url, upstream, session, faults), case)
