"""The cells of ``bench/peer_client.py``: a peer's client (``testkit.vllm.BenchClient``) against a backend,
directly or through a fresh mmgate in one of its modes, with the CPU the backend and mmgate spent per request.

- ``backend``: the backends, started for a run: the stub (``STUB_PROFILES``), vLLM loading the tiny Idefics3 from
  its folder, or by a Hub id from a Hugging Face cache laid out as huggingface_hub does (``vllm-hf``). Where the
  model mode finds the model: vLLM's ``root`` is the folder it loaded, so ``MMGATE_MODEL_DIRS`` names the folder
  holding it; ``vllm-hf``'s ``root`` is the Hub id, found through ``HF_HOME``; the stub lists only its served name
  (no ``root``), found as a folder of that name (a copy of the tiny Idefics3's) in ``MMGATE_MODEL_DIRS``;
- ``mmgate_flags`` and ``check_model``: each mode's mmgate, and the check that what it has in force is what the
  mode measures (in ``model``, the tiny Idefics3 found by auto discovery in the expected folder; else no model),
  which stops the bench rather than pass the generic rule off as the model mode;
- ``warm_up``: the requests a model cell sends before its client starts, outside the figures (a model found by
  auto is not warmed into the decode pool as one named at start-up is);
- ``run_cell``: one cell.
"""

from __future__ import annotations

import base64
import io
import json
import os
import shutil
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from testkit import procfs
from testkit import vllm as h
from testkit.bench_serve import SINGLE_TILE, with_target
from testkit.load import start_stub, stop
from testkit.models import hub_snapshot

MODES = ("direct", "defaults", "full", "model")
HUB_MODES = ("direct", "model")  # vllm-hf: the discovery through the Hugging Face cache, against direct
HUB_IMAGES = ("camera",)
HUB_ID = "mmgate-bench/tiny-idefics3"
MODEL_FAMILY = "idefics3"  # the tiny model's family: what the model cells must find
DISCOVERY_TIMEOUT = 120.0  # s: mmgate asks the upstream in the background, after it answers its health check
# Each worker's first image at the model's size pays its one-time cost in the warm-up (about 1.2 s of CPU on 2
# cores): two waves of one request per usable CPU (the pool's default size).
WARM_UP_WAVES = 2
OUTPUT_TOKENS = 8
# Backend name -> the stub's profile (demo/backend.py's PROFILES).
STUB_PROFILES = {"stub": "plain", "stub-frontend": "frontend"}
BACKENDS = (*STUB_PROFILES, "vllm", "vllm-hf")


def tree_jiffies(pid: int | None) -> int:
    """CPU clock ticks of ``pid`` and the processes below it so far (0 without a process)."""
    return 0 if pid is None else procfs.cpu_ticks(procfs.tree(pid))


@dataclass(frozen=True)
class Backend:
    """A started backend: where it answers, its process, and where the model mode must find its model."""

    url: str
    pid: int
    model_dirs: tuple[str, ...]  # MMGATE_MODEL_DIRS of the model mode (none: the Hugging Face cache)
    model_folder: Path  # the folder mmgate must report it found, resolved


@contextmanager
def backend(name: str, scratch: Path) -> Iterator[Backend]:
    """The backend, started for this run and stopped after it."""
    model = h.DEFAULT_DIR / "tiny-idefics3"
    if name in STUB_PROFILES:
        # The stub lists its served name only: auto looks for a folder of that name in MMGATE_MODEL_DIRS.
        models = scratch / "stub-models"
        if not (models / h.SERVED_MODEL).exists():
            shutil.copytree(model, models / h.SERVED_MODEL)
        proc, url = start_stub("--tokens", str(OUTPUT_TOKENS), "--model", h.SERVED_MODEL, "--profile",
                               STUB_PROFILES[name])
        try:
            yield Backend(url, proc.pid, (str(models),), (models / h.SERVED_MODEL).resolve())
        finally:
            stop(proc)
        return
    if name == "vllm":
        server = h.start_vllm(extra_args=SINGLE_TILE)
        try:
            assert server.pid is not None
            yield Backend(server.url, server.pid, (str(model.parent),), model.resolve())
        finally:
            server.stop()
        return
    home = scratch / "hf-home"
    snapshot = hub_snapshot(home / "hub", HUB_ID, model)
    with h.hf_home(home):
        # start_vllm names the folder with --model; a second --model replaces it (argparse keeps the last), so
        # vLLM loads the Hub id from the cache and its /v1/models root is that id, not a path.
        server = h.start_vllm(extra_args=(*SINGLE_TILE, "--model", HUB_ID))
        try:
            assert server.pid is not None
            yield Backend(server.url, server.pid, (), snapshot.resolve())
        finally:
            server.stop()


def modes_of(backend_name: str) -> tuple[str, ...]:
    return HUB_MODES if backend_name == "vllm-hf" else MODES


def mmgate_flags(mode: str, served: Backend) -> tuple[str, ...]:
    if mode == "full":
        return ("--validate", "full")
    if mode == "model":
        dirs = ("--model-dirs", ",".join(served.model_dirs)) if served.model_dirs else ()
        return (*dirs, "--cache-mb", "0")
    return ()


