"""``mmgate`` (serve), ``mmgate demo`` (proxy + the built-in stub backend), ``mmgate --print-config``.

Shutdown follows Kubernetes' order of events: SIGTERM arrives while the endpoint is still being removed, so
readiness fails at once but requests are still served for MMGATE_DRAIN_GRACE seconds; then new requests
get 503 ``draining`` and in-flight ones (streams included) get up to MMGATE_DRAIN_TIMEOUT to finish.
SIGINT (Ctrl-C) comes from a person, not from a load balancer that is still sending traffic: an idle server
stops at once, and the grace lasts only as long as requests are in flight.
"""

from __future__ import annotations

import argparse
import asyncio
import difflib
import errno
import importlib.util
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from functools import partial
from typing import NoReturn

import orjson
from aiohttp import web

from preprocessors.video import pyav_available
from preprocessors.worker_handle import WorkerStartError
from proxy.admission.shared import Link, SharedGate
from proxy.app import build_admin_app, build_app, make_runner, served_model
from proxy.edge.site import GuardedSite
from proxy.edge.upstream_health import loggable
from proxy.serve.fd_limit import fit_fd_limit
from proxy.serve.lifecycle import StopSignals
from proxy.serve.memory import tune_process
from proxy.serve.supervisor import supervise
from proxy.settings import (
    ConfigError,
    Settings,
    add_arguments,
    overrides_from_args,
    unknown_variables,
)
from proxy.state import BASE, STATE, AppState

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
    if settings.logs.log_format == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(settings.logs.log_level.upper())
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
    args = list(sys.argv[1:] if argv is None else argv)
    if (unknown := unknown_flag(parser, args)) is not None:
        # Checked first: argparse would take the misspelt flag's value for the command and name that instead.
        close = difflib.get_close_matches(unknown, list(parser._option_string_actions), n=1)
        hint = f"did you mean {close[0]}?" if close else "mmgate --help lists every flag"
        parser.exit(2, f"mmgate: unknown flag {unknown} ({hint})\n")
    return parser.parse_args(args)


_NUMBER = re.compile(r"-\d+(\.\d*)?|-\.\d+")


def unknown_flag(parser: argparse.ArgumentParser, args: Sequence[str]) -> str | None:
    """The first ``-flag`` in ``args`` that is neither one of the parser's options nor an abbreviation of one."""
    known = list(parser._option_string_actions)
    for arg in args:
        if arg == "--":
            return None
        if not arg.startswith("-") or arg == "-" or _NUMBER.fullmatch(arg):
            continue
        flag = arg.split("=", 1)[0]
        if flag in known or (flag.startswith("--") and any(option.startswith(flag) for option in known)):
            continue
        return flag
    return None


class ListenError(Exception):
    """A socket mmgate cannot listen on; ``str()`` is the one line the CLI prints before exiting with status 2."""


def main(argv: Sequence[str] | None = None, environ: dict[str, str] | None = None,
         also_known: Collection[str] = ()) -> None:
    """``mmgate``. ``also_known``: ``MMGATE_*`` names that are no setting but draw no warning (a tool's own)."""
    args = parse_args(argv)
    environ = dict(os.environ if environ is None else environ)
    for warning in unknown_variables(environ, also_known):
        print(f"mmgate: warning: {warning}", file=sys.stderr)
    overrides = overrides_from_args(args)
    stub: subprocess.Popen[bytes] | None = None
    try:
        try:
            if args.command == "demo":
                stub, upstream = start_stub_backend()
                overrides.setdefault("upstream", upstream)
            settings = Settings.from_env(environ, **overrides)
            if not settings.backend.upstream:
                # --print-config too: the worst case it prints is for a proxy that could not start without one.
                raise ConfigError("MMGATE_UPSTREAM is not set: point it at your backend (e.g. --upstream "
                                  "http://127.0.0.1:8000), or try `mmgate demo`")
            served_model(settings)  # loaded once here (cached), so a bad MMGATE_MODEL stops now with status 2
        except ConfigError as error:
            exit_with(error)
        if args.print_config:
            print(settings.describe())
            return
        configure_logging(settings)
        decode = settings.decode
        applied = tune_process(environ, memory_first=settings.memory.malloc_tuning,
                               decode_threads=decode.decode_workers if decode.decode_mode == "thread" else 0)
        if settings.memory.malloc_tuning:
            log.info("memory: %s",
                     " ".join(applied) if applied else "allocator settings left as the environment set them")
        on_ready = print_demo_help if stub is not None else None
        if settings.listen.processes > 1:
            try:
                listen_sock = bound(settings.listen.host, settings.listen.port, "MMGATE_PORT / --port")
                admin_sock = (bound(settings.listen.host, settings.listen.admin_port,
                                    "MMGATE_ADMIN_PORT / --admin-port") if settings.listen.admin_port else None)
            except ListenError as error:
                exit_with(error)
            status = supervise(settings, listen_sock, admin_sock, partial(announce, on_ready=on_ready))
            if status:
                raise SystemExit(status)
            return
        try:
            asyncio.run(serve(settings, on_ready=on_ready))
        except (ListenError, WorkerStartError, ConfigError) as error:
            exit_with(error)
    finally:
        if stub is not None:
            stub.terminate()
            stub.wait(10)


