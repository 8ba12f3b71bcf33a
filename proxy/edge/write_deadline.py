"""The client side of an answer has a deadline: a client that reads nothing of it loses its connection.

Once the answer waiting in a connection's buffer is over the transport's high-water mark (asyncio's and
uvloop's: 64 KiB), the client has ``stall_deadline`` seconds to read it down to the low-water mark (16 KiB),
or its connection is aborted and the request logged as ``client_write_timeout`` (the role of nginx's
``send_timeout``). aiohttp then cancels the request's handler, which gives back what it held and closes its
upstream connection: the backend stops generating. A timer lives only while a connection is over its
high-water mark: nothing is armed per chunk written.

The deadline is ``MMGATE_CLIENT_WRITE_TIMEOUT``, and never longer than ``MMGATE_UPSTREAM_READ_TIMEOUT``:
while mmgate waits on the client it reads nothing from the upstream, and aiohttp's client drops its read
timer while its reading is paused, so the upstream's own deadline would otherwise be suspended.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from aiohttp import web

from proxy.edge.timer import Timer

# Set on a request whose client was cut for reading nothing of its answer (``client_gone_code``).
WRITE_TIMED_OUT = web.RequestKey("write_timed_out", bool)
WRITE_TIMEOUT_CODE = "client_write_timeout"


def stall_deadline(client_write_timeout: float, upstream_read_timeout: float) -> float:
    """Seconds a client may read nothing of its answer: ``MMGATE_CLIENT_WRITE_TIMEOUT`` (0 = off), never
    longer than ``MMGATE_UPSTREAM_READ_TIMEOUT``."""
    if client_write_timeout > 0:
        return min(client_write_timeout, upstream_read_timeout)
    return upstream_read_timeout


def client_gone_code(request: web.BaseRequest) -> str:
    """The log code of a request whose client went away: cut for reading nothing, or gone by itself."""
    return WRITE_TIMEOUT_CODE if request.get(WRITE_TIMED_OUT) else "client_closed"


def cut_for_reading_nothing(transport: asyncio.Transport, request: web.BaseRequest | None,
                            counted: Callable[[], None]) -> None:
    """Abort the connection, its ``request`` (if one is in flight) marked for ``client_gone_code``. Abort, not
    close: a close would wait for the client to read what it does not read."""
    if transport.is_closing():
        return
    if request is not None:
        request[WRITE_TIMED_OUT] = True
    counted()
    transport.abort()


class WriteDeadline:
    """One connection's write deadline: started when its answer goes over the high-water mark, stopped when
    the client read it down (or the connection ended); ``passed`` is called when it runs out."""

    __slots__ = ("_seconds", "_timer")

    def __init__(self, seconds: float, passed: Callable[[], None]) -> None:
        self._seconds = seconds  # 0: no deadline
        self._timer = Timer(passed)

    def start(self) -> None:
        """A deadline already running keeps running."""
        if self._seconds > 0:
            self._timer.start(self._seconds)

    def stop(self) -> None:
        self._timer.stop()
