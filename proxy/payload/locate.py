"""Finding the media in a request body without parsing it whole: the sniff, the walk, and the plan.

``chunks_may_contain_media`` (the sniff, one pass over the chunks a body arrived in) answers for every
body on a media route; a body it clears leaves untouched, without a copy or a parse. ``find_media``
parses the rest the cheaper correct way and walks the route's dialect. ``plan_media`` turns the items
it found (``item.MediaItem``) into a ``Plan``: every inline item measured from its base64 length (no decode
yet), its declared type checked, the URL policy applied, each item then carrying where its bytes are and
what to check them against, so a decode worker needs nothing else.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import hyperscan

from preprocessors.dataurl import decoded_size, parse_data_url
from preprocessors.errors import (
    FETCH_URL_NOT_ALLOWED,
    INVALID_DATA_URI,
    INVALID_MEDIA_TYPE,
    JSON_TOO_COMPLEX,
    MEDIA_TOO_LARGE,
    MEDIA_URL_NOT_ALLOWED,
    MEDIA_URL_SCHEME_NOT_ALLOWED,
    TOO_MANY_MEDIA,
    InvalidJson,
    MediaError,
    MmgateError,
)
from proxy.payload.dialects import Route
from proxy.payload.item import MediaItem
from proxy.payload.rawjson import (
    Skeleton,
    Span,
    Steps,
    StructureTooLarge,
    parse_plain,
    run_steps,
    skeleton_steps,
    string_value,
)
from proxy.payload.walkers import WALKERS, BoundedParts, EnoughParts

# Every media part a walker can find sits under a key or a ``type`` value that contains "image", "audio"
# or "video" (compared case-sensitively, after JSON unescaping). A JSON string can only hide those letters
# behind a ``\uXXXX`` escape, and an ASCII letter escaped is ``\u006X`` or ``\u007X`` (the ``u`` of an
# escape is always lower-case, RFC 8259 section 7), so these five literals make a miss impossible (pinned by
# hypothesis tests). Text escaped for other reasons (``\u00e9``, ``\u4e2d``, ``\n``) does not match.
MARKERS: tuple[bytes, ...] = (b"image", b"audio", b"video", b"\\u006", b"\\u007")

DEFAULT_MAX_DEPTH = 64


def _compile_markers() -> hyperscan.Database:
    database = hyperscan.Database(mode=hyperscan.HS_MODE_BLOCK)
    database.compile(expressions=[re.escape(marker) for marker in MARKERS], ids=list(range(len(MARKERS))),
                     elements=len(MARKERS), flags=[hyperscan.HS_FLAG_SINGLEMATCH] * len(MARKERS))
    return database


_MARKERS_DB = _compile_markers()
_scratch = threading.local()  # a scratch space serves one scan at a time: one per thread that sniffs


def _stop_at_first(*_match: object) -> bool:
    return True  # True ends the scan at the first marker (hyperscan raises ScanTerminated)


def may_contain_media(body: bytes | bytearray | memoryview) -> bool:
    """Cheap pre-check: False means no walker can find media here, so skip the JSON parse.

    One pass over the body for all markers at once (hyperscan: SIMD literal matching, several GB/s, with
    the GIL released), stopping at the first: a media body names its media in its first bytes. A stdlib
    ``bytes.find`` costs a pass per marker at a fraction of that speed (``python -m bench run sniff``).
    """
    scratch = getattr(_scratch, "space", None)
    if scratch is None:
        scratch = _scratch.space = hyperscan.Scratch(_MARKERS_DB)
    try:
        _MARKERS_DB.scan(body, match_event_handler=_stop_at_first, scratch=scratch)
    except hyperscan.ScanTerminated:
        return True
    return False


_SEAM = max(map(len, MARKERS)) - 1  # a marker across a boundary has at most this many bytes on either side


def chunks_may_contain_media(chunks: Sequence[bytes]) -> bool:
    """``may_contain_media`` of the chunks joined, without joining them: each chunk is scanned where it lies,
    and each boundary through a few bytes either side of it (the last ``_SEAM`` bytes before it, gathered
    across chunks shorter than that, and the first ``_SEAM`` after it), so a marker split over any number
    of chunks is still found."""
    tail = b""
    for chunk in chunks:
        if tail and may_contain_media(tail + chunk[:_SEAM]):
            return True
        if may_contain_media(chunk):
            return True
        tail = chunk[-_SEAM:] if len(chunk) >= _SEAM else (tail + chunk)[-_SEAM:]
    return False


# Walking string tokens costs far more per token than orjson costs per byte: past about 8 quotes
# (4 tokens) per KB a plain parse of the whole body is the cheaper way to find out.
_TEXT_HEAVY_QUOTES_PER_KB = 8
_SAMPLES = 33
_SAMPLE_WINDOW = 1024


def looks_text_heavy(body: bytes) -> bool:
    """True when ``body`` looks like many small strings (a text chat) rather than a few huge ones.

    The median quote count of evenly spread 1 KB windows: robust to the dense JSON head of a media body.
    Only picks the faster of two correct paths (``find_media``), so a wrong guess costs time, never
    correctness.
    """
    size = len(body)
    if size <= _SAMPLES * _SAMPLE_WINDOW:
        return body.count(b'"') * _SAMPLE_WINDOW > size * _TEXT_HEAVY_QUOTES_PER_KB
    step = (size - _SAMPLE_WINDOW) // (_SAMPLES - 1)
    counts = sorted(body.count(b'"', i * step, i * step + _SAMPLE_WINDOW) for i in range(_SAMPLES))
    return counts[_SAMPLES // 2] > _TEXT_HEAVY_QUOTES_PER_KB


def locate(route: Route, skeleton: Skeleton, max_depth: int = DEFAULT_MAX_DEPTH,
           max_parts: int | None = None) -> list[MediaItem]:
    """Every media part of the request, in document order. MmgateError 400 ``invalid_request`` (with the
    part's path as ``param``) only for a media part too malformed to process, ``json_too_deep`` for media
    nested deeper than ``max_depth``. With ``max_parts``, the walk ends at the part that makes that many:
    the rest of the document is not visited (nor checked)."""
    walker = WALKERS.get(route)
    doc = skeleton.doc
    if walker is None or not isinstance(doc, dict):
        return []
    out: list[MediaItem] = [] if max_parts is None else BoundedParts(max_parts)
    try:
        walker(skeleton, doc, out, max_depth)
    except EnoughParts:
        pass
    return out


def find_media(route: Route, body: bytes,
               max_depth: int = DEFAULT_MAX_DEPTH) -> tuple[Skeleton | None, list[MediaItem]]:
    """The skeleton and media parts of ``body`` (``(None, [])``: forward it as it is), in one go: see
    ``find_media_steps``."""
    return run_steps(find_media_steps(route, body, max_depth))


def find_media_steps(route: Route, body: bytes, max_depth: int = DEFAULT_MAX_DEPTH, max_parts: int | None = None,
                     max_structure: int | None = None) -> Steps[tuple[Skeleton | None, list[MediaItem]]]:
    """The skeleton and media parts of ``body`` (``(None, [])``: forward it as it is), in bounded steps.

    Same outcome as sniff -> skeletonize -> locate, by the cheaper correct path. A text-heavy body no
    bigger than ``max_structure`` is parsed plainly (spans are needed only if it turns out to hold media,
    then it is skeletonized); any other body is skeletonized in steps (``rawjson.skeleton_steps``), and
    one whose structure outside long strings exceeds ``max_structure`` bytes is refused with 400
    ``json_too_complex`` before any parse. The walk stops at ``max_parts`` parts. The sniff decides only
    what invalid JSON means: no marker -> forwarded untouched for the backend to judge, else 400.
    """
    if route == "other":
        return None, []
    try:
        if looks_text_heavy(body) and (max_structure is None or len(body) <= max_structure):
            plain = parse_plain(body)
            if not locate(route, plain, max_depth, max_parts=1):
                return plain, []
        skeleton = yield from skeleton_steps(body, max_structure=max_structure)
    except InvalidJson:
        if not may_contain_media(body):
            return None, []
        raise
    except StructureTooLarge as over:
        if not may_contain_media(body):
            return None, []
        raise JSON_TOO_COMPLEX.error(
            f"the request's JSON has {over.what} (keys, numbers, short strings, brackets), over what "
            "mmgate parses (MMGATE_MAX_JSON_STRUCTURE_KB): send fewer parts or messages") from None
    return skeleton, locate(route, skeleton, max_depth, max_parts)


def inline_value(body: bytes, item: MediaItem) -> bytes | memoryview:
    """An inline item's value as UTF-8 bytes (data URI or raw base64); a view into ``body`` when possible."""
    if item.span is not None:
        return string_value(body, item.span)
    if not item.is_url:
        return item.literal.encode("utf-8")
    raise ValueError(f"{item.path} is a URL item, it has no inline data")


@dataclass(slots=True)
class Plan:
    """What the media step will do for one request.

    ``items`` are what the media step works on (inline, and URLs it fetches); ``urls`` the URL items it
    forwards as they are. ``refusals`` holds the refusal when an item cannot be processed (at most one): the
    plan then stops at that item, and ``urls`` holds only the URL items before it (they are counted all the
    same, as they were seen). Raise it popped (``raise plan.refusals.pop()``): that leaves no cycle between
    the error, its traceback's frames and this plan, which would keep the request's body alive until a GC
    pass.
    """

    is_stream: bool = False
    model: str | None = None  # the body's "model" field, where it is a string
    parts: int = 0  # media items found, URLs included
    items: list[MediaItem] = field(default_factory=list)
    urls: list[MediaItem] = field(default_factory=list)
    refusals: list[MmgateError] = field(default_factory=list)

    @property
    def refusal(self) -> MmgateError | None:
        return self.refusals[0] if self.refusals else None

    @property
    def cost(self) -> int:
        """Decoded bytes the request will hold while its media is worked on: what admission weighs."""
        return sum(item.size for item in self.items)


@dataclass(frozen=True, slots=True, kw_only=True)
class Limits:
    """The settings a plan is checked against, each given by name."""

    max_parts: int
    max_item_bytes: int
    max_depth: int = DEFAULT_MAX_DEPTH
    max_structure: int | None = None  # bytes of JSON outside long strings parsed in one call (None: no bound)
    # MMGATE_MEDIA_URLS: URL parts are forwarded as they are, unless refused (reject) or fetched before their job
    reject_urls: bool = False
    fetch_urls: bool = False


def plan_media(route: Route, body: bytes, limits: Limits) -> Plan:
    """``plan_steps`` in one go."""
    return run_steps(plan_steps(route, body, limits))


def plan_steps(route: Route, body: bytes, limits: Limits) -> Steps[Plan]:
    """Find the media of ``body`` and measure it, in bounded steps (a generator that returns the plan).
    Raises for a body whose media cannot even be walked (invalid JSON, structure over
    ``limits.max_structure``, a malformed or too deeply nested item); an item that fails a limit ends the
    plan with a refusal instead, so the items seen before it are still accounted for. The walk stops at
    the first item over ``limits.max_parts``."""
    skeleton, found = yield from find_media_steps(route, body, limits.max_depth, limits.max_parts + 1,
                                                  limits.max_structure)
    doc = skeleton.doc if skeleton is not None and isinstance(skeleton.doc, dict) else {}
    model = skeleton.text(doc.get("model")) if skeleton is not None else None  # a long name is a placeholder
    plan = Plan(is_stream=doc.get("stream") is True, model=model)
    del doc
    del skeleton  # it references the body; the spans in ``found`` are all a plan keeps
    plan.parts = len(found)
    if len(found) > limits.max_parts:
        plan.refusals.append(TOO_MANY_MEDIA.error(
            f"the request has more than {limits.max_parts} media parts, the limit "
            "(MMGATE_MAX_MEDIA_PER_REQUEST): send fewer", param=found[limits.max_parts].path))
        return plan
    try:
        for item in found:
            if item.is_url:
                _check_scheme(item)
                if limits.reject_urls:
                    raise MEDIA_URL_NOT_ALLOWED.error(
                        "media URLs are not accepted here (MMGATE_MEDIA_URLS=reject): send the media "
                        "inline as base64", param=item.path)
                if limits.fetch_urls:
                    _check_fetchable(route, item)
                    # Unknown until read: charged the per-item cap.
                    plan.items.append(replace(item, index=len(plan.items), size=limits.max_item_bytes))
                    continue
                plan.urls.append(item)
                continue
            plan.items.append(_measured(body, item, len(plan.items), limits.max_item_bytes))
    except MmgateError as refusal:
        plan.refusals.append(refusal)
    return plan


def _measured(body: bytes, item: MediaItem, index: int, max_item: int) -> MediaItem:
    """``item`` as the plan's item ``index``: its decoded size from the base64 length alone (413 before any
    decode) and its declared type; parses only a data URI's head."""
    span = item.span
    if span is not None and not span.escaped:  # the common case: look at the head only, copy nothing
        head: bytes | memoryview = memoryview(body)[span.start + 1 : min(span.end - 1, span.start + 257)]
        length = span.end - span.start - 2
    else:  # a short literal, or a string with JSON escapes (rare): unescape it first
        value = inline_value(body, item)
        head, length = value[:256], len(value)
    offset = 0
    declared = (item.declared_mime or "").lower()  # not stripped: a media_type with spaces is no token
    declared_span = item.mime_span
    if item.encoding == "data_uri":
        try:
            data_url = parse_data_url(head)
        except MediaError as error:
            raise error.at(item.path) from None
        if data_url is None:
            raise INVALID_DATA_URI.error("expected a data: URI or an http(s) URL", param=item.path)
        offset = data_url.payload_offset
        declared = data_url.mime
        declared_span = None
        if span is not None and not span.escaped:
            # "data:" + the type as written, up to the first ";" (the header is ASCII, checked above)
            mime_end = bytes(head[: offset - 1]).find(b";")
            mime_end = offset - 1 if mime_end < 0 else mime_end
            declared_span = Span(span.start + 6, span.start + 1 + mime_end, False)
    if (declared or item.declared_mime is not None) and not _declared_type_allowed(item, declared):
        raise INVALID_MEDIA_TYPE.error(
            f"the declared type {declared[:64]!r} is not an accepted {item.kind} type: declare "
            f"{item.kind}/<subtype> or leave it out", param=item.path)
    size = decoded_size(length - offset)
    if size > max_item:
        raise MEDIA_TOO_LARGE.error(
            f"this {item.kind} decodes to about {size} bytes, over the per-item limit of {max_item} "
            "(MMGATE_MAX_MEDIA_ITEM_MB): send a smaller file", param=item.path)
    return replace(item, index=index, payload_offset=offset, size=size, declared_type=declared,
                   declared_span=declared_span)


# A URL's scheme as a backend's URL parser reads it: WHATWG and Python's urlsplit both drop leading C0 controls
# and spaces, and tabs and line breaks anywhere, so " FiLe:" and "fi\tle:" are file: URLs to them.
_SCHEME = re.compile(r"[\x00-\x20]*([A-Za-z][A-Za-z0-9+.\-\t\r\n]*):")
_TAB_OR_NEWLINE = str.maketrans("", "", "\t\r\n")
_FORWARDED_SCHEMES = ("http", "https")


def _check_scheme(item: MediaItem) -> None:
    """A media URL with any scheme but http or https is refused, whatever MMGATE_MEDIA_URLS: a backend that
    reads local files (``file:``) or speaks other protocols would read them for the client. A value with no
    scheme is the backend's to judge. A ``data:`` URI is inline media, never a URL item, unless something comes
    before its ``data:`` or it sits where only a URL goes (an Anthropic url source): then it is refused too,
    as it would reach the backend as media mmgate never checked."""
    found = _SCHEME.match(item.url)
    if found is None:
        return
    scheme = found.group(1).translate(_TAB_OR_NEWLINE).lower()
    if scheme in _FORWARDED_SCHEMES:
        return
    hint = ("inline media is a data: URI with nothing before it, or a base64 source" if scheme == "data"
            else "send an http(s) URL or the media inline")
    raise MEDIA_URL_SCHEME_NOT_ALLOWED.error(
        f"media URLs with the scheme {scheme[:32]!r} are not accepted, only http and https: {hint}", param=item.path)


def _check_fetchable(route: Route, item: MediaItem) -> None:
    """A URL item mmgate will fetch (``fetch.fetcher``), refused here when its fetched bytes could not take
    the URL's place."""
    url = item.url
    if route == "messages":  # an Anthropic url source: a data URL in its place is no valid source
        raise MEDIA_URL_NOT_ALLOWED.error(
            "image URLs are not accepted here (MMGATE_MEDIA_URLS=fetch does not rewrite Anthropic "
            "url sources): send a base64 source", param=item.path)
    if item.kind == "video":
        raise MEDIA_URL_NOT_ALLOWED.error(
            "video URLs are not fetched (MMGATE_MEDIA_URLS=fetch reads images and audio): send the "
            "video inline", param=item.path)
    if item.span is None or not url[:8].lower().startswith(("http://", "https://")):
        raise FETCH_URL_NOT_ALLOWED.error("only http and https media URLs are fetched",
                                          param=item.path)


# RFC 6838 section 4.2: a type and a subtype of restricted-name characters.
_MEDIA_TYPE = re.compile(r"[a-z0-9][a-z0-9!#$&^_.+-]{0,126}/[a-z0-9][a-z0-9!#$&^_.+-]{0,126}")


def _declared_type_allowed(item: MediaItem, declared: str) -> bool:
    """An item's declared type must name its kind; a data URI may also say application/octet-stream."""
    if not _MEDIA_TYPE.fullmatch(declared):
        return False
    if declared.startswith(item.kind + "/"):
        return True
    return item.encoding == "data_uri" and declared == "application/octet-stream"
