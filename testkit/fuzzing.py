"""What the fuzzing suite is made of: strategies, properties, the corpus. Shared by ``tests/proxy/test_app_fuzz.py``
(CI, small budget) and ``bench/fuzz.py`` (large budget), so both run exactly the same properties.

Why in ``testkit``: the bench must not import the test suite, and neither edits ``sys.path``; ``python -m
bench.fuzz`` from the repository root imports ``testkit.fuzzing`` like any module.

Layout:

- **JSON writer** (``write``): serialises a small tree the way real clients do and the way the rarest
  clients do (``\\/``, ``\\u00e9``, surrogate pairs, lone surrogates, big integers, ``1e2``, duplicate
  keys, random whitespace, nesting thousands of levels deep) and records where every media string went,
  so a property knows which bytes mmgate may change.
- **Strategies**: one per dialect (chat, responses, Anthropic messages, ``/generate``), media values (real
  tiny images made once with Pillow, junk, every way to mangle a data URL header or base64), request
  targets, and bodies for the pure functions.
- **Properties**: ``check_*`` functions raise ``AssertionError`` whose message starts with a stable
  signature in square brackets (``[5xx:RecursionError@proxy/payload/walkers.py:_generate_item]``); the signature
  names the fault, so the corpus keeps one input per fault, not one per shrink step.
- **Corpus**: ``tests/fuzz_corpus/*.json``, one minimal failing input per file (format in its README.md),
  replayed by ``tests/proxy/test_app_fuzz.py::test_corpus_replay`` through the property it came from; written
  automatically for hypothesis' final (minimal) example when ``MMGATE_FUZZ_SAVE=1``.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import contextlib
import datetime
import functools
import hashlib
import io
import json
import logging
import os
import random
import re
import subprocess
import sys
import traceback
import wave
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

import aiohttp
from hypothesis import strategies as st
from PIL import Image

from preprocessors.dataurl import decode_base64, parse_data_url
from preprocessors.errors import MediaError, MmgateError
from proxy.payload.rawjson import MAX_NESTING, Span, skeletonize, splice

from .media import video_clip
from .servers import Proxy, Upstream

REPO = Path(__file__).resolve().parent.parent
CORPUS = REPO / "tests" / "fuzz_corpus"  # beside the test that replays it
SAVE_ENV = "MMGATE_FUZZ_SAVE"
SEED_ENV = "MMGATE_FUZZ_SEED"

ROUTES: dict[str, str] = {
    "chat": "/v1/chat/completions",
    "responses": "/v1/responses",
    "messages": "/v1/messages",
    "generate": "/generate",
}
ALLOWED_PREFIXES: tuple[str, ...] = ("/v1/chat/completions", "/v1/models")
PATHS_ENV: dict[str, str] = {"MMGATE_ALLOW_PATHS": ",".join(ALLOWED_PREFIXES)}
RESIZE_MAX_PIXELS = 100  # below most sample images (so they are rewritten), above the 2x2 and 4x4 ones
RESIZE_ENV: dict[str, str] = {"MMGATE_RESIZE_MAX_PIXELS": str(RESIZE_MAX_PIXELS)}
MAX_MEDIA_PER_REQUEST = 16  # MMGATE_MAX_MEDIA_PER_REQUEST's default
CLEAN_DEPTH = 24  # extra nesting still "clean" (well under MMGATE_MAX_JSON_DEPTH's default of 64)

Path_ = list[str | int]  # a JSON path: keys and indices from the root
T = TypeVar("T")


# ----------------------------------------------------------------------------------------------------------
# the seed: reproducible per commit, new inputs on every commit


def commit() -> str:
    """``git rev-parse HEAD`` of this checkout ("unknown" outside git): recorded in results and corpus files."""
    try:
        done = subprocess.run(["git", "rev-parse", "HEAD"], check=False, cwd=REPO, capture_output=True, text=True,
                              timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return done.stdout.strip() or "unknown"


def ci_seed() -> int | None:
    """The hypothesis seed CI uses: ``MMGATE_FUZZ_SEED`` (an integer, or ``random`` for none), else derived
    from the commit. The same commit always replays the same inputs (a red run reproduces by re-running it);
    every new commit explores new ones. None means hypothesis picks a random seed (and prints it on failure).
    """
    raw = os.environ.get(SEED_ENV, "").strip()
    if raw.lower() == "random":
        return None
    if raw:
        return int(raw)
    head = commit()
    return int(head[:12], 16) if re.fullmatch(r"[0-9a-f]{40}", head) else 0


# ----------------------------------------------------------------------------------------------------------
# a JSON writer that knows where the media went


@dataclass(frozen=True)
class Obj:
    """A JSON object as ordered pairs: the writer may add duplicate keys in front of real ones."""

    items: tuple[tuple[str, Any], ...]


@dataclass(frozen=True)
class Num:
    """A number written exactly as given (``1e2``, ``-0.0``, 40-digit integers)."""

    raw: str


@dataclass(frozen=True)
class RawStr:
    """A string token written exactly as given (a lone surrogate escape, which no Python str can encode)."""

    token: str


@dataclass(frozen=True)
class Media:
    """A media string (data URI, raw base64, URL) or the MIME type declared beside one."""

    text: str
    role: Literal["data", "mime"] = "data"
    form: Literal["data_uri", "base64", "url"] = "data_uri"
    pixels: int = 0  # width x height of the image it encodes; 0 when not a decodable image
    mime_site: int | None = None  # for Anthropic data: index (in Written.sites) of its media_type, if any


@dataclass(frozen=True)
class Deep:
    """``inner`` wrapped ``depth`` times in ``open``/``close`` (written without recursion: 3000 levels is fine).

    ``step`` is the JSON path of ``inner`` inside one level, e.g. ``(0,)`` for ``[``...``]``.
    """

    depth: int
    inner: Any
    open: str = "["
    close: str = "]"
    step: tuple[str | int, ...] = (0,)


@dataclass
class Site:
    """Where the writer put a media string: its JSON path and its index among all string tokens."""

    path: Path_
    token: int
    role: str
    form: str
    pixels: int
    mime_token: int | None = None


@dataclass
class Written:
    body: bytes
    sites: list[Site]


@dataclass(frozen=True)
class Style:
    """How awkwardly to write: probabilities of escapes, whitespace and duplicate keys."""

    unicode_escape: float = 0.0  # any character as \\uXXXX (astral ones as a surrogate pair)
    slash_escape: float = 0.0  # "/" as "\\/"
    media_escapes: bool = False  # apply the escapes inside media strings too
    whitespace: float = 0.0
    duplicates: float = 0.0  # per object: a junk value under a real key, written before the real one


_WS = (" ", "\n", "\t", "\r\n", "  ", "\n    ")
_NEEDS_NO_ESCAPE = re.compile(r'[^"\\\x00-\x1f\ud800-\udfff]*')
_SHORT_ESCAPES = {'"': '\\"', "\\": "\\\\", "\n": "\\n", "\r": "\\r", "\t": "\\t", "\b": "\\b", "\f": "\\f"}


def escape(text: str, rng: random.Random, style: Style) -> str:
    """``text`` as the inside of a JSON string token, escaped at random per ``style``."""
    if not style.unicode_escape and not style.slash_escape and _NEEDS_NO_ESCAPE.fullmatch(text):
        return text
    out: list[str] = []
    for char in text:
        code = ord(char)
        if char in _SHORT_ESCAPES and (code >= 0x20 or rng.random() < 0.7):
            out.append(_SHORT_ESCAPES[char])
        elif code < 0x20 or char in '"\\' or 0xD800 <= code <= 0xDFFF or rng.random() < style.unicode_escape:
            fmt = "\\u%04x" if rng.random() < 0.5 else "\\u%04X"
            if code > 0xFFFF:
                code -= 0x10000
                out.append(fmt % (0xD800 + (code >> 10)) + fmt % (0xDC00 + (code & 0x3FF)))
            else:
                out.append(fmt % code)
        elif char == "/" and rng.random() < style.slash_escape:
            out.append("\\/")
        else:
            out.append(char)
    return "".join(out)


class _Writer:
    def __init__(self, rng: random.Random, style: Style) -> None:
        self.rng = rng
        self.style = style
        self.out: list[str] = []
        self.tokens = 0
        self.sites: list[Site] = []

    def ws(self) -> None:
        if self.style.whitespace and self.rng.random() < self.style.whitespace:
            self.out.append(self.rng.choice(_WS))

    def string(self, text: str, escapes: bool = True) -> None:
        style = self.style if escapes else Style()
        self.out.append('"' + escape(text, self.rng, style) + '"')
        self.tokens += 1

    def value(self, node: Any, path: Path_) -> None:
        self.ws()
        if isinstance(node, Media):
            mime_token = None
            if node.mime_site is not None:
                mime_token = self.sites[node.mime_site].token
            self.sites.append(Site(list(path), self.tokens, node.role, node.form, node.pixels, mime_token))
            self.string(node.text, escapes=self.style.media_escapes)
        elif isinstance(node, str):
            self.string(node)
        elif isinstance(node, RawStr):
            self.out.append(node.token)
            self.tokens += 1
        elif isinstance(node, Num):
            self.out.append(node.raw)
        elif node is True or node is False or node is None:
            self.out.append(json.dumps(node))
        elif isinstance(node, int):
            self.out.append(str(node))
        elif isinstance(node, float):
            self.out.append(repr(node))
        elif isinstance(node, Deep):
            per_level = node.open.count('"') // 2
            self.out.append(node.open * node.depth)
            self.tokens += per_level * node.depth
            self.value(node.inner, path + list(node.step) * node.depth)
            self.out.append(node.close * node.depth)
        elif isinstance(node, (list, tuple)):
            self.out.append("[")
            for i, item in enumerate(node):
                if i:
                    self.ws()
                    self.out.append(",")
                self.value(item, [*path, i])
                self.ws()
            self.out.append("]")
        elif isinstance(node, (Obj, dict)):
            items = list(node.items) if isinstance(node, Obj) else list(node.items())
            if items and self.style.duplicates and self.rng.random() < self.style.duplicates:
                # A junk value under a key that comes again later: JSON parsers keep the last one.
                key = self.rng.choice(items)[0]
                junk: Num | str | Obj | list[Any] | None = self.rng.choice(
                    [Num("1e2"), "dup", None, Obj(()), [], Num("-0")])
                position = next(i for i, (k, _v) in enumerate(items) if k == key)
                items.insert(position, (key, junk))
            self.out.append("{")
            for i, (key, item) in enumerate(items):
                if i:
                    self.out.append(",")
                self.ws()
                self.string(key)
                self.ws()
                self.out.append(":")
                # A duplicate's junk never holds media, so a site's path is the path of the last key.
                self.value(item, [*path, key])
                self.ws()
            self.out.append("}")
        else:  # pragma: no cover - a strategy bug
            raise TypeError(f"cannot write {type(node).__name__}")


def write(node: Any, rng: random.Random, style: Style) -> Written:
    """Serialise ``node``; the sites say at which JSON path and string-token index each media string sits."""
    writer = _Writer(rng, style)
    writer.value(node, [])
    writer.ws()
    return Written("".join(writer.out).encode("utf-8"), writer.sites)


def writer_rng(draw: st.DrawFn) -> random.Random:
    """The writer's per-character coin flips, from one drawn seed. (``st.randoms`` would make every flip a
    hypothesis choice: a few hundred base64 characters then overrun hypothesis' buffer, and the examples
    that survive are biased towards tiny documents.)"""
    return random.Random(draw(st.integers(0, 2**32 - 1)))


styles = st.builds(
    Style,
    unicode_escape=st.sampled_from([0.0, 0.0, 0.05, 0.5]),
    slash_escape=st.sampled_from([0.0, 0.0, 0.5, 1.0]),
    media_escapes=st.booleans(),
    whitespace=st.sampled_from([0.0, 0.0, 0.3, 1.0]),
    duplicates=st.sampled_from([0.0, 0.0, 0.3]),
)


# ----------------------------------------------------------------------------------------------------------
# media samples: made once per process


@dataclass(frozen=True)
class Blob:
    """One file to embed: ``valid`` means mmgate must accept it for its ``kind``."""

    name: str
    kind: Literal["image", "audio", "video", "junk"]
    mime: str
    data: bytes
    pixels: int = 0
    valid: bool = True


def _image(width: int, height: int, fmt: str, mode: str = "RGB", **save: Any) -> bytes:
    buf = io.BytesIO()
    image = Image.new(mode, (width, height), 0)
    for x in range(width):  # a gradient, so the encoders have something to encode
        for y in range(height):
            value = (x * 37 + y * 91) % 256
            image.putpixel((x, y), value if mode in ("L", "P") else (value,) * len(mode))
    image.save(buf, fmt, **save)
    return buf.getvalue()


def _gif_animated() -> bytes:
    frames = [Image.new("P", (10, 10), c) for c in (1, 2, 3)]
    buf = io.BytesIO()
    frames[0].save(buf, "GIF", save_all=True, append_images=frames[1:], duration=20, loop=0)
    return buf.getvalue()


def _wav() -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(8000)
        out.writeframes(b"\x00\x01" * 40)
    return buf.getvalue()


@functools.cache
def blobs() -> dict[str, tuple[Blob, ...]]:
    """Real tiny files by kind, made once: Pillow in a strategy would dominate the budget."""
    png = _image(24, 16, "PNG")
    images = (
        Blob("png-rgb-24x16", "image", "image/png", png, 24 * 16),
        Blob("png-rgba-12x12", "image", "image/png", _image(12, 12, "PNG", "RGBA"), 144),
        Blob("png-l-2x2", "image", "image/png", _image(2, 2, "PNG", "L"), 4),
        Blob("png-p-4x4", "image", "image/png", _image(4, 4, "PNG", "P"), 16),
        Blob("jpeg-20x20", "image", "image/jpeg", _image(20, 20, "JPEG", quality=80), 400),
        Blob("gif-animated-10x10", "image", "image/gif", _gif_animated(), 100),
        Blob("webp-16x10", "image", "image/webp", _image(16, 10, "WEBP"), 160),
        Blob("bmp-11x9", "image", "image/bmp", _image(11, 9, "BMP"), 99),
    )
    junk = (
        Blob("png-truncated", "junk", "image/png", png[: len(png) // 2], valid=False),
        Blob("png-magic-then-junk", "junk", "image/png", png[:8] + b"\x00junk" * 8, valid=False),
        Blob("text", "junk", "text/plain", b"hello, not an image at all", valid=False),
        Blob("svg", "junk", "image/svg+xml", b'<svg xmlns="http://www.w3.org/2000/svg"/>', valid=False),
        Blob("zeros", "junk", "application/octet-stream", bytes(33), valid=False),
        Blob("one-byte", "junk", "application/octet-stream", b"\xff", valid=False),
    )
    audio = (Blob("wav", "audio", "audio/wav", _wav()),)
    video = (Blob("mp4-h264-16x16", "video", "video/mp4", video_clip(16, 16, 2)),
             Blob("mp4-head-then-junk", "junk", "video/mp4", b"\x00\x00\x00\x18ftypmp42" + bytes(range(40)),
                  valid=False))
    return {"image": images, "junk": junk, "audio": audio, "video": video}


# ----------------------------------------------------------------------------------------------------------
# media strategies


@dataclass(frozen=True)
class Choice:
    """A media value and whether mmgate must accept it (True), must refuse it (False) or may do either (None)."""

    text: str
    clean: bool | None
    pixels: int = 0
    form: Literal["data_uri", "base64", "url"] = "data_uri"


def both(*flags: bool | None) -> bool | None:
    """Combine cleanliness: any False wins, then any None, else True."""
    if any(flag is False for flag in flags):
        return False
    return None if any(flag is None for flag in flags) else True


_B64_VARIANTS = ("std", "std", "std", "std", "urlsafe", "nopad", "lines", "crlf", "space", "extra_pad",
                 "truncated", "empty", "junk_char", "unicode", "lowercase")


@st.composite
def base64_of(draw: st.DrawFn, data: bytes) -> tuple[str, bool]:
    """Base64 of ``data``, possibly mangled; True when it is exactly the standard padded encoding."""
    std = base64.b64encode(data).decode()
    variant = draw(st.sampled_from(_B64_VARIANTS))
    text = std
    if variant == "urlsafe":
        text = base64.urlsafe_b64encode(data).decode()
    elif variant == "nopad":
        text = std.rstrip("=")
    elif variant in ("lines", "crlf"):
        width = draw(st.sampled_from([4, 60, 76]))
        text = ("\n" if variant == "lines" else "\r\n").join(std[i : i + width] for i in range(0, len(std), width))
    elif variant == "space":
        at = draw(st.integers(0, len(std)))
        text = std[:at] + " " + std[at:]
    elif variant == "extra_pad":
        text = std + draw(st.sampled_from(["=", "==", "===", "A="]))
    elif variant == "truncated" and std:
        text = std[: draw(st.integers(0, len(std) - 1))]
    elif variant == "empty":
        text = ""
    elif variant == "junk_char":
        at = draw(st.integers(0, len(std)))
        text = std[:at] + draw(st.sampled_from(["*", "%", "\x00", "-", "_", ".", "\\", '"', ","])) + std[at:]
    elif variant == "unicode":
        at = draw(st.integers(0, len(std)))
        text = std[:at] + draw(st.sampled_from(["é", "😀", "\u2028", "\ufeff"])) + std[at:]
    elif variant == "lowercase":
        text = std.lower()
    return text, text == std and text != ""


def _blob_for(draw: st.DrawFn, kind: str) -> Blob:
    if draw(st.integers(0, 9)) == 0:
        return Blob("random-bytes", "junk", "application/octet-stream", draw(st.binary(max_size=48)), valid=False)
    pool = blobs()
    if kind == "image":
        choices = pool["image"] * 3 + pool["junk"]
    elif kind == "audio":
        choices = pool["audio"] * 3 + pool["junk"] + pool["image"][:1]
    else:
        choices = pool["video"] * 3 + pool["junk"][:2]
    return draw(st.sampled_from(choices))


_OTHER_IMAGE_MIME = {"image/png": "image/jpeg", "image/jpeg": "image/png", "image/gif": "image/webp",
                     "image/webp": "image/gif", "image/bmp": "image/png"}


@st.composite
def data_uri(draw: st.DrawFn, kind: str = "image") -> Choice:
    """A ``data:`` URL: valid, or with a broken header, a wrong/non-image/missing MIME type, params, case."""
    blob = _blob_for(draw, kind)
    payload, payload_ok = draw(base64_of(blob.data))
    mime = blob.mime
    header = draw(st.sampled_from([
        ("data:{m};base64,", True), ("data:{m};base64,", True), ("data:{m};base64,", True),
        ("DATA:{M};BASE64,", True), ("Data:{m};Base64,", True),
        ("data:{m};charset=utf-8;base64,", True), ("data:{m};name=cat.png;base64,", True),
        ("data:;base64,", None), ("data:{wrong};base64,", None), ("data:text/plain;base64,", None),
        ("data:application/octet-stream;base64,", None), ("data:{m} ;base64,", None),
        ("data:{m};;base64,", None), ("data: {m};base64,", None), ("data:{m};charset=utf-8,", False),
        ("data:{m},", False), ("data:{m};base64", False), ("data:{m};base64;x=y,", False),
        ("data:{m};" + "p=" + "x" * 300 + ";base64,", False), ("data:imagé/png;base64,", False),
        ("data:{m}%3Bbase64,", False), ("data:", False), ("data:image/\ud800png;base64,", False),
        ("data:{m};charset=\udfff;base64,", False),
    ]))
    template, header_ok = header
    text = template.format(m=mime, M=mime.upper(), wrong=_OTHER_IMAGE_MIME.get(mime, "image/png")) + payload
    blob_ok: bool | None = blob.valid if blob.kind == kind else (False if kind == "image" else None)
    return Choice(text, both(header_ok, payload_ok, blob_ok), blob.pixels if blob.kind == "image" else 0)


@st.composite
def raw_base64(draw: st.DrawFn, kind: str = "image") -> tuple[Choice, Blob]:
    blob = _blob_for(draw, kind)
    payload, payload_ok = draw(base64_of(blob.data))
    blob_ok: bool | None = blob.valid if blob.kind == kind else (False if kind == "image" else None)
    return Choice(payload, both(payload_ok, blob_ok), blob.pixels if blob.kind == "image" else 0, "base64"), blob


urls = st.sampled_from([
    Choice("https://example.invalid/cat.png", True, form="url"),
    Choice("http://example.invalid/a/b.jpg?x=1&y=%2F", True, form="url"),
    Choice("HTTPS://EXAMPLE.INVALID/X.PNG", True, form="url"),
    Choice("ftp://example.invalid/x.png", None, form="url"),
    Choice("file:///etc/passwd", None, form="url"),
    Choice("not a url at all", None, form="url"),
    Choice("", None, form="url"),
])


def media_url_or_data(kind: str = "image") -> st.SearchStrategy[Choice]:
    return st.one_of(data_uri(kind), data_uri(kind), data_uri(kind), urls)


def media_node(choice: Choice) -> Media:
    return Media(choice.text, "data", choice.form, choice.pixels if choice.clean is not False else 0)


# ----------------------------------------------------------------------------------------------------------
# documents, per dialect


texts = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=24) | st.sampled_from([
    "café", "naïve", "😀 emoji", "a/b\\c", 'quote " inside', "tab\there", "\u2028line", "image data:x;base64,",
    "<svg/>", "\x00nul", "\\u0041 not an escape", "image_url",
])
# Lone surrogates are valid JSON for Python's parser but not orjson's (mmgate falls back): rare on purpose, as
# they send the whole body down that slower road and would hide what else the document does.
odd_texts = st.one_of(texts, texts, texts, texts, texts, texts, st.sampled_from(
    [RawStr('"lone \\ud800 surrogate"'), RawStr('"\\udfff"'), RawStr('"pair \\ud83d\\ude00"')]))
numbers = st.sampled_from([
    Num("1e2"), Num("1E+2"), Num("-0"), Num("-0.0"), Num("0.1e-5"), Num("123456789012345678901234567890"),
    Num("-98765432109876543210987654321098765432"), Num("3.141592653589793238462643383279"), Num("1.0e308"),
    Num("5e-324"), Num("1e400"), Num("18446744073709551616"), Num("9007199254740993"), Num("0"),
])
scalars = st.one_of(st.none(), st.booleans(), st.integers(-(10**30), 10**30),
                    st.floats(allow_nan=False, allow_infinity=False), numbers, odd_texts)
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4)
    | st.lists(st.tuples(texts, inner), max_size=4).map(lambda items: Obj(tuple(items))),
    max_leaves=12,
)

# Around the limits that matter: MMGATE_MAX_JSON_DEPTH's default (64), Python's recursion limit (1000; a
# recursive walker dies a little below it), orjson's depth limit (1024), and far beyond.
DEEP_DEPTHS = (63, 64, 65, 500, 900, 960, 970, 980, 990, 1000, 1010, 1020, 1023, 1024, 1030, 2000, 3000)


@st.composite
def nesting(draw: st.DrawFn, deep: bool = True) -> tuple[int, bool | None]:
    """A nesting depth and its cleanliness: shallow is clean; deep (up to 3000) may be refused, never 5xx."""
    if deep and draw(st.sampled_from(["shallow", "shallow", "deep"])) == "deep":
        return draw(st.sampled_from(DEEP_DEPTHS)), None
    depth = draw(st.integers(0, 40))
    return depth, True if depth <= CLEAN_DEPTH else None


@st.composite
def extras(draw: st.DrawFn, deep: bool) -> tuple[list[tuple[str, Any]], bool | None]:
    """Fields around the media: numbers written oddly, text with escapes, random JSON, deep nesting."""
    fields: list[tuple[str, Any]] = []
    clean: bool | None = True
    if draw(st.booleans()):
        fields.append(("temperature", draw(numbers)))
    if draw(st.booleans()):
        fields.append(("max_tokens", draw(numbers)))
    if draw(st.booleans()):
        fields.append(("user", draw(odd_texts)))
    if draw(st.booleans()):
        fields.append(("metadata", draw(json_values)))
    if draw(st.integers(0, 3)) == 0:
        depth, deep_clean = draw(nesting(deep))
        shapes: list[tuple[str, str, tuple[str | int, ...]]] = [("[", "]", (0,)), ('{"a":', "}", ("a",))]
        shape = draw(st.sampled_from(shapes))
        fields.append(("nested", Deep(depth, draw(scalars), *shape)))
        clean = both(clean, deep_clean)
    fields.append(("stream", False))
    return fields, clean


@dataclass(frozen=True)
class Doc:
    """A generated request document: the tree, whether mmgate must accept it, and its route."""

    dialect: str
    node: Any
    clean: bool | None


@st.composite
def chat_part(draw: st.DrawFn) -> tuple[Any, bool | None]:
    shape = draw(st.integers(0, 15))
    if shape <= 2:
        return Obj((("type", "text"), ("text", draw(odd_texts)))), True
    if shape <= 5:
        choice = draw(media_url_or_data())
        image_url = Obj((("url", media_node(choice)), ("detail", draw(st.sampled_from(["auto", "low", "high"])))))
        return Obj((("type", "image_url"), ("image_url", image_url))), choice.clean
    if shape == 6:  # vLLM: image_url as a bare string
        choice = draw(media_url_or_data())
        return Obj((("type", "image_url"), ("image_url", media_node(choice)))), choice.clean
    if shape == 7:  # no type: vLLM infers it from the field
        choice = draw(media_url_or_data())
        return Obj((("image_url", Obj((("url", media_node(choice)),))),)), choice.clean
    if shape == 8:  # a uuid: vLLM reads the fields, whatever the type says
        choice = draw(media_url_or_data())
        uuid = draw(st.sampled_from(["u-1", "0b1e", ""]))
        return Obj((("type", draw(st.sampled_from(["text", "image_url"]))),
                    ("image_url", Obj((("url", media_node(choice)),))), ("uuid", uuid))), choice.clean
    if shape == 9:  # a uuid and no data: a reference to media the backend has cached
        return Obj((("type", "image_url"), ("image_url", None), ("uuid", "u-2"))), True
    if shape == 10:
        audio, _blob = draw(raw_base64("audio"))
        fmt = draw(st.sampled_from([("wav", True), ("WAV", True), ("mp3", None), ("ogg", None), ("aiff", None),
                                         ("wav\ud800", None), ("", None)]))
        part = Obj((("type", "input_audio"),
                    ("input_audio", Obj((("data", media_node(audio)), ("format", fmt[0])))),))
        return part, both(audio.clean, fmt[1])
    if shape == 11:
        kind = draw(st.sampled_from(["video", "audio"]))
        choice = draw(media_url_or_data(kind))
        field = f"{kind}_url"
        return Obj((("type", field), (field, Obj((("url", media_node(choice)),))))), choice.clean
    odd = draw(st.sampled_from([
        Obj((("type", "image_url"), ("image_url", 5))), Obj((("type", "image_url"),)),
        Obj((("type", "image_url"), ("image_url", Obj(())))),
        Obj((("type", "image_url"), ("image_url", Obj((("url", 5),))))),
        Obj((("type", 7), ("image_url", Obj((("url", "https://example.invalid/x.png"),))))),
        "a bare string part", 42, None,
        Obj((("type", "input_audio"), ("input_audio", "AAAA"))), Obj((("type", "image"), ("image", "xyz"))),
        Obj((("type", "refusal"), ("refusal", "no"))), Obj(()),
    ]))
    return odd, None


@st.composite
def chat_doc(draw: st.DrawFn, deep: bool = True) -> Doc:
    messages: list[Any] = []
    clean: bool | None = True
    for _ in range(draw(st.integers(1, 3))):
        role = draw(st.sampled_from(["user", "user", "system", "assistant"]))
        if draw(st.integers(0, 4)) == 0:
            messages.append(Obj((("role", role), ("content", draw(odd_texts)))))
            continue
        parts = [draw(chat_part()) for _ in range(draw(st.integers(0, 4)))]
        clean = both(clean, *(c for _p, c in parts))
        messages.append(Obj((("role", role), ("content", [p for p, _c in parts]))))
    more, extra_clean = draw(extras(deep))
    return Doc("chat", Obj((("model", "m"), ("messages", messages), *more)), both(clean, extra_clean))


@st.composite
def responses_part(draw: st.DrawFn) -> tuple[Any, bool | None]:
    shape = draw(st.integers(0, 7))
    if shape <= 1:
        return Obj((("type", "input_text"), ("text", draw(odd_texts)))), True
    if shape <= 3:
        choice = draw(media_url_or_data())
        return Obj((("type", "input_image"), ("image_url", media_node(choice)), ("detail", "auto"))), choice.clean
    if shape == 4:  # defensively accepted: {"url": ...}
        choice = draw(media_url_or_data())
        return Obj((("type", "input_image"), ("image_url", Obj((("url", media_node(choice)),))))), choice.clean
    if shape == 5:
        return Obj((("type", "input_image"), ("file_id", "file-123"))), True
    if shape == 6:  # chat-style parts are looked for in Responses content too
        return draw(chat_part())
    return draw(st.sampled_from([Obj((("type", "input_image"),)), Obj((("type", "input_image"), ("image_url", 3))),
                                 "text", 1.5])), None


@st.composite
def responses_doc(draw: st.DrawFn, deep: bool = True) -> Doc:
    clean: bool | None = True
    if draw(st.integers(0, 5)) == 0:
        items: Any = draw(odd_texts)
    else:
        items = []
        for _ in range(draw(st.integers(1, 3))):
            shape = draw(st.integers(0, 4))
            if shape <= 1:
                parts = [draw(responses_part()) for _ in range(draw(st.integers(0, 4)))]
                clean = both(clean, *(c for _p, c in parts))
                items.append(Obj((("role", "user"), ("content", [p for p, _c in parts]))))
            elif shape == 2:  # a bare input_image item
                part, part_clean = draw(responses_part())
                clean = both(clean, part_clean)
                items.append(part)
            elif shape == 3:
                parts = [draw(responses_part()) for _ in range(draw(st.integers(0, 3)))]
                clean = both(clean, *(c for _p, c in parts))
                items.append(Obj((("type", "function_call_output"), ("call_id", "c1"),
                                  ("output", [p for p, _c in parts]))))
            else:
                items.append(Obj((("type", "message"), ("role", "assistant"), ("content", draw(odd_texts)))))
    more, extra_clean = draw(extras(deep))
    return Doc("responses", Obj((("model", "m"), ("input", items), *more)), both(clean, extra_clean))


@dataclass
class _MimeSlot:
    """Anthropic ``media_type``: written before ``data``; the data's Media points back at it by site index."""

    node: Media


