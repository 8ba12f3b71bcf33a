"""``data:`` URL parsing and strict base64 decoding with the size checked before any work.

Inline media arrives as base64 text, often tens of MB. Three rules keep that cheap and safe:

- The header (``data:image/png;base64,``) is parsed from the first bytes only; the payload is never
  scanned by Python code.
- The decoded size is known from the encoded length, so an oversized item is refused (413) before a
  single byte is decoded or allocated.
- Decoding is strict (``validate=True``): the lenient default silently drops junk characters, so a
  mangled payload would decode into a different file instead of being refused.
"""

from __future__ import annotations

import binascii
import re
from dataclasses import dataclass, field

import pybase64

from .dimensions import HEAD_STEPS
from .errors import INVALID_BASE64, INVALID_DATA_URI, MEDIA_TOO_LARGE
from .formats import sniff_image_format

# "data:" + a MIME type with parameters fits easily; a longer header is not a media data URL.
_HEADER_LIMIT = 256
_BASE64_MARK = b";base64"
_NOT_BASE64 = re.compile(rb"[^A-Za-z0-9+/=]")


@dataclass(frozen=True, slots=True)
class DataUrl:
    """The parsed header of a base64 ``data:`` URL."""

    mime: str  # lowercased, "" when absent ("data:;base64,...")
    params: str  # raw text between the MIME type and ";base64", e.g. ";charset=utf-8"; usually ""
    payload_offset: int  # index in the input where the base64 payload starts (after the comma)


def parse_data_url(value: bytes | memoryview) -> DataUrl | None:
    """Parse the header of ``value``; None when it is not a ``data:`` URL (e.g. an http URL).

    Only the first 256 bytes are read. A ``data:`` URL that is not base64 or has no comma there is
    refused with ``invalid_data_uri``.
    """
    head = bytes(value[:_HEADER_LIMIT])
    if head[:5].lower() != b"data:":
        return None
    comma = head.find(b",")
    if comma < 0:
        raise INVALID_DATA_URI.error(
            f"data: URL has no ',' within its first {_HEADER_LIMIT} bytes; "
            "expected data:<mime>;base64,<payload>",
        )
    meta = head[5:comma]
    if not meta.lower().endswith(_BASE64_MARK):
        raise INVALID_DATA_URI.error(
            "data: URL is not base64-encoded; expected data:<mime>;base64,<payload>",
        )
    meta = meta[: -len(_BASE64_MARK)]
    try:
        text = meta.decode("ascii")
    except UnicodeDecodeError:
        raise INVALID_DATA_URI.error(
            "data: URL header contains non-ASCII bytes before the comma"
        ) from None
    mime, sep, params = text.partition(";")
    return DataUrl(mime=mime.strip().lower(), params=sep + params, payload_offset=comma + 1)


def decoded_size(encoded_len: int) -> int:
    """Upper bound of the decoded size of ``encoded_len`` base64 characters (exact up to padding)."""
    return encoded_len * 3 // 4


def decode_base64(payload: bytes | memoryview | str, *, max_bytes: int) -> bytes:
    """Decode ``payload`` strictly, refusing it first if it would decode to more than ``max_bytes``.

    A bytes-like buffer is handed to pybase64 as is (no copy); a str (already JSON-decoded text) is
    encoded once. Errors say what is wrong and where, so the client can fix its encoder (line breaks,
    URL-safe alphabet, missing padding...).
    """
    if isinstance(payload, str):  # any non-ASCII character is then reported as invalid base64 below
        payload = payload.encode("utf-8", "surrogatepass")
    checked_size(payload, max_bytes)
    return _strict(payload)


def checked_size(payload: bytes | memoryview, max_bytes: int) -> int:
    """The decoded size of the base64 ``payload``, from its length: refused when empty or over ``max_bytes``."""
    length = len(payload)
    if length == 0:
        raise INVALID_BASE64.error("base64 payload is empty")
    size = decoded_size(length) - _padding(payload)
    if size > max_bytes:
        raise MEDIA_TOO_LARGE.error(
            f"media item decodes to {size} bytes ({size / 2**20:.1f} MiB), over the limit of "
            f"{max_bytes} bytes ({max_bytes / 2**20:g} MiB, MMGATE_MAX_MEDIA_ITEM_MB)",
        )
    return size


