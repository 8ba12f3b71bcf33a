"""Talking to the upstream: header hygiene, a request body that lets go of itself, the answer relayed back.

``open_upstream`` sends the request and returns the upstream's response once its headers arrived, or raises
``UpstreamError`` (or 503 ``local_resources_exhausted`` when mmgate's own descriptors or ports ran out);
``relay`` writes that response to the client and ends it (``close_upstream``, which the caller calls itself
only when something fails before). The answer is never
buffered whole on the way back (except a small one of known length): each chunk is written as it arrives, so
SSE tokens keep their timing. On the way, the relay counts the answer's output tokens as far as it can
without parsing it (``OutputCount``), for the adaptive limit's request classes. Header rules:

* RFC 9110 section 7.6.1: hop-by-hop fields (``Connection`` and every field it names, Keep-Alive,
  Proxy-Connection, Proxy-Authenticate, Proxy-Authorization, TE, Trailer, Transfer-Encoding, Upgrade)
  are removed in both directions; ``Host`` is set for the upstream by the client library.
* RFC 7239's de facto predecessors: ``X-Forwarded-For`` gets the client address appended,
  ``X-Forwarded-Proto`` is set.
"""

from __future__ import annotations

import errno
import logging
import os
import random
import re
from collections.abc import Awaitable, Callable, Mapping

import aiohttp
from aiohttp import hdrs, web
from aiohttp.abc import AbstractStreamWriter
from aiohttp.payload import Payload
from multidict import CIMultiDict, CIMultiDictProxy
from yarl import URL

from preprocessors.errors import (
    LOCAL_RESOURCES_EXHAUSTED,
    UPSTREAM_RESET,
    UPSTREAM_TIMEOUT,
    MmgateError,
)
from proxy.edge.aiohttp_internals import client_read_down, write_without_waiting
from proxy.edge.buffers import MediaBuffer
from proxy.edge.upstream_health import upstream_down

HOP_BY_HOP = frozenset(
    h.lower()
    for h in (
        "Connection", "Keep-Alive", "Proxy-Connection", "Proxy-Authenticate", "Proxy-Authorization",
        "TE", "Trailer", "Transfer-Encoding", "Upgrade",
    )
)
# Fields mmgate itself owns on the way up: the body length is recomputed, the deadline header is ours.
# ``Expect`` too: mmgate answered 100-continue itself and already holds the whole body (RFC 9110 section
# 10.1.1 makes the expectation hop-by-hop in effect: the upstream is not asked to confirm a body in flight).
_NOT_FORWARDED = frozenset({"host", "content-length", "x-mmgate-timeout", "expect"})
# Fields recomputed on the way back (aiohttp frames the body itself).
_NOT_RETURNED = frozenset({"content-length"})

FIRST_WRITE = 16 << 10  # bytes of a request body sent together with the request head
WRITE_PIECE = 256 << 10  # bytes of a request body written upstream at a time
SMALL_ANSWER = 64 << 10  # bytes: answers up to this size with a Content-Length are sent in one write
# Bytes of one answer read on from the upstream while its client is not reading, kept in the client's transport
# buffer (``relay``): a streamed chat answer of a few thousand tokens, so that the backend finishes it and
# the gate stops counting it. The gate's limit bounds how many answers are read ahead at once.
READ_AHEAD = 1 << 20

# A connect that fails with one of these failed for want of mmgate's own resources (descriptors, local ports,
# socket buffers), not because of the upstream: it is answered and logged as mmgate's, and never marks the
# upstream down.
LOCAL_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.EADDRNOTAVAIL, errno.ENOBUFS})
# Seconds a client is asked to wait after a local shortage: descriptors free up as connections end.
LOCAL_RETRY_AFTER = 1

log = logging.getLogger("mmgate")

_REQUEST_ID = re.compile(r"[A-Za-z0-9._-]{1,128}")


