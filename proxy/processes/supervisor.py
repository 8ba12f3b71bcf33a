"""``MMGATE_PROCESSES`` > 1: a supervisor, N front processes on one port, one gate.

The supervisor (the process ``mmgate`` started as) binds the listening sockets, runs the one
``admission.gate.Gate`` behind a ``gate_server.GateServer``, and starts N front processes (``python -m
proxy.serve.front``). Each inherits the listening sockets (one accept queue in the kernel, as uvicorn's and
gunicorn's workers share theirs) and its end of a Unix socket pair to the gate, and serves the whole app:
connections, bodies, decoding with its share of the decode workers, the cache, forwarding, streaming.

- A front that exits while mmgate serves (a crash, SIGKILL, the OOM killer) is replaced; the gate gives back
  its leases and places as soon as its end of the pair closes, so the limits stay exact.
- A front that hangs (SIGSTOP, a blocked event loop) is found as uvicorn's supervisor finds one, by a ping over
  the link its event loop must answer: two pings in a row unanswered, each given half of MMGATE_PROCESS_TIMEOUT,
  and it is killed (SIGKILL), what it held given back at once, and replaced. Two, so that a supervisor that
  was itself stopped a while does not take the answer still unread on its socket for silence.
- SIGTERM / SIGINT are passed to every front, which drains as a single process does (``server.drain``: its
  streams finish); the supervisor waits for all of them, kills any still running after
  MMGATE_DRAIN_GRACE + MMGATE_DRAIN_TIMEOUT + ``STOP_MARGIN``, and exits 0 when every front did.
- A front that fails before it is ready (bad model, a decode worker that cannot start) stops mmgate with
  its status: a start-up fault would fail again at every restart.
- The supervisor dying (SIGKILL) closes every link: each front then drains and exits on its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import pickle
import signal
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from proxy.admission.client import gate_from_settings
from proxy.processes.gate_server import GateServer
from proxy.processes.messages import PING_INTERVAL
from proxy.runtime.loop import run
from proxy.runtime.signals import FORCED_EXIT_STATUS, StopSignals
from proxy.settings import Settings

log = logging.getLogger("mmgate")

STOP_MARGIN = 10.0  # seconds past the drain's own bounds before a front that has not exited is killed
RESTART_DELAY_MAX = 5.0  # a front that keeps dying right after start is restarted at most this often


@dataclass
class _Child:
    index: int
    process: asyncio.subprocess.Process
    ready: asyncio.Event
    link: asyncio.Task[None]
    started: float
    watchdog: asyncio.Task[None] = field(init=False)  # ``Supervisor._watchdog``


class Supervisor:
    def __init__(self, settings: Settings, listen: socket.socket, admin: socket.socket | None) -> None:
        self.settings = settings
        self.listen = listen
        self.admin = admin
        self.gate = gate_from_settings(settings.gate)
        self.server = GateServer(self.gate)
        self.children: list[_Child] = []
        self.restarts = 0

    async def _start(self, index: int) -> _Child:
        parent_end, child_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        fds = [self.listen.fileno(), child_end.fileno()]
        argv = [sys.executable, "-m", "proxy.serve.front", "--index", str(index), "--listen-fd", str(fds[0]),
                "--gate-fd", str(fds[1])]
        if self.admin is not None:
            fds.append(self.admin.fileno())
            argv += ["--admin-fd", str(self.admin.fileno())]
        try:
            process = await asyncio.create_subprocess_exec(*argv, stdin=asyncio.subprocess.PIPE, pass_fds=fds)
        finally:
            child_end.close()  # the front holds the only other end: its exit is the link's end
        await _hand_over(process, pickle.dumps(self.settings.for_front(index)))
        ready = asyncio.Event()
        link = asyncio.create_task(self.server.serve(index, parent_end, ready))
        child = _Child(index, process, ready, link, time.monotonic())
        child.watchdog = asyncio.create_task(self._watchdog(child))
        return child

    async def _watchdog(self, child: _Child) -> None:
        """Ping ``child`` once it is ready; kill it when two pings in a row go unanswered (module docstring)."""
        await child.ready.wait()
        bound = self.settings.listen.process_timeout / 2
        missed = 0
        while missed < 2:
            answered = await self.server.ping(child.index, bound)
            if answered is None:  # gone: ``_watch`` replaces it
                return
            if answered:
                missed = 0
                await asyncio.sleep(PING_INTERVAL)
            else:
                missed += 1
        log.error("front process %d (pid %d) answered no ping for %g s: killed, what it held given back",
                  child.index, child.process.pid, 2 * bound)
        self.server.drop(child.index)
        child.process.kill()

    async def run(self, on_ready: Callable[[Settings, int], None] | None) -> int:
        signals = StopSignals()
        signals.install()
        stop = signals.stopped
        try:
            self.children = [await self._start(index) for index in range(self.settings.listen.processes)]
            for child in self.children:
                await _first(child.ready.wait(), child.process.wait(), stop.wait())
                if not child.ready.is_set() and child.process.returncode is not None:
                    log.error("front process %d exited with status %s during start-up; stopping", child.index,
                              child.process.returncode)
                    await self._stop(signal.SIGINT)
                    return child.process.returncode or 2
                if child.index == 0 and on_ready is not None:  # from now on requests are served
                    on_ready(self.settings, self.listen.getsockname()[1])
                if stop.is_set():
                    break
            if not stop.is_set():
                log.info("%d front processes (pids %s) share the port and one gate", len(self.children),
                         " ".join(str(c.process.pid) for c in self.children))
                await self._watch(stop)
            status: list[int] = []

            async def drained() -> None:
                status.append(await self._stop(signals.first))

            if await signals.unless_forced(drained()):
                return status[0]
            return await self._stop_now()
        finally:
            signals.remove()

    async def _watch(self, stop: asyncio.Event) -> None:
        """Replace every front that exits, until a signal."""
        quick_exits = 0
        while not stop.is_set():
            exits = {asyncio.create_task(child.process.wait()): child for child in self.children}
            stopping = asyncio.create_task(stop.wait())
            done, pending = await asyncio.wait([*exits, stopping], return_when=asyncio.FIRST_COMPLETED)
            for task in pending:
                task.cancel()
            if stop.is_set():
                return
            for task in done:
                child = exits[task]
                child.watchdog.cancel()
                await child.link  # the gate has given back what the front held
                quick_exits = quick_exits + 1 if time.monotonic() - child.started < 1.0 else 0
                delay = min(RESTART_DELAY_MAX, 0.1 * 2 ** quick_exits) if quick_exits else 0.0
                log.warning("front process %d (pid %d) exited with status %s; starting another%s", child.index,
                            child.process.pid, child.process.returncode,
                            f" in {delay:g} s" if delay else "")
                if delay:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(stop.wait(), delay)
                    if stop.is_set():
                        return
                self.restarts += 1
                self.children[child.index] = await self._start(child.index)

    async def _stop(self, signum: signal.Signals) -> int:
        """Pass ``signum`` to every front, wait for each to drain and exit (bounded), reap them all."""
        for child in self.children:  # a front draining its last streams is not pinged: the drain has a bound
            child.watchdog.cancel()
        async def stopped(child: _Child) -> None:
            # A front still starting has no handler for the signal yet: it is told once it is ready.
            await _first(child.ready.wait(), child.process.wait())
            if child.process.returncode is None:
                child.process.send_signal(signum)
            await child.process.wait()

        bound = self.settings.drain.drain_grace + self.settings.drain.drain_timeout + STOP_MARGIN
        try:
            async with asyncio.timeout(bound):
                await asyncio.gather(*(stopped(child) for child in self.children))
        except TimeoutError:
            for child in self.children:
                if child.process.returncode is None:
                    log.error("front process %d did not stop within %g s: killed", child.index, bound)
                    child.process.kill()
            await asyncio.gather(*(child.process.wait() for child in self.children))
        await self._let_go_of_links()
        failed = [child for child in self.children if child.process.returncode != 0]
        if not failed:
            log.info("mmgate stopped")
        return 1 if failed else 0

    async def _stop_now(self) -> int:
        """Ctrl-C again during the drain: each front is told the same (it cuts its connections and exits), and
        one that has not exited within ``STOP_MARGIN`` is killed."""
        log.warning("SIGINT again: stopping the front processes now")
        for child in self.children:
            if child.process.returncode is None:
                child.process.send_signal(signal.SIGINT)
        try:
            async with asyncio.timeout(STOP_MARGIN):
                await asyncio.gather(*(child.process.wait() for child in self.children))
        except TimeoutError:
            for child in self.children:
                if child.process.returncode is None:
                    child.process.kill()
            await asyncio.gather(*(child.process.wait() for child in self.children))
        await self._let_go_of_links()
        return FORCED_EXIT_STATUS

    async def _let_go_of_links(self) -> None:
        for child in self.children:
            child.link.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await child.link


async def _hand_over(process: asyncio.subprocess.Process, settings: bytes) -> None:
    """Write a front's ``settings`` on its stdin (a pipe), then close it: the front reads to the end."""
    if process.stdin is None:  # asyncio types it optional; started with stdin=PIPE, it never is
        raise RuntimeError(f"front process {process.pid} has no stdin to read its settings from")
    process.stdin.write(settings)
    with contextlib.suppress(ConnectionError):
        await process.stdin.drain()
    process.stdin.close()


async def _first(*waits: object) -> None:
    """Wait until the first of ``waits`` (coroutines) is done; cancel the rest."""
    tasks = [asyncio.ensure_future(wait) for wait in waits]  # type: ignore[call-overload]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()


def supervise(settings: Settings, listen: socket.socket, admin: socket.socket | None,
              on_ready: Callable[[Settings, int], None] | None = None) -> int:
    """Run the supervisor until SIGTERM/SIGINT; its exit status."""
    try:
        return run(Supervisor(settings, listen, admin).run(on_ready), settings.listen.loop)
    finally:
        listen.close()
        if admin is not None:
            admin.close()
