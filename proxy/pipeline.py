"""One request, start to finish (README "How a request flows"): read, sniff, locate, admit, preprocess, splice,
forward, release, stream. Text-only bodies leave after the sniff, untouched, without a parse, the gate or
the pool. Read ``handle_request`` top to bottom; the media steps are in ``prepare_media``.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
import weakref
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable

from aiohttp import HttpVersion11, hdrs, web

from preprocessors.audio import validate_audio
from preprocessors.base import Cancelled, Checkpoint, MediaError
from preprocessors.dataurl import decode_base64, decoded_size, encode_base64, parse_data_url
from preprocessors.image import image_mime, process_image
from preprocessors.pool import run_soon

from .admission import Lease, Place
from .buffers import BufferReleased, MediaBuffer
from .dialects import MediaPart, Route, find_media, route_for
from .errors import Dialect, ProxyError, dialect_for_path
from .metrics import Stopwatch, server_timing
from .paths import Target, is_allowed, normalise_target
from .splice import Span, may_contain_media, splice
from .state import STATE, AppState
from .upstream import (
    UPSTREAM_ERROR_KIND,
    BrokenStream,
    OneShotBody,
    ReleasePoints,
    forward,
    request_id_for,
    upstream_headers,
)


log = logging.getLogger("mmgate.access")

CLIENT_CLOSED = 499  # nginx's convention for "client went away"; metrics label only


@dataclass
class Exchange:
    """What mmgate knows about one request while it is in flight (and logs when it ends)."""

    request_id: str
    route: Route
    dialect: Dialect
    kind: str = "text"
    status: int = 0
    code: str = ""
    watch: Stopwatch = field(default_factory=Stopwatch)
    response: web.StreamResponse | None = None
    place: Place | None = None  # held while a big media body is still arriving
    lease: Lease | None = None
    lease_owned_by_batch: bool = False
    media: weakref.ref[MediaBuffer] | None = None  # weak: the payload is the owner's only strong holder
    bytes_in: int = 0
    media_in: int = 0
    media_out: int = 0

    upstream_started: float = 0.0

    def timing_header(self) -> dict[str, str]:
        stages = [(s, self.watch.stages[s]) for s in ("queue", "preprocess") if s in self.watch.stages]
        stages.append(("upstream", time.perf_counter() - self.upstream_started))
        return {"Server-Timing": server_timing(stages)}


# ----------------------------------------------------------------------------------------------------------
# the request


async def handle_request(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    settings = state.settings
    ex = Exchange(
        request_id=request_id_for(request.headers.get("X-Request-Id")),
        route="other",
        dialect=dialect_for_path(request.path),
    )
    state.request_started()
    deadline: asyncio.Timeout | None = None
    try:
        if state.refusing:
            raise ProxyError.draining()
        when = _request_deadline(request, settings.request_timeout)
        if when is None:  # the common case: no timer to arm and cancel for every request
            return await _serve(request, state, ex)
        deadline = asyncio.timeout_at(when)
        async with deadline:
            return await _serve(request, state, ex)
    except TimeoutError:
        if deadline is None or not deadline.expired():
            return await _refuse(request, state, ex, _internal_error(ex))
        return await _refuse(request, state, ex, ProxyError(504, "request_timeout", "the request deadline passed"))
    except ProxyError as error:
        return await _refuse(request, state, ex, error)
    except BrokenStream as broken:
        return await _refuse(request, state, ex, broken.error)
    except (asyncio.CancelledError, ConnectionResetError):
        ex.status, ex.code = CLIENT_CLOSED, "client_closed"
        raise
    except Exception:
        # The last guard: a fault of mmgate's own is logged once with its traceback, and the client gets a
        # 500 in its API's shape naming the request id, never a traceback.
        return await _refuse(request, state, ex, _internal_error(ex))
    finally:
        if ex.place is not None:
            ex.place.release()
        if ex.lease is not None and not ex.lease_owned_by_batch:
            ex.lease.release()
        _let_go(ex)
        state.request_finished()
        _record(state, ex, request)


def _internal_error(ex: Exchange) -> ProxyError:
    log.exception("request %s: internal error", ex.request_id)
    return ProxyError(500, "internal_error",
                      f"mmgate failed on this request; its log has the details under request id {ex.request_id}")


def _checked_target(request: web.Request, allow_paths: tuple[str, ...]) -> Target:
    """The one path decision (proxy/paths.py): the normalised target, if it may be forwarded at all."""
    target = normalise_target(request.raw_path)
    if target.path.startswith("/mmgate/") or not is_allowed(target.path, allow_paths):
        raise ProxyError(404, "path_not_allowed", f"{target.path[:200]} is not served by this proxy")
    return target


async def expect_continue(request: web.Request) -> None:
    """``Expect: 100-continue`` (RFC 9110 section 10.1.1): invite the body only when it will be read.

    A request that will be refused anyway (path not allowed, body over the limit, draining, an unknown
    expectation) gets its refusal without a 100, so a well-behaved client never sends that body."""
    if request.version != HttpVersion11:
        return
    if request.headers.get(hdrs.EXPECT, "").strip().lower() != "100-continue":
        return  # answered with 417 by handle_request, in the client's API shape
    state = request.app[STATE]
    length = request.content_length
    if state.refusing or (length is not None and length > state.settings.max_body_bytes):
        return
    try:
        _checked_target(request, state.settings.allow_paths)
    except ProxyError:
        return
    await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
    request.writer.output_size = 0  # the interim answer is not part of the response's size


def _request_deadline(request: web.Request, configured: float) -> float | None:
    """Seconds from now: MMGATE_REQUEST_TIMEOUT, lowered (never raised) by ``X-MMGate-Timeout``."""
    limit = configured or None
    raw = request.headers.get("X-MMGate-Timeout")
    if raw is not None:
        try:
            asked = float(raw)
        except ValueError:
            asked = float("nan")
        if not 0 < asked < float("inf"):
            raise ProxyError(400, "invalid_timeout_header",
                             f"X-MMGate-Timeout must be a positive number of seconds, got {raw[:32]!r}")
        limit = asked if limit is None else min(limit, asked)
    return None if limit is None else asyncio.get_running_loop().time() + limit


async def _serve(request: web.Request, state: AppState, ex: Exchange) -> web.StreamResponse:
    settings = state.settings
    target = _checked_target(request, settings.allow_paths)
    ex.dialect = dialect_for_path(target.path)
    ex.route = route_for(request.method, target.path)
    if request.headers.get(hdrs.UPGRADE, "").lower() == "websocket":
        raise ProxyError(501, "websocket_not_supported", "WebSocket upgrades are not proxied")
    expect = request.headers.get(hdrs.EXPECT)
    if expect is not None and expect.strip().lower() != "100-continue":
        raise ProxyError(417, "expectation_failed",
                         f"Expect: {expect[:64]!r} is not supported; only 100-continue is (RFC 9110 section 10.1.1)")

    if ex.route != "other":
        encoding = request.headers.get(hdrs.CONTENT_ENCODING, "identity").strip().lower()
        if encoding not in ("", "identity"):  # compressed media could slip past every check
            raise ProxyError(415, "unsupported_content_encoding",
                             f"Content-Encoding {encoding[:32]!r} is not accepted on a media route; send identity")
    started = time.perf_counter()
    on_head = partial(_take_place_for_media, state, ex) if ex.route != "other" else None
    body = await read_body(request, settings.max_body_bytes, settings.body_read_timeout, on_head)
    ex.watch.add("read", time.perf_counter() - started)
    ex.bytes_in = len(body)

    outgoing: bytes | MediaBuffer = body
    del body
    is_stream = False
    if ex.route != "other" and may_contain_media(outgoing):
        outgoing = state.buffers.hold(outgoing)  # from here on the owner is the only holder of the bytes
        ex.media = weakref.ref(outgoing)
        is_stream = await prepare_media(state, ex, outgoing)
    if ex.place is not None:  # the body held no media after all: give the place back before forwarding
        ex.place.release()
    release = _release_points(state, ex, is_stream)
    # The payload is now the only holder: it releases the bytes once they are written (the handoff).
    payload = OneShotBody(outgoing, release.on_sent) if len(outgoing) else None
    del outgoing

    ex.upstream_started = time.perf_counter()
    assert state.session is not None
    try:
        return await forward(
            request,
            state.session,
            settings.upstream + target.forwarded,
            payload,
            upstream_headers(request, ex.request_id),
            state.upstream_timeout(),
            release,
            partial(_response_headers, settings.server_timing, ex),
            partial(setattr, ex, "response"),
        )
    except (ProxyError, BrokenStream) as exc:
        error = exc if isinstance(exc, ProxyError) else exc.error
        state.metrics.upstream_errors.labels(UPSTREAM_ERROR_KIND.get(error.code, "other")).inc()
        raise
    finally:
        ex.watch.add("upstream", time.perf_counter() - ex.upstream_started)


def _release_points(state: AppState, ex: Exchange, is_stream: bool) -> ReleasePoints:
    """Where the gate lease ends (MMGATE_RELEASE_AT; ``auto``: headers if streaming, else sent). The media
    bytes themselves are always let go at handoff, by the payload."""
    release = ReleasePoints()
    if ex.lease is not None:
        release_at = state.settings.release_at
        if release_at == "auto":
            release_at = "headers" if is_stream else "sent"
        if release_at == "sent":
            release.on_sent = ex.lease.release
        elif release_at == "headers":
            release.on_headers = ex.lease.release
    return release


def _take_place_for_media(state: AppState, ex: Exchange, head: bytes) -> None:
    """``read_body``'s look at the first bytes of a big body: if they name media, hold a place in line
    before reading the rest (or refuse now, with the rest unread)."""
    if may_contain_media(head):
        ex.place = state.gate.take_place()


def _let_go(ex: Exchange) -> None:
    """The request is over: its media owner, if anything still keeps it alive, lets go of the bytes."""
    media = ex.media() if ex.media is not None else None
    if media is not None:
        media.release()


def _response_headers(server_timing: bool, ex: Exchange) -> dict[str, str]:
    headers = {"X-Request-Id": ex.request_id}
    if server_timing:
        headers.update(ex.timing_header())
    return headers


HEAD_BYTES = 64 << 10  # how much of a body ``on_head`` sees; smaller bodies are not worth a place in line


async def read_body(request: web.Request, limit: int, timeout: float,
                    on_head: Callable[[bytes], None] | None = None) -> bytes:
    """The whole body, refusing more than ``limit`` bytes (413 up front from Content-Length, or as soon as a
    chunked body crosses it) and more than ``timeout`` seconds (408: aiohttp has no body-read timeout).

    ``on_head`` is called once with the first ``HEAD_BYTES`` of a body bigger than that which has not fully
    arrived yet; it may raise to refuse the request before the rest is read."""
    if request.content_length is not None and request.content_length > limit:
        raise ProxyError(413, "body_too_large",
                         f"the body is {request.content_length} bytes, over the limit of {limit} (MMGATE_MAX_BODY_MB)")
    if not request.body_exists:
        return b""
    content = request.content
    if content.is_eof():  # the whole body came with the head (small requests): no wait, no timer
        body = content.read_nowait()
        if len(body) > limit:
            raise ProxyError(413, "body_too_large", f"the body is over the limit of {limit} bytes (MMGATE_MAX_BODY_MB)")
        return body
    expected = request.content_length
    if expected is not None and expected <= HEAD_BYTES:
        on_head = None
    # With a Content-Length the chunks go straight into one buffer of that size: a list joined at the end
    # would hold the body twice at the moment of the join, for every request being read at once.
    buffer = bytearray(expected) if expected is not None else None
    chunks: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(timeout):
            async for chunk in content.iter_any():
                end = size + len(chunk)
                if end > limit:
                    raise ProxyError(413, "body_too_large",
                                     f"the body is over the limit of {limit} bytes (MMGATE_MAX_BODY_MB)")
                if buffer is not None:
                    buffer[size:end] = chunk  # the HTTP parser never delivers more than Content-Length
                else:
                    chunks.append(chunk)
                size = end
                if on_head is not None and size >= HEAD_BYTES:
                    on_head(buffer[:HEAD_BYTES] if buffer is not None else b"".join(chunks)[:HEAD_BYTES])
                    on_head = None
    except TimeoutError:
        raise ProxyError(408, "body_read_timeout", f"the request body did not arrive within {timeout:g} s") from None
    if buffer is not None:
        if size != len(buffer):  # pragma: no cover - aiohttp raises on a short body before we get here
            raise ProxyError(400, "incomplete_body", f"the body ended after {size} of {len(buffer)} bytes")
        return buffer  # bytes-like: every consumer only reads it
    body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
    chunks.clear()
    return body


# ----------------------------------------------------------------------------------------------------------
# media


@dataclass(slots=True)
class _Item:
    """One inline media part, ready for a worker: where its string is, how big it decodes."""

    part: MediaPart
    payload_offset: int  # where the base64 starts inside the string value (after "data:...;base64,")
    size: int  # decoded bytes, exact upper bound from the base64 length
    declared_mime: str = ""  # the type the client declared ("" when none); checked against the bytes
    declared_span: Span | None = None  # where that type is written in the body, to put the true one there


async def prepare_media(state: AppState, ex: Exchange, media: MediaBuffer) -> bool:
    """Locate, admit, preprocess and splice ``media`` in place. Returns whether the client streams.

    Only ``media`` holds the body: locals here and the decode jobs reach the bytes through it, so a
    released owner (the request ended) leaves nothing behind in a frame or a queued job.
    """
    settings = state.settings
    started = time.perf_counter()
    skeleton, parts = find_media(ex.route, media.data, settings.max_json_depth)
    is_stream = skeleton is not None and isinstance(skeleton.doc, dict) and skeleton.doc.get("stream") is True
    del skeleton  # it references the body; the spans in ``parts`` are all we keep
    ex.watch.add("parse", time.perf_counter() - started)
    if not parts:
        return is_stream
    ex.kind = "media"

    if len(parts) > settings.max_media_per_request:
        raise ProxyError(400, "too_many_media",
                         f"the request has {len(parts)} media parts, over the limit of "
                         f"{settings.max_media_per_request} (MMGATE_MAX_MEDIA_PER_REQUEST): send fewer",
                         param=parts[settings.max_media_per_request].path)
    items: list[_Item] = []
    for part in parts:
        if part.is_url:
            if settings.media_urls == "reject":
                raise ProxyError(400, "media_url_not_allowed",
                                 "media URLs are not accepted here (MMGATE_MEDIA_URLS=reject): send the media inline "
                                 "as base64", param=part.path)
            state.metrics.media_items.labels(part.kind, "url").inc()
            continue
        items.append(_measure(media.data, part, settings.max_media_item_bytes))
    cost = sum(item.size for item in items)

    started = time.perf_counter()
    ex.lease = await state.gate.acquire(cost, settings.queue_timeout, ex.place)
    ex.place = None
    ex.watch.add("queue", time.perf_counter() - started)

    started = time.perf_counter()
    assert state.pool is not None
    batch = state.pool.batch()
    # Jobs reach the body through a weak reference: a job still queued or finishing in its thread after
    # the request moved on (or ended) must not keep the owner alive.
    media_ref = weakref.ref(media)
    jobs = [partial(_process_item, media_ref, item, state) for item in items]
    try:
        outcomes = await batch.run(jobs, settings.preprocess_timeout)
    except BaseException as exc:
        # The answer goes out now; the slot is given back only when the work has really stopped.
        lease, ex.lease_owned_by_batch = ex.lease, True
        run_soon(batch.stopped(), lease.release)
        if isinstance(exc, TimeoutError):
            _count_items(state, items, "timeout")
            if batch.started == 0:  # every decode worker stayed busy: not the client's media at fault
                raise ProxyError(504, "preprocess_timeout",
                                 f"no decode worker became free within {settings.preprocess_timeout:g} s "
                                 "(MMGATE_PREPROCESS_TIMEOUT): the proxy is overloaded, retry later") from None
            raise ProxyError(504, "preprocess_timeout",
                             f"media preprocessing took longer than {settings.preprocess_timeout:g} s "
                             "(MMGATE_PREPROCESS_TIMEOUT): send smaller media") from None
        if isinstance(exc, _ItemFailed):
            _count_items(state, items, "rejected")
            raise ProxyError(exc.error.status, exc.error.code, exc.error.message, param=exc.path) from None
        raise
    finally:
        ex.watch.add("preprocess", time.perf_counter() - started)

    started = time.perf_counter()
    replacements: list[tuple[Span, bytes]] = []
    for item, outcome in zip(items, outcomes):
        ex.media_in += outcome.size_in
        ex.media_out += outcome.size_out
        if outcome.true_mime:
            state.metrics.media_type_corrected.labels(item.part.kind).inc()
        if outcome.token is None:
            state.metrics.media_items.labels(item.part.kind, "unchanged").inc()
            if outcome.true_mime and item.declared_span is not None:
                replacements.append((item.declared_span, _mime_text(item, outcome.true_mime)))
            continue
        state.metrics.media_items.labels(item.part.kind, "rewritten").inc()
        assert item.part.span is not None
        replacements.append((item.part.span, outcome.token))
        if item.part.mime_span is not None:
            replacements.append((item.part.mime_span, b'"' + outcome.mime + b'"'))
    del outcomes
    state.metrics.media_bytes.labels("in").inc(ex.media_in)
    state.metrics.media_bytes.labels("out").inc(ex.media_out)
    if replacements:
        media.replace(splice(media.data, replacements))
        replacements.clear()
    ex.watch.add("splice", time.perf_counter() - started)
    return is_stream


def _mime_text(item: _Item, mime: bytes) -> bytes:
    """What replaces ``item.declared_span``: a whole JSON string (Anthropic ``media_type``) or, inside a data
    URI, just the type's characters."""
    return mime if item.part.encoding == "data_uri" else b'"' + mime + b'"'