def served_model(gate: h.Server) -> dict[str, Any]:
    """What mmgate's /mmgate/stats says is in force: its ``served_model``."""
    status, body = h.http_get(gate.url + "/mmgate/stats")
    if status != 200:
        raise SystemExit(f"mmgate's /mmgate/stats answered {status}; its log: {gate.log}")
    found: dict[str, Any] = json.loads(body)["served_model"]
    return found


def check_model(gate: h.Server, mode: str, served: Backend, wait: bool) -> dict[str, Any]:
    """What mmgate has in force, stopping the bench unless it is what ``mode`` measures: in ``model`` the tiny
    Idefics3 found by auto in the backend's folder (``wait``: until the background lookup has found it), in any
    other mode no model at all."""
    deadline = time.monotonic() + DISCOVERY_TIMEOUT
    found = served_model(gate)
    while wait and found["family"] is None and time.monotonic() < deadline:
        time.sleep(0.2)  # polling mmgate's stats as a readiness probe polls
        found = served_model(gate)
    if mode == "model":
        if found["mode"] != "auto" or found["family"] != MODEL_FAMILY or found["folder"] != str(served.model_folder):
            raise SystemExit(f"the model mode is not in force as measured (MMGATE_MODEL=auto, {MODEL_FAMILY} from "
                             f"{served.model_folder}): /mmgate/stats says {found}; mmgate's log: {gate.log}")
    elif found["family"] is not None:
        raise SystemExit(f"mode {mode} measures mmgate without a model, but /mmgate/stats says {found}")
    return found


def warm_up_body() -> bytes:
    """A chat request of one 12 MP JPEG, which the model mode resizes to the model's size."""
    buf = io.BytesIO()
    h.photo_like(4000, 3000, seed=7).save(buf, "JPEG", quality=90)
    uri = "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode()
    return json.dumps({"model": h.SERVED_MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "Describe this image."}, {"type": "image_url", "image_url": {"url": uri}}]}]}).encode()


def warm_up(gate: h.Server, body: bytes) -> dict[str, Any]:
    """``WARM_UP_WAVES`` waves of one request per usable CPU through ``gate``; their wall time and mmgate's CPU."""
    workers = len(os.sched_getaffinity(0))
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback only

    def send(_: int) -> int:
        request = urllib.request.Request(gate.url + "/v1/chat/completions", body,
                                         {"Content-Type": "application/json"})
        with opener.open(request, timeout=300) as answer:
            answer.read()
            return int(answer.status)

    before, started = tree_jiffies(gate.pid), time.monotonic()
    with ThreadPoolExecutor(workers) as pool:
        for _ in range(WARM_UP_WAVES):
            statuses = list(pool.map(send, range(workers)))
            if statuses != [200] * workers:
                raise SystemExit(f"mmgate's warm-up requests answered {statuses}; its log: {gate.log}")
    return {"requests": WARM_UP_WAVES * workers, "s": time.monotonic() - started,
            "mmgate_cpu_ms": (tree_jiffies(gate.pid) - before) / procfs.CLK_TCK * 1000}


def run_cell(client: h.BenchClient, served: Backend, mode: str, argv: list[str], scratch: Path, requests: int,
             warm_body: bytes, label: str) -> dict[str, Any]:
    """One cell: ``argv`` (``testkit.bench_serve.client_argv``) run by ``client`` against ``served``, directly or
    through a fresh mmgate in ``mode``; the client's result, with the CPU ms per completed request of the backend
    and of mmgate, the model mmgate had in force and the model cell's warm-up. Its figures are printed after
    ``label``."""
    gate = h.start_mmgate(served.url, *mmgate_flags(mode, served), log_dir=scratch) if mode != "direct" else None
    warmed: dict[str, Any] | None = None
    try:
        if gate is not None and mode == "model":
            check_model(gate, mode, served, wait=True)
            warmed = warm_up(gate, warm_body)
        before = tree_jiffies(served.pid), tree_jiffies(gate.pid if gate else None)
        started = time.monotonic()
        result = client.run(with_target(argv, gate.url if gate is not None else served.url), scratch)
        result["wall_s"] = time.monotonic() - started
        after = tree_jiffies(served.pid), tree_jiffies(gate.pid if gate else None)
        if gate is not None:
            found = check_model(gate, mode, served, wait=False)
            result["served_model"] = {key: found[key] for key in ("mode", "family", "served", "root", "folder")}
        if warmed is not None:
            result["warm_up"] = warmed
    finally:
        if gate is not None:
            gate.stop()
    done = max(1, result.get("completed") or 0)
    result["backend_cpu_ms"] = (after[0] - before[0]) / procfs.CLK_TCK * 1000 / done
    result["mmgate_cpu_ms"] = (after[1] - before[1]) / procfs.CLK_TCK * 1000 / done
    if result.get("completed") != requests:
        print(f"  ! {mode}: {result.get('completed')} of {requests} completed: {result.get('errors') or result}",
              flush=True)
    warm = "" if warmed is None else (f" (after {warmed['requests']} warm-up requests: {warmed['s']:.1f} s, mmgate "
                                      f"CPU {warmed['mmgate_cpu_ms']:.0f} ms)")
    print(f"{label} {mode:8} {result.get('request_throughput') or 0:.2f} req/s, TTFT "
          f"{result.get('mean_ttft_ms') or 0:.0f} ms, backend CPU {result['backend_cpu_ms']:.0f} ms/req, mmgate CPU "
          f"{result['mmgate_cpu_ms']:.0f} ms/req{warm}", flush=True)
    return result