@st.composite
def anthropic_image(draw: st.DrawFn) -> tuple[Any, bool | None]:
    shape = draw(st.integers(0, 9))
    if shape <= 5:
        choice, blob = draw(raw_base64("image"))
        declared = draw(st.sampled_from([
            (blob.mime, True), (blob.mime.upper(), True), (_OTHER_IMAGE_MIME.get(blob.mime, "image/png"), None),
            ("text/plain", None), ("image/svg+xml", None), ("", None), (" image/png ", None),
            ("image/png\ud800", None), ("IMAGE/\u0130NG", None),
        ]))
        source: list[tuple[str, Any]] = [("type", "base64")]
        mime_clean = declared[1]
        if draw(st.integers(0, 9)):
            source.append(("media_type", _MimeSlot(Media(declared[0], "mime"))))
        else:
            mime_clean = None
        source.append(("data", media_node(choice)))
        return Obj((("type", "image"), ("source", Obj(tuple(source))))), both(choice.clean, mime_clean)
    if shape <= 7:
        choice = draw(urls)
        return Obj((("type", "image"), ("source", Obj((("type", "url"), ("url", media_node(choice))))))), choice.clean
    if shape == 8:
        return Obj((("type", "image"), ("source", Obj((("type", "file"), ("file_id", "file-1")))))), True
    return draw(st.sampled_from([
        Obj((("type", "image"),)), Obj((("type", "image"), ("source", "x"))),
        Obj((("type", "image"), ("source", Obj((("type", "base64"), ("data", 5)))))),
        Obj((("type", "image"), ("source", Obj((("type", "url"),))))),
        Obj((("type", "image"), ("source", Obj((("type", "weird"), ("data", "AAAA")))))),
    ])), None