def _count_items(state: AppState, items: list[_Item], outcome: str) -> None:
    for item in items:
        state.metrics.media_items.labels(item.part.kind, outcome).inc()


def _measure(body: bytes, part: MediaPart, max_item: int) -> _Item:
    """Decoded size from the base64 length alone (413 before any decode); parses only a data URI's head."""
    span = part.span
    if span is not None and not span.escaped:  # the common case: look at the head only, copy nothing
        head: bytes | memoryview = memoryview(body)[span.start + 1 : min(span.end - 1, span.start + 257)]
        length = span.end - span.start - 2
    else:  # a short literal, or a string with JSON escapes (rare): unescape it first
        value = part.data(body)
        head, length = value[:256], len(value)
    offset = 0
    declared = (part.declared_mime or "").lower()  # not stripped: a media_type with spaces is no token
    declared_span = part.mime_span
    if part.encoding == "data_uri":
        try:
            data_url = parse_data_url(head)
        except MediaError as error:
            raise ProxyError(error.status, error.code, error.message, param=part.path) from None
        if data_url is None:
            raise ProxyError(400, "invalid_data_uri", "expected a data: URI or an http(s) URL", param=part.path)
        offset = data_url.payload_offset
        declared = data_url.mime
        declared_span = None
        if span is not None and not span.escaped:
            # "data:" + the type as written, up to the first ";" (the header is ASCII, checked above)
            mime_end = bytes(head[: offset - 1]).find(b";")
            mime_end = offset - 1 if mime_end < 0 else mime_end
            declared_span = Span(span.start + 6, span.start + 1 + mime_end, False)
    if (declared or part.declared_mime is not None) and not _declared_type_allowed(part, declared):
        raise ProxyError(400, "invalid_media_type",
                         f"the declared type {declared[:64]!r} is not an accepted {part.kind} type: declare "
                         f"{part.kind}/<subtype> or leave it out", param=part.path)
    size = decoded_size(length - offset)
    if size > max_item:
        raise ProxyError(413, "media_too_large",
                         f"this {part.kind} decodes to about {size} bytes, over the per-item limit of {max_item} "
                         "(MMGATE_MAX_MEDIA_ITEM_MB): send a smaller file", param=part.path)
    return _Item(part, offset, size, declared, declared_span)


