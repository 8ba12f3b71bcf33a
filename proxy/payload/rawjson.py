"""Reading JSON bytes without parsing them whole: string-token spans and a skeleton with placeholders.

A multimodal body is mostly a few huge base64 strings. Parsing it whole and re-serialising it would cost
GIL time and change bytes the client sent (big integers, ``1e2``, duplicate keys, ``\\/``). Instead:

1. ``skeletonize`` walks the string tokens with ``bytes.find`` (C speed; base64 holds neither ``"``
   nor ``\\``, so even a huge body has few tokens), replaces long, escaped or media-looking string
   *values* by short placeholders, and parses the small remainder with orjson. ``skeleton_steps`` is the
   same walk cut into bounded steps, with a bound on the remainder orjson may be given, for a caller on an
   event loop.
2. A walker (``proxy/payload/dialects.py``) reads that small document; a placeholder names the byte ``Span`` of
   its token.
3. The body's owner builds the outgoing body in one join (``proxy/edge/buffers.py``'s ``splice``): original
   bytes, with only the chosen tokens' spans replaced.

This module knows JSON, not APIs nor HTTP: what is not JSON raises ``InvalidJson``, and so does JSON nested more
than ``MAX_NESTING`` (1024, orjson's bound) deep, on the stdlib fallback too, whatever the Python.
"""

from __future__ import annotations

import functools
import json
import re
import secrets
import sys
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any, TypeVar

import orjson

from preprocessors.errors import INVALID_JSON, InvalidJson

# String values starting with one of these (ASCII case-insensitive) are always placeholdered,
# whatever their length: media data (data: URI), the MIME beside Anthropic data, and web URLs, so that
# every one of them has a span (a walker can name it, the pipeline can rewrite it).
_MEDIA_PREFIXES: tuple[bytes, ...] = (b"data:", b"image/", b"audio/", b"video/", b"http:", b"https:")

_QUOTE = 0x22
_BACKSLASH = 0x5C
_COLON = 0x3A
_WHITESPACE = frozenset(b" \t\r\n")
_SUFFIXES: tuple[bytes, ...] = tuple(b'%d"' % i for i in range(1024))  # placeholder endings, premade


@dataclass(frozen=True, slots=True)
class Span:
    """One JSON string token in the raw body, quotes included: ``body[start:end]``."""

    start: int  # index of the opening quote
    end: int  # index just after the closing quote
    escaped: bool  # the content holds a backslash: unescape it before use (see string_value)

    @property
    def raw_length(self) -> int:
        """Bytes between the quotes (for unescaped base64, exactly the encoded length)."""
        return self.end - self.start - 2


