"""Client connections: how many may be open, and how long a request head may take to arrive.

aiohttp bounds the size of a request head but not the time it takes, so a client that sends header lines
slowly holds a connection (and its buffers) as long as it likes, and nothing caps how many connections
are open at once. ``GuardedSite`` listens like ``web.TCPSite`` but wraps every connection in a
``GuardedConnection`` that

* caps the connections open at once at ``MMGATE_MAX_CONNECTIONS``. At the cap, a new connection first
  takes the place of the connection idle the longest: one between requests (aiohttp waiting for its next
  head, no byte of it arrived, the last answer flushed) or opened without a byte sent yet, where "arrived"
  includes bytes in the kernel's receive buffer the loop has not read yet (``bytes_waiting``), closed the way
  aiohttp's own keep-alive timer closes it (RFC 9112 section 9.5: a server may close an idle connection
  at any time, and clients retry on a new one). A connection in the middle of a request is never closed
  for this. Only when every connection is busy is a new one over the cap: it is read just far enough to
  see its request line (``PROBE_LINE_MAX`` bytes, within the head deadline). Liveness and readiness
  (``GET``/``HEAD`` ``/mmgate/health`` or ``/mmgate/ready``) are served to it by the app, on a connection
  that closes after the answer and never carries a body; anything else gets a complete 503
  (``too_many_connections``, ``Retry-After``), an access log line and a close. At most ``PROBE_RESERVE``
  connections are over the cap at once; a new one replaces the oldest that has not shown its request line yet;
* gives the request head ``MMGATE_HEADER_TIMEOUT`` seconds from the connection's opening, or from the
  first byte after an idle keep-alive pause: then it answers 408 ``header_timeout`` and closes (the
  role of nginx's ``client_header_timeout``). Idle keep-alive connections are closed by aiohttp after
  ``MMGATE_KEEPALIVE_TIMEOUT``; the body has its own deadline (``MMGATE_BODY_READ_TIMEOUT``);
* cuts a client that reads nothing of its answer for ``MMGATE_CLIENT_WRITE_TIMEOUT`` (``write_deadline``),
  and calls ``GuardedConnection.on_stall`` the first time its answer waits on it.

A head is known to be complete when aiohttp hands the request to the application: ``mark_head_received``
(a middleware) tells the connection, and re-opens the head deadline for the next request once the
response is done and the body was read whole (a body left unread is drained by aiohttp's lingering close,
which ends the connection anyway).
"""

from __future__ import annotations

import asyncio
import fcntl
import re
import sys
import termios
import time
from collections.abc import Callable
from typing import Any, cast

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from preprocessors.errors import HEADER_TIMEOUT, TOO_MANY_CONNECTIONS, MmgateError
from proxy.edge.access_log import log_refused_connection
from proxy.edge.aiohttp_internals import reading_held_by_aiohttp, waits_for_next_request
from proxy.edge.error_response import raw_error_response
from proxy.edge.timer import Timer
from proxy.edge.write_deadline import WriteDeadline, cut_for_reading_nothing
from proxy.settings import PROBE_RESERVE

PROBE_PATHS = frozenset({"/mmgate/health", "/mmgate/ready"})
# The longest request line a probe sends: "GET /mmgate/ready?<query> HTTP/1.1".
PROBE_LINE_MAX = 256
PROBE_LINE = re.compile(rb"(?:GET|HEAD) /mmgate/(?:health|ready)(?:\?[^ ]*)? HTTP/1\.[01]\r?\n")


def bytes_waiting(transport: asyncio.BaseTransport) -> bool:
    """Bytes from the client wait in the kernel's receive buffer, not yet read by the loop: a request that
    arrived before its connection's first read (a burst of new connections is accepted, and their protocols
    made, before the loop reads any of them)."""
    sock = transport.get_extra_info("socket")
    if sock is None:
        return False
    try:
        waiting = fcntl.ioctl(sock.fileno(), termios.FIONREAD, bytes(4))
    except OSError:  # closed under us: nothing to read on it either way
        return False
    return int.from_bytes(waiting, sys.byteorder) > 0


