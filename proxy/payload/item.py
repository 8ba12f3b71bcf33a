"""One media item of a request, as a value: ``MediaItem``, and what applying its verdict makes of it: ``Applied``.

An item is frozen; each step that learns more of it makes a new one (``dataclasses.replace``):

- a walker (``walkers``) finds it: its JSON path, its kind, and where its data is: ``span``, its string token
  in the body (rewritable), or ``literal``, a short value the skeleton kept (validated, never rewritten); a URL
  item has ``url`` (and ``span`` when its token was placeholdered, as every ``http(s):`` URL is). On a
  ``parse_plain`` skeleton no item has a span;
- the plan (``locate.plan_steps``) measures it: its index in the plan, its decoded size from the base64 length,
  its declared type checked; a URL item to fetch is charged the per-item cap until its bytes are known;
- the fetcher (``fetch.fetcher.fetch_items``) reads a URL item's body into ``fetched``.

The media step keeps what it decides about items in its own tables, by plan index (their cache keys, their
verdicts), and ``apply`` turns an item's verdict into an ``Applied``: the sizes in and out, the true type, and
the replacements it makes in the body for ``buffers.MediaBuffer.splice``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, Protocol

from preprocessors.base import Cancelled, MediaKind
from preprocessors.job import Verdict
from proxy.payload.rawjson import Span, string_value

Outcome = Literal["rewritten", "unchanged"]
Source = Literal["inline", "fetched"]


class HeldBody(Protocol):
    """The request body's one owner (``edge.buffers.MediaBuffer``)."""

    @property
    def data(self) -> bytes: ...


# The owner through a weak reference: None once the request let go of its body.
BodyRef = Callable[[], HeldBody | None]


@dataclass(frozen=True, slots=True)
class Applied:
    """What an item's verdict makes of it: whether it is ``rewritten`` or goes ``unchanged``, its decoded sizes in
    and out, its true type where the client declared another (else empty), a probed clip's (frames, width,
    height), and the tokens it replaces in the body."""

    outcome: Outcome
    size_in: int
    size_out: int
    true_mime: bytes = b""
    video: tuple[int, int, int] | None = None
    replacements: tuple[tuple[Span, bytes], ...] = ()


@dataclass(frozen=True, slots=True)
class MediaItem:
    """One media item of a request (see the module's docstring for who fills what)."""

    # found by a walker
    path: str  # the JSON path, the ``param`` of a refusal that names the item
    kind: MediaKind
    is_url: bool
    url: str = ""  # a URL item's URL
    span: Span | None = None
    literal: str = ""  # an inline item without a span: its value as the skeleton kept it
    encoding: Literal["data_uri", "base64"] = "data_uri"  # meaningless when is_url
    declared_mime: str | None = None  # Anthropic media_type; None for data URIs (the plan parses them)
    mime_span: Span | None = None  # Anthropic media_type token, rewritten when the format changes
    audio_format: str | None = None  # OpenAI input_audio "format"
    # measured by the plan
    index: int = 0  # in the plan: the media step's tables are keyed by it
    payload_offset: int = 0  # where the base64 starts inside the string value (after "data:...;base64,")
    size: int = 0  # decoded bytes: the exact bound from the base64 length, or a URL's per-item cap
    declared_type: str = ""  # the type the client declared ("" when none); checked against the bytes
    declared_span: Span | None = None  # where that type is written in the body, to put the true one there
    # read by the fetcher
    fetched: bytes | None = None  # a URL item's body, once read
    fetched_mime: str = ""  # the type its server declared

    @property
    def source(self) -> Source:
        """Where the item's bytes come from: the request body's base64, or a fetched URL."""
        return "fetched" if self.is_url else "inline"

    @property
    def weight(self) -> int:
        """Decoded bytes, what the gate weighs: the measured bound inline, the bytes read once fetched, the
        per-item cap before that."""
        return len(self.fetched) if self.fetched is not None else self.size

    @property
    def own_key(self) -> bytes:
        """A key of this item's own: unique in its request, and shorter than every cache key, so no lookup
        ever finds it (the cache off, or an item judged without the cache)."""
        return self.index.to_bytes(4, "big")

    def payload(self, body: BodyRef) -> bytes | memoryview:
        """The bytes a decode job reads: the fetched body, or the inline base64 (a view into the request body
        when possible). ``Cancelled`` once the request let go of its body: a job or a hash still running then
        stops instead of keeping the body alive."""
        if self.fetched is not None:
            return self.fetched
        media = body()
        if media is None:
            raise Cancelled()
        if self.span is not None:
            return string_value(media.data, self.span)[self.payload_offset :]
        return self.literal.encode("utf-8")[self.payload_offset :]

    def apply(self, verdict: Verdict, original: Callable[[], bytes]) -> Applied:
        """What ``verdict`` makes of this item: the sizes, the true type against the declared one, and the body's
        replacements. ``original`` gives the item's own base64 as sent, needed only to rewrite a whole escaped
        token."""
        if verdict.video is not None:  # a probed clip goes as it came
            return Applied("unchanged", verdict.size_in, verdict.size_in, video=verdict.video)
        true_mime = verdict.sniffed_mime
        if self.declared_type.encode() in (true_mime, b""):
            true_mime = b""
        span = self.span
        if verdict.encoded is not None and span is not None:
            return Applied("rewritten", verdict.size_in, verdict.size_out, true_mime,
                           replacements=self._rewrite(span, verdict.mime, verdict.encoded))
        unchanged = Applied("unchanged", verdict.size_in, verdict.size_in, true_mime)
        if not true_mime:
            return unchanged
        if self.declared_span is not None:
            return Applied("unchanged", verdict.size_in, verdict.size_in, true_mime,
                           replacements=((self.declared_span, self._mime_text(true_mime)),))
        if span is not None and verdict.encoded is None:
            # The declared type is inside an escaped token: the whole token is written anew.
            return Applied("rewritten", verdict.size_in, verdict.size_in, true_mime,
                           replacements=self._rewrite(span, true_mime, original()))
        return unchanged

    def _rewrite(self, span: Span, mime: bytes, encoded: bytes) -> tuple[tuple[Span, bytes], ...]:
        """The item's token written anew: a data URI when the client sent one (and for a fetched URL), else
        bare base64; and an Anthropic ``media_type`` to match."""
        if self.encoding == "data_uri":
            token = b"".join((b'"data:', mime, b";base64,", encoded, b'"'))
        else:
            token = b"".join((b'"', encoded, b'"'))
        if self.mime_span is not None:
            return (span, token), (self.mime_span, b'"' + mime + b'"')
        return ((span, token),)

    def _mime_text(self, mime: bytes) -> bytes:
        """What replaces ``declared_span``: a whole JSON string (Anthropic ``media_type``) or, inside a data
        URI, just the type's characters."""
        return mime if self.encoding == "data_uri" else b'"' + mime + b'"'