@st.composite
def anthropic_block(draw: st.DrawFn, nest: int = 2) -> tuple[Any, bool | None]:
    shape = draw(st.integers(0, 6))
    if shape <= 1:
        return Obj((("type", "text"), ("text", draw(odd_texts)))), True
    if shape <= 4:
        return draw(anthropic_image())
    if shape == 5 and nest > 0:
        blocks = [draw(anthropic_block(nest - 1)) for _ in range(draw(st.integers(0, 3)))]
        content: Any = [b for b, _c in blocks] if draw(st.integers(0, 4)) else "plain tool output"
        return (Obj((("type", "tool_result"), ("tool_use_id", "t1"), ("content", content))),
                both(*(c for _b, c in blocks)) if isinstance(content, list) else True)
    return draw(st.sampled_from([Obj((("type", "thinking"), ("thinking", "hm"))), 7, "str", None, Obj(())])), None


@st.composite
def messages_doc(draw: st.DrawFn, deep: bool = True) -> Doc:
    messages: list[Any] = []
    clean: bool | None = True
    for _ in range(draw(st.integers(1, 3))):
        role = draw(st.sampled_from(["user", "assistant"]))
        if draw(st.integers(0, 4)) == 0:
            messages.append(Obj((("role", role), ("content", draw(odd_texts)))))
            continue
        blocks = [draw(anthropic_block()) for _ in range(draw(st.integers(0, 4)))]
        if draw(st.integers(0, 9)) == 0:  # a chain of tool_results, up to thousands of levels
            depth, depth_clean = draw(nesting(deep))
            inner, inner_clean = draw(anthropic_image())
            chain = Deep(depth // 2, inner, '{"type":"tool_result","tool_use_id":"t","content":[', "]}",
                         ("content", 0))
            blocks.append((chain, both(depth_clean, inner_clean)))
        clean = both(clean, *(c for _b, c in blocks))
        messages.append(Obj((("role", role), ("content", [b for b, _c in blocks]))))
    more, extra_clean = draw(extras(deep))
    doc = Obj((("model", "m"), ("max_tokens", 16), ("messages", messages), *more))
    return Doc("messages", doc, both(clean, extra_clean))