async def write_in_pieces(write: Callable[[memoryview], Awaitable[None]], view: memoryview) -> None:
    """``view`` written ``WRITE_PIECE`` bytes at a time, each once the transport has sent the one before
    (aiohttp drains after each write): the socket takes a piece straight from the buffer, the transport copies
    at most a piece's remainder, never the whole rest of a big buffer (a copy into fresh pages under
    ``runtime.memory``'s threshold), and the loop does one piece's work per turn."""
    for low in range(0, len(view), WRITE_PIECE):
        await write(view[low : low + WRITE_PIECE])


def request_id_for(incoming: str | None) -> str:
    """Keep a client's X-Request-Id when it is short and plain (log-safe), otherwise make one."""
    if incoming and _REQUEST_ID.fullmatch(incoming):
        return incoming
    return f"{random.getrandbits(128):032x}"  # an id, not a secret: no urandom syscall per request


def without_hop_by_hop(headers: CIMultiDictProxy[str] | CIMultiDict[str], drop: frozenset[str]) -> CIMultiDict[str]:
    """A copy of ``headers`` without hop-by-hop fields, the fields ``Connection`` names, and ``drop``."""
    named = {token.strip().lower() for value in headers.getall(hdrs.CONNECTION, ()) for token in value.split(",")}
    out: CIMultiDict[str] = CIMultiDict()
    for name, value in headers.items():
        lower = name.lower()
        if lower in HOP_BY_HOP or lower in named or lower in drop:
            continue
        out.add(name, value)
    return out


def upstream_headers(request: web.Request, request_id: str) -> CIMultiDict[str]:
    headers = without_hop_by_hop(request.headers, _NOT_FORWARDED)
    peer = request.remote or ""
    previous = request.headers.get("X-Forwarded-For")
    headers["X-Forwarded-For"] = f"{previous}, {peer}" if previous else peer
    headers["X-Forwarded-Proto"] = request.scheme
    headers["X-Request-Id"] = request_id
    return headers


class OneShotBody(Payload):
    """A request body that drops its buffers once written, then tells the caller.

    aiohttp's ClientRequest keeps its body for the request's whole lifetime (for redirects and retries,
    which a proxy never does): with a plain ``bytes`` body the media would stay alive until the response
    stream ends. This payload lets go of the bytes (releasing a ``MediaBuffer`` owner) as soon as the
    transport has them, then calls ``on_sent`` (the ``sent`` release point).

    The body is a ``MediaBuffer`` (one buffer: the media path joined it) or the chunks a text body arrived
    in, written one after the other without being joined.
    """

    _autoclose = True

    def __init__(self, body: list[bytes] | MediaBuffer, on_sent: Callable[[], None] | None = None) -> None:
        # aiohttp wants a Content-Type here; skip_auto_headers keeps it off the wire, so the client's own
        # Content-Type (or none) is what the upstream sees.
        super().__init__(None)
        self._body: list[bytes] | MediaBuffer | None = body
        self._length = len(body) if isinstance(body, MediaBuffer) else sum(map(len, body))
        self._size = self._length
        self._on_sent = on_sent

    def decode(self, encoding: str = "utf-8", errors: str = "strict") -> str:
        body = self._body
        data = body.data if isinstance(body, MediaBuffer) else b"".join(body or [])
        return data.decode(encoding, errors)

    async def write(self, writer: AbstractStreamWriter) -> None:
        await self.write_with_length(writer, None)

    async def write_with_length(self, writer: AbstractStreamWriter, content_length: int | None) -> None:
        body, self._body = self._body, None
        if body is None:
            raise RuntimeError("OneShotBody written twice")
        try:
            left = self._length if content_length is None else min(content_length, self._length)
            pieces = [body.data] if isinstance(body, MediaBuffer) else body
            for n, piece in enumerate(pieces):
                if left <= 0:
                    break
                with memoryview(piece) as whole:
                    # Views, so the part the socket does not take at once is copied exactly once, into the
                    # transport's buffer (slicing bytes would copy the rest first).
                    view = whole[:left]
                    left -= len(view)
                    if n == 0 and len(view) > FIRST_WRITE:
                        # aiohttp joins the request head with the first write into one buffer: a small first
                        # write keeps that copy small.
                        await writer.write(view[:FIRST_WRITE])
                        view = view[FIRST_WRITE:]
                    await write_in_pieces(writer.write, view)
                    del view
            del pieces
        finally:
            if isinstance(body, MediaBuffer):
                body.release()  # the handoff: the transport has every byte
            else:
                body.clear()
            del body
        self._consumed = True
        if self._on_sent is not None:
            on_sent, self._on_sent = self._on_sent, None
            on_sent()

    def _close(self) -> None:
        body, self._body = self._body, None
        if isinstance(body, MediaBuffer):
            body.release()
        self._on_sent = None


