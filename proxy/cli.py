"""``mmgate`` (serve), ``mmgate demo`` (proxy + the built-in stub backend), ``mmgate --print-config``.

Shutdown follows Kubernetes' order of events: SIGTERM arrives while the endpoint is still being removed, so
readiness fails at once but requests are still served for MMGATE_DRAIN_GRACE seconds; then new requests
get 503 ``draining`` and in-flight ones (streams included) get up to MMGATE_DRAIN_TIMEOUT to finish.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Callable, Sequence

import orjson
from aiohttp import web

from .app import build_admin_app, build_app
from .memory import tune_allocators
from .state import STATE, AppState
from .settings import ConfigError, Settings, add_arguments, overrides_from_args

log = logging.getLogger("mmgate")


class JsonFormatter(logging.Formatter):
    """One JSON object per line; access records carry their fields (never bodies or credentials)."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {"ts": round(record.created, 3), "level": record.levelname.lower(), "logger": record.name}
        fields = getattr(record, "fields", None)
        if fields is not None:
            entry.update(fields)
        else:
            entry["message"] = record.getMessage()
        return orjson.dumps(entry).decode()


def configure_logging(settings: Settings) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if settings.log_format == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(settings.log_level.upper())
    logging.getLogger("aiohttp.access").disabled = True  # mmgate writes its own access log


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="mmgate",
        description="Admission-control and media-preprocessing sidecar for multimodal inference servers. "
        "Every flag is also an environment variable: --max-queue is MMGATE_MAX_QUEUE.",
    )
    parser.add_argument("command", nargs="?", choices=("serve", "demo"), default="serve",
                        help="serve (default) or demo: the proxy in front of the built-in stub backend")
    parser.add_argument("--print-config", action="store_true", help="print the effective settings and exit")
    add_arguments(parser)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None, environ: dict[str, str] | None = None) -> None:
    args = parse_args(argv)
    environ = dict(os.environ if environ is None else environ)
    overrides = overrides_from_args(args)
    stub: subprocess.Popen[bytes] | None = None
    try:
        if args.command == "demo" and not args.print_config:
            stub, upstream = start_stub_backend()
            overrides.setdefault("upstream", upstream)
        settings = Settings.from_env(environ, **overrides)
        if not settings.upstream and not args.print_config:
            raise ConfigError("MMGATE_UPSTREAM is not set: point it at your backend (e.g. --upstream "
                              "http://127.0.0.1:8000), or try `mmgate demo`")
    except ConfigError as error:
        print(f"mmgate: {error}", file=sys.stderr)
        if stub is not None:
            stub.terminate()
        raise SystemExit(2) from None
    if args.print_config:
        print(settings.describe())
        return
    configure_logging(settings)
    if settings.malloc_tuning:
        applied = tune_allocators(environ)
        log.info("memory: %s", " ".join(applied) if applied else "allocator settings left as the environment set them")
    try:
        asyncio.run(serve(settings, on_ready=print_demo_help if stub is not None else None))
    finally:
        if stub is not None:
            stub.terminate()
            stub.wait(10)


async def serve(settings: Settings, on_ready: Callable[[Settings, int], None] | None = None) -> None:
    """Run until SIGTERM/SIGINT, then drain (see the module docstring) and return."""
    app = build_app(settings)
    # drain() already waited for in-flight requests; the runner's own shutdown wait is only for stragglers,
    # so the whole stop stays within MMGATE_DRAIN_GRACE + MMGATE_DRAIN_TIMEOUT (+1 s).
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=1.0)
    await runner.setup()
    site = web.TCPSite(runner, settings.host, settings.port, backlog=1024, reuse_address=True)
    await site.start()
    admin_runner = None
    if settings.admin_port:
        admin_runner = web.AppRunner(build_admin_app(app[STATE]), access_log=None)
        await admin_runner.setup()
        await web.TCPSite(admin_runner, settings.host, settings.admin_port).start()
    port = site._server.sockets[0].getsockname()[1] if site._server and site._server.sockets else settings.port  # type: ignore[union-attr]
    log.info("mmgate listening on http://%s:%s -> %s", settings.host, port, settings.upstream)
    if on_ready is not None:
        on_ready(settings, port)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    await stop.wait()
    await drain(app[STATE])
    await runner.cleanup()
    if admin_runner is not None:
        await admin_runner.cleanup()
    log.info("mmgate stopped")


async def drain(state: AppState) -> None:
    settings = state.settings
    state.not_ready = True
    log.info("SIGTERM: readiness now fails; serving for %g s more (MMGATE_DRAIN_GRACE)", settings.drain_grace)
    await asyncio.sleep(settings.drain_grace)
    state.refusing = True
    state.gate.start_draining()
    log.info("draining: %d request(s) in flight, waiting up to %g s", state.in_flight, settings.drain_timeout)
    try:
        async with asyncio.timeout(settings.drain_timeout):
            await state.idle.wait()
    except TimeoutError:
        log.warning("drain timeout: %d request(s) still in flight are cut", state.in_flight)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_stub_backend() -> tuple[subprocess.Popen[bytes], str]:
    """The demo's backend, in its own process so its CPU and memory are its own."""
    port = free_port()
    stub = subprocess.Popen(
        [sys.executable, "-m", "proxy.stub_backend", "--host", "127.0.0.1", "--port", str(port)],
        stdout=subprocess.PIPE,
    )
    assert stub.stdout is not None
    deadline = time.monotonic() + 30
    line = stub.stdout.readline()  # the stub prints one line once it listens
    if b"listening" not in line or time.monotonic() > deadline:
        stub.terminate()
        raise ConfigError(f"the demo stub backend did not start (said {line[:200]!r})")
    return stub, f"http://127.0.0.1:{port}"


def print_demo_help(settings: Settings, port: int) -> None:
    base = f"http://127.0.0.1:{port}"
    print(
        f"""
mmgate demo: proxy on {base} -> stub backend at {settings.upstream}

  curl -s {base}/v1/chat/completions -H 'Content-Type: application/json' \\
    -d '{{"model": "stub", "messages": [{{"role": "user", "content": "Hello!"}}]}}'

  python - <<'EOF'
from openai import OpenAI
client = OpenAI(base_url="{base}/v1", api_key="unused")
reply = client.chat.completions.create(model="stub", messages=[{{"role": "user", "content": "Hello!"}}])
print(reply.choices[0].message.content)
EOF

  metrics: {base}/mmgate/metrics   dashboard: {base}/mmgate/dashboard   Ctrl-C to stop
""",
        flush=True,
    )