def decode_head(payload: bytes | memoryview, head_bytes: int) -> bytes:
    """The first ``head_bytes`` (rounded down to whole base64 quanta) of what ``payload`` decodes to, strictly;
    all of it when it is shorter. The rest of the payload is not read."""
    chars = head_bytes // 3 * 4
    return _strict(payload if len(payload) <= chars else payload[:chars])


def decode_tail(payload: bytes | memoryview, tail_bytes: int) -> bytes:
    """The last ``tail_bytes`` (give or take the padding) of what ``payload`` decodes to, strictly; all of it when
    it is shorter. The slice starts on a base64 quantum counted from the payload's start, so a payload whose
    length is no multiple of 4 is refused as the whole would be; the rest of the payload is not read."""
    start = max(0, len(payload) - tail_bytes // 3 * 4) // 4 * 4
    return _strict(payload[start:] if start else payload, offset=start)


@dataclass(slots=True)
class Base64Ends:
    """Base64 read from its ends only, each stretch decoded once however often it is asked for, and its image
    format sniffed once: an inline image's header is read by the header check, the bound on what is forwarded and
    the served model's plan alike.
    ``head(n)`` is ``decode_head``'s, ``tail(n)`` ``decode_tail``'s, each raising what they raise. It holds a view
    into the request's body: keep it only while the body is read on the loop, never across an await."""

    payload: bytes | memoryview
    _heads: dict[int, bytes] = field(default_factory=dict)
    _tails: dict[int, bytes] = field(default_factory=dict)
    _format: str = ""

    def size(self) -> int:
        """What the payload decodes to, in bytes, from its length (``checked_size`` without its checks)."""
        return decoded_size(len(self.payload)) - _padding(self.payload) if self.payload else 0

    def checked_size(self, max_bytes: int) -> int:
        """``checked_size`` of the payload: its decoded size, refused when empty or over ``max_bytes``."""
        return checked_size(self.payload, max_bytes)

    def image_format(self) -> str:
        """The image format its first bytes name (``formats.sniff_image_format``), sniffed once from the first
        head a header check reads (``dimensions.HEAD_STEPS``); raises what ``head`` and the sniff raise."""
        if not self._format:
            self._format = sniff_image_format(self.head(HEAD_STEPS[0]))
        return self._format

    def head(self, head_bytes: int) -> bytes:
        data = self._heads.get(head_bytes)
        if data is None:
            data = self._heads[head_bytes] = decode_head(self.payload, head_bytes)
        return data

    def tail(self, tail_bytes: int) -> bytes:
        data = self._tails.get(tail_bytes)
        if data is None:
            data = self._tails[tail_bytes] = decode_tail(self.payload, tail_bytes)
        return data


def _strict(payload: bytes | memoryview, offset: int = 0) -> bytes:
    try:
        return pybase64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        # binascii.Error for bad input; ValueError is what the stdlib decoder raises for some of it.
        raise INVALID_BASE64.error(_describe_bad_base64(payload, offset)) from None


def encode_base64(data: bytes) -> bytes:
    """Standard base64 (with padding) of ``data``."""
    return pybase64.b64encode(data)


def _padding(payload: bytes | memoryview) -> int:
    """Number of trailing '=' (0-2), which the length alone does not account for."""
    tail = bytes(payload[-2:])
    return len(tail) - len(tail.rstrip(b"="))


def _describe_bad_base64(payload: bytes | memoryview, offset: int = 0) -> str:
    """Why strict decoding failed: the first stray byte (``offset``: where ``payload`` starts in the whole
    payload), or a length/padding problem."""
    bad = _NOT_BASE64.search(payload)
    if bad is not None:
        char = bad.group()
        hint = ""
        if char in b"\r\n \t":
            hint = " (line breaks and spaces are not allowed)"
        elif char in b"-_":
            hint = " (URL-safe base64 is not accepted; use the standard + and / alphabet)"
        elif char == b"\\":
            hint = " (an escape sequence inside the base64 text)"
        elif char[0] >= 0x80:
            hint = " (non-ASCII)"
        return f"invalid base64: byte {char!r} at offset {offset + bad.start()} is not in the base64 alphabet{hint}"
    return (
        f"invalid base64: {offset + len(payload)} characters with wrong length or padding "
        "(the length must be a multiple of 4, '=' only at the end)"
    )