@st.composite
def generate_item(draw: st.DrawFn, kind: str, level: int = 0, deep: bool = True) -> tuple[Any, bool | None]:
    shape = draw(st.integers(0, 10))
    if shape <= 3:
        choice, _blob = draw(raw_base64(kind))
        return media_node(choice), choice.clean
    if shape <= 5:
        choice = draw(media_url_or_data(kind))
        return media_node(choice), choice.clean
    if shape == 6 and level < 3:  # a batch (lists in lists, three levels at most)
        items = [draw(generate_item(kind, level + 1, deep)) for _ in range(draw(st.integers(0, 3)))]
        return [i for i, _c in items], both(*(c for _i, c in items))
    if shape == 7:  # SGLang's {"url": ...}
        choice = draw(st.one_of(media_url_or_data(kind), raw_base64(kind).map(lambda pair: pair[0])))
        return Obj((("url", media_node(choice)),)), choice.clean
    if shape in (8, 9) and level < 4:  # a batch nested deep: the walk over nested lists must not recurse
        depth, depth_clean = draw(nesting(deep))
        inner, inner_clean = draw(generate_item(kind, 4, deep))  # one Deep per item: "clean" stays shallow
        return Deep(depth, inner), both(depth_clean, inner_clean)
    return draw(st.sampled_from([None, 5, Obj((("embedding", [0.1, 0.2]),)), Obj((("url", 5),)), True])), None


@st.composite
def generate_doc(draw: st.DrawFn, deep: bool = True) -> Doc:
    fields: list[tuple[str, Any]] = [("text", draw(odd_texts))]
    clean: bool | None = True
    for field_name, kind in (("image_data", "image"), ("audio_data", "audio"), ("video_data", "video")):
        present = draw(st.integers(0, 5)) != 0 if kind == "image" else draw(st.integers(0, 5)) == 0
        if not present:
            continue
        if deep and kind == "image" and draw(st.sampled_from(["flat", "flat", "flat", "deep"])) == "deep":
            # A batch nested around the limits: a recursive walk over image_data dies near Python's 1000 frames.
            item, item_clean = draw(generate_item(kind, 4, deep))
            item = Deep(draw(st.sampled_from(DEEP_DEPTHS)), item)
            item_clean = None
        else:
            item, item_clean = draw(generate_item(kind, 0, deep))
        fields.append((field_name, item))
        clean = both(clean, item_clean)
    fields.append(("sampling_params", Obj((("max_new_tokens", draw(numbers)), ("temperature", 0)))))
    more, extra_clean = draw(extras(deep))
    return Doc("generate", Obj((*fields, *more)), both(clean, extra_clean))


DOCS: dict[str, Callable[..., st.SearchStrategy[Doc]]] = {
    "chat": chat_doc, "responses": responses_doc, "messages": messages_doc, "generate": generate_doc,
}


def _write_doc(node: Any, rng: random.Random, style: Style) -> Written:
    """``write`` with Anthropic ``media_type`` sites linked to the data site next to them."""
    pending: list[int] = []
    writer = _Writer(rng, style)
    original_value = writer.value

    def value(item: Any, path: Path_) -> None:
        if isinstance(item, _MimeSlot):
            pending.append(len(writer.sites))
            original_value(item.node, path)
        elif isinstance(item, Media) and item.role == "data" and pending and path[-1] == "data":
            original_value(Media(item.text, item.role, item.form, item.pixels, pending.pop()), path)
        else:
            original_value(item, path)

    writer.value = value  # type: ignore[method-assign,assignment]  # an instance override of the method
    writer.value(node, [])
    writer.ws()
    return Written("".join(writer.out).encode("utf-8"), writer.sites)


# ----------------------------------------------------------------------------------------------------------
# HTTP cases


@dataclass
class HttpCase:
    """One request to a media route: the body as sent, where its media strings are, whether it is clean."""

    route: str
    body: bytes
    sites: list[Site] = field(default_factory=list)
    clean: bool | None = None
    content_type: str = "application/json"

    def record(self) -> dict[str, Any]:
        return {"route": self.route, "body_b64": base64.b64encode(self.body).decode(), "clean": self.clean,
                "content_type": self.content_type,
                "sites": [{"path": s.path, "token": s.token, "role": s.role, "form": s.form, "pixels": s.pixels,
                           "mime_token": s.mime_token} for s in self.sites]}

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> HttpCase:
        return cls(record["route"], base64.b64decode(record["body_b64"]),
                   [Site(**s) for s in record.get("sites", [])], record.get("clean"),
                   record.get("content_type", "application/json"))


_MUTATIONS = ("truncate", "insert", "drop", "flip", "replace_quote", "junk", "not_object", "invalid_utf8")


@st.composite
def mutated(draw: st.DrawFn, body: bytes) -> bytes:
    """``body`` broken in one of the ways a buggy client or a cut connection breaks JSON."""
    how = draw(st.sampled_from(_MUTATIONS))
    at = draw(st.integers(0, max(len(body) - 1, 0)))
    if how == "truncate":
        return body[:at]
    if how == "insert":
        byte = draw(st.sampled_from([b"{", b"}", b"[", b'"', b"\\", b",", b":", b"\x00", b"\xff"]))
        return body[:at] + byte + body[at:]
    if how == "drop":
        return body[:at] + body[at + 1 :]
    if how == "flip":
        return body[:at] + bytes([body[at] ^ (1 << draw(st.integers(0, 7)))]) + body[at + 1 :] if body else body
    if how == "replace_quote":
        return body.replace(b'"', b"'", 1)
    if how == "junk":
        return draw(st.binary(max_size=64))
    if how == "invalid_utf8":
        return body[:at] + b"\xc3\x28" + body[at:]
    return draw(st.sampled_from([b"[]", b'"image"', b"null", b"1e2", b'[{"image_url": "x"}]', b"", b" ",
                                 b'{"messages": "image"}', b'{"image_data": {}}', b"\xef\xbb\xbf{}"]))


@st.composite
def http_cases(draw: st.DrawFn, dialect: str, *, deep: bool = True, mutate: bool = True) -> HttpCase:
    """A request for ``dialect``: a generated document written awkwardly, sometimes broken on purpose."""
    doc = draw(DOCS[dialect](deep=deep))
    written = _write_doc(doc.node, writer_rng(draw), draw(styles))
    clean = doc.clean
    if sum(site.role == "data" for site in written.sites) > MAX_MEDIA_PER_REQUEST:
        clean = None  # too_many_media is a fair refusal
    case = HttpCase(ROUTES[dialect], written.body, written.sites, clean)
    if mutate and draw(st.integers(0, 7)) == 0:
        body = draw(mutated(written.body))
        if body != written.body:
            return HttpCase(case.route, body, [], None)
    if draw(st.integers(0, 15)) == 0:
        case.content_type = draw(st.sampled_from(["text/plain", "application/json; charset=utf-8", ""]))
    return case


# ----------------------------------------------------------------------------------------------------------
# what went wrong on the server side (for the failure's signature)