def local_shortage(exc: BaseException) -> str | None:
    """``"EMFILE (too many open files)"`` when ``exc`` is a connect that failed for want of mmgate's own
    resources (``LOCAL_ERRNOS``), else None."""
    number = getattr(getattr(exc, "os_error", None), "errno", None) if isinstance(
        exc, aiohttp.ClientConnectorError) else None
    if number not in LOCAL_ERRNOS:
        return None
    return f"{errno.errorcode[number]} ({os.strerror(number).lower()})"


def local_resources_exhausted(shortage: str) -> MmgateError:
    """503 for a request mmgate could not forward for want of its own resources (logged as mmgate's own)."""
    log.error("mmgate could not open a connection to the upstream: %s; mmgate's own shortage, not the upstream's "
              "fault: raise the file descriptor limit (ulimit -n) or lower MMGATE_MAX_CONNECTIONS", shortage)
    return LOCAL_RESOURCES_EXHAUSTED.error(
        "mmgate has no resources left to open a connection to the upstream; the request was not forwarded, "
        "retry shortly", headers={"Retry-After": str(LOCAL_RETRY_AFTER)})


def _drop_tracebacks(exc: BaseException) -> None:
    seen: set[int] = set()
    pending: list[BaseException | None] = [exc]
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        current.__traceback__ = None
        pending += [current.__cause__, current.__context__, getattr(current, "os_error", None)]
        if isinstance(current, BaseExceptionGroup):
            pending += current.exceptions


def _classify(exc: BaseException, *, headers_received: bool) -> MmgateError:
    """A client-library failure as the error a client sees and the kind the metrics count.

    The tracebacks of the failure and of every error it chains are dropped: aiohttp's connector and
    aiohappyeyeballs keep the errors they raise in locals of frames those tracebacks hold (``last_exc``,
    ``exceptions``), cycles that would keep the request's frames, and its media buffer, alive until the garbage
    collector runs."""
    _drop_tracebacks(exc)
    if (shortage := local_shortage(exc)) is not None:
        return local_resources_exhausted(shortage)
    if isinstance(exc, (aiohttp.ConnectionTimeoutError, aiohttp.ClientConnectorError)):
        # The same answer as a media request gets while the upstream is known to be down: one down backend,
        # one status, code and Retry-After for every request (an answer the backend gave itself, a 502 of its
        # own included, is relayed as it came).
        return upstream_down(f"cannot connect to the upstream ({exc.__class__.__name__})")
    if isinstance(exc, (aiohttp.SocketTimeoutError, aiohttp.ServerTimeoutError, TimeoutError)):
        where = "while streaming" if headers_received else "before answering"
        return UPSTREAM_TIMEOUT.error(f"the upstream sent nothing for too long {where}")
    return UPSTREAM_RESET.error(f"the upstream connection failed: {exc.__class__.__name__}")


