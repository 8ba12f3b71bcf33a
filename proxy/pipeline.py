"""One request, start to finish: check the door, read, locate, admit, preprocess, splice, forward, relay.

Text-only bodies leave after the sniff, untouched, without a parse, the gate or the pool. Every layer below
raises ``errors.MmgateError``; ``handle_request`` catches it once, counts it and answers it through
``refusals.refuse``. Read ``_serve`` top to bottom: it is the whole story.
"""

from __future__ import annotations

import asyncio
import time
import weakref
from functools import partial
from typing import TypeVar

from aiohttp import HttpVersion11, hdrs, web

from preprocessors.dataurl import Base64Ends
from preprocessors.errors import (
    EXPECTATION_FAILED,
    INVALID_TIMEOUT_HEADER,
    PATH_NOT_ALLOWED,
    REQUEST_TIMEOUT,
    UNSUPPORTED_CONTENT_ENCODING,
    UPSTREAM_DOWN,
    WEBSOCKET_NOT_SUPPORTED,
    MmgateError,
    UpstreamError,
    draining,
)
from preprocessors.job import judge_head
from proxy.admission.client import GateLease
from proxy.admission.flows import flow_for
from proxy.admission.sample import Sample, sample_class
from proxy.edge.body import HEAD_BYTES, read_body
from proxy.edge.buffers import MediaBuffer
from proxy.edge.connections import ConnectionGuard, GuardedConnection
from proxy.edge.paths import Target, is_allowed, normalise_target
from proxy.edge.refusals import internal_error, refuse
from proxy.edge.upstream import close_upstream, open_upstream, relay, request_id_for
from proxy.edge.upstream_health import upstream_down
from proxy.edge.write_deadline import client_gone_code
from proxy.exchange import CLIENT_CLOSED, Exchange, record
from proxy.media.model import Model
from proxy.media.step import MediaStep
from proxy.media.tokens import plan_image_tokens
from proxy.ops.metrics import Metrics
from proxy.payload.dialects import dialect_for_path, route_for
from proxy.payload.locate import Limits, Plan, chunks_may_contain_media, may_contain_media, plan_media, plan_steps
from proxy.payload.rawjson import Steps
from proxy.state import STATE, AppState

# Sent upstream with MMGATE_MODEL: the request's image tokens for the served model, for a router or scheduler.
IMAGE_TOKENS_HEADER = "x-mmgate-image-tokens"
VIDEO_TOKENS_HEADER = "x-mmgate-video-tokens"

T = TypeVar("T")