class FaultLog(logging.Handler):
    """Collects exceptions the proxy logged (aiohttp's "Error handling request", mmgate's own): a 5xx is
    reported with the exception type and the innermost product frame, which names the fault."""

    LOGGERS = ("aiohttp.server", "aiohttp.web", "mmgate")

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info and record.exc_info[1] is not None:
            self.records.append(record)

    @contextlib.contextmanager
    def installed(self) -> Iterator[FaultLog]:
        loggers = [logging.getLogger(name) for name in self.LOGGERS]
        for logger in loggers:
            logger.addHandler(self)
        try:
            yield self
        finally:
            for logger in loggers:
                logger.removeHandler(self)

    def clear(self) -> None:
        self.records.clear()

    def where(self) -> str:
        """``ExcType@file:function`` of the last logged exception: the innermost frame in proxy/ or
        preprocessors/, or for a RecursionError the product function that recurses (where the stack happens
        to run out varies from run to run)."""
        for record in reversed(self.records):
            assert record.exc_info is not None
            exc = record.exc_info[1]
            assert exc is not None
            frames = traceback.extract_tb(exc.__traceback__)
            ours = [f for f in frames if "/proxy/" in f.filename or "/preprocessors/" in f.filename] or frames
            if not ours:
                return type(exc).__name__
            frame = ours[-1]
            if isinstance(exc, RecursionError):
                counts = collections.Counter((f.filename, f.name) for f in ours)
                top = max(counts.values())
                frame = next(f for f in ours if counts[(f.filename, f.name)] == top)
            return f"{type(exc).__name__}@{_short_path(frame.filename)}:{frame.name}"
        return "unlogged"


def _short_path(filename: str) -> str:
    for root in ("/proxy/", "/preprocessors/"):
        if root in filename:
            return root.strip("/") + "/" + filename.split(root, 1)[1]
    return Path(filename).name


@dataclass
class Harness:
    """The real proxy in front of the scripted upstream, a real client, and the proxy's fault log."""

    proxy_url: str
    upstream: Upstream
    session: aiohttp.ClientSession
    faults: FaultLog


def fail(signature: str, detail: str) -> AssertionError:
    """An AssertionError whose first token ``[signature]`` names the fault (the corpus keys on it)."""
    return AssertionError(f"[{signature}] {detail}")


def attempt(function: Callable[..., T], *args: Any, **kwargs: Any) -> tuple[T | None, Exception | None]:
    """(result, None) or (None, the exception): properties raise their verdict *outside* the except block,
    so the failure carries no exception context and hypothesis sees one stable failure, not a flaky one."""
    try:
        return function(*args, **kwargs), None
    except Exception as exc:
        return None, exc


def error_shape_problem(route: str, body: bytes) -> str | None:
    """None when ``body`` is an error in the API's own shape for ``route``, else what is wrong."""
    try:
        doc = json.loads(body)
    except ValueError:
        return f"not JSON: {body[:120]!r}"
    anthropic = route.rstrip("/").startswith("/v1/messages")
    if anthropic:
        if not isinstance(doc, dict) or set(doc) != {"type", "error"} or doc["type"] != "error":
            return f"not {{type: error, error}}: {body[:160]!r}"
        error = doc["error"]
        if not isinstance(error, dict) or set(error) != {"type", "message"}:
            return f"error is not {{type, message}}: {body[:160]!r}"
        if not all(isinstance(error[k], str) for k in ("type", "message")):
            return f"type/message not strings: {body[:160]!r}"
        return None
    if not isinstance(doc, dict) or set(doc) != {"error"} or not isinstance(doc["error"], dict):
        return f"not {{error: {{...}}}}: {body[:160]!r}"
    error = doc["error"]
    if set(error) != {"message", "type", "code", "param"}:
        return f"error keys {sorted(error)} != [code, message, param, type]: {body[:160]!r}"
    if not isinstance(error["message"], str) or not isinstance(error["type"], str):
        return f"message/type not strings: {body[:160]!r}"
    if not all(error[k] is None or isinstance(error[k], str) for k in ("code", "param")):
        return f"code/param neither string nor null: {body[:160]!r}"
    return None


# Frames from the bottom of the stack to the event loop's ``_run_once`` (itself included) in a real ``mmgate``
# process (the console script; ``python -m proxy`` has 9), measured with a sitecustomize hook.
PRODUCTION_LOOP_DEPTH = 7


def _stack() -> list[Any]:
    """The current thread's frames, innermost first."""
    frames = []
    frame: Any = sys._getframe(1)
    while frame is not None:
        frames.append(frame)
        frame = frame.f_back
    return frames


@contextlib.contextmanager
def stack_headroom(frames: int) -> Iterator[None]:
    """Exactly ``frames`` frames of room above the caller, whatever the limit was (restored afterwards)."""
    old = sys.getrecursionlimit()
    sys.setrecursionlimit(len(_stack()) + frames)
    try:
        yield
    finally:
        sys.setrecursionlimit(old)


@contextlib.contextmanager
def production_stack() -> Iterator[None]:
    """Give the proxy's handlers the stack room they have in production while a request is in flight.

    Here the proxy runs in the test's thread, its event loop on top of pytest's and hypothesis' frames, and
    hypothesis raises the recursion limit while a test runs: a handler that recurses once per JSON level
    would pass at depths that crash a real ``mmgate``. So the limit is set to what a real process has above
    its event loop (default 1000), counted from this loop's ``_run_once``, and restored afterwards.
    """
    frames = _stack()
    frames.reverse()
    loop_depth = next((i + 1 for i, f in enumerate(frames) if f.f_code.co_name == "_run_once"), None)
    old = sys.getrecursionlimit()
    if loop_depth is not None:
        sys.setrecursionlimit(1000 + loop_depth - PRODUCTION_LOOP_DEPTH)
    try:
        yield
    finally:
        sys.setrecursionlimit(old)


async def _post(h: Harness, case: HttpCase) -> tuple[int, bytes, str]:
    h.upstream.seen.clear()
    while not h.upstream.arrived.empty():
        h.upstream.arrived.get_nowait()
    h.faults.clear()
    headers = {"Content-Type": case.content_type} if case.content_type else {}
    with production_stack():
        async with h.session.post(h.proxy_url + case.route, data=case.body, headers=headers) as response:
            answer = await response.read()
            return response.status, answer, response.headers.get("Content-Type", "")


def _answer_checks(h: Harness, case: HttpCase, status: int, answer: bytes, content_type: str) -> None:
    """The checks every answer passes: no 5xx (the upstream always answers 200), no traceback, the API's
    error shape, nothing forwarded on a refusal, exactly one forward on a success."""
    if status >= 500:
        raise fail(f"5xx:{h.faults.where()}", f"{case.route} answered {status}: {answer[:200]!r}")
    if b"Traceback" in answer:
        raise fail("traceback", f"{case.route} answered {status} with a traceback: {answer[:300]!r}")
    if status >= 400:
        problem = error_shape_problem(case.route, answer)
        if problem is not None or not content_type.startswith("application/json"):
            raise fail(f"error-shape:{status}", f"{case.route} {status} ({content_type}): {problem}")
        if h.upstream.seen:
            raise fail("forwarded-a-refusal", f"{case.route} answered {status} but the upstream got the request")
    elif len(h.upstream.seen) != 1:
        raise fail("not-forwarded", f"{case.route} answered {status} after {len(h.upstream.seen)} upstream requests")


# JSON string tokens, found the way skeletonize finds them: a quote, then the next quote not escaped.
def string_tokens(body: bytes) -> list[tuple[int, int]]:
    """Byte spans of the string tokens of ``body`` (for invalid JSON: whatever the same scan finds)."""
    spans: list[tuple[int, int]] = []
    pos = 0
    while True:
        start = body.find(b'"', pos)
        if start < 0:
            return spans
        end = body.find(b'"', start + 1)
        while end > 0:
            k = end - 1
            while body[k] == 0x5C:
                k -= 1
            if not (end - 1 - k) & 1:
                break
            end = body.find(b'"', end + 1)
        if end < 0:
            spans.append((start, len(body)))
            return spans
        spans.append((start, end + 1))
        pos = end + 1


_MIME_LIKE = re.compile(r"\s*[A-Za-z0-9.+-]*/?[A-Za-z0-9.+-]*\s*")
_BASE64_LIKE = re.compile(r"[A-Za-z0-9+/=_\-\s]+")


def media_like(token: bytes) -> bool:
    """Could this string token be a media string mmgate may rewrite (data URI, base64 data, a MIME type)?"""
    try:
        value = json.loads(token)
    except ValueError:
        return False
    if not isinstance(value, str):
        return False
    return (value[:5].lower() == "data:" or bool(_MIME_LIKE.fullmatch(value))
            or (len(value) >= 4 and bool(_BASE64_LIKE.fullmatch(value))))


def token_diff(sent: bytes, forwarded: bytes) -> list[tuple[int, bytes, bytes]] | str:
    """The string tokens that differ, as (token index, sent, forwarded); a str says the bodies differ
    somewhere else (outside string tokens, or in how many there are)."""
    a, b = string_tokens(sent), string_tokens(forwarded)
    if len(a) != len(b):
        return f"{len(a)} string tokens sent, {len(b)} forwarded"
    changed: list[tuple[int, bytes, bytes]] = []
    prev_a = prev_b = 0
    for i, ((sa, ea), (sb, eb)) in enumerate(zip(a, b, strict=True)):
        if sent[prev_a:sa] != forwarded[prev_b:sb]:
            return (f"bytes between tokens {i - 1} and {i} differ: "
                    f"{sent[prev_a:sa][:80]!r} -> {forwarded[prev_b:sb][:80]!r}")
        if sent[sa:ea] != forwarded[sb:eb]:
            changed.append((i, sent[sa:ea], forwarded[sb:eb]))
        prev_a, prev_b = ea, eb
    if sent[prev_a:] != forwarded[prev_b:]:
        return f"bytes after the last token differ: {sent[prev_a:][:80]!r} -> {forwarded[prev_b:][:80]!r}"
    return changed


async def check_http_media(h: Harness, case: HttpCase) -> None:
    """No resize configured: never a 5xx or traceback, errors in the API's shape, a clean request accepted
    and forwarded byte for byte, any forwarded body identical except inside media string tokens."""
    status, answer, content_type = await _post(h, case)
    _answer_checks(h, case, status, answer, content_type)
    if case.clean and status != 200:
        raise fail(f"refused-clean:{status}", f"{case.route} refused a valid request: {answer[:300]!r}")
    if status >= 400:
        return
    forwarded = h.upstream.seen[0].body
    if forwarded == case.body:
        return
    if case.clean:
        raise fail("rewrote-clean", f"{case.route}: a valid request without resize was changed on its way")
    diff = token_diff(case.body, forwarded)
    if isinstance(diff, str):
        raise fail("changed-outside-strings", f"{case.route}: {diff}")
    for index, old, new in diff:
        if not media_like(old):
            raise fail("changed-non-media", f"{case.route}: string token {index} {old[:80]!r} -> {new[:80]!r}")
        try:
            ok = isinstance(json.loads(new), str)
        except ValueError:
            ok = False
        if not ok:
            raise fail("spliced-bad-token", f"{case.route}: token {index} became {new[:80]!r}")


