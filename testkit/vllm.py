"""Process harness shared by the real-vLLM e2e tests (tests/e2e) and the benches that run a real vLLM
(bench/real_vllm.py, model_tokens.py, fleet_vllm.py, peer_client.py).

Why a module of its own, in ``testkit``: the tests (tests/e2e/conftest.py) and the benchmark must start vLLM
and mmgate the same way, wait for them by polling their readiness endpoints (never by sleeping a fixed time),
and tear them down by process group so no vLLM engine core survives a crashed run. No pytest import here.
"""

from __future__ import annotations

import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from testkit.environment import mmgate_env

REPO = Path(__file__).resolve().parents[1]
SETUP_SCRIPT = REPO / "tests" / "e2e" / "setup_vllm.sh"  # beside the suite it installs vLLM for
DEFAULT_DIR = Path(os.environ.get("MMGATE_E2E_DIR", str(REPO / ".e2e")))
SERVED_MODEL = "tiny-vlm"
VLLM_START_TIMEOUT = float(os.environ.get("MMGATE_E2E_VLLM_START_TIMEOUT", "420"))
SETUP_TIMEOUT = float(os.environ.get("MMGATE_E2E_SETUP_TIMEOUT", "1200"))


class HarnessError(RuntimeError):
    """vLLM or mmgate could not be installed or started; the message says why (for skip/fail reasons)."""


# ----------------------------------------------------------------------------------------------- small helpers


def free_port() -> int:
    """A free loopback port (the kernel picks it, so parallel sessions never collide on a fixed number)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


_LOCAL = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback only: ignore *_proxy env vars


def http_get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    """GET returning (status, body) for any status; (0, b"") when nothing answers."""
    try:
        with _LOCAL.open(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except (OSError, urllib.error.URLError):
        return 0, b""


def tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def wait_until_healthy(url: str, proc: subprocess.Popen[bytes], timeout: float, log: Path, what: str) -> float:
    """Poll ``url`` until it answers 200; fail fast when ``proc`` exits. Returns the seconds it took."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise HarnessError(f"{what} exited with status {proc.returncode} before {url} answered; log {log}:\n"
                               + tail(log))
        status, _ = http_get(url, timeout=2.0)
        if status == 200:
            return time.monotonic() - t0
        time.sleep(0.25)  # polling interval of a readiness probe, not a synchronisation sleep
    raise HarnessError(f"{what} did not answer 200 on {url} within {timeout:.0f} s; log {log}:\n" + tail(log))


def stop_group(proc: subprocess.Popen[bytes], grace: float = 15.0) -> None:
    """SIGTERM the whole process group (vLLM forks an engine core), then SIGKILL what is left after ``grace``."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        pass
    try:  # the leader may be gone while children linger: kill the group regardless
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass


def parse_prometheus(text: str) -> dict[str, float]:
    """Prometheus text → {'name{labels}': value}; labels kept verbatim (sorted as the server printed them)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = re.match(r"^([^\s{]+(?:\{[^}]*\})?)\s+(\S+)", line)
        if m:
            try:
                out[m.group(1)] = float(m.group(2))
            except ValueError:
                pass
    return out


def metric_sum(metrics: dict[str, float], name: str, **labels: str) -> float:
    """Sum of every series of ``name`` whose labels include ``labels`` (e.g. status="4xx")."""
    total = 0.0
    for key, value in metrics.items():
        base, _, rest = key.partition("{")
        if base != name:
            continue
        if all(f'{k}="{v}"' in rest for k, v in labels.items()):
            total += value
    return total


# ----------------------------------------------------------------------------------------------- images


def photo_like(width: int, height: int, seed: int = 0) -> Image.Image:
    """Synthetic photo-like RGB: smooth gradients + blobs + sensor noise (compresses like a photo, not a flat fill)."""
    rng = np.random.default_rng(seed)
    y = np.linspace(0.0, 1.0, height, dtype=np.float32)[:, None]
    x = np.linspace(0.0, 1.0, width, dtype=np.float32)[None, :]
    r = 255 * (0.5 + 0.5 * np.sin(6.0 * x + 3.0 * y))
    g = 255 * (0.5 + 0.5 * np.cos(4.0 * y - 2.0 * x * y))
    b = 255 * (x * 0.6 + y * 0.4)
    img = np.stack([np.broadcast_to(c, (height, width)) for c in (r, g, b)], axis=-1)
    img = img + rng.normal(0.0, 12.0, size=(height, width, 3)).astype(np.float32)
    return Image.fromarray(np.clip(img, 0, 255).astype(np.uint8), "RGB")


