"""Where each API keeps its media: one walker per media route, over the small skeleton document from
``rawjson.skeletonize``.

Each walker reports every media part with its JSON path (the ``param`` of a refusal) and the byte span of its
data, so nothing downstream ever parses the base64. They are liberal: unknown part types, unknown fields and
odd shapes are left for the backend to judge; only a media part too malformed to process is refused. They err
towards finding media, since a part the backend treats as media but mmgate missed would skip the gate:
OpenAI-style parts are recognised the way vLLM does (including parts with no ``type`` or with a ``uuid``), and
chat parts are also looked for in Responses content and vice versa.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from preprocessors.base import MediaKind
from preprocessors.errors import INVALID_REQUEST, JSON_TOO_DEEP, MmgateError
from proxy.payload.dialects import Route
from proxy.payload.item import MediaItem
from proxy.payload.rawjson import Skeleton


class EnoughParts(Exception):
    """Raised by ``BoundedParts.append`` once the collection is full: the walk stops there."""


class BoundedParts(list[MediaItem]):
    """The parts a walker finds, at most ``limit`` of them: the part that fills it ends the walk (a request
    over a limit is refused at the first part past it, without visiting the rest of its document)."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit

    def append(self, part: MediaItem) -> None:
        super().append(part)
        if len(self) >= self.limit:
            raise EnoughParts


def _bad(message: str, path: str) -> MmgateError:
    return INVALID_REQUEST.error(message, param=path)


DEFAULT_MAX_DEPTH = 64


def _check_depth(depth: int, max_depth: int, path: str) -> None:
    """The walkers recurse into client-chosen nesting: bound it (MMGATE_MAX_JSON_DEPTH) instead of
    letting Python's recursion limit answer for it."""
    if depth > max_depth:
        raise JSON_TOO_DEEP.error(f"media is nested more than {max_depth} levels deep (MMGATE_MAX_JSON_DEPTH)",
                                  param=path[:200])


def _short_text(sk: Skeleton, value: object, limit: int = 4096) -> str | None:
    """A small string field (``type``, ``format``, MIME) as text; None if absent, not a str or huge."""
    span = sk.span_of(value)
    if span is not None and span.end - span.start > limit:
        return None
    return sk.text(value)


def _inline_or_url(
    sk: Skeleton, value: object, path: str, kind: MediaKind, field: str, *, raw_base64: bool
) -> MediaItem:
    """A media string: a ``data:`` URI (inline), else a URL, or raw base64 when ``raw_base64``.

    ``raw_base64`` (SGLang/vLLM ``/generate``): only something with a ``scheme://`` is a URL;
    base64 never contains a colon.
    """
    if not isinstance(value, str):
        raise _bad(f"{field} must be a string", path)
    span = sk.span_of(value)
    literal = "" if span is not None else value
    head = sk.head(value, 64) or ""
    if head[:5].lower() == "data:":
        return MediaItem(path, kind, False, span=span, literal=literal, encoding="data_uri")
    if raw_base64 and "://" not in head:
        return MediaItem(path, kind, False, span=span, literal=literal, encoding="base64")
    return MediaItem(path, kind, True, url=sk.text(value) or "", span=span)


def _base64_part(sk: Skeleton, data: str, path: str, kind: MediaKind, **declared: Any) -> MediaItem:
    """An inline part whose field holds bare base64 (no ``data:`` header): its span, or the text itself when the
    skeleton kept the string (a short one)."""
    span = sk.span_of(data)
    return MediaItem(path, kind, False, span=span, literal="" if span is not None else data, encoding="base64",
                     **declared)


def _url_field(sk: Skeleton, value: object, path: str, kind: MediaKind, field: str) -> MediaItem:
    """``{"url": ...}`` or (vLLM) a bare string."""
    if value is None:
        raise _bad(f"{field} is missing", path)
    if isinstance(value, dict):
        if "url" not in value:
            raise _bad(f"{field} has no url", path)
        return _inline_or_url(sk, value["url"], path, kind, f"{field}.url", raw_base64=False)
    return _inline_or_url(sk, value, path, kind, field, raw_base64=False)