# RFC 6838 section 4.2: a type and a subtype of restricted-name characters.
_MEDIA_TYPE = re.compile(r"[a-z0-9][a-z0-9!#$&^_.+-]{0,126}/[a-z0-9][a-z0-9!#$&^_.+-]{0,126}")


def _declared_type_allowed(part: MediaPart, declared: str) -> bool:
    """A part's declared type must name its kind; a data URI may also say application/octet-stream."""
    if not _MEDIA_TYPE.fullmatch(declared):
        return False
    if declared.startswith(part.kind + "/"):
        return True
    return part.encoding == "data_uri" and declared == "application/octet-stream"


def _inline_value(media_ref: weakref.ref[MediaBuffer], part: MediaPart) -> bytes | memoryview:
    """The part's string value (a view into the body when possible); Cancelled if the request let go of it."""
    media = media_ref()
    try:
        if media is None:
            raise BufferReleased()
        return part.data(media.data)
    except BufferReleased:
        raise Cancelled() from None


class _ItemFailed(Exception):
    def __init__(self, path: str, error: MediaError) -> None:
        super().__init__(error.message)
        self.path = path
        self.error = error


@dataclass(slots=True)
class _Outcome:
    """What a worker made of one item: the new JSON string token (None = forward unchanged), its MIME,
    and the decoded sizes in and out (for the media byte counters)."""

    size_in: int
    size_out: int
    token: bytes | None = None
    mime: bytes = b""
    true_mime: bytes = b""  # set when the bytes are not the type the client declared


