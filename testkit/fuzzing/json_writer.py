"""A JSON writer that knows where the media went.

``write`` serialises a small tree (``Obj``, ``Num``, ``RawStr``, ``Media``, ``Deep``) the way real clients do and the
way the rarest do (escaped slashes and letters, surrogate pairs, lone surrogates, big integers, ``1e2``,
duplicate keys, random whitespace, nesting thousands of levels deep), and records each media string's ``Site``,
so a property knows which bytes mmgate may change.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from typing import Any, Literal

from hypothesis import strategies as st

Path_ = list[str | int]  # a JSON path: keys and indices from the root


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


class Writer:
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
    writer = Writer(rng, style)
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