class ConnectionGuard:
    """The open client connections of one app, and the limits they live under."""

    def __init__(self, max_connections: int, header_timeout: float,
                 on_refused: Callable[[str], None] = lambda code: None,
                 on_idle_closed: Callable[[], None] = lambda: None, *, write_timeout: float = 0.0,
                 on_write_timeout: Callable[[], None] = lambda: None, access_log: bool = True) -> None:
        self.max_connections = max_connections
        self.header_timeout = header_timeout
        self.on_refused = on_refused
        self.on_idle_closed = on_idle_closed
        self.write_timeout = write_timeout  # ``write_deadline.stall_deadline``; 0 = none
        self.on_write_timeout = on_write_timeout
        self.access_log = access_log  # MMGATE_ACCESS_LOG: a line for each connection refused before any handler
        self.open = 0
        self._by_handler: dict[RequestHandler, GuardedConnection] = {}
        # Connections that may be idle, the one idle the longest first (dicts keep insertion order).
        self._idle: dict[GuardedConnection, None] = {}
        # Over the cap: those whose request line has not arrived yet, and those served a probe.
        self._sniffing: dict[GuardedConnection, None] = {}
        self._probes = 0

    def connection_for(self, handler: Any) -> GuardedConnection | None:
        return self._by_handler.get(handler)

    @property
    def idle(self) -> int:
        """Connections idle right now (between requests, nothing of the next one arrived)."""
        return sum(conn.idle_handler() is not None for conn in self._idle)

    @property
    def waiting_on_clients(self) -> int:
        """Connections whose answer waits on a client that is not reading it (``GuardedConnection.waits_on_client``)."""
        return sum(conn.waits_on_client() for conn in self._by_handler.values())

    @property
    def over_the_cap(self) -> int:
        """Connections beyond MMGATE_MAX_CONNECTIONS: read for their request line, or served a probe."""
        return len(self._sniffing) + self._probes

    def too_many(self) -> MmgateError:
        return TOO_MANY_CONNECTIONS.error(
            f"{self.open} client connections are open, the limit (MMGATE_MAX_CONNECTIONS); retry later",
            headers={"Retry-After": "1"})

    def refused(self, error: MmgateError, request_line: bytes, seconds: float) -> None:
        """A refusal no request handler saw (``request_line``: what arrived of it, maybe nothing, ``seconds``
        after the connection opened): counted, and logged like a request."""
        self.on_refused(error.code)
        if self.access_log:
            log_refused_connection(error, request_line, seconds)

    def _admit(self) -> bool:
        """Whether a new connection fits: under the cap, or in the place of the connection idle the longest."""
        if self.open < self.max_connections:
            return True
        for conn in self._idle:
            if (handler := conn.idle_handler()) is not None:
                conn.close_idle(handler)
                self.on_idle_closed()
                return True
        return False

    def _room_over_the_cap(self, conn: GuardedConnection) -> bool:
        """Room for one more connection over the cap, read for a probe; the oldest still silent makes way."""
        if self.over_the_cap >= PROBE_RESERVE:
            if not self._sniffing:
                return False
            next(iter(self._sniffing)).refuse()
        self._sniffing[conn] = None
        return True

    def _opened(self, conn: GuardedConnection, handler: RequestHandler) -> None:
        self.open += 1
        self._by_handler[handler] = conn

    def _closed(self, conn: GuardedConnection, handler: RequestHandler | None) -> None:
        """Idempotent: a connection closed for idleness is counted out at once, before its transport is gone."""
        self._idle.pop(conn, None)
        self._sniffing.pop(conn, None)
        if handler is not None and self._by_handler.pop(handler, None) is not None:
            if conn.probe:
                self._probes -= 1
            else:
                self.open -= 1