def _process_item(media_ref: weakref.ref[MediaBuffer], item: _Item, state: AppState,
                  checkpoint: Checkpoint) -> _Outcome:
    """In a decode thread: base64 → bytes → validate → (resize → re-encode → base64 token)."""
    part = item.part
    try:
        value = _inline_value(media_ref, part)
        data = decode_base64(value[item.payload_offset :], max_bytes=state.settings.max_media_item_bytes)
        del value
        size = len(data)
        checkpoint()
        if part.kind == "image":
            true_mime = image_mime(data).encode()
            if item.declared_mime.encode() in (true_mime, b""):
                true_mime = b""
            processed = process_image(data, state.image_policy, checkpoint)
            if processed is None and true_mime and item.declared_span is None and part.span is not None:
                # The declared type is inside an escaped token: the whole token is written anew.
                return _Outcome(size, size, _token(part, true_mime, encode_base64(data)), true_mime, true_mime)
            del data
            if processed is None or part.span is None:
                return _Outcome(size, size, true_mime=true_mime)
            mime = processed.mime.encode()
            out_size = len(processed.data)
            encoded = encode_base64(processed.data)
            del processed
            return _Outcome(size, out_size, _token(part, mime, encoded), mime, true_mime)
        if part.kind == "audio":
            validate_audio(data, part.audio_format, state.audio_policy, checkpoint)
        return _Outcome(size, size)  # audio and video are validated / size-checked and forwarded unchanged
    except MediaError as error:
        raise _ItemFailed(part.path, error) from None