def _loads_str(token: bytes | memoryview) -> str:
    """Unescape one JSON string token. orjson first; the stdlib also takes lone surrogates."""
    try:
        value = orjson.loads(token)
    except orjson.JSONDecodeError:
        try:
            value = json.loads(bytes(token).decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as exc:
            raise INVALID_JSON.error(f"request body is not valid JSON: bad string ({exc})") from None
    if not isinstance(value, str):  # cannot happen for a token found by skeletonize
        raise INVALID_JSON.error("request body is not valid JSON: expected a string")
    return value


def string_value(body: bytes, span: Span) -> bytes | memoryview:
    """The string's content without quotes, as UTF-8.

    Unescaped (the normal case for base64): a zero-copy view into ``body``. Escaped (e.g. base64
    written with ``\\/``): the correct slow path, a full unescape.
    """
    if not span.escaped:
        return memoryview(body)[span.start + 1 : span.end - 1]
    text = _loads_str(memoryview(body)[span.start : span.end])
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:
        raise INVALID_JSON.error("request body is not valid JSON: string has an unpaired surrogate") from None


class Skeleton:
    """A parsed body whose long strings are placeholders that point back at their byte spans.

    ``doc`` is the parsed document. Every string *value* (never a key) that is longer than the
    threshold, holds a backslash escape, or starts with ``data:``, ``image/``, ``audio/``,
    ``video/``, ``http:`` or ``https:`` (ASCII case-insensitive) appears in ``doc`` as a placeholder
    ``"\\x00<nonce>:<i>"`` standing for ``spans[i]``. So a string left literal is spelled in the
    body exactly as in ``doc``, and no data URI, media MIME or web URL is ever left without a span.
    Read strings of ``doc`` through ``text()``. The nonce is random per call, so a client cannot
    forge a placeholder. The skeleton holds ``body``: drop it once the body is spliced.
    """

    __slots__ = ("_cuts", "_prefix", "_spans", "body", "doc")

    def __init__(self, body: bytes, doc: Any, cuts: list[tuple[int, int, bool]], prefix: str) -> None:
        self.body = body
        self.doc = doc
        self._cuts = cuts  # (start, end, escaped) per placeholder: Span objects are made on demand
        self._prefix = prefix
        self._spans: list[Span] | None = None

    @property
    def spans(self) -> list[Span]:
        """Every placeholdered token, in body order (index i is placeholder i)."""
        if self._spans is None:
            self._spans = [Span(*cut) for cut in self._cuts]
        return self._spans

    def span_of(self, value: object) -> Span | None:
        """The Span behind ``value`` when it is one of this skeleton's placeholders."""
        if isinstance(value, str) and value.startswith(self._prefix):
            return Span(*self._cuts[int(value[len(self._prefix) :])])
        return None

    def text(self, value: object) -> str | None:
        """``value`` as the client's string (a placeholder is unescaped from the body); None if no str.

        Decodes the whole token: use it for URLs, MIME types and ``type`` values, not for media data.
        """
        if not isinstance(value, str):
            return None
        span = self.span_of(value)
        if span is None:
            return value
        if span.escaped:
            return _loads_str(memoryview(self.body)[span.start : span.end])
        try:
            return str(memoryview(self.body)[span.start + 1 : span.end - 1], "utf-8")
        except UnicodeDecodeError:
            raise INVALID_JSON.error("request body is not valid JSON: string is not UTF-8") from None

    def head(self, value: object, n: int) -> str | None:
        """The first ``n`` characters of ``value`` (cheap even for a placeholder of many megabytes)."""
        if not isinstance(value, str):
            return None
        span = self.span_of(value)
        if span is None:
            return value[:n]
        content = memoryview(self.body)[span.start + 1 : span.end - 1]
        if not span.escaped:
            # 4 bytes per character at most; a character cut at the end only affects chars past n.
            return str(content[: 4 * n], "utf-8", "replace")[:n]
        # One character is at most 12 escaped bytes (a surrogate pair); back off from a cut that
        # splits an escape or a UTF-8 sequence until the prefix parses.
        chunk = bytes(content[: 12 * n + 12])
        if len(chunk) == len(content):
            return _loads_str(b'"' + chunk + b'"')[:n]
        for cut in range(len(chunk), len(chunk) - 13, -1):
            try:
                return _loads_str(b'"' + chunk[:cut] + b'"')[:n]
            except InvalidJson:
                continue
        raise INVALID_JSON.error("request body is not valid JSON: bad string escape")

    def resolve(self, value: Any = ...) -> Any:
        """A deep copy of ``value`` (default: ``doc``) with every placeholder unescaped (tests, debugging).

        Iterative: the nesting is the client's choice, Python's recursion limit is not."""
        if value is ...:
            value = self.doc

        def copy(item: Any) -> Any:
            if isinstance(item, str):
                return self.text(item)
            if isinstance(item, list):
                new: Any = []
            elif isinstance(item, dict):
                new = {}
            else:
                return item
            pending.append((item, new))
            return new

        pending: list[tuple[Any, Any]] = []
        root = copy(value)
        while pending:
            source, target = pending.pop()
            if isinstance(source, list):
                target.extend(copy(item) for item in source)
            else:
                for key, item in source.items():
                    target[key] = copy(item)
        return root


def parse_plain(body: bytes) -> Skeleton:
    """A Skeleton without placeholders (a plain parse): right for finding out *whether* a text-heavy
    body has media; its parts carry no spans, so re-run ``skeletonize`` when there are some."""
    return Skeleton(body, _parse(body), [], "\x00" + secrets.token_hex(8) + ":")


@functools.lru_cache(maxsize=8)
def _skip_plain(long_string: int) -> Callable[[bytes, int, int], re.Match[bytes] | None]:
    """A matcher for the run of bytes from ``pos`` that needs no placeholder: everything outside
    strings, and every string of at most ``long_string`` bytes with no backslash and no media prefix.

    The regex engine walks such runs at about orjson's speed per token, far faster than a Python loop
    per token, so a chat history or a body of many tiny strings stays cheap; it stops in front of the
    next string that must be looked at (long, escaped or media-looking), whose end the caller finds
    with memchr. The match never fails (it may be empty).

    Plain greedy repeats only, no possessive repeat nor atomic group: CPython before 3.11.5 matched a
    possessive repeat of a group wrongly (gh-100061, gh-106052; Debian 12 ships 3.11.2). Greedy means
    the same here: each repeat can match in one way only (a run of bytes that are neither quote nor
    backslash must be followed by a quote to go on), so bytes given back never lead to another match.
    A string's first byte picks its one alternative, a test the engine makes without entering it: most
    strings start with no prefix's first letter and skip the media lookahead, the dearest step. Each
    alternative ends with the closing quote, so a long string's bytes are given back by one quick scan
    for that quote, not by a retry of what follows the group at each byte.
    """
    limit = min(long_string, 1 << 30)  # the regex engine's repeat bound; bodies are far smaller
    rests: dict[bytes, list[bytes]] = {}  # the media prefixes by their first letter
    for prefix in _MEDIA_PREFIXES:
        rests.setdefault(prefix[:1].lower(), []).append(re.escape(prefix[1:]))
    plain_strings = [b'"']  # what may follow a plain string's opening quote, one alternative per first byte
    if limit:
        firsts = b"".join(rests)
        tail = rb'[^"\\]{0,%d}"' % (limit - 1)
        plain_strings[:0] = [rb'[^"\\%s%s]' % (firsts, firsts.upper()) + tail] + [
            b"[%s%s](?!(?i:%s))" % (first, first.upper(), b"|".join(rest)) + tail for first, rest in rests.items()]
    return re.compile(rb'(?:[^"\\]*"(?:%s))*[^"\\]*' % b"|".join(plain_strings)).match


def skeletonize(body: bytes, *, long_string: int = 64) -> Skeleton:
    """Parse ``body`` with its long, escaped and media-looking string values replaced by placeholders.

    Raises ``InvalidJson`` for anything that is not JSON. The content of a
    placeholdered string is not validated here (that is what makes it cheap): ``string_value`` /
    ``Skeleton.text`` check it when it is used, and the media checks reject junk bytes anyway.
    The same work as ``skeleton_steps``, in one go.
    """
    return run_steps(skeleton_steps(body, long_string=long_string))


T = TypeVar("T")
Steps = Generator[None, None, T]

# One step of ``skeleton_steps`` scans at most STEP_BYTES with the regex engine or handles at most STEP_TOKENS
# strings (or escaped quotes) in Python, so a caller on an event loop can let others run between steps
# whatever the body's size or shape (``bench/loop_stall.py``).
STEP_BYTES = 64 * 1024
STEP_TOKENS = 256
_SPACES = re.compile(rb"[ \t\r\n]*")


# orjson's time per byte is highest for a run of empty objects or arrays (each one an allocation): a skeleton
# may hold at most one container per CONTAINER_BYTES of ``max_structure``.
CONTAINER_BYTES = 8


class StructureTooLarge(Exception):
    """The skeleton (the JSON left once long strings are placeholders) is bigger than the caller allows: parsing
    it would hold the GIL for longer than one step may. ``what`` says which bound it crossed."""

    def __init__(self, what: str, limit: int) -> None:
        super().__init__(what)
        self.what, self.limit = what, limit


def run_steps(steps: Steps[T]) -> T:
    """Drive a step generator to its end without pausing (where no event loop waits on it)."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


def skeleton_steps(body: bytes, *, long_string: int = 64, max_structure: int | None = None,
                   step_bytes: int = STEP_BYTES, step_tokens: int = STEP_TOKENS) -> Steps[Skeleton]:
    """``skeletonize`` in bounded steps: a generator that yields between steps and returns the Skeleton.

    Each step holds the GIL for a bounded time (``step_bytes``, ``step_tokens``); the one call that cannot
    be cut, orjson's parse of the skeleton, is bounded by ``max_structure``: once more bytes than that are
    left outside placeholders, ``StructureTooLarge`` is raised at the end of the step that found them, and
    no parse happens (None: no bound, for callers that are not on an event loop).
    """
    find = body.find
    skip_plain = _skip_plain(long_string)
    size = len(body)
    nonce = secrets.token_hex(8)
    head = b'"\\u0000' + nonce.encode("ascii") + b":"
    cuts: list[tuple[int, int, bool]] = []
    pieces: list[bytes | memoryview] = []
    view = memoryview(body)
    copied = 0  # body[:copied] is already in pieces
    kept = 0  # bytes of the skeleton in pieces (body[:copied] less its placeholdered strings, plus placeholders)
    pos = 0
    tokens = 0  # strings and escaped quotes handled in Python since the last step

    def check(at: int) -> None:
        if max_structure is not None and kept + at - copied > max_structure:
            raise StructureTooLarge(f"more than {max_structure // 1024} KiB outside its long strings", max_structure)

    step_end = min(step_bytes, size)  # where this step's regex scan ends
    while True:
        if pos >= step_end:  # the step is done: check the bound, let the caller run others, start the next
            check(pos)
            if pos >= size:
                break
            tokens = 0
            yield
            step_end = min(pos + step_bytes, size)
            continue
        start = skip_plain(body, pos, step_end).end()  # type: ignore[union-attr]
        if start >= step_end:  # the rest of this step is plain (the regex stops only outside a string)
            pos = step_end
            continue
        if body[start] != _QUOTE:
            raise INVALID_JSON.error("request body is not valid JSON: backslash outside a string")
        end = find(b'"', start + 1)
        if end < 0:
            raise INVALID_JSON.error("request body is not valid JSON: unterminated string")
        escaped = find(b"\\", start + 1, end) >= 0
        if escaped:
            # The quote ends the string only after an even run of backslashes. body[start] is a
            # quote, so the backwards walk stops there at the latest.
            while True:
                k = end - 1
                while body[k] == _BACKSLASH:
                    k -= 1
                if not (end - 1 - k) & 1:
                    break
                end = find(b'"', end + 1)
                if end < 0:
                    raise INVALID_JSON.error("request body is not valid JSON: unterminated string")
                tokens += 1
                if tokens >= step_tokens:  # a string of many escaped quotes: its walk is cut into steps too
                    tokens = 0
                    yield
        pos = end + 1
        length = end - start - 1
        tokens += 1
        if escaped or length > long_string or body[start + 1 : start + 7].lower().startswith(_MEDIA_PREFIXES):
            after = body[pos] if pos < size else 0
            if after in _WHITESPACE:  # a key only if a colon follows the blanks; their run is scanned in steps
                blank = pos
                while True:
                    limit = min(blank + step_bytes, size)
                    blank = _SPACES.match(body, blank, limit).end()  # type: ignore[union-attr]
                    if blank < limit or blank >= size:
                        break
                    yield
                after = body[blank] if blank < size else 0
            if after == _COLON:
                continue  # keys stay literal so dialects can look them up
            n = len(cuts)
            suffix = _SUFFIXES[n] if n < len(_SUFFIXES) else b'%d"' % n
            pieces.append(view[copied:start])
            pieces.append(head)
            pieces.append(suffix)
            kept += start - copied + len(head) + len(suffix)
            cuts.append((start, pos, escaped))
            copied = pos
        if tokens >= step_tokens:
            check(pos)
            tokens = 0
            yield
            step_end = min(pos + step_bytes, size)

    if cuts:
        pieces.append(view[copied:])
        skeleton_bytes = b"".join(pieces)
    else:
        skeleton_bytes = body
    del pieces, view
    if max_structure is not None:  # an upper bound: a bracket inside a short string counts too
        containers = skeleton_bytes.count(b"{") + skeleton_bytes.count(b"[")
        if containers > max_structure // CONTAINER_BYTES:
            raise StructureTooLarge(f"more than {max_structure // CONTAINER_BYTES} objects and arrays", max_structure)
    return Skeleton(body, _parse(skeleton_bytes), cuts, "\x00" + nonce + ":")


# How deep objects and arrays may nest in a body: orjson's own bound, held on the stdlib fallback too, so that
# the answer is the same on every Python (3.11's json.loads stops where the recursion limit is, near 1000
# frames less the caller's; 3.12 and later count its C recursion apart, allowing thousands).
MAX_NESTING = 1024
_STRING_TOKEN = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)


def _too_deep() -> InvalidJson:
    return INVALID_JSON.error(f"request body is not valid JSON: objects and arrays are nested more than "
                              f"{MAX_NESTING} levels deep")


def _nesting(data: bytes) -> int:
    """The deepest nesting of objects and arrays in ``data``, brackets inside strings not counted. numpy is
    imported here, on the rare fallback path, not with the module (about 0.1 s of every start)."""
    import numpy

    brackets = numpy.frombuffer(_STRING_TOKEN.sub(b"", data), numpy.uint8)
    openers, closers = numpy.frombuffer(b"[{", numpy.uint8), numpy.frombuffer(b"]}", numpy.uint8)
    steps = numpy.isin(brackets, openers).astype(numpy.int64) - numpy.isin(brackets, closers)
    return int(numpy.cumsum(steps).max(initial=0))


def _parse(data: bytes) -> Any:
    """orjson; the stdlib as a fallback for JSON it refuses but Python backends accept (NaN, Infinity, numbers
    beyond a double, lone surrogate escapes), tried only where one of those could be why: the stdlib is
    slower, and a second full parse of a body that is plain invalid would double the time the GIL is held.
    Either way nesting deeper than ``MAX_NESTING`` is refused, and nesting within it is parsed."""
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        reason = exc.msg
    if reason.startswith("depth limit exceeded"):
        raise _too_deep() from None
    if not ("surrogate" in reason or "infinity" in reason or b"NaN" in data or b"Infinity" in data):
        raise INVALID_JSON.error(f"request body is not valid JSON: {reason}") from None
    if _nesting(data) > MAX_NESTING:
        raise _too_deep()
    try:
        return _stdlib_loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise INVALID_JSON.error(f"request body is not valid JSON: {reason}") from None


def _stdlib_loads(text: str) -> Any:
    """``json.loads`` with room for ``MAX_NESTING`` levels: before 3.12 its C scanner counts against the Python
    recursion limit, which is raised (never lowered) to the caller's depth and that much more."""
    if sys.version_info < (3, 12):
        needed = len(_frames()) + MAX_NESTING + 50
        if sys.getrecursionlimit() < needed:
            sys.setrecursionlimit(needed)
    return json.loads(text)


def _frames() -> list[Any]:
    import inspect  # only where the recursion limit may need raising (before 3.12), never at start-up

    frame, frames = inspect.currentframe(), []
    while frame is not None:
        frames.append(frame)
        frame = frame.f_back
    return frames
