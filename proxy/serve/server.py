"""Serving in one process: start the app and its sites, announce, and on SIGTERM/SIGINT drain and stop. A front
process of several (``proxy.serve.front``) runs the same ``serve`` on the supervisor's sockets.

Shutdown follows Kubernetes' order of events: SIGTERM arrives while the endpoint is still being removed, so
readiness fails at once but requests are still served for MMGATE_DRAIN_GRACE seconds; then new requests
get 503 ``draining`` and in-flight ones (streams included) get up to MMGATE_DRAIN_TIMEOUT to finish.
SIGINT (Ctrl-C) comes from a person, not from a load balancer that is still sending traffic: an idle server
stops at once, and the grace lasts only as long as requests are in flight. Ctrl-C again stops at once, whatever
is in flight (exit status 130, as a shell reports a process ended by SIGINT).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import signal
import socket
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NoReturn

import orjson
from aiohttp import web

from preprocessors.video import pyav_available
from preprocessors.worker_handle import WorkerStartError
from proxy.app import build_admin_app, build_app, make_runner
from proxy.edge.site import GuardedSite
from proxy.edge.upstream_health import loggable
from proxy.processes.link import Link
from proxy.runtime.fd_limit import fit_fd_limit
from proxy.runtime.loop import loop_name
from proxy.runtime.signals import FORCED_EXIT_STATUS, StopSignals
from proxy.settings import Settings
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


class ListenError(Exception):
    """A socket mmgate cannot listen on; ``str()`` is the one line the CLI prints before exiting with status 2."""


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


# A process ended by a second Ctrl-C exits as the shell reports one that SIGINT ended: 128 + 2.


async def serve(settings: Settings, on_ready: Callable[[Settings, int], None] | None = None, *,
                front: FrontSockets | None = None, warnings: Sequence[str] = ()) -> None:
    """Run until SIGTERM/SIGINT, then drain (see the module docstring) and return; ``SystemExit`` with
    ``FORCED_EXIT_STATUS`` when Ctrl-C comes again. With ``front``, as one front process of several: on the
    supervisor's sockets, with its gate (``proxy.processes.supervisor``). ``warnings``: start-up warnings,
    repeated once mmgate listens (``announce``)."""
    settings = fit_fd_limit(settings)  # before the first connection: the cap the descriptors allow
    signals = StopSignals()
    signals.install()
    link = await Link.over(front.gate) if front is not None else None
    app = build_app(settings, link=link, on_gate_lost=lambda: signals(signal.SIGINT),
                    front_index=front.index if front is not None else 0)
    fleet = app[BASE].fleet  # the other front processes; None when this one is the whole
    if fleet is not None:
        fleet.start()
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
    if fleet is not None:
        fleet.ready()
    if front is not None:
        log.info("front process %d ready (pid %d)", front.index, os.getpid())
    else:
        announce(settings, site.port, on_ready, warnings)

    await signals.stopped.wait()
    forced = not await signals.unless_forced(drain(app[STATE], signals.first))
    if forced:
        log.warning("SIGINT again: stopping now; %d request(s) in flight cut", app[STATE].in_flight)
        close_client_connections(runner)
    await runner.cleanup()
    if admin_runner is not None:
        await admin_runner.cleanup()
    if fleet is not None:
        await fleet.close()
    if front is None and not forced:
        log.info("mmgate stopped")
    if forced:
        raise SystemExit(FORCED_EXIT_STATUS)


def close_client_connections(runner: web.AppRunner) -> None:
    """Close every client connection now: aiohttp cancels their handlers as they go, so the runner's cleanup
    has nothing left to wait for (one whose client reads nothing is cut by the cleanup's own timeout)."""
    server = runner.server
    for handler in server.connections if server is not None else ():
        handler.force_close()


def announce(settings: Settings, port: int, on_ready: Callable[[Settings, int], None] | None,
             warnings: Sequence[str] = ()) -> None:
    """The lines a person reads once mmgate listens (one process, or the supervisor of several), the start-up
    ``warnings`` last again: printed before the settings were read, they would have scrolled away."""
    log.info("mmgate listening on http://%s:%s%s -> %s (event loop: %s)", settings.listen.host, port,
             where_note(settings.listen.host), loggable(settings.backend.upstream), loop_name())
    if settings.listen.admin_port:
        log.info("/mmgate/* only on the admin port: http://%s:%s", settings.listen.host, settings.listen.admin_port)
    if not pyav_available():
        log.info("video parts are refused (400 video_unavailable): probing them needs PyAV, "
                 "pip install 'mmgate[video]'")
    if on_ready is not None:
        on_ready(settings, port)
    for warning in warnings:
        log.warning("%s: ignored", warning)


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
    grace, timeout = settings.drain.drain_grace, settings.drain.drain_timeout
    if signum == signal.SIGTERM:
        log.info("SIGTERM: readiness now fails; serving for %g s more (MMGATE_DRAIN_GRACE), then up to %g s for "
                 "requests in flight (MMGATE_DRAIN_TIMEOUT): stopped within %g s", grace, timeout, grace + timeout)
        await asyncio.sleep(grace)
    elif state.idle.is_set():
        log.info("%s: no request in flight; stopping now", signum.name)
    else:
        # Ctrl-C: no load balancer is still sending requests, so the grace only lets those in flight finish.
        log.info("%s: %d request(s) in flight; waiting up to %g s in all while they finish (MMGATE_DRAIN_GRACE + "
                 "MMGATE_DRAIN_TIMEOUT); Ctrl-C again to stop now", signum.name, state.in_flight, grace + timeout)
        try:
            async with asyncio.timeout(grace):
                await state.idle.wait()
        except TimeoutError:
            pass
    state.lifecycle.start_draining()
    if state.in_flight:
        log.info("draining: %d request(s) in flight, waiting up to %g s (MMGATE_DRAIN_TIMEOUT)", state.in_flight,
                 timeout)
    try:
        async with asyncio.timeout(timeout):
            await state.idle.wait()
    except TimeoutError:
        log.warning("drain timeout: %d request(s) still in flight are cut", state.in_flight)