def _input_audio(sk: Skeleton, value: object, path: str) -> MediaItem:
    if not isinstance(value, dict):
        raise _bad("input_audio must be an object with data and format", path)
    data = value.get("data")
    if not isinstance(data, str):
        raise _bad("input_audio.data must be a base64 string", path)
    return _base64_part(sk, data, path, "audio", audio_format=_short_text(sk, value.get("format")))


def _input_image(sk: Skeleton, part: dict[str, Any], path: str) -> MediaItem | None:
    """Responses ``input_image``: ``image_url`` (a string, or defensively ``{"url"}``) or ``file_id``."""
    image_url = part.get("image_url")
    if image_url is None:
        if part.get("file_id") is not None:
            return None  # a stored file: nothing inline, the backend resolves it
        raise _bad("input_image needs image_url or file_id", path)
    return _url_field(sk, image_url, path, "image", "image_url")


# Field -> kind for parts without a usable ``type`` (vLLM's order; the *_embeds/pil fields are not
# media we process, and vLLM stops at them).
_INFERRED_FIELDS: tuple[tuple[str, MediaKind | None], ...] = (
    ("image_url", "image"),
    ("image_pil", None),
    ("image_embeds", None),
    ("audio_embeds", None),
    ("prompt_embeds", None),
    ("audio_url", "audio"),
    ("input_audio", "audio"),
    ("video_url", "video"),
)


_URL_TYPES: dict[str, MediaKind] = {"image_url": "image", "audio_url": "audio", "video_url": "video"}


def _openai_part(sk: Skeleton, part: object, path: str) -> MediaItem | None:
    """An OpenAI-style content part (chat or Responses), recognised as vLLM does."""
    if not isinstance(part, dict):
        return None
    raw_type = part.get("type")
    part_type = _short_text(sk, raw_type, limit=1024)
    if part.get("uuid") is None and part_type is not None:
        if part_type in _URL_TYPES:
            return _url_field(sk, part.get(part_type), path, _URL_TYPES[part_type], part_type)
        if part_type == "input_audio":
            return _input_audio(sk, part.get("input_audio"), path)
        if part_type == "input_image":
            return _input_image(sk, part, path)
        return None  # text, file, refusal, unknown: not media
    if raw_type is not None and part.get("uuid") is None:
        return None  # a non-string type: the backend refuses it
    # No type, or a uuid (vLLM then reads the fields, not the type). A None value with a uuid is a
    # reference to media the backend has cached: nothing inline.
    for field, kind in _INFERRED_FIELDS:
        if field not in part:
            continue
        value = part[field]
        if kind is None:
            return None
        if value is None:
            if field == "input_audio":
                continue  # vLLM checks input_audio with get(), not `in`
            return None
        if field == "input_audio":
            return _input_audio(sk, value, path)
        return _url_field(sk, value, path, kind, field)
    return None


# Typed parts that are never media (vLLM reads a typed part by its type unless it has a uuid):
# skipped before any path string is built, which is most of the walk over a long text chat.
_TEXT_TYPES = frozenset({"text", "input_text", "output_text", "refusal", "thinking"})


def _content_parts(sk: Skeleton, content: list[Any], path: str, out: list[MediaItem]) -> None:
    for j, part in enumerate(content):
        if not isinstance(part, dict):
            continue
        part_type = part.get("type")
        if isinstance(part_type, str) and part_type in _TEXT_TYPES and part.get("uuid") is None:
            continue
        found = _openai_part(sk, part, f"{path}[{j}]")
        if found is not None:
            out.append(found)


def _chat(sk: Skeleton, doc: dict[str, Any], out: list[MediaItem], max_depth: int) -> None:
    messages = doc.get("messages")
    if not isinstance(messages, list):
        return
    for i, message in enumerate(messages):
        if isinstance(message, dict):
            content = message.get("content")
            if isinstance(content, list):
                _content_parts(sk, content, f"messages[{i}].content", out)