class GuardedConnection(asyncio.Protocol):
    """One client connection: aiohttp's own protocol inside; the cap, the head and write deadlines around."""

    # Set by connection_made, which asyncio calls before any other method of a protocol.
    _transport: asyncio.Transport

    def __init__(self, guard: ConnectionGuard, make_handler: Callable[[], RequestHandler]) -> None:
        self._guard = guard
        self._make_handler = make_handler
        self._handler: RequestHandler | None = None
        self._opened_at = time.perf_counter()
        self._head_deadline = Timer(self._head_too_slow)
        self._write_deadline = WriteDeadline(guard.write_timeout, lambda: cut_for_reading_nothing(
            self._transport, self._request, guard.on_write_timeout))
        # Called once, the first time the client's answer waits over the high-water mark (then cleared).
        self.on_stall: Callable[[], None] | None = None
        self._paused_writing = False  # the answer waits over the high-water mark: the client is not reading
        self._awaiting_head = True  # no request in the handler's hands: the next bytes are a head
        self._request: web.BaseRequest | None = None  # the request in the handler's hands, or its body draining
        self._answered = False  # the handler is done with that request
        self._next_head_started = False  # a byte of the next request arrived
        # Bytes that arrived behind the end of the head not yet handed over (its body, and maybe the next head).
        self._after_head: int | None = None
        self._head_tail = b""  # the last bytes of a head still arriving, to find its end across reads
        self._sniffed: bytearray | None = None  # over the cap: the bytes read so far, request line not seen
        self.probe = False  # over the cap, served one liveness or readiness probe
        # Pacing (proxy/edge/pacing.py): reading held, what arrived since (aiohttp may resume the transport for its
        # own flow control: that read waits here), and bytes received since the pacer last asked.
        self._held = False
        self._held_data: list[bytes] = []
        self._bytes_read = 0

    # --- asyncio.Protocol, delegated to aiohttp's RequestHandler ---

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream transport: asyncio's and uvloop's TCP transports alike (no common class to check against).
        self._transport = cast(asyncio.Transport, transport)
        guard = self._guard
        if guard._admit():
            self._handler = self._make_handler()
            guard._opened(self, self._handler)
            guard._idle[self] = None  # nothing sent yet: the first to make way at the cap, if it stays silent
            self._handler.connection_made(transport)
        elif guard._room_over_the_cap(self):
            self._sniffed = bytearray()
        else:
            self.refuse()
            return
        self._head_deadline.start(guard.header_timeout)

    def data_received(self, data: bytes) -> None:
        if self._handler is None:
            if self._sniffed is not None:
                self._sniff(self._sniffed, data)
            return  # refused: whatever the client still sends is dropped with the connection
        if self._held:
            self._held_data.append(data)
            self._pause_transport()
            return
        self._bytes_read += len(data)
        request = self._request
        if request is not None and self._answered and request.content.is_eof():
            self._head_follows()  # the body aiohttp drained after the answer is all in
            request = None
        body_done = request is not None and request.content.is_eof()
        if self._awaiting_head or body_done:
            self._next_request_started()
        if self._awaiting_head:
            self._follow_head(data)
        if request is None or body_done or request.content_length is None:
            self._handler.data_received(data)
            return
        # The chunk that ends a Content-Length body may carry the start of a pipelined request behind it.
        before = request.content.total_bytes
        self._handler.data_received(data)
        if request.content.is_eof() and request.content.total_bytes - before < len(data):
            self._next_request_started()
            if self._answered:
                self._head_follows()

    def eof_received(self) -> bool | None:
        if self._handler is not None:
            self._held = False  # the client has sent everything: what arrived before the end goes first
            self._deliver_held()
            self._handler.eof_received()  # aiohttp's handler returns None: keep the transport's default close
        return None

    def pause_writing(self) -> None:
        self._paused_writing = True
        if self._handler is not None:
            self._handler.pause_writing()
            self._write_deadline.start()
            on_stall, self.on_stall = self.on_stall, None
            if on_stall is not None:
                on_stall()

    def resume_writing(self) -> None:
        self._paused_writing = False
        self._write_deadline.stop()
        if self._handler is not None:
            self._handler.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self._head_deadline.stop()
        self._write_deadline.stop()
        self._request = None
        self._sniffed = None
        self._held, self._held_data = False, []
        handler, self._handler = self._handler, None
        self._guard._closed(self, handler)
        if handler is not None:
            handler.connection_lost(exc)

    def waits_on_client(self) -> bool:
        """Whether the answer waits on the client: more of it is buffered than the client reads (over the
        transport's high-water mark, not yet read down to its low-water mark)."""
        return self._paused_writing

    # --- pacing: a valve of proxy/edge/pacing.py ---

    def hold_reading(self) -> None:
        """Stop reading from the client until ``release_reading``: its bytes wait in the socket buffer."""
        self._held = True
        self._pause_transport()

    def release_reading(self) -> None:
        """Read again: what arrived while held first, then the socket, unless aiohttp's own flow control
        (a full body buffer or message queue) still wants the transport paused."""
        if not self._held:
            return
        self._held = False
        self._deliver_held()
        handler, transport = self._handler, self._transport
        if handler is None or transport.is_closing() or self._held:
            return
        if not reading_held_by_aiohttp(handler):
            transport.resume_reading()

    def take_bytes_read(self) -> int:
        """Bytes received from the client since the last call."""
        count, self._bytes_read = self._bytes_read, 0
        return count

    def _deliver_held(self) -> None:
        held, self._held_data = self._held_data, []
        for data in held:
            self.data_received(data)

    def _pause_transport(self) -> None:
        transport = self._transport
        if not transport.is_closing() and transport.is_reading():
            transport.pause_reading()

    # --- idleness, and the connections over the cap ---

    def idle_handler(self) -> RequestHandler | None:
        """aiohttp's handler of this connection when it is idle, else None. Idle is between requests: aiohttp
        waits for the next head (its keep-alive timer's own test), no byte of it arrived, and the last answer
        left the process."""
        handler, transport = self._handler, self._transport
        if handler is None or transport.is_closing() or self._next_head_started or self._held_data:
            return None
        if not waits_for_next_request(handler) or transport.get_write_buffer_size() or bytes_waiting(transport):
            return None
        return handler

    def close_idle(self, handler: RequestHandler) -> None:
        """Close this idle connection (``handler``: its ``idle_handler``) as aiohttp's keep-alive timer does,
        and count it out now."""
        self._head_deadline.stop()
        self._guard._closed(self, handler)
        handler.force_close()

    def refuse(self) -> None:
        """Over the cap and not a probe: a complete 503, then close."""
        transport = self._transport
        self._head_deadline.stop()
        sniffed, self._sniffed = self._sniffed, None
        self._guard._closed(self, self._handler)
        if transport.is_closing():
            return
        error = self._guard.too_many()
        self._guard.refused(error, bytes(sniffed or b""), time.perf_counter() - self._opened_at)
        transport.write(raw_error_response(error))
        transport.close()

    def _sniff(self, sniffed: bytearray, data: bytes) -> None:
        """Over the cap: ``data`` after ``sniffed``, what arrived before it, until the request line is in."""
        sniffed += data
        end = sniffed.find(b"\n", 0, PROBE_LINE_MAX)
        if end < 0:
            if len(sniffed) >= PROBE_LINE_MAX:
                self.refuse()
            return
        if PROBE_LINE.fullmatch(sniffed, 0, end + 1) is None:
            self.refuse()
            return
        guard = self._guard
        guard._sniffing.pop(self, None)
        guard._probes += 1
        self.probe = True
        self._sniffed = None
        self._handler = self._make_handler()
        guard._by_handler[self._handler] = self
        self._handler.connection_made(self._transport)
        self._handler.data_received(bytes(sniffed))

    def _follow_head(self, data: bytes) -> None:
        """Where the arriving head ends: what follows it in the same reads is its body, or the next request."""
        if self._after_head is not None:
            self._after_head += len(data)
            return
        seen = self._head_tail + data
        end = seen.find(b"\r\n\r\n")
        if end < 0:
            self._head_tail = seen[-3:]
        else:
            self._after_head = len(seen) - end - 4

    def _next_request_started(self) -> None:
        self._next_head_started = True
        self._guard._idle.pop(self, None)
        if self._awaiting_head:
            self._head_deadline.start(self._guard.header_timeout)

    def _head_follows(self) -> None:
        """The answered request's body is all in: the next bytes are a head, under the head deadline."""
        self._request = None
        self._awaiting_head = True
        if self._next_head_started:
            self._head_deadline.start(self._guard.header_timeout)

    # --- the head deadline ---

    def head_received(self, request: web.BaseRequest) -> None:
        self._awaiting_head = False
        self._request = request
        self._answered = False
        # Bytes behind this head beyond its Content-Length are the next request's (a chunked body's end is
        # not known here: such a request counts as idle once answered).
        after_head = self._after_head or 0
        self._next_head_started = after_head > (request.content_length or 0) and "chunked" not in \
            request.headers.get("Transfer-Encoding", "").lower()
        self._after_head, self._head_tail = None, b""
        self._guard._idle.pop(self, None)
        self._head_deadline.stop()

    def response_done(self, body_read: bool) -> None:
        """The handler is done with a request. Its next bytes start a new head, unless this body was left
        unread: aiohttp drains it after the answer (lingering close) and closes the connection, or keeps it
        when the body ends in time; the head deadline then starts with the first byte behind the body."""
        self._answered = True
        if body_read:
            self._head_follows()  # a pipelined head that already began has its deadline run from now

    def request_finished(self) -> None:
        """The answer is written: the connection may now wait idle for its next request (``idle_handler`` tells
        when aiohttp is done draining an unread body)."""
        if self._handler is not None and not self._next_head_started and not self.probe:
            self._guard._idle[self] = None

    def _head_too_slow(self) -> None:
        transport = self._transport
        if not self._awaiting_head or transport.is_closing():
            return
        error = HEADER_TIMEOUT.error(
            f"the request head did not arrive within {self._guard.header_timeout:g} s (MMGATE_HEADER_TIMEOUT)")
        self._guard.refused(error, bytes(self._sniffed or b""), self._guard.header_timeout)
        transport.write(raw_error_response(error))
        transport.close()