async def handle_request(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    exchange = Exchange(request_id_for(request.headers.get("X-Request-Id")), "other", dialect_for_path(request.path))
    state.request_started()
    deadline: asyncio.Timeout | None = None
    try:
        if state.lifecycle.refusing:
            raise draining()
        when = _request_deadline(request, state.settings.timeouts.request_timeout)
        if when is None:  # the common case: no timer to arm and cancel for every request
            return await _serve(request, state, exchange)
        deadline = asyncio.timeout_at(when)
        async with deadline:
            return await _serve(request, state, exchange)
    except TimeoutError:
        if deadline is None or not deadline.expired():
            return await _answer(request, state, exchange, _internal_error(exchange))
        passed = _deadline_passed(request, state.settings.timeouts.request_timeout)
        return await _answer(request, state, exchange, passed)
    except MmgateError as error:
        return await _answer(request, state, exchange, error)
    except (asyncio.CancelledError, ConnectionResetError):
        exchange.status, exchange.code = CLIENT_CLOSED, client_gone_code(request)
        raise
    except Exception:
        # The last guard: a fault of mmgate's own is logged once with its traceback, and the client gets a
        # 500 in its API's shape naming the request id, never a traceback.
        return await _answer(request, state, exchange, _internal_error(exchange))
    finally:
        exchange.let_go()
        state.request_finished()
        record(state.metrics, state.settings.logs.access_log, state.model, exchange, request)


async def _serve(request: web.Request, state: AppState, exchange: Exchange) -> web.StreamResponse:
    settings = state.settings
    target = _checked_target(request, settings.backend.allow_paths)
    exchange.dialect = dialect_for_path(target.path)
    exchange.route = route_for(request.method, target.path)
    exchange.declared_length = request.content_length
    _check_headers(request, media_route=exchange.route != "other")
    if exchange.route != "other":
        exchange.flow = flow_for(request.headers, request.remote, state.flow_rules)

    started = time.perf_counter()
    on_head = partial(_take_place_for_media, state, exchange) if exchange.route != "other" else None
    state.traffic.reading += 1
    try:
        with state.pacer.upload(_big_upload(request, state.connections)):
            chunks = await read_body(request, settings.limits.max_body_bytes, settings.timeouts.body_read_timeout,
                                     on_head)
    finally:
        state.traffic.reading -= 1
    exchange.watch.add("read", time.perf_counter() - started)
    exchange.bytes_in = sum(map(len, chunks))

    # A text body leaves as the chunks it came in: the sniff is the only pass over it, nothing copies it.
    outgoing: list[bytes] | MediaBuffer = chunks
    is_stream = False
    if exchange.route != "other":
        exchange.sniffed_media = chunks_may_contain_media(chunks)
    if exchange.sniffed_media:
        media = await state.buffers.hold(chunks)  # from here on the owner is the only holder of the bytes
        outgoing, exchange.media = media, weakref.ref(media)
        is_stream = await _prepare_media(state, exchange, media)
        del media
    del chunks
    if exchange.place is not None:  # the body held no media after all: give the place back before forwarding
        exchange.place.release()  # (nothing when the media step's admission used it)

    # Where the gate lease ends (MMGATE_RELEASE_AT; auto: at the headers when streaming, else once sent).
    # The media bytes themselves are always let go at the handoff, by the payload.
    release_at = settings.gate.release_at
    if release_at == "auto" and settings.gate.adaptive_concurrency:
        release_at = "complete"  # the adaptive limit learns from the backend's latency: the lease must span it
    elif release_at == "auto":
        release_at = "headers" if is_stream else "sent"
    lease = exchange.lease
    on_sent = lease.release if lease is not None and release_at == "sent" else None
    if lease is not None:
        lease.handed_off()

    exchange.upstream_started = time.perf_counter()
    adaptive = lease is not None and settings.gate.adaptive_concurrency
    # A lease that lasts to the end of the answer ends when the backend is done with it, which a client that stopped
    # reading must not put off: the relay reads ahead for it (``upstream.relay``), watching the client's connection.
    to_the_end = lease is not None and release_at == "complete"
    client = state.connections.connection_for(request.protocol) if to_the_end else None
    if adaptive and client is not None:
        client.on_stall = partial(_client_stalled, exchange)
    try:
        upstream = await open_upstream(state.session, request, settings.backend.upstream + target.forwarded,
                                       outgoing if exchange.bytes_in else None, exchange.request_id,
                                       _own_headers(state.model, exchange), on_sent, settings.timeouts.upstream_client)
        del outgoing
        state.upstream.reached()
        try:
            if lease is not None and release_at == "headers":
                lease.release()
            return await relay(  # which ends the upstream's answer too
                request, upstream, exchange.response_headers(settings.logs.server_timing),
                started=partial(_answer_started, exchange),
                client_waits=client.waits_on_client if client is not None else None,
                upstream_done=partial(_backend_done, state, exchange, upstream.status, is_stream)
                if to_the_end else None)
        except BaseException:
            close_upstream(upstream)
            raise
    finally:
        if adaptive and client is not None:
            client.on_stall = None
        exchange.watch.add("upstream", time.perf_counter() - exchange.upstream_started)


def _answer_started(exchange: Exchange, response: web.StreamResponse) -> None:
    """The answer's headers went out: a refusal from here on can only end ``response`` (``refusals.refuse``)."""
    exchange.response = response


def _client_stalled(exchange: Exchange) -> None:
    """With the adaptive limit, the answer waits on the client, which stopped reading: the exchange will be
    no sample, since its time would measure the client too. Its lease stays: the backend still holds the
    request until the relay, reading ahead, sees its answer end (``_backend_done``)."""
    exchange.client_stalled = True


def _backend_done(state: AppState, exchange: Exchange, status: int, is_stream: bool,
                  output_tokens: int | None) -> None:
    """The backend has sent the whole answer of a request whose lease lasts to the end: the adaptive limit
    learns from it, and the lease goes back, whether or not the client has read it all yet."""
    lease = exchange.lease
    if lease is None:
        return
    if state.settings.gate.adaptive_concurrency and 200 <= status < 300:
        _completed(state, exchange, lease, is_stream, output_tokens)
    lease.release()


def _completed(state: AppState, exchange: Exchange, lease: GateLease, is_stream: bool,
               output_tokens: int | None) -> None:
    """A media request the backend answered 2xx, read to its last byte: its sample teaches the adaptive limit
    (``admission.sample``), unless the client stalled. Every other ending (the client gone, a refusal, an
    error, a deadline) never gets here, and teaches it nothing."""
    if exchange.client_stalled:
        return
    seconds = time.perf_counter() - exchange.upstream_started  # from the hand-off to the backend to the last byte
    image_tokens = exchange.image_tokens if state.model is not None else None
    state.gate.observe(lease, Sample(seconds, sample_class(exchange.route, is_stream, output_tokens, image_tokens,
                                                           exchange.media_in)))


def _own_headers(model: Model | None, exchange: Exchange) -> dict[str, str | None]:
    """The headers mmgate sets on the way up (None: removed), never a client's own: with MMGATE_MODEL the
    request's image tokens, and its video tokens where the family counts them."""
    if model is None:
        return {}
    return {IMAGE_TOKENS_HEADER: str(exchange.image_tokens),
            VIDEO_TOKENS_HEADER: str(exchange.video_tokens) if model.counts_video else None}


async def _prepare_media(state: AppState, exchange: Exchange, media: MediaBuffer) -> bool:
    """Locate, admit, preprocess and splice ``media`` in place. Returns whether the client streams.

    Only ``media`` holds the body: nothing here keeps the bytes in a local, so a released owner (the
    request ended) leaves nothing behind in a frame or a queued job."""
    started = time.perf_counter()
    plan = await _in_steps(plan_steps(exchange.route, media.data, state.plan_limits))
    exchange.watch.add("parse", time.perf_counter() - started)
    exchange.parsed_media = bool(plan.parts)
    if not plan.parts:
        return plan.is_stream
    step = state.media
    if plan.urls:
        step.count_urls(plan.urls)
    if plan.refusals:
        raise plan.refusals.pop()  # popped: no cycle through the plan keeps the body alive
    served = state.served.served
    if state.model is not None and served is not None and plan.model is not None and not served.serves(plan.model):
        # MMGATE_MODEL=auto found the served model: a request for another one (nor an adapter of it) is the
        # upstream's to answer, untouched: no geometry of the served model is applied to it.
        return plan.is_stream
    if state.upstream.down:  # its forward cannot connect: refuse before the queue and the pool spend anything
        raise upstream_down()
    if state.model is not None:  # MMGATE_MODEL: the image tokens, from the headers, before admission
        started = time.perf_counter()
        exchange.image_tokens = _count_image_tokens(state.model, state.metrics, plan, media.data)
        exchange.watch.add("parse", time.perf_counter() - started)

    fetched = [0]
    try:  # admits weighing only what the cache lacks
        result = await step.run(plan, media, place=exchange.place, flow=exchange.flow,
                                image_tokens=exchange.image_tokens, watch=exchange.watch, fetched=fetched)
    finally:
        exchange.fetched = fetched[0]

    started = time.perf_counter()
    exchange.lease, exchange.media_in, exchange.media_out, exchange.video_tokens = (
        result.lease, result.media_in, result.media_out, result.video_tokens)
    if result.replacements:
        media.splice(result.replacements)
    del result
    exchange.watch.add("splice", time.perf_counter() - started)
    return plan.is_stream


def warm_up_request_path(step: MediaStep, limits: Limits) -> None:
    """A tiny image request's body through what a media request runs on the loop (the sniff, the plan, the
    header judge), once at start: the first call of each costs more than every later one, and the first client
    should not pay it."""
    image = b"iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAIAAACQd1PeAAAADElEQVR4nGNgYGAAAAAEAAH2FzhVAAAAAElFTkSuQmCC"  # 1x1 PNG
    body = b'{"messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"data:image/png;base64,' \
        + image + b'"}}]}]}'
    chunks_may_contain_media([body])
    for item in plan_media("chat", body, limits).items:
        judge_head(step.task(item), Base64Ends(image))


async def _in_steps(steps: Steps[T]) -> T:
    """Run ``steps`` (``locate.plan_steps``) on the loop, letting every other ready task and every arrived
    packet (a health probe, another request) run between two steps: one body holds the loop for one
    bounded step at a time, whatever its size or shape."""
    while True:
        await asyncio.sleep(0)
        try:
            next(steps)
        except StopIteration as done:
            return done.value


def _count_image_tokens(model: Model, metrics: Metrics, plan: Plan, body: bytes) -> int:
    """The request's image tokens for the served model; each image's observed."""
    per_image = plan_image_tokens(model, plan, body)
    for item, tokens in zip(plan.items, per_image, strict=True):
        if item.kind == "image":
            metrics.image_tokens.observe(tokens)
    return sum(per_image)


async def _answer(request: web.Request, state: AppState, exchange: Exchange, error: MmgateError) -> web.StreamResponse:
    """The one place a refusal is counted and answered."""
    exchange.status, exchange.code = error.status, error.code
    if isinstance(error, UpstreamError):
        state.metrics.upstream_errors.labels(error.kind).inc()
        if error.entry is UPSTREAM_DOWN:  # this request could not connect (or the upstream is known down already)
            state.upstream.unreachable(f"a request: {error.message}")
    else:
        state.metrics.rejected.labels(error.code).inc()
    return await refuse(request, error, exchange.dialect, exchange.request_id, exchange.response)


def _internal_error(exchange: Exchange) -> MmgateError:
    return internal_error(exchange.request_id, "")


# ----------------------------------------------------------------------------------------------------------
# the door: what is refused before a byte of the body is read


def _checked_target(request: web.Request, allow_paths: tuple[str, ...]) -> Target:
    """The one path decision (proxy/edge/paths.py): the normalised target, if it may be forwarded at all."""
    target = normalise_target(request.raw_path)
    if target.path.startswith("/mmgate/") or not is_allowed(target.path, allow_paths):
        raise PATH_NOT_ALLOWED.error(f"{target.path[:200]} is not served by this proxy")
    return target


def _check_headers(request: web.Request, *, media_route: bool) -> None:
    if request.headers.get(hdrs.UPGRADE, "").lower() == "websocket":
        raise WEBSOCKET_NOT_SUPPORTED.error("WebSocket upgrades are not proxied")
    expect = request.headers.get(hdrs.EXPECT)
    if expect is not None and expect.strip().lower() != "100-continue":
        raise EXPECTATION_FAILED.error(
            f"Expect: {expect[:64]!r} is not supported; only 100-continue is (RFC 9110 section 10.1.1)")
    if media_route:
        encoding = request.headers.get(hdrs.CONTENT_ENCODING, "identity").strip().lower()
        if encoding not in ("", "identity"):  # compressed media could slip past every check
            raise UNSUPPORTED_CONTENT_ENCODING.error(
                f"Content-Encoding {encoding[:32]!r} is not accepted on a media route; send identity")


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
            raise INVALID_TIMEOUT_HEADER.error(
                f"X-MMGate-Timeout must be a positive number of seconds, got {raw[:32]!r}")
        limit = asked if limit is None else min(limit, asked)
    return None if limit is None else asyncio.get_running_loop().time() + limit


def _deadline_passed(request: web.Request, configured: float) -> MmgateError:
    """504 naming the deadline that fired and where it was set (the request's own header wins when lower)."""
    raw = request.headers.get("X-MMGate-Timeout")
    asked = float(raw) if raw is not None else None  # valid: ``_request_deadline`` accepted it
    if asked is not None and (not configured or asked < configured):
        limit, setting = asked, "the request's X-MMGate-Timeout header"
    else:
        limit, setting = configured, "MMGATE_REQUEST_TIMEOUT"
    return REQUEST_TIMEOUT.error(
        f"the request did not finish within its {limit:g} s deadline ({setting}); it was stopped")


def _big_upload(request: web.Request, connections: ConnectionGuard) -> GuardedConnection | None:
    """The connection of a body worth pacing (over ``HEAD_BYTES`` and still arriving), or None."""
    length = request.content_length
    if not request.body_exists or request.content.is_eof() or (length is not None and length <= HEAD_BYTES):
        return None
    return connections.connection_for(request.protocol)


async def _take_place_for_media(state: AppState, exchange: Exchange, head: bytes) -> bool:
    """``read_body``'s look at the first bytes of a big body: if they name media, hold a place in line
    before reading the rest (or refuse now, with the rest unread), and have the rest gathered into one buffer."""
    exchange.sniffed_media = may_contain_media(head)
    if exchange.sniffed_media:
        exchange.place = await state.gate.take_place(exchange.flow)
    return exchange.sniffed_media


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
    if state.lifecycle.refusing or (length is not None and length > state.settings.limits.max_body_bytes):
        return
    try:
        _checked_target(request, state.settings.backend.allow_paths)
    except MmgateError:
        return
    await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
    request.writer.output_size = 0  # the interim answer is not part of the response's size