def _responses(sk: Skeleton, doc: dict[str, Any], out: list[MediaItem], max_depth: int) -> None:
    items = doc.get("input")
    if not isinstance(items, list):
        return  # a plain string prompt
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            continue
        found = _openai_part(sk, item, f"input[{i}]")  # a bare input_image item
        if found is not None:
            out.append(found)
            continue
        content = item.get("content")
        if isinstance(content, list):
            _content_parts(sk, content, f"input[{i}].content", out)
        output = item.get("output")  # function_call_output: may list input_text / input_image parts
        if isinstance(output, list):
            _content_parts(sk, output, f"input[{i}].output", out)


def _anthropic_block(sk: Skeleton, block: object, path: str, out: list[MediaItem], depth: int,
                     max_depth: int) -> None:
    if not isinstance(block, dict):
        return
    block_type = _short_text(sk, block.get("type"), limit=1024)
    if block_type == "tool_result":
        inner = block.get("content")
        if isinstance(inner, list):
            _check_depth(depth + 2, max_depth, path)
            for k, item in enumerate(inner):
                _anthropic_block(sk, item, f"{path}.content[{k}]", out, depth + 2, max_depth)
        return
    if block_type != "image":
        return
    source = block.get("source")
    if not isinstance(source, dict):
        raise _bad("image block needs a source object", path)
    source_type = _short_text(sk, source.get("type"), limit=1024)
    if source_type == "base64":
        data = source.get("data")
        if not isinstance(data, str):
            raise _bad("image source of type base64 needs a data string", path)
        media_type = source.get("media_type")
        out.append(_base64_part(sk, data, path, "image", declared_mime=_short_text(sk, media_type),
                                mime_span=sk.span_of(media_type)))
    elif source_type == "url":
        url = source.get("url")
        if not isinstance(url, str):
            raise _bad("image source of type url needs a url string", path)
        out.append(MediaItem(path, "image", True, url=sk.text(url) or "", span=sk.span_of(url)))


def _messages(sk: Skeleton, doc: dict[str, Any], out: list[MediaItem], max_depth: int) -> None:
    messages = doc.get("messages")
    if not isinstance(messages, list):
        return
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            continue
        content = message.get("content")
        if isinstance(content, list):
            for j, block in enumerate(content):
                _anthropic_block(sk, block, f"messages[{i}].content[{j}]", out, 5, max_depth)


_GENERATE_FIELDS: tuple[tuple[str, MediaKind], ...] = (
    ("image_data", "image"),
    ("audio_data", "audio"),
    ("video_data", "video"),
)


def _generate_item(sk: Skeleton, value: object, path: str, kind: MediaKind, out: list[MediaItem], depth: int,
                   max_depth: int) -> None:
    """A string, a list (a batch, possibly nested), or SGLang's ``{"url": ...}`` object."""
    if isinstance(value, str):
        out.append(_inline_or_url(sk, value, path, kind, path, raw_base64=True))
    elif isinstance(value, list):
        _check_depth(depth, max_depth, path)
        for k, item in enumerate(value):
            _generate_item(sk, item, f"{path}[{k}]", kind, out, depth + 1, max_depth)
    elif isinstance(value, dict) and isinstance(value.get("url"), str):
        out.append(_inline_or_url(sk, value["url"], path, kind, f"{path}.url", raw_base64=True))


def _generate(sk: Skeleton, doc: dict[str, Any], out: list[MediaItem], max_depth: int) -> None:
    for field, kind in _GENERATE_FIELDS:
        if field in doc:
            _generate_item(sk, doc[field], field, kind, out, 2, max_depth)


Walker = Callable[[Skeleton, dict[str, Any], list["MediaItem"], int], None]


# Where each media route's parts live (``locate.find_media`` runs the walker for the request's route).
WALKERS: dict[Route, Walker] = {"chat": _chat, "responses": _responses, "messages": _messages, "generate": _generate}
