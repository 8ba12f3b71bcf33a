"""One media item on its way through the media step: where its bytes come from, and its cache key.

An item's bytes come from one of two places, and that is a property of the item (``Piece.source``):

- **inline**: the part's base64 text, read from the request body through a weak reference to its owner
  (``buffers.MediaBuffer``): a job or a hash still running after the request let go stops with
  ``Cancelled`` instead of keeping the body alive;
- **fetched** (``MMGATE_MEDIA_URLS=fetch``): the body read from the part's URL, known only once fetched.

``key_pieces`` is the one key function: the SHA-256 of the payload as it arrived (base64 text, or the raw
fetched bytes; ``cache.media_digest`` keeps the two apart) joined with the part's context. A payload that
repeats an earlier one of the same request byte for byte reuses its digest: comparing costs a memcmp, about a
ninth of hashing. With the cache off (``cache.NoCache``) nothing is hashed: each piece gets a key of its own.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from preprocessors.base import Cancelled
from proxy.fetch.fetcher import Fetched
from proxy.media.buffers import MediaBuffer
from proxy.media.cache import HASH_CHUNK, HASH_INLINE_BYTES, MediaCache, VerdictCache, cache_key, new_hasher
from proxy.payload.locate import Item
from proxy.payload.rawjson import string_value

BodyRef = weakref.ref[MediaBuffer]


@dataclass(slots=True)
class Piece:
    """One item of the plan: the item, its fetched body once there is one, and its key once known."""

    index: int  # in the plan: an inline piece's key is unique to it when the cache is off
    item: Item
    fetched: Fetched | None = None
    key: bytes = b""

    @property
    def source(self) -> Literal["inline", "fetched"]:
        return "fetched" if self.item.part.is_url else "inline"

    @property
    def size(self) -> int:
        """Decoded bytes, what the gate weighs: the measured bound inline, the bytes read once fetched, the
        per-item cap before that."""
        return len(self.fetched.data) if self.fetched is not None else self.item.size

    @property
    def own_key(self) -> bytes:
        """A key of this piece's own: unique in its request, and shorter than every cache key, so no lookup
        ever finds it (the cache off, or an item judged without the cache)."""
        return self.index.to_bytes(4, "big")

    def payload(self, body: BodyRef) -> bytes | memoryview:
        """The bytes a decode job reads: the fetched body, or the inline base64 (a view into the request body
        when possible). ``Cancelled`` once the request let go of its body."""
        if self.fetched is not None:
            return self.fetched.data
        media = body()
        if media is None:
            raise Cancelled()
        part = self.item.part
        if part.span is not None:
            return string_value(media.data, part.span)[self.item.payload_offset :]
        assert part.literal is not None  # an inline part is a span of the body or a literal
        return part.literal.encode("utf-8")[self.item.payload_offset :]

    def text(self, body: BodyRef) -> bytes:
        """The inline part's own base64, as sent: rewrites a whole escaped token without decoding (its
        characters are the base64 alphabet only, as the strict decode accepted them)."""
        return bytes(self.payload(body))


async def key_pieces(cache: VerdictCache, pieces: Sequence[Piece], body: BodyRef) -> None:
    """Set every piece's key. Hashing runs in the cache's hasher threads unless the payloads are small
    enough that a thread hop costs more; with the cache off nothing is hashed."""
    if not isinstance(cache, MediaCache):
        for piece in pieces:
            piece.key = piece.own_key
        return
    if sum(piece.size for piece in pieces) * 4 // 3 > HASH_INLINE_BYTES:
        digests = await asyncio.get_running_loop().run_in_executor(cache.hasher, _digests, body, pieces)
    else:
        digests = _digests(body, pieces)
    for piece, digest in zip(pieces, digests, strict=True):
        part = piece.item.part
        # A fetched body's declared type joins its key: it names an audio file's type when its bytes do not.
        declared = piece.fetched.mime if piece.fetched is not None else ""
        piece.key = cache_key(digest, cache.context(part.kind, part.audio_format, declared))


def _digests(body: BodyRef, pieces: Sequence[Piece]) -> list[bytes]:
    """Each piece's digest; a payload equal to an earlier one reuses that one's."""
    digests: list[bytes] = []
    for n, piece in enumerate(pieces):
        for earlier in range(n):
            if _same_payload(body, pieces[earlier], piece):
                digests.append(digests[earlier])
                break
        else:
            digests.append(_digest(body, piece))
    return digests


def _payload_range(piece: Piece) -> tuple[int, int] | None:
    """Where an unescaped inline piece's base64 lies in the body; None for anything else."""
    span = piece.item.part.span
    if piece.fetched is not None or span is None or span.escaped:
        return None
    return span.start + 1 + piece.item.payload_offset, span.end - 1


def _same_payload(body: BodyRef, first: Piece, second: Piece) -> bool:
    """Whether two pieces' payloads are the same bytes from the same source, compared a piece at a time
    (each comparison holds the GIL for a memcmp only)."""
    if first.fetched is not None and second.fetched is not None:
        a_data, b_data = first.fetched.data, second.fetched.data
        if len(a_data) != len(b_data):
            return False
        with memoryview(a_data) as a_view:
            return all(b_data.startswith(a_view[low : low + HASH_CHUNK], low)
                       for low in range(0, len(a_data), HASH_CHUNK))
    a, b = _payload_range(first), _payload_range(second)
    if a is None or b is None or a[1] - a[0] != b[1] - b[0]:
        return False
    for low in range(0, a[1] - a[0], HASH_CHUNK):
        media = body()
        if media is None:
            raise Cancelled()
        data = media.data
        del media
        with memoryview(data) as view:
            if not data.startswith(view[a[0] + low : min(a[0] + low + HASH_CHUNK, a[1])], b[0] + low):
                return False
        del data
    return True


def _digest(body: BodyRef, piece: Piece) -> bytes:
    """SHA-256 of the piece's payload. Inline base64 is read from the body a piece at a time (``Cancelled``
    once the request let go of it); an escaped string is unescaped whole first (rare: base64 needs no escape)."""
    if piece.fetched is not None:
        hasher = new_hasher("raw")
        hasher.update(piece.fetched.data)
        return hasher.digest()
    hasher = new_hasher("base64")
    where = _payload_range(piece)
    if where is None:
        hasher.update(piece.payload(body))
        return hasher.digest()
    start, end = where
    for low in range(start, end, HASH_CHUNK):
        media = body()
        if media is None:
            raise Cancelled()
        with memoryview(media.data) as view:
            del media
            hasher.update(view[low : min(low + HASH_CHUNK, end)])
    return hasher.digest()