def encode(img: Image.Image, fmt: str) -> bytes:
    """PNG (compress_level 1, as a camera app or screenshot tool would) or JPEG q90."""
    buf = io.BytesIO()
    if fmt == "png":
        img.save(buf, "PNG", compress_level=1)
    else:
        img.save(buf, "JPEG", quality=90)
    return buf.getvalue()


def photo_file(width: int, height: int, fmt: str = "JPEG", orientation: int = 1) -> bytes:
    """``photo_like`` (seeded by its size) as a JPEG q90 carrying an EXIF block (with ``orientation`` where it
    is not 1), a PNG (compress_level 1), or another Pillow format at quality 90."""
    exif = Image.Exif()
    if orientation != 1:
        exif[0x0112] = orientation
    buf = io.BytesIO()
    img = photo_like(width, height, seed=width + height)
    if fmt == "JPEG":
        img.save(buf, "JPEG", quality=90, exif=exif.tobytes())
    elif fmt == "PNG":
        img.save(buf, "PNG", compress_level=1)
    else:
        img.save(buf, fmt, quality=90)
    return buf.getvalue()


def data_uri(data: bytes, mime: str) -> str:
    import base64

    return f"data:{mime};base64," + base64.b64encode(data).decode("ascii")


# ----------------------------------------------------------------------------------------------- setup + servers


def run_setup(dir_: Path = DEFAULT_DIR, log: Path | None = None) -> float:
    """Run setup_vllm.sh (idempotent). Returns seconds taken; raises HarnessError with the log tail on failure."""
    try:
        dir_.mkdir(parents=True, exist_ok=True)
        log = log or dir_ / "setup.log"
        f = open(log, "ab")  # noqa: SIM115 (opened here to turn OSError into HarnessError; `with f:` below)
    except OSError as e:
        raise HarnessError(f"cannot use {dir_} for the vLLM install: {e}") from None
    t0 = time.monotonic()
    with f:
        try:
            rc = subprocess.run(["bash", str(SETUP_SCRIPT), str(dir_)], stdout=f, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, timeout=SETUP_TIMEOUT).returncode
        except subprocess.TimeoutExpired:
            raise HarnessError(
                f"setup_vllm.sh took more than {SETUP_TIMEOUT:.0f} s; log {log}:\n" + tail(log)) from None
    if rc != 0:
        raise HarnessError(f"setup_vllm.sh failed with status {rc}; log {log}:\n" + tail(log))
    return time.monotonic() - t0


@dataclass
class Server:
    """A started server: its base URL, process (group leader) and log file."""

    name: str
    url: str
    proc: subprocess.Popen[bytes] | None  # None: a server someone else started (MMGATE_E2E_VLLM_URL)
    log: Path | None
    start_seconds: float = 0.0
    extra: dict[str, str] = field(default_factory=dict)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def stop(self) -> None:
        if self.proc is not None:
            stop_group(self.proc)

    def metrics(self, path: str) -> dict[str, float]:
        status, body = http_get(self.url + path)
        if status != 200:
            raise HarnessError(f"{self.name} {path} answered {status}")
        return parse_prometheus(body.decode())


def start_vllm(dir_: Path = DEFAULT_DIR, port: int | None = None, log: Path | None = None,
               extra_args: tuple[str, ...] = ()) -> Server:
    """Start the real vLLM OpenAI server (CPU) on loopback serving the tiny Idefics3 as ``tiny-vlm``."""
    python = dir_ / "venv" / "bin" / "python"
    model = dir_ / "tiny-idefics3"
    if not python.exists() or not (model / "config.json").exists():
        raise HarnessError(f"vLLM is not set up in {dir_}: run tests/e2e/setup_vllm.sh {dir_}")
    port = port or free_port()
    log = log or dir_ / "logs" / f"vllm-{port}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "MMGATE_"))}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1",
               VLLM_TARGET_DEVICE="cpu", VLLM_CPU_KVCACHE_SPACE="1",  # 1 GiB KV cache; the default takes far more
               PYTHONUNBUFFERED="1")
    cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server",  # the `vllm` console script fails with vllm-cpu
           "--model", str(model), "--served-model-name", SERVED_MODEL,
           "--host", "127.0.0.1", "--port", str(port), "--dtype", "bfloat16", "--max-model-len", "4096",
           "--limit-mm-per-prompt", '{"image":1}',
           # no caching across requests: every request pays the full image cost, as a fresh image would
           "--mm-processor-cache-gb", "0", "--no-enable-prefix-caching", *extra_args]
    with open(log, "ab") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                start_new_session=True, cwd=str(dir_))
    url = f"http://127.0.0.1:{port}"
    try:
        took = wait_until_healthy(url + "/health", proc, VLLM_START_TIMEOUT, log, "vLLM")
    except BaseException:
        stop_group(proc)
        raise
    return Server("vllm", url, proc, log, took)


