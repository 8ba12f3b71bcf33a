"""The one path decision: what request target is forwarded, and whether it is allowed.

The allowlist (``MMGATE_ALLOW_PATHS``) is only as good as the agreement between the path it checks and
the path the upstream acts on. So the target is normalised once, the allowlist is matched on the
normalised path, and exactly that path is what ``forward`` sends; the raw target never reaches the
upstream.

Normalisation, in RFC 3986's order (section 6.2.2):

1. Request-target forms (RFC 9112 section 3.2): origin-form ``/path?query`` is the normal case; an
   absolute-form target (``http://host/path``, which a server must accept, section 3.2.2) is reduced
   to its path and query, its authority ignored (the upstream is fixed); authority-form and
   asterisk-form are refused.
2. Percent-encodings are checked: malformed ones are refused; those of unreserved characters are
   decoded (section 6.2.2.2), so ``%2e`` is a dot like any other and ``/v1/mod%65ls`` is
   ``/v1/models``; the rest keep their encoding with upper-case hex digits (section 6.2.2.1).
3. What cannot be normalised safely is refused with 400 ``invalid_path``: an encoded ``/`` or ``\\``
   (backends disagree on whether it separates segments), a literal ``\\`` (some servers treat it as
   ``/``), NUL and other control characters, raw or encoded, and a ``#`` fragment.
4. Dot-segments are removed (section 5.2.4), and repeated slashes are merged (nginx's
   ``merge_slashes``), so ``/v1/models/../../admin`` and ``/v1//models`` are ``/admin`` and
   ``/v1/models``.

Prefixes match on segment boundaries: ``/v1/models`` allows ``/v1/models`` and ``/v1/models/x``,
never ``/v1/modelsx``. The query is forwarded as the client sent it (control characters refused).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import quote, urlsplit

from preprocessors.errors import INVALID_PATH

_UNRESERVED = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-._~")
_HEX = frozenset(b"0123456789abcdefABCDEF")
# Encoded bytes that would change how the path splits into segments, or that no backend should see.
_UNSAFE_ENCODED = frozenset({ord("/"), ord("\\"), *range(0x20), 0x7F})
_CONTROL_OR_UNSAFE = re.compile(r"[\x00-\x20\x7f\\#]")
_QUERY_SAFE = "!$&'()*+,;=:@/?%"  # RFC 3986 query characters besides unreserved, kept as sent
_ABSOLUTE_FORM = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


@dataclass(frozen=True, slots=True)
class Target:
    """A checked request target: ``path`` (normalised) and ``query`` (raw, without the ``?``)."""

    path: str
    query: str

    @property
    def forwarded(self) -> str:
        """What goes after the upstream base URL: the checked path, then the query as the client sent it."""
        return self.path + "?" + self.query if self.query else self.path


def normalise_target(raw: str) -> Target:
    """The checked form of ``raw`` (the request target as it arrived), or MmgateError 400 ``invalid_path``."""
    if _ABSOLUTE_FORM.match(raw):
        parts = urlsplit(raw)
        if parts.scheme.lower() not in ("http", "https"):
            raise INVALID_PATH.error(f"request target scheme {parts.scheme[:16]!r} is not http(s)")
        raw = (parts.path or "/") + ("?" + parts.query if parts.query else "")
    elif not raw.startswith("/"):
        raise INVALID_PATH.error(
            "the request target must be a path starting with / (origin-form, RFC 9112 section 3.2.1)")
    path, _, query = raw.partition("?")
    bad = _CONTROL_OR_UNSAFE.search(path)
    if bad is not None:
        raise INVALID_PATH.error(f"the path contains {bad.group()!r}, which is not accepted in a path")
    if _CONTROL_OR_UNSAFE.search(query.replace("\\", "").replace("#", "")) is not None:
        raise INVALID_PATH.error("the query contains control characters")
    if "%" in path or not path.isascii():
        path = _normalise_percent(path)
    if not query.isascii():
        query = quote(query, safe=_QUERY_SAFE)
    return Target(_merge_slashes(remove_dot_segments(path)), query)


def _normalise_percent(path: str) -> str:
    """Decode encoded unreserved characters, upper-case the hex of the rest, refuse unsafe or broken ones."""
    out: list[str] = []
    i = 0
    size = len(path)
    while i < size:
        char = path[i]
        if char != "%":
            out.append(char if char.isascii() else quote(char))  # a URI is ASCII (RFC 3986 section 2)
            i += 1
            continue
        pair = path[i + 1 : i + 3].encode("ascii", "replace")
        if len(pair) != 2 or pair[0] not in _HEX or pair[1] not in _HEX:
            raise INVALID_PATH.error(f"malformed percent-encoding {path[i : i + 3]!r} in the path")
        byte = int(pair, 16)
        if byte in _UNSAFE_ENCODED:
            raise INVALID_PATH.error(f"the path contains an encoded {chr(byte)!r} (%{byte:02X}), which is not accepted")
        out.append(chr(byte) if byte in _UNRESERVED else "%" + pair.decode().upper())
        i += 3
    return "".join(out)


def remove_dot_segments(path: str) -> str:
    """RFC 3986 section 5.2.4, for an absolute path: ``/a/b/../c/./d`` is ``/a/c/d``."""
    segments = path.split("/")[1:]
    out: list[str] = []
    for segment in segments:
        if segment == "..":
            if out:
                out.pop()
        elif segment != ".":
            out.append(segment)
    # A path ending in a dot-segment names a directory: keep its trailing slash.
    if segments and segments[-1] in (".", ".."):
        out.append("")
    return "/" + "/".join(out)


def _merge_slashes(path: str) -> str:
    while "//" in path:
        path = path.replace("//", "/")
    return path


def is_allowed(path: str, prefixes: tuple[str, ...]) -> bool:
    """Whether the normalised ``path`` is one of ``prefixes`` or below one, on a segment boundary.

    An empty allowlist allows everything."""
    if not prefixes:
        return True
    for prefix in prefixes:
        base = prefix.rstrip("/")
        if path in (prefix, base) or path.startswith(base + "/"):
            return True
    return False
