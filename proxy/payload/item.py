"""One media item of a request, from the walk that finds it to the splice that writes it back: ``MediaItem``.

The item is one object all the way, filled in as the request moves on; ``state`` names how far it got:

- ``located``: a walker (``walkers``) found it: its JSON path, its kind, and where its data is: ``span``, its
  string token in the body (rewritable), or ``literal``, a short value the skeleton kept (validated, never
  rewritten); a URL item has ``url`` (and ``span`` when its token was placeholdered, as every ``http(s):``
  URL is). On a ``parse_plain`` skeleton no item has a span.
- ``planned``: the plan (``locate.plan_steps``) measured it: its decoded size from the base64 length, its
  declared type checked; a URL item to fetch is charged the per-item cap until its bytes are known.
- ``fetched``: a URL item's body was read (``fetch.fetcher``).
- ``keyed``: the media step gave it its cache key (``media.keys``).
- ``rewritten`` or ``unchanged``: its verdict was applied (``apply``): the sizes in and out, and the
  ``replacements`` it makes in the body for ``buffers.MediaBuffer.splice``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal, Protocol

from preprocessors.base import Cancelled, MediaKind
from preprocessors.job import Verdict
from proxy.payload.rawjson import Span, string_value

ItemState = Literal["located", "planned", "fetched", "keyed", "rewritten", "unchanged"]
Source = Literal["inline", "fetched"]


class HeldBody(Protocol):
    """The request body's one owner (``edge.buffers.MediaBuffer``)."""

    @property
    def data(self) -> bytes: ...


# The owner through a weak reference: None once the request let go of its body.
BodyRef = Callable[[], HeldBody | None]


@dataclass(slots=True)
class MediaItem:
    """One media item of a request (see the module's docstring for the states it goes through)."""

    # located: what the walker found
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
    state: ItemState = "located"
    # planned
    index: int = 0  # in the plan: an inline item's key is unique to it when the cache is off
    payload_offset: int = 0  # where the base64 starts inside the string value (after "data:...;base64,")
    size: int = 0  # decoded bytes: the exact bound from the base64 length, or a URL's per-item cap
    declared_type: str = ""  # the type the client declared ("" when none); checked against the bytes
    declared_span: Span | None = None  # where that type is written in the body, to put the true one there
    # fetched, keyed
    fetched: bytes | None = None  # a URL item's body, once read
    fetched_mime: str = ""  # the type its server declared
    key: bytes = b""
    # rewritten or unchanged
    size_in: int = 0
    size_out: int = 0
    true_mime: bytes = b""  # set when the bytes are not the type the client declared
    video: tuple[int, int, int] | None = None  # a probed clip's (frames, width, height)
    replacements: list[tuple[Span, bytes]] = field(default_factory=list)

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

    def apply(self, verdict: Verdict, original: Callable[[], bytes]) -> None:
        """Take ``verdict``: the sizes, the true type against the declared one, and the body's replacements.
        ``original`` gives the item's own base64 as sent, needed only to rewrite a whole escaped token."""
        self.size_in = self.size_out = verdict.size_in
        self.state = "unchanged"
        if verdict.video is not None:  # a probed clip goes as it came
            self.video = verdict.video
            return
        true_mime = verdict.sniffed_mime
        if self.declared_type.encode() in (true_mime, b""):
            true_mime = b""
        self.true_mime = true_mime
        span = self.span
        if verdict.encoded is None or span is None:
            if not true_mime:
                return
            if self.declared_span is not None:
                self.replacements.append((self.declared_span, self._mime_text(true_mime)))
            elif span is not None and verdict.encoded is None:
                # The declared type is inside an escaped token: the whole token is written anew.
                self._rewrite(span, true_mime, original())
            return
        self.size_out = verdict.size_out
        self._rewrite(span, verdict.mime, verdict.encoded)

    def _rewrite(self, span: Span, mime: bytes, encoded: bytes) -> None:
        """The item's token written anew: a data URI when the client sent one (and for a fetched URL), else
        bare base64; and an Anthropic ``media_type`` to match."""
        self.state = "rewritten"
        if self.encoding == "data_uri":
            token = b"".join((b'"data:', mime, b";base64,", encoded, b'"'))
        else:
            token = b"".join((b'"', encoded, b'"'))
        self.replacements.append((span, token))
        if self.mime_span is not None:
            self.replacements.append((self.mime_span, b'"' + mime + b'"'))

    def _mime_text(self, mime: bytes) -> bytes:
        """What replaces ``declared_span``: a whole JSON string (Anthropic ``media_type``) or, inside a data
        URI, just the type's characters."""
        return mime if self.encoding == "data_uri" else b'"' + mime + b'"'