# ----------------------------------------------------------------------------------------------------------
# with resize on: parse both bodies, equal everywhere but at media strings


def _loads_deep(body: bytes) -> Any:
    """json.loads with room for the deep documents the strategies make (the C scanner recurses per level)."""
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 20_000))
    try:
        return json.loads(body)
    finally:
        sys.setrecursionlimit(limit)


def _get(doc: Any, path: Path_) -> Any:
    for step in path:
        doc = doc[step]
    return doc


def doc_differences(a: Any, b: Any, allowed: set[tuple[str | int, ...]]) -> list[str]:
    """Where ``a`` and ``b`` differ outside ``allowed`` paths (iterative: documents may be 3000 deep).
    At an allowed path both must be strings."""
    problems: list[str] = []
    stack: list[tuple[Any, Any, tuple[str | int, ...]]] = [(a, b, ())]
    while stack and len(problems) < 5:
        x, y, path = stack.pop()
        if path in allowed:
            if not (isinstance(x, str) and isinstance(y, str)):
                problems.append(f"{list(path)}: media string became {type(y).__name__}")
            continue
        if type(x) is not type(y):
            problems.append(f"{list(path)}: {type(x).__name__} -> {type(y).__name__}")
        elif isinstance(x, dict):
            if list(x) != list(y):
                problems.append(f"{list(path)}: keys {list(x)[:8]} -> {list(y)[:8]}")
            else:
                stack.extend((x[k], y[k], (*path, k)) for k in x)
        elif isinstance(x, list):
            if len(x) != len(y):
                problems.append(f"{list(path)}: {len(x)} items -> {len(y)}")
            else:
                stack.extend((x[i], y[i], (*path, i)) for i in range(len(x)))
        elif x != y:
            problems.append(f"{list(path)}: {x!r:.60} -> {y!r:.60}")
    return problems


def _image_of(value: str, form: str) -> tuple[str, Image.Image]:
    """(declared MIME or "", image) of a rewritten media string."""
    declared = ""
    payload = value
    if form == "data_uri":
        head, _, payload = value.partition(",")
        declared = head[5:].split(";", 1)[0].lower()
    image = Image.open(io.BytesIO(base64.b64decode(payload, validate=True)))
    image.load()
    return declared, image


async def check_http_resize(h: Harness, case: HttpCase) -> None:
    """``MMGATE_RESIZE_MAX_PIXELS`` on: same answers as without resize; the forwarded body parses to the
    document sent with only media strings changed, each change a decodable image within the limit whose
    declared type (data URI header or Anthropic ``media_type``) is its real format, and an image that
    already fits is never rewritten."""
    status, answer, content_type = await _post(h, case)
    _answer_checks(h, case, status, answer, content_type)
    if case.clean and status != 200:
        raise fail(f"refused-clean:{status}", f"{case.route} refused a valid request: {answer[:300]!r}")
    if status >= 400:
        return
    forwarded = h.upstream.seen[0].body
    if forwarded == case.body:
        return
    docs, error = attempt(lambda: (_loads_deep(case.body), _loads_deep(forwarded)))
    if docs is None:
        raise fail("rewrote-unparsable", f"{case.route}: a body was rewritten but does not parse: {error}")
    sent_doc, forwarded_doc = docs
    allowed = {tuple(site.path) for site in case.sites}
    problems = doc_differences(sent_doc, forwarded_doc, allowed)
    if problems:
        raise fail("changed-non-media", f"{case.route}: {'; '.join(problems)}")
    by_token = {site.token: site for site in case.sites}
    for site in case.sites:
        if site.role != "data":
            continue
        old, new = _get(sent_doc, site.path), _get(forwarded_doc, site.path)
        mime_site = by_token.get(site.mime_token) if site.mime_token is not None else None
        mime_changed = mime_site is not None and _get(sent_doc, mime_site.path) != _get(forwarded_doc, mime_site.path)
        if old == new and not mime_changed:
            continue
        if site.form == "data_uri" and old.partition(",")[2] == new.partition(",")[2]:
            payload_changed = False  # only the declared type in the header changed
        else:
            payload_changed = old != new
        if payload_changed and site.pixels and site.pixels <= RESIZE_MAX_PIXELS:
            raise fail("rewrote-fitting-image", f"{case.route} {site.path}: {site.pixels} px fit but were rewritten")
        decoded, error = attempt(_image_of, new, site.form)
        if decoded is None:
            if payload_changed:
                raise fail("rewrote-to-junk", f"{case.route} {site.path}: the new media does not decode: {error}")
            continue  # a type corrected beside data that is no image (audio, video): nothing to decode here
        declared, image = decoded
        width, height = image.size
        if payload_changed and width * height > RESIZE_MAX_PIXELS:
            raise fail("resize-over-limit", f"{case.route} {site.path}: {width}x{height} > {RESIZE_MAX_PIXELS} px")
        real = Image.MIME.get(image.format or "", "")
        if mime_site is not None:
            declared = str(_get(forwarded_doc, mime_site.path)).strip().lower()
        if (site.form == "data_uri" or mime_site is not None) and declared != real:
            raise fail("mime-mismatch", f"{case.route} {site.path}: declared {declared!r}, data is {real!r}")


# ----------------------------------------------------------------------------------------------------------
# request targets and MMGATE_ALLOW_PATHS


@dataclass
class PathCase:
    method: str
    target: bytes

    def record(self) -> dict[str, Any]:
        record: dict[str, Any] = {"method": self.method, "target_b64": base64.b64encode(self.target).decode()}
        with contextlib.suppress(UnicodeDecodeError):
            record["target"] = self.target.decode("utf-8")
        return record

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> PathCase:
        if "target_b64" in record:
            return cls(record.get("method", "GET"), base64.b64decode(record["target_b64"]))
        return cls(record.get("method", "GET"), record["target"].encode("utf-8"))


_SEGMENTS = (
    "v1", "v1", "chat", "completions", "models", "admin", "mmgate", "metrics", "", ".", "..", "...", "%2e", "%2E",
    "%2e%2e", ".%2e", "%2E.", "%2f", "%2F", "..%2f", "..%2F..", "%5c", "%5C", "..\\", "\\", "%00", "%", "%zz", "%252e",
    "%2", ";", ";x=1", "models;v=2", "completions;a", "..;", "é", "%C3%A9", "~", "-", "completionsx", "modelsfoo",
    "%76%31", "mod%65ls", "%7e", "\t", "\x01", "\x7f", " ", "#frag", "@", ":", "%40", "%3f", "?", "%FF", "%C0%AE",
    "%ED%A0%80", "%u002e", "%2e%2e%2f", "%252f", "%%32%65",
)


@st.composite
def targets(draw: st.DrawFn) -> PathCase:
    """A raw request target around the allowed prefixes. Always origin-form (``/...``) or an absolute form
    naming 127.0.0.1, so no target can make a proxy forward anywhere else."""
    start = draw(st.sampled_from(["/v1/chat/completions", "/v1/models", "/v1/models", "/", "/v1/chat", "//",
                                  "http://127.0.0.1/v1/models", "HTTP://127.0.0.1:1/v1/chat/completions"]))
    parts = draw(st.lists(st.sampled_from(_SEGMENTS), max_size=6))
    path = start
    for part in parts:
        path += draw(st.sampled_from(["/", "/", "/", "//", "\\"])) + part
    if draw(st.integers(0, 4)) == 0:
        path += "/"
    query = draw(st.sampled_from(["", "", "", "?a=1", "?q=../..%2f", "?x=\\", "?", "?a=%2e%2e&b=/v1/models/..",
                                  "?é=1", "#frag"]))
    method = draw(st.sampled_from(["GET", "GET", "POST", "DELETE"]))
    return PathCase(method, (path + query).encode("utf-8"))


def path_problem(raw_path: str) -> str | None:
    """Why a path the upstream received breaks the allowlist's promise (None when it keeps it). The spelling
    rules come first, so the prefix rule names only a clean path outside the allowlist (``/v1/modelsx``)."""
    path = raw_path.split("?", 1)[0]
    if "\\" in path:
        return "backslash"
    if re.search(r"%2e|%2f|%5c", path, re.IGNORECASE):
        return "encoded-dot-or-slash"
    if "//" in path:
        return "double-slash"
    segments = path.split("/")
    if "." in segments or ".." in segments:
        return "dot-segment"
    if not any(path == prefix or path.startswith(prefix + "/") for prefix in ALLOWED_PREFIXES):
        return "outside-prefix"
    return None