def _token(part: MediaPart, mime: bytes, encoded: bytes) -> bytes:
    """The JSON string token for rewritten media: a data URI when the client sent one, else bare base64."""
    if part.encoding == "data_uri":
        return b"".join((b'"data:', mime, b";base64,", encoded, b'"'))
    return b"".join((b'"', encoded, b'"'))


# ----------------------------------------------------------------------------------------------------------
# answers mmgate gives itself


async def _refuse(request: web.Request, state: AppState, ex: Exchange, error: ProxyError) -> web.StreamResponse:
    """Answer ``error`` in the client's API shape, or end a response whose headers already went out."""
    ex.status, ex.code = error.status, error.code
    if error.code not in UPSTREAM_ERROR_KIND:  # upstream failures are counted as upstream_errors_total
        state.metrics.rejected.labels(error.code).inc()
    response = ex.response
    if response is not None and response.prepared:
        # Too late to change the status: an SSE stream gets one final error event, anything else is cut.
        if response.content_type == "text/event-stream":
            try:
                await response.write(error.sse_event(ex.dialect))
                await response.write_eof()
            except ConnectionResetError:
                pass
        else:
            response.force_close()
            if request.transport is not None:
                request.transport.close()
        return response
    answer = web.Response(status=error.status, body=error.body(ex.dialect), content_type="application/json")
    answer.headers["X-Request-Id"] = ex.request_id
    answer.headers.update(error.headers)
    if error.status in (408, 413) and not request.content.is_eof():
        # The rest of a body too big or too slow may still be on its way: answer, then close without
        # reading it (aiohttp's lingering close would read on for seconds, megabytes at a time).
        answer.force_close()
        await answer.prepare(request)
        await answer.write_eof()
        request.protocol.force_close()
    # Any other refusal before the body was read whole (429 while it arrived): aiohttp reads the rest and
    # drops it chunk by chunk after the answer (lingering close, at most MMGATE_MAX_BODY_MB and 10 s), so
    # the client, still uploading, gets the answer instead of a reset.
    return answer


