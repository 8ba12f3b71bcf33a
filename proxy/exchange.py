"""One request's record: what mmgate knows about it while it is in flight, and what is counted and logged
when it ends (the request metrics and the access log line)."""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass, field
from typing import Literal

from aiohttp import web

from proxy.admission.client import GateLease, GatePlace
from proxy.admission.flows import DEFAULT_FLOW, Flow
from proxy.edge.access_log import write_line
from proxy.edge.buffers import MediaBuffer
from proxy.media.model import Model
from proxy.ops.metrics import Metrics, Stopwatch, server_timing
from proxy.payload.dialects import Dialect, Route

CLIENT_CLOSED = 499  # nginx's convention for "client went away"; metrics label only

Kind = Literal["text", "media"]

# A media route's body declared bigger than this is counted as media when it is refused before a byte of it
# is read (413 from its Content-Length): 4 MiB of text is about a million tokens, more than a text prompt
# plausibly is, while an image or two is that big.
TEXT_BODY_MAX_BYTES = 4 << 20


@dataclass
class Exchange:
    """What mmgate knows about one request while it is in flight (and logs when it ends)."""

    request_id: str
    route: Route
    dialect: Dialect
    declared_length: int | None = None  # the body's Content-Length, if it has one
    sniffed_media: bool | None = None  # the sniff of the body read so far (its head, then all of it) names media
    parsed_media: bool | None = None  # the parse found media parts in the body
    status: int = 0
    code: str = ""
    watch: Stopwatch = field(default_factory=Stopwatch)
    response: web.StreamResponse | None = None  # set once the headers went out: a refusal can only end it then
    place: GatePlace | None = None  # held while a big media body is still arriving (the gate's admission uses it up)
    lease: GateLease | None = None  # the media step's admission
    flow: Flow = DEFAULT_FLOW  # media routes: the fairness and priority headers' flow
    media: weakref.ref[MediaBuffer] | None = None  # weak: the payload is the owner's only strong holder
    bytes_in: int = 0
    media_in: int = 0
    media_out: int = 0
    fetched: int = 0  # body bytes read from media URLs (MMGATE_MEDIA_URLS=fetch)
    image_tokens: int = 0  # with MMGATE_MODEL: the request's image tokens for the served model
    video_tokens: int = 0  # with MMGATE_MODEL and a family with video tokens: its clips', once probed
    upstream_started: float = 0.0
    # With the adaptive limit: the answer waited on the client, which stopped reading (its time measures the
    # client too: it is no sample).
    client_stalled: bool = False

    @property
    def kind(self) -> Kind:
        """What the request is counted, logged and drawn as, whatever stage ends it: the last thing known of
        its body wins. Off the media routes: text. Parsed: media when it holds media parts. Sniffed (the
        head of a big body still arriving, or the whole body): media when its bytes name media, as the gate
        and the parse took it. Nothing read yet: media when its declared length is over
        ``TEXT_BODY_MAX_BYTES``."""
        if self.route == "other":
            return "text"
        media = self.parsed_media
        if media is None:
            media = self.sniffed_media
        if media is None:
            media = self.declared_length is not None and self.declared_length > TEXT_BODY_MAX_BYTES
        return "media" if media else "text"

    def response_headers(self, with_timing: bool) -> dict[str, str]:
        """The headers mmgate adds to the upstream's answer (``Server-Timing`` with MMGATE_SERVER_TIMING)."""
        headers = {"X-Request-Id": self.request_id}
        if with_timing:
            stages: list[tuple[str, float]] = [
                (s, self.watch.stages[s]) for s in ("queue", "fetch", "preprocess") if s in self.watch.stages]
            stages.append(("upstream", time.perf_counter() - self.upstream_started))
            headers["Server-Timing"] = server_timing(stages)
        return headers

    def let_go(self) -> None:
        """The request is over: give back its place and lease, and let its media owner drop the bytes if
        anything still keeps the owner alive. Each of these is idempotent."""
        if self.place is not None:
            self.place.release()
        if self.lease is not None:
            self.lease.release()
        media = self.media() if self.media is not None else None
        if media is not None:
            media.release()


def record(metrics: Metrics, access_log: bool, model: Model | None, exchange: Exchange, request: web.Request) -> None:
    """Count the finished request and, with ``access_log`` (MMGATE_ACCESS_LOG), write its access log line
    (with ``model``, MMGATE_MODEL's, its image and video tokens)."""
    status = exchange.status or (exchange.response.status if exchange.response is not None else 0)
    duration = exchange.watch.elapsed()
    m = metrics
    m.child(m.requests, exchange.route, exchange.kind, str(status)).inc()
    m.child(m.request_duration, exchange.route, exchange.kind).observe(duration)
    for stage, seconds in exchange.watch.stages.items():
        m.child(m.stage_duration, stage).observe(seconds)
    m.child(m.stage_duration, "total").observe(duration)
    if access_log:
        fields = {
            "request_id": exchange.request_id, "method": request.method, "path": request.path, "route": exchange.route,
            "kind": exchange.kind, "status": status, "code": exchange.code or None,
            "duration_ms": round(duration * 1000, 2),
            "stages_ms": {k: round(v * 1000, 2) for k, v in exchange.watch.stages.items()},
            "bytes_in": exchange.bytes_in, "media_in": exchange.media_in, "media_out": exchange.media_out,
            "fetched": exchange.fetched, "answered_by": answered_by(exchange, status),
        }
        if model is not None:
            fields["image_tokens"] = exchange.image_tokens
            if model.counts_video:
                fields["video_tokens"] = exchange.video_tokens
        write_line(fields)


def answered_by(exchange: Exchange, status: int) -> Literal["mmgate", "upstream", "-"]:
    """Whose answer the client got: mmgate's (a refusal, its code logged), the upstream's (relayed as it came,
    whatever its status: a 502 the backend sent is the backend's), or none (the client left first)."""
    if status == CLIENT_CLOSED:
        return "-"
    return "mmgate" if exchange.code else "upstream"