def exit_with(error: Exception) -> NoReturn:
    """One line on stderr and exit status 2: what a person or a crash-looping pod log needs, no traceback."""
    print(f"mmgate: {error}", file=sys.stderr, flush=True)
    raise SystemExit(2) from None


@dataclass(frozen=True)
class FrontSockets:
    """What a front process of several (``MMGATE_PROCESSES``) is given by the supervisor: the listening
    sockets it accepts on with the others, and its end of the link to the shared gate."""

    index: int
    listen: socket.socket
    admin: socket.socket | None
    gate: socket.socket


async def serve(settings: Settings, on_ready: Callable[[Settings, int], None] | None = None, *,
                front: FrontSockets | None = None) -> None:
    """Run until SIGTERM/SIGINT, then drain (see the module docstring) and return. With ``front``, as one
    front process of several: on the supervisor's sockets, with its gate (``proxy.supervisor``)."""
    settings = fit_fd_limit(settings)  # before the first connection: the cap the descriptors allow
    signals = StopSignals()
    signals.install()
    link = await Link.over(front.gate) if front is not None else None
    app = build_app(settings, link=link, on_gate_lost=lambda: signals(signal.SIGINT),
                    front_index=front.index if front is not None else 0)
    gate = app[BASE].gate
    if isinstance(gate, SharedGate):
        gate.start()
    runner = make_runner(app)
    try:
        await runner.setup()
    except WorkerStartError:
        await runner.cleanup()  # what started before the decode pool (the upstream session) is closed
        raise
    admin_runner = None
    try:
        # Client connections are capped and their heads have a deadline (proxy/edge/connections.py).
        site = GuardedSite(runner, settings.listen.host, settings.listen.port, app[STATE].connections,
                           sock=front.listen if front is not None else None)
        await listen(site, settings.listen.host, settings.listen.port, "MMGATE_PORT / --port")
        if settings.listen.admin_port:
            admin_runner = web.AppRunner(build_admin_app(app[STATE]), access_log=None)
            await admin_runner.setup()
            admin_site: web.BaseSite
            if front is not None and front.admin is not None:
                admin_site = web.SockSite(admin_runner, front.admin)
            else:
                admin_site = web.TCPSite(admin_runner, settings.listen.host, settings.listen.admin_port)
            await listen(admin_site, settings.listen.host, settings.listen.admin_port,
                         "MMGATE_ADMIN_PORT / --admin-port")
    except ListenError:
        await runner.cleanup()
        if admin_runner is not None:
            await admin_runner.cleanup()
        raise
    if front is not None:
        assert isinstance(gate, SharedGate)
        gate.ready()
        log.info("front process %d ready (pid %d)", front.index, os.getpid())
    else:
        announce(settings, site.port, on_ready)

    await signals.stopped.wait()
    await drain(app[STATE], signals.first)
    await runner.cleanup()
    if admin_runner is not None:
        await admin_runner.cleanup()
    if isinstance(gate, SharedGate):
        await gate.close()
    else:
        log.info("mmgate stopped")


def announce(settings: Settings, port: int, on_ready: Callable[[Settings, int], None] | None) -> None:
    """The lines a person reads once mmgate listens (one process, or the supervisor of several)."""
    log.info("mmgate listening on http://%s:%s%s -> %s", settings.listen.host, port, where_note(settings.listen.host),
             loggable(settings.backend.upstream))
    if settings.listen.admin_port:
        log.info("/mmgate/* only on the admin port: http://%s:%s", settings.listen.host, settings.listen.admin_port)
    if not pyav_available():
        log.info("video parts are refused (400 video_unavailable): probing them needs PyAV, "
                 "pip install 'mmgate[video]'")
    if on_ready is not None:
        on_ready(settings, port)


async def listen(site: web.BaseSite, host: str, port: int, setting: str) -> None:
    """``site.start()``, with a socket that cannot be opened as one line naming the setting to change."""
    try:
        await site.start()
    except OSError as exc:
        raise listen_error(exc, host, port, setting) from None