def loggable(text: str, limit: int = 512) -> str:
    """A client-chosen string for a text log line: control characters escaped, so a path cannot forge lines
    or drive a terminal."""
    text = text[:limit]
    return text if text.isprintable() else text.encode("unicode_escape").decode("ascii")


@web.middleware
async def refusals_in_api_shape(request: web.Request, handler: Any) -> web.StreamResponse:
    """Answers aiohttp gives before ``handle_request`` runs (a target the router cannot match) or from the
    admin routes, in the client's API shape like every other refusal; a fault is a 500, never a traceback."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        error = ProxyError(exc.status, "path_not_allowed" if exc.status == 404 else "invalid_request", exc.reason)
        if exc.status == 404:
            try:  # a target the router cannot even match (a raw control character) is an invalid path
                normalise_target(request.raw_path)
            except ProxyError as invalid:
                error = invalid
    except Exception:
        request_id = request_id_for(None)
        log.exception("request %s (%s %s): internal error", request_id, request.method, loggable(request.path))
        error = ProxyError(500, "internal_error",
                           f"mmgate failed on this request; its log has the details under request id {request_id}")
    request.app[STATE].metrics.rejected.labels(error.code).inc()
    answer = web.Response(status=error.status, body=error.body(dialect_for_path(request.path)),
                          content_type="application/json")
    answer.headers.update(error.headers)
    return answer


def _record(state: AppState, ex: Exchange, request: web.Request) -> None:
    status = ex.status or (ex.response.status if ex.response is not None else 0)
    duration = ex.watch.elapsed()
    m = state.metrics
    m.child(m.requests, ex.route, ex.kind, str(status)).inc()
    m.child(m.request_duration, ex.route, ex.kind).observe(duration)
    for stage, seconds in ex.watch.stages.items():
        m.child(m.stage_duration, stage).observe(seconds)
    m.child(m.stage_duration, "total").observe(duration)
    if state.settings.access_log:
        fields = {
            "request_id": ex.request_id, "method": request.method, "path": request.path, "route": ex.route,
            "kind": ex.kind, "status": status, "code": ex.code or None, "duration_ms": round(duration * 1000, 2),
            "stages_ms": {k: round(v * 1000, 2) for k, v in ex.watch.stages.items()},
            "bytes_in": ex.bytes_in, "media_in": ex.media_in, "media_out": ex.media_out,
        }
        log.info("%s %s %s %s %s %.1fms %s", ex.request_id, request.method, loggable(request.path), status, ex.kind,
                 duration * 1000, ex.code or "-", extra={"fields": fields})