def start_mmgate(upstream: str, *flags: str, log_dir: Path = DEFAULT_DIR / "logs", timeout: float = 60.0) -> Server:
    """Start ``python -m proxy`` (this interpreter, the project's) on a free loopback port in front of ``upstream``,
    on asyncio's own event loop, what ``pip install mmgate`` gives (``flags`` may name another: ``--loop``). It
    leaves at once when stopped (``MMGATE_DRAIN_GRACE=0``: no load balancer is there to see it unready; the
    5 s default cost every test session and bench 5 s a gate)."""
    port = free_port()
    log_dir.mkdir(parents=True, exist_ok=True)
    log = log_dir / f"mmgate-{port}.log"
    env = mmgate_env(keep=(), PYTHONUNBUFFERED="1", MMGATE_LOOP="asyncio", MMGATE_DRAIN_GRACE="0")
    cmd = [sys.executable, "-m", "proxy", "--upstream", upstream, "--host", "127.0.0.1", "--port", str(port), *flags]
    with open(log, "ab") as f:
        f.write(("$ " + " ".join(cmd) + "\n").encode())
        f.flush()
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                start_new_session=True, cwd=str(REPO))
    url = f"http://127.0.0.1:{port}"
    try:
        took = wait_until_healthy(url + "/mmgate/health", proc, timeout, log, "mmgate")
    except BaseException:
        stop_group(proc)
        raise
    return Server("mmgate", url, proc, log, took, {"flags": " ".join(flags)})


@contextmanager
def vllm_server(url: str = "", extra_args: tuple[str, ...] = (), setup: bool = False) -> Iterator[Server]:
    """The vLLM at ``url`` (started by someone else: left running), else the tiny model started here with
    ``extra_args`` (after ``run_setup`` with ``setup``) and stopped on the way out."""
    if url:
        yield Server("vllm", url.rstrip("/"), None, None)
        return
    if setup:
        print(f"setup: {run_setup():.1f} s", flush=True)
    server = start_vllm(extra_args=extra_args)
    print(f"vLLM started in {server.start_seconds:.1f} s (pid {server.pid})", flush=True)
    try:
        yield server
    finally:
        server.stop()


@contextmanager
def gates(upstream: str, flags: Mapping[str, tuple[str, ...]]) -> Iterator[dict[str, Server]]:
    """One mmgate per entry of ``flags`` (its name: its flags) in front of ``upstream``, started in order and
    stopped in reverse on the way out."""
    with ExitStack() as stack:
        started: dict[str, Server] = {}
        for name, its_flags in flags.items():
            started[name] = start_mmgate(upstream, *its_flags)
            stack.callback(started[name].stop)
        yield started


class BenchClient:
    """``vllm bench serve`` as a peer's client: ``testkit/peer_driver.py`` in the real vLLM's venv, one cell per
    ``run`` (``argv``: what follows ``vllm bench serve`` on a command line), its result as vLLM writes it."""

    def __init__(self, log: Path) -> None:
        python = DEFAULT_DIR / "venv" / "bin" / "python"
        if not python.exists():
            raise SystemExit(f"the peer client needs the real vLLM's venv: bash {SETUP_SCRIPT} {DEFAULT_DIR}")
        self._read, write = os.pipe()
        self._log = log.open("ab")
        env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "MMGATE_"))}
        env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1", PYTHONUNBUFFERED="1")
        # -P: the driver's folder is not on its path, or testkit/vllm.py would hide vLLM's own package
        driver = Path(__file__).with_name("peer_driver.py")
        self.proc = subprocess.Popen([str(python), "-P", str(driver), str(write)], pass_fds=(write,),
                                     stdin=subprocess.PIPE, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        os.close(write)
        self._answers = os.fdopen(self._read)

    def run(self, argv: list[str], scratch: Path) -> dict[str, Any]:
        out = scratch / "cell.json"
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps({"argv": argv, "out": str(out)}) + "\n").encode())
        self.proc.stdin.flush()
        if self._answers.readline() != "done\n":
            raise SystemExit(f"the peer client ended; its log: {self._log.name}")
        return dict(json.loads(out.read_text()))

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(timeout=30)
        self._log.close()


@contextmanager
def hf_home(folder: Path) -> Iterator[None]:
    """``HF_HOME`` = ``folder`` for the servers started inside (vLLM and mmgate copy this process's environment),
    with the variables that would take precedence over it removed."""
    names = ("HF_HOME", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE")
    saved = {name: os.environ.pop(name) for name in names if name in os.environ}
    os.environ["HF_HOME"] = str(folder)
    try:
        yield
    finally:
        os.environ.pop("HF_HOME", None)
        os.environ.update(saved)