async def open_upstream(
    session: aiohttp.ClientSession,
    request: web.Request,
    url: str,
    body: list[bytes] | MediaBuffer | None,
    request_id: str,
    own_headers: Mapping[str, str | None],
    on_sent: Callable[[], None] | None,
    timeout: aiohttp.ClientTimeout,
) -> aiohttp.ClientResponse:
    """Send ``request`` on: its headers as ``upstream_headers`` makes them, with ``own_headers`` (mmgate's) set,
    or removed where None; ``body`` as a ``OneShotBody`` that calls ``on_sent`` once written. The upstream's
    response once its headers arrived. Raises ``UpstreamError``, or ``LOCAL_RESOURCES_EXHAUSTED`` when mmgate
    itself could not open the connection.

    What it returns is ended by ``relay``; the caller must ``close_upstream`` it if anything fails
    before."""
    headers = upstream_headers(request, request_id)
    for name, value in own_headers.items():
        if value is None:
            headers.popall(name, None)
        else:
            headers[name] = value
    payload = OneShotBody(body, on_sent) if body is not None else None
    del body  # the payload is the body's only holder here: it lets go of it once written
    try:
        return await session.request(
            request.method,
            URL(url, encoded=True),  # the checked target (proxy/edge/paths.py), never re-encoded
            data=payload,
            headers=headers,
            timeout=timeout,
            allow_redirects=False,
            skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding", "Content-Type"),
        )
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise _classify(exc, headers_received=False) from None


async def relay(request: web.Request, upstream: aiohttp.ClientResponse, extra_headers: dict[str, str], *,
                started: Callable[[web.StreamResponse], None],
                client_waits: Callable[[], bool] | None = None,
                upstream_done: Callable[[int | None], None] | None = None) -> web.StreamResponse:
    """Relay the upstream's answer to the client: its status and end-to-end headers plus ``extra_headers``
    (``_start``), then its body chunk by chunk (``_copy_body``), ending the response and the upstream's
    (``close_upstream``). Returns the client's response.

    ``started`` is given the response once its headers went out: from then on a failure, the upstream's
    (``UpstreamError``) or the request's deadline, can only end that response as the client's API allows, and
    the caller must know it. The caller closes the upstream's answer if this raises."""
    response = await _start(request, upstream, extra_headers)
    started(response)
    await _copy_body(upstream, response, client_waits, upstream_done)
    return response


async def _start(request: web.Request, upstream: aiohttp.ClientResponse,
                 extra_headers: dict[str, str]) -> web.StreamResponse:
    """Start the client's response: the upstream's status and end-to-end headers plus ``extra_headers``,
    prepared (headers sent). Raises ``UpstreamError`` only while nothing went out yet.

    A small answer of known length (a typical non-streaming completion) is read whole first, so headers and
    body leave in one write instead of two; ``_copy_body`` then only finishes it."""
    length = upstream.headers.get(hdrs.CONTENT_LENGTH)
    chunked = hdrs.TRANSFER_ENCODING in upstream.headers
    known_length = int(length) if length is not None and not chunked and length.isdigit() else None
    headers = without_hop_by_hop(upstream.headers, _NOT_RETURNED)
    headers.update(extra_headers)
    if known_length is not None and 0 < known_length <= SMALL_ANSWER and request.method != "HEAD":
        try:
            data = await upstream.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise _classify(exc, headers_received=False) from None
        whole = web.Response(status=upstream.status, reason=upstream.reason, body=data)
        whole.headers.extend(headers)
        await whole.prepare(request)
        return whole
    response = web.StreamResponse(status=upstream.status, reason=upstream.reason)
    response.headers.extend(headers)
    if known_length is not None:
        response.content_length = known_length
    elif request.method != "HEAD" and upstream.status not in (204, 304):
        response.enable_chunked_encoding()
    await response.prepare(request)
    return response