async def raw_request(port: int, method: str, target: bytes, body: bytes = b"") -> tuple[int | None, bytes]:
    """Send one request with exactly ``target`` on the request line (only to 127.0.0.1); the status
    (None when the connection closed without an answer) and the whole answer."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(method.encode() + b" " + target + b" HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
                     + b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(), 30)
    except ConnectionResetError:
        answer = b""
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()
    match = re.match(rb"HTTP/1\.[01] (\d{3})", answer)
    return (int(match.group(1)) if match else None), answer


async def check_http_paths(h: Harness, case: PathCase) -> None:
    """``MMGATE_ALLOW_PATHS=/v1/chat/completions,/v1/models``: every path the upstream receives (query
    removed) is an allowed prefix or under one on a segment boundary, and has no ``.``/``..`` segment, no
    ``//``, no ``%2e``/``%2f``/``%5c`` (any case) and no backslash; no target is answered with a 5xx, and
    mmgate's own JSON refusals have the API's error shape."""
    h.upstream.seen.clear()
    h.faults.clear()
    port = int(h.proxy_url.rsplit(":", 1)[1])
    with production_stack():
        status, answer = await raw_request(port, case.method, case.target, b"{}" if case.method == "POST" else b"")
    if status is not None and status >= 500:
        raise fail(f"5xx:{h.faults.where()}", f"{case.method} {case.target!r} answered {status}: {answer[-200:]!r}")
    if b"Traceback" in answer:
        raise fail("traceback", f"{case.method} {case.target!r}: {answer[-300:]!r}")
    head, _, body = answer.partition(b"\r\n\r\n")
    if status is not None and status >= 400 and re.search(rb"(?im)^content-type: *application/json", head):
        # mmgate's own refusal (aiohttp's answer to an unparsable request line is plain text)
        route = case.target.split(b"?", 1)[0].decode("utf-8", "replace")
        problem = error_shape_problem(route, body)
        if problem is not None:
            raise fail(f"error-shape:{status}", f"{case.method} {case.target!r}: {problem}")
    for seen in h.upstream.seen:
        problem = path_problem(seen.path)
        if problem is not None:
            raise fail(f"path-escape:{problem}", f"{case.method} {case.target!r} reached the upstream as {seen.path!r}")


# ----------------------------------------------------------------------------------------------------------
# pure functions


@dataclass
class JsonCase:
    """A body for the pure JSON properties, and what to splice into it."""

    body: bytes
    picks: list[int] = field(default_factory=list)  # indices into the reachable placeholders
    new_values: list[str] = field(default_factory=list)
    ascii: bool = False

    def record(self) -> dict[str, Any]:
        return {"body_b64": base64.b64encode(self.body).decode(), "picks": self.picks,
                "new_values": self.new_values, "ascii": self.ascii}

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> JsonCase:
        return cls(base64.b64decode(record["body_b64"]), record.get("picks", []), record.get("new_values", []),
                   record.get("ascii", False))


media_texts = st.sampled_from(["data:image/png;base64,iVBORw0KGgo=", "DATA:x", "image/png", "Audio/wav",
                               "https://a.invalid/x", "http:", "video/mp4", "x" * 100, "data:"])


_json_trees = st.recursive(
    st.one_of(scalars, media_texts),
    lambda inner: st.lists(inner, max_size=4)
    | st.lists(st.tuples(st.one_of(texts, media_texts), inner), max_size=4).map(lambda i: Obj(tuple(i))),
    max_leaves=16,
)


@st.composite
def json_bodies(draw: st.DrawFn, *, depth: bool = True, broken: bool = True) -> bytes:
    """Any JSON, written awkwardly; sometimes nested up to 3000 levels, sometimes broken. (No depth between
    500 and 1100: there json.loads, the reference, runs out of stack inside a test runner's frames.)"""
    value = draw(_json_trees)
    if depth and draw(st.integers(0, 5)) == 0:
        level = draw(st.sampled_from([10, 64, 200, 500, 1100, 1500, 3000]))
        shapes: list[tuple[str, str, tuple[str | int, ...]]] = [
            ("[", "]", (0,)), ('{"k":', "}", ("k",)), ('{"data:x" : ', "}", ("data:x",))]
        shape = draw(st.sampled_from(shapes))
        value = Deep(level, value, *shape)
    body = write(value, writer_rng(draw), draw(styles)).body
    if broken and draw(st.integers(0, 5)) == 0:
        body = draw(mutated(body))
    return body


@st.composite
def splice_cases(draw: st.DrawFn) -> JsonCase:
    body = draw(json_bodies(depth=False, broken=False))
    picks = draw(st.lists(st.integers(0, 40), max_size=6, unique=True))
    values = [draw(st.one_of(texts, media_texts, st.text(max_size=200))) for _ in picks]
    return JsonCase(body, picks, values, draw(st.booleans()))


def _placeholders(sk: Any) -> list[tuple[Path_, Span]]:
    """(path, span) of every placeholder reachable in ``sk.doc``, in document order (iterative walk)."""
    found: list[tuple[Path_, Span]] = []
    stack: list[tuple[Any, Path_]] = [(sk.doc, [])]
    while stack:
        value, path = stack.pop()
        span = sk.span_of(value)
        if span is not None:
            found.append((path, span))
        elif isinstance(value, dict):
            stack.extend((v, [*path, k]) for k, v in reversed(list(value.items())))
        elif isinstance(value, list):
            stack.extend((v, [*path, i]) for i, v in reversed(list(enumerate(value))))
    return found


def check_pure_splice(case: JsonCase) -> None:
    """``splice(body, replacements)`` parses to what parsing ``body``, replacing those string values and
    dumping would give: splicing changes exactly the chosen values and nothing else."""
    sk = skeletonize(case.body, long_string=0)
    spots = _placeholders(sk)
    if not spots:
        return
    expected = json.loads(case.body)
    replacements: list[tuple[Span, bytes]] = []
    for pick, new in zip(case.picks, case.new_values, strict=False):  # a hand-edited corpus file may differ
        path, span = spots[pick % len(spots)]
        if any(span == s for s, _t in replacements):
            continue
        replacements.append((span, json.dumps(new, ensure_ascii=case.ascii).encode()))
        if path:
            _get(expected, path[:-1])[path[-1]] = new
        else:
            expected = new
    out = splice(case.body, replacements)
    got, error = attempt(json.loads, out)
    if error is not None:
        raise fail("splice-invalid-json", f"splice made invalid JSON: {error}: {out[:200]!r}")
    if got != expected:
        raise fail("splice-differs", f"splice != parse-modify-dump: {got!r:.200} vs {expected!r:.200}")


def check_pure_skeleton(case: JsonCase) -> None:
    """``skeletonize(body).resolve()`` equals ``json.loads`` of the body for any JSON json.loads takes that
    nests at most ``MAX_NESTING`` deep; deeper JSON is refused, and anything else too, with nothing but
    ``MmgateError(400, "invalid_json")``: the same bound on every Python, whatever its recursion accounting.

    Both run with the same 1000 frames of headroom (a fresh interpreter's limit), whatever the caller's
    stack or hypothesis' raised limit; the reference gets ``MAX_NESTING`` more, so that it parses all JSON
    within the bound on any Python."""
    too_deep = _nesting(case.body) > MAX_NESTING
    with stack_headroom(1000 + MAX_NESTING):
        # From a str: json.loads(bytes) would also take a UTF-8 byte order mark, which RFC 8259 section 8.1
        # lets a parser refuse (mmgate does: 400 invalid_json).
        expected, reference_error = attempt(lambda: json.loads(case.body.decode("utf-8")))
    with stack_headroom(1000):
        got, error = attempt(lambda: skeletonize(case.body).resolve())
    valid = reference_error is None and not too_deep
    if too_deep and not isinstance(error, MmgateError):
        raise fail("skeleton-took-too-deep", f"nested past {MAX_NESTING} and not refused: {case.body[:100]!r}")
    if isinstance(error, MmgateError):
        if error.status != 400 or error.code != "invalid_json":
            raise fail("skeleton-wrong-error", f"{error.status} {error.code}")
        if valid:
            raise fail("skeleton-refused-valid-json", f"{error.message}: {case.body[:200]!r}")
        return
    if isinstance(error, RecursionError):
        raise fail("skeleton-recursion", f"RecursionError: {case.body[:100]!r}")
    if error is not None:
        raise fail(f"skeleton-raised:{type(error).__name__}", f"{error!r}: {case.body[:200]!r}")
    if valid and _orjson_numbers(got) != _orjson_numbers(expected):
        raise fail("skeleton-differs", f"resolve() != json.loads: {got!r:.200} vs {expected!r:.200}")


def _nesting(body: bytes) -> int:
    """How deep objects and arrays nest in ``body``, brackets inside strings not counted: read byte by byte,
    apart from the product's own scan."""
    depth = deepest = 0
    in_string = escaped = False
    for byte in body:
        if in_string:
            if escaped:
                escaped = False
            elif byte == 0x5C:
                escaped = True
            elif byte == 0x22:
                in_string = False
        elif byte == 0x22:
            in_string = True
        elif byte in b"[{":
            depth += 1
            deepest = max(deepest, depth)
        elif byte in b"]}":
            depth -= 1
    return deepest


def _orjson_numbers(doc: Any) -> Any:
    """``doc`` with every integer beyond 64 bits as the float orjson makes of it. The skeleton only locates
    media and its numbers never reach the wire (the body is spliced, never re-serialised), so this is the
    one way it may differ from ``json.loads``: orjson parses the body unless it needs the stdlib fallback
    (``NaN``, ``1e400``, lone surrogates), so both sides are compared in orjson's terms. Iterative: documents
    may be deep."""

    def number(value: Any) -> Any:
        if isinstance(value, int) and not isinstance(value, bool) and not -(1 << 63) <= value < (1 << 64):
            return float(value)
        return value

    root: list[Any] = [doc]
    stack: list[Any] = [root]
    while stack:
        container = stack.pop()
        keys = range(len(container)) if isinstance(container, list) else list(container)
        for key in keys:
            value = container[key]
            if isinstance(value, (list, dict)):
                copy: Any = list(value) if isinstance(value, list) else dict(value)
                container[key] = copy
                stack.append(copy)
            else:
                container[key] = number(value)
    return root[0]


@dataclass
class BytesCase:
    """Input for the data URL and base64 properties."""

    data: bytes
    as_str: bool = False
    max_bytes: int = 1 << 20
    valid: bytes | None = None  # the original bytes when ``data`` is their standard base64

    def record(self) -> dict[str, Any]:
        return {"data_b64": base64.b64encode(self.data).decode(), "as_str": self.as_str, "max_bytes": self.max_bytes,
                "valid_b64": None if self.valid is None else base64.b64encode(self.valid).decode()}

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> BytesCase:
        valid = record.get("valid_b64")
        return cls(base64.b64decode(record["data_b64"]), record.get("as_str", False), record.get("max_bytes", 1 << 20),
                   None if valid is None else base64.b64decode(valid))


@st.composite
def data_url_inputs(draw: st.DrawFn) -> BytesCase:
    if draw(st.integers(0, 3)) == 0:
        return BytesCase(draw(st.binary(max_size=300)))
    prefix = draw(st.sampled_from([b"data:", b"DATA:", b"Data:", b"dAtA:", b"data", b"dat", b"", b" data:", b"data;"]))
    mime = draw(st.sampled_from([b"image/png", b"IMAGE/PNG", b"", b"text/plain", b"image/svg+xml", b" image/png ",
                                 b"ima\xc3\xa9ge/png", b"\xff\xfe", b"image/png;charset=utf-8", b"x" * 300]))
    params = draw(st.sampled_from([b"", b";charset=utf-8", b";name=a,b", b";;", b";base64;base64", b"\x00"]))
    mark = draw(st.sampled_from([b";base64", b";BASE64", b";Base64", b"", b"base64", b";base64 ", b";base6"]))
    comma = draw(st.sampled_from([b",", b",", b"", b",,", b"%2C"]))
    payload = draw(st.one_of(st.binary(max_size=40), st.just(base64.b64encode(b"\x89PNG\r\n\x1a\n"))))
    return BytesCase(prefix + mime + params + mark + comma + payload, as_str=draw(st.booleans()))


def check_pure_data_url(case: BytesCase) -> None:
    """``parse_data_url`` raises only MediaError; returns None exactly when the value does not start with
    ``data:`` (any case); a result points just past a comma in the header and has a lower-case MIME."""
    value: bytes | memoryview = memoryview(case.data) if case.as_str else case.data
    parsed, error = attempt(parse_data_url, value)
    if isinstance(error, MediaError):
        if error.status != 400 or error.code != "invalid_data_uri":
            raise fail("data-url-wrong-error", f"{error.status} {error.code} for {case.data[:80]!r}")
        return
    if error is not None:
        raise fail(f"data-url-raised:{type(error).__name__}", f"{error!r} for {case.data[:120]!r}")
    is_data = case.data[:5].lower() == b"data:"
    if parsed is None:
        if is_data:
            raise fail("data-url-missed", f"None for a data: URL {case.data[:80]!r}")
        return
    if not is_data:
        raise fail("data-url-invented", f"parsed a non-data URL {case.data[:80]!r}")
    offset = parsed.payload_offset
    if not 6 <= offset <= 256 or case.data[offset - 1 : offset] != b",":
        raise fail("data-url-offset", f"payload_offset {offset} for {case.data[:80]!r}")
    if parsed.mime != parsed.mime.lower() or ";" in parsed.mime or "," in parsed.mime:
        raise fail("data-url-mime", f"mime {parsed.mime!r} for {case.data[:80]!r}")


@st.composite
def base64_inputs(draw: st.DrawFn) -> BytesCase:
    raw = draw(st.binary(max_size=64))
    max_bytes = draw(st.sampled_from([0, 1, 2, 3, 16, 48, 1 << 20]))
    shape = draw(st.integers(0, 5))
    if shape <= 1:
        return BytesCase(base64.b64encode(raw), draw(st.booleans()), max_bytes, raw)
    if shape == 2:
        text, _ok = draw(base64_of(raw))
        return BytesCase(text.encode("utf-8"), draw(st.booleans()), max_bytes)
    if shape == 3:
        return BytesCase(draw(st.binary(max_size=80)), False, max_bytes)
    if shape == 4:  # a str with anything in it, lone surrogates included
        text = draw(st.text(st.characters(codec=None), max_size=40))
        return BytesCase(text.encode("utf-8", "surrogatepass"), True, max_bytes)
    return BytesCase(draw(st.text("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/=", max_size=40))
                     .encode(), draw(st.booleans()), max_bytes)


def check_pure_base64(case: BytesCase) -> None:
    """``decode_base64`` raises only MediaError (invalid_base64, or 413 media_too_large exactly when the
    result would exceed ``max_bytes``); on valid input it agrees with ``base64.b64decode(validate=True)``,
    and it never accepts what the strict stdlib decoder refuses or decodes differently."""
    payload: bytes | str = case.data.decode("utf-8", "surrogatepass") if case.as_str else case.data
    stdlib, _refused = attempt(base64.b64decode, case.data, validate=True)
    got, error = attempt(decode_base64, payload, max_bytes=case.max_bytes)
    if isinstance(error, MediaError):
        if error.code == "media_too_large":
            if error.status != 413 or (stdlib is not None and len(stdlib) <= case.max_bytes):
                raise fail("base64-too-large-wrongly", f"{error.status} for {len(stdlib or b'')} <= {case.max_bytes}")
        elif error.code != "invalid_base64" or error.status != 400:
            raise fail("base64-wrong-error", f"{error.status} {error.code}")
        elif case.valid and len(case.valid) <= case.max_bytes:
            raise fail("base64-refused-valid", f"{case.data[:80]!r}: {error.message}")
        return
    if error is not None or got is None:
        raise fail(f"base64-raised:{type(error).__name__}", f"{error!r} for {case.data[:80]!r}")
    if len(got) > case.max_bytes:
        raise fail("base64-over-limit", f"{len(got)} bytes > max_bytes {case.max_bytes}")
    if stdlib is None:
        raise fail("base64-laxer-than-stdlib", f"accepted what b64decode(validate=True) refuses: {case.data[:80]!r}")
    if got != stdlib:
        raise fail("base64-differs", f"{case.data[:80]!r}: {got[:40]!r} != {stdlib[:40]!r}")
    if case.valid is not None and got != case.valid:
        raise fail("base64-roundtrip", f"{case.data[:80]!r} did not decode to what was encoded")


# ----------------------------------------------------------------------------------------------------------
# the property registry: what the tests, the bench and the corpus replay share


@dataclass(frozen=True)
class Property:
    name: str
    summary: str  # one line, for the bench's table
    kind: Literal["http", "pure"]
    env: dict[str, str]
    load: Callable[[dict[str, Any]], Any]  # corpus record -> case
    check: Callable[..., Any]  # (Harness, case) -> awaitable for http; (case) -> None for pure


PROPERTIES: dict[str, Property] = {
    p.name: p
    for p in (
        Property("http_media", "no 5xx/traceback, API error shapes, valid requests accepted and forwarded byte for "
                 "byte, changes only inside media strings", "http", {}, HttpCase.from_record, check_http_media),
        Property("http_resize", "with resize: same document but media strings, each rewrite a smaller image of its "
                 "declared type, fitting images untouched", "http", RESIZE_ENV, HttpCase.from_record,
                 check_http_resize),
        Property("http_paths", "MMGATE_ALLOW_PATHS: the upstream only sees clean paths under an allowed prefix; no "
                 "target gets a 5xx", "http", PATHS_ENV, PathCase.from_record, check_http_paths),
        Property("pure_splice", "splice == parse-modify-dump", "pure", {}, JsonCase.from_record, check_pure_splice),
        Property("pure_skeleton", "skeletonize().resolve() == json.loads; junk raises only invalid_json", "pure", {},
                 JsonCase.from_record, check_pure_skeleton),
        Property("pure_data_url", "parse_data_url raises only MediaError; None iff not data:", "pure", {},
                 BytesCase.from_record, check_pure_data_url),
        Property("pure_base64", "decode_base64 raises only MediaError, agrees with b64decode(validate=True), never "
                 "laxer", "pure", {}, BytesCase.from_record, check_pure_base64),
    )
}


def strategy_for(name: str) -> st.SearchStrategy[Any]:
    """The inputs of property ``name`` over all dialects (the tests split HTTP ones per dialect instead)."""
    dialects = st.sampled_from(list(ROUTES))
    strategies: dict[str, Callable[[], st.SearchStrategy[Any]]] = {
        "http_media": lambda: dialects.flatmap(http_cases),
        "http_resize": lambda: dialects.flatmap(lambda d: http_cases(d, mutate=False)),
        "http_paths": targets,
        "pure_splice": splice_cases,
        "pure_skeleton": lambda: json_bodies().map(JsonCase),
        "pure_data_url": data_url_inputs,
        "pure_base64": base64_inputs,
    }
    return strategies[name]()


# ----------------------------------------------------------------------------------------------------------
# the corpus


def signature_of(exc: BaseException) -> str:
    """The ``[signature]`` an AssertionError from ``fail`` starts with; else the exception type."""
    match = re.match(r"\[([^\]]+)\]", str(exc))
    return match.group(1) if match else f"raised:{type(exc).__name__}"


def corpus_files() -> list[Path]:
    return sorted(CORPUS.glob("*.json"))


def corpus_signatures() -> set[tuple[str, str]]:
    """(property, signature) of every kept input: a new find with the same pair is not written twice."""
    found = set()
    for path in corpus_files():
        with contextlib.suppress(ValueError, KeyError, OSError):
            record = json.loads(path.read_text())
            found.add((record["property"], record["signature"]))
    return found


def corpus_text(entry: dict[str, Any]) -> str:
    """One top-level field per line, each value compact (a 1000-level JSON path stays one line)."""
    lines = [f" {json.dumps(key)}: {json.dumps(value, ensure_ascii=False)}" for key, value in entry.items()]
    return "{\n" + ",\n".join(lines) + "\n}\n"


def save_to_corpus(prop: str, record: dict[str, Any], signature: str, note: str, env: dict[str, str], *,
                   by: str = "hypothesis", force: bool = False) -> Path | None:
    """Write one failing input as ``tests/fuzz_corpus/<property>-<hash>.json``, unless an input with the same
    property and signature is already kept (then None; ``force`` keeps it anyway: another way to the same
    symptom)."""
    if not force and (prop, signature) in corpus_signatures():
        return None
    entry = {"property": prop, "signature": signature, "note": note[:2000], "env": env, **record,
             "found": {"commit": commit(), "date": datetime.date.today().isoformat(), "by": by}}
    digest = hashlib.sha1(json.dumps(record, sort_keys=True).encode()).hexdigest()[:10]
    CORPUS.mkdir(exist_ok=True)
    path = CORPUS / f"{prop}-{digest}.json"
    path.write_text(corpus_text(entry))
    return path


def _is_final_example() -> bool:
    """True while hypothesis replays the minimal failing example after shrinking (its last call)."""
    try:
        from hypothesis.control import current_build_context

        return bool(current_build_context().is_final)
    except Exception:
        return True


@dataclass
class Tally:
    """Counts for one property run (the bench prints them): inputs run, distinct failures found."""

    inputs: int = 0
    failures: dict[str, str] = field(default_factory=dict)  # signature -> note of its minimal example
    saved: list[str] = field(default_factory=list)


@contextlib.contextmanager
def keep_failures(prop: str, case: Any, tally: Tally | None = None, *, save: bool | None = None) -> Iterator[None]:
    """Around one example: count it; when it fails during hypothesis' final (minimal) replay, remember it
    and, with ``MMGATE_FUZZ_SAVE=1`` (or ``save=True``), write it to the corpus. Re-raises always."""
    if tally is not None:
        tally.inputs += 1
    try:
        yield
    except Exception as exc:
        if _is_final_example():
            signature = signature_of(exc)
            note = str(exc).split("\n", 1)[0]
            if tally is not None:
                tally.failures.setdefault(signature, note)
            if save if save is not None else os.environ.get(SAVE_ENV) == "1":
                written = save_to_corpus(prop, case.record(), signature, note, PROPERTIES[prop].env)
                if written is not None and tally is not None:
                    tally.saved.append(written.name)
        raise


async def replay_http(prop: Property, case: Any, upstream: Upstream,
                      start: Callable[..., Awaitable[Proxy]]) -> None:
    """Run one HTTP case through a proxy started with the property's env (corpus replay)."""
    proxy = await start(upstream.url, **prop.env)
    faults = FaultLog()
    with faults.installed():
        async with aiohttp.ClientSession() as session:
            await prop.check(Harness(proxy.url, upstream, session, faults), case)