def listen_error(exc: OSError, host: str, port: int, setting: str) -> ListenError:
    if exc.errno is not None and exc.errno > 0:
        reason = os.strerror(exc.errno).lower()
    else:  # a host name that does not resolve: no errno, the resolver's own words
        reason = str(exc.strerror or exc).lower()
    if exc.errno not in (errno.EADDRINUSE, errno.EACCES):
        setting = "MMGATE_HOST / --host"
    return ListenError(f"cannot listen on {host}:{port}: {reason} ({setting})")


def bound(host: str, port: int, setting: str, backlog: int = 1024) -> socket.socket:
    """A listening socket for the front processes to share (one accept queue), as ``listen`` would open."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(address)
            sock.listen(backlog)
        except BaseException:
            sock.close()
            raise
    except OSError as exc:
        raise listen_error(exc, host, port, setting) from None
    return sock


def where_note(host: str) -> str:
    """The listen address in words when it is every interface, the default a first-time user may not expect."""
    if host in ("0.0.0.0", "::", ""):
        return " (all interfaces; MMGATE_HOST=127.0.0.1 to listen locally only)"
    return ""


async def drain(state: AppState, signum: signal.Signals = signal.SIGTERM) -> None:
    """Readiness fails; serve on through the grace (SIGTERM: all of it; SIGINT: only while requests are in
    flight); then refuse new requests and give those in flight up to MMGATE_DRAIN_TIMEOUT."""
    settings = state.settings
    state.lifecycle.start_grace()
    if signum == signal.SIGTERM:
        log.info("SIGTERM: readiness now fails; serving for %g s more (MMGATE_DRAIN_GRACE)", settings.drain.drain_grace)
        await asyncio.sleep(settings.drain.drain_grace)
    elif state.idle.is_set():
        log.info("%s: no request in flight; stopping now", signum.name)
    else:
        # Ctrl-C: no load balancer is still sending requests, so the grace only lets those in flight finish.
        log.info("%s: %d request(s) in flight; serving for up to %g s more while they finish (MMGATE_DRAIN_GRACE)",
                 signum.name, state.in_flight, settings.drain.drain_grace)
        try:
            async with asyncio.timeout(settings.drain.drain_grace):
                await state.idle.wait()
        except TimeoutError:
            pass
    state.lifecycle.start_draining()
    if state.in_flight:
        log.info("draining: %d request(s) in flight, waiting up to %g s", state.in_flight, settings.drain.drain_timeout)
    try:
        async with asyncio.timeout(settings.drain.drain_timeout):
            await state.idle.wait()
    except TimeoutError:
        log.warning("drain timeout: %d request(s) still in flight are cut", state.in_flight)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_stub_backend() -> tuple[subprocess.Popen[bytes], str]:
    """The demo's backend, in its own process so its CPU and memory are its own."""
    # The stub needs numpy, which only the demo extra installs: say so in one line, not with a traceback.
    if importlib.util.find_spec("numpy") is None:
        raise ConfigError("mmgate demo needs the demo extra: pip install -e '.[demo]'")
    port = free_port()
    stub = subprocess.Popen(
        [sys.executable, "-m", "demo.backend", "--host", "127.0.0.1", "--port", str(port)],
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
    """Snippets to paste into another shell (the README's demo command installs the ``demo`` extra they need)."""
    base = f"http://127.0.0.1:{port}"
    print(
        f"""
mmgate demo: proxy on {base} -> stub backend at {settings.backend.upstream}

  curl -s {base}/v1/chat/completions -H 'Content-Type: application/json' \\
    -d '{{"model": "stub", "messages": [{{"role": "user", "content": "Hello!"}}]}}'

  # an image, made on the fly and sent inline (the openai SDK comes with the demo extra: pip install -e '.[demo]')
  python - <<'EOF'
import base64, io
from openai import OpenAI
from PIL import Image
png = io.BytesIO()
Image.new("RGB", (640, 480), "teal").save(png, "PNG")
image = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
client = OpenAI(base_url="{base}/v1", api_key="unused")
reply = client.chat.completions.create(model="stub", messages=[{{"role": "user", "content": [
    {{"type": "text", "text": "What is in this picture?"}},
    {{"type": "image_url", "image_url": {{"url": image}}}}]}}])
print(reply.choices[0].message.content)
EOF

  metrics: {base}/mmgate/metrics   dashboard: {base}/mmgate/dashboard   Ctrl-C to stop
""",
        flush=True,
    )