class OutputCount:
    """An answer's output tokens as the relay sees them, without parsing it.

    A whole answer (one of known length, read by ``_start``): its ``completion_tokens`` in ``usage``, found by one
    search of its bytes. An event stream (``text/event-stream``, the WHATWG HTML "Server-sent events" format):
    its events, one per line that starts with a ``data:`` field, less a closing ``data: [DONE]``; a model
    server's streamed completion sends one event per token or so, and a JSON string in an event cannot hold a
    raw newline, so no text inside one starts a line. Anything else: unknown (None)."""

    _USAGE = re.compile(rb'"completion_tokens"\s*:\s*(\d+)')
    _EVENT = b"\ndata:"
    _DONE = b"[DONE]"

    def __init__(self) -> None:
        self._events = 0
        self._tail = b"\n"  # the bytes before the next chunk (the start of the stream starts a line)
        self._end = b""  # the stream's last bytes, for its closing event

    @classmethod
    def of_whole(cls, body: bytes) -> int | None:
        found = cls._USAGE.search(body)
        return int(found.group(1)) if found is not None else None

    def feed(self, chunk: bytes) -> None:
        """Count the events that start in ``chunk`` (one may start in the bytes before it)."""
        span = len(self._EVENT) - 1
        self._events += (self._tail + chunk[:span]).count(self._EVENT) + chunk.count(self._EVENT)
        self._tail = (self._tail + chunk[-span:])[-span:]
        self._end = (self._end + chunk[-16:])[-16:]

    @property
    def events(self) -> int:
        return self._events - (self._end.rstrip().endswith(self._DONE))


async def _copy_body(upstream: aiohttp.ClientResponse, response: web.StreamResponse,
                     client_waits: Callable[[], bool] | None,
                     upstream_done: Callable[[int | None], None] | None) -> None:
    """Copy the upstream's body to the client chunk by chunk, then end the response and the upstream's
    (``close_upstream``). A failure of the upstream now raises ``UpstreamError`` too, but the status already
    went out: the caller can only end the response as the client's API allows (and close the upstream's).

    With ``client_waits`` (whether the answer waits on a client that is not reading), the relay reads on from
    the upstream while the client is not reading, up to ``READ_AHEAD`` bytes more in the client's transport
    buffer, so that a backend whose client stalled can still finish and free what it holds. ``upstream_done``
    is called once the upstream's answer has been read to its end, before the end goes out to the client (the
    moment the backend is done with the request), with the answer's output tokens as far as the relay could
    count them (``OutputCount``), or None."""
    tokens: int | None = None
    if isinstance(response, web.Response):  # a small answer was read whole by _start
        tokens = OutputCount.of_whole(response.body) if isinstance(response.body, bytes) else None
    else:
        count = OutputCount() if upstream.content_type == "text/event-stream" else None
        ahead = 0  # bytes added while the client was not reading
        try:
            async for chunk in upstream.content.iter_any():
                if count is not None:
                    count.feed(chunk)
                if client_waits is None:
                    await response.write(chunk)  # waits while the client reads what is buffered down
                    continue
                await write_without_waiting(response, chunk)
                if not client_waits():
                    ahead = 0
                    continue
                ahead += len(chunk)
                if ahead > READ_AHEAD:  # read ahead enough: from here on the upstream waits on the client too
                    await client_read_down(response)
                    ahead = 0
        except ConnectionResetError:
            # The client left: aiohttp's ClientConnectionResetError from the write is an aiohttp ClientError
            # too, but it is no upstream failure (499 client_closed, not 502 upstream_reset).
            raise
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise _classify(exc, headers_received=True) from None
        tokens = count.events if count is not None else None
    close_upstream(upstream)
    if upstream_done is not None:
        upstream_done(tokens)
    await response.write_eof()


def close_upstream(upstream: aiohttp.ClientResponse) -> None:
    """End the upstream request whatever happened (done, client gone, deadline): an unfinished body closes
    the connection, which is how the backend learns to stop generating."""
    if upstream.content.is_eof():
        upstream.release()
    else:
        upstream.close()
