"""A media item's content digest, from its bytes as they arrived; the cache joins it with the item's context
to make the key (``cache.MediaCache.key_items``).

An item's bytes come from one of two places, and that is a property of the item (``MediaItem.source``):

- **inline**: the item's base64 text, read from the request body through a weak reference to its owner
  (``buffers.MediaBuffer``): a job or a hash still running after the request let go stops with
  ``Cancelled`` instead of keeping the body alive (``MediaItem.payload``);
- **fetched** (``MMGATE_MEDIA_URLS=fetch``): the body read from the item's URL, known only once fetched.

``digests`` is the one digest function: the SHA-256 of the payload as it arrived (base64 text, or the raw
fetched bytes; a fixed domain prefix keeps the two apart). A payload that repeats an earlier one of the same
request byte for byte reuses its digest: comparing costs a memcmp, about a ninth of hashing. With the cache off
(``cache.NoCache``) nothing is hashed: each item gets a key of its own.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Iterator, Sequence
from concurrent.futures import Executor
from typing import Literal

from preprocessors.base import Cancelled
from proxy.payload.item import BodyRef, MediaItem

Encoding = Literal["base64", "raw"]

# Fixed-length prefixes: base64 text and raw bytes never share a key, even where one spells the other.
_DOMAINS: dict[Encoding, bytes] = {"base64": b"mmgate-media/b64\x00", "raw": b"mmgate-media/raw\x00"}
# Below this a thread hop costs more than hashing on the loop (SHA-256 runs at about 1-2 GB/s).
HASH_INLINE_BYTES = 64 << 10
HASH_CHUNK = 1 << 20


def new_hasher(encoding: Encoding) -> hashlib._Hash:
    """A SHA-256 already fed its domain prefix; feed it the media, in as many pieces as convenient."""
    hasher = hashlib.sha256()
    hasher.update(_DOMAINS[encoding])
    return hasher


async def digests(hasher: Executor, items: Sequence[MediaItem], body: BodyRef) -> list[bytes]:
    """Every item's digest. Hashing runs in ``hasher``'s threads unless the payloads are small enough that a
    thread hop costs more."""
    if sum(item.weight for item in items) * 4 // 3 > HASH_INLINE_BYTES:
        return await asyncio.get_running_loop().run_in_executor(hasher, _digests, body, items)
    return _digests(body, items)


def _data(body: BodyRef) -> bytes:
    media = body()
    if media is None:
        raise Cancelled()
    return media.data


def _digests(body: BodyRef, items: Sequence[MediaItem]) -> list[bytes]:
    """Each item's digest; a payload equal to an earlier one reuses that one's."""
    digests: list[bytes] = []
    for n, item in enumerate(items):
        for earlier in range(n):
            if _same_payload(body, items[earlier], item):
                digests.append(digests[earlier])
                break
        else:
            digests.append(_digest(body, item))
    return digests


def _payload_range(item: MediaItem) -> tuple[int, int] | None:
    """Where an unescaped inline item's base64 lies in the body; None for anything else."""
    span = item.span
    if item.fetched is not None or span is None or span.escaped:
        return None
    return span.start + 1 + item.payload_offset, span.end - 1


def _chunks(body: BodyRef, start: int, end: int) -> Iterator[tuple[bytes, int, int]]:
    """``(body bytes, low, high)`` for each ``HASH_CHUNK`` of ``body[start:end]``, the body looked up anew
    for each (``Cancelled`` once the request let go of it), so a long pass never keeps it alive."""
    for low in range(start, end, HASH_CHUNK):
        yield _data(body), low, min(low + HASH_CHUNK, end)


def _same_payload(body: BodyRef, first: MediaItem, second: MediaItem) -> bool:
    """Whether two items' payloads are the same bytes from the same source, compared a piece at a time
    (each comparison holds the GIL for a memcmp only)."""
    if first.fetched is not None and second.fetched is not None:
        a_data, b_data = first.fetched, second.fetched
        if len(a_data) != len(b_data):
            return False
        with memoryview(a_data) as a_view:
            return all(b_data.startswith(a_view[low : low + HASH_CHUNK], low)
                       for low in range(0, len(a_data), HASH_CHUNK))
    a, b = _payload_range(first), _payload_range(second)
    if a is None or b is None or a[1] - a[0] != b[1] - b[0]:
        return False
    for data, low, high in _chunks(body, *a):
        with memoryview(data) as view:
            if not data.startswith(view[low:high], low - a[0] + b[0]):
                return False
        del data
    return True


def _digest(body: BodyRef, item: MediaItem) -> bytes:
    """SHA-256 of the item's payload. Inline base64 is read from the body a piece at a time; an escaped
    string is unescaped whole first (rare: base64 needs no escape)."""
    if item.fetched is not None:
        hasher = new_hasher("raw")
        hasher.update(item.fetched)
        return hasher.digest()
    hasher = new_hasher("base64")
    where = _payload_range(item)
    if where is None:
        hasher.update(item.payload(body))
        return hasher.digest()
    for data, low, high in _chunks(body, *where):
        with memoryview(data) as view:
            del data
            hasher.update(view[low:high])
    return hasher.digest()
