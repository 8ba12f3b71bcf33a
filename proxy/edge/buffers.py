"""Who holds a media request's bytes, and until when (docs/architecture.md, "Invariants").

A request body that may carry media gets exactly one owner, a ``MediaBuffer``: ``BufferLedger.hold`` joins the
chunks it arrived in into it, and ``MediaBuffer.splice`` rewrites it with the media step's replacements. The
pipeline hands the owner along (locate → decode workers → splice → ``OneShotBody``) and nobody else keeps the
bytes: the upstream
payload releases the owner as soon as the last byte is on the wire (the handoff), and the handler's
``finally`` releases it on every other way out (error, timeout, disconnect).

``weakref`` cannot point at ``bytes``, so the owner is what a test or an operator watches. The ledger keeps
two gauges: ``mmgate_media_bytes_live`` (bytes owners still hold; drops to 0 at handoff) and
``mmgate_media_buffers_live`` (owner objects not yet garbage, counted with ``weakref.finalize``). Both
must be 0 whenever the proxy is idle; a count that stays up is a reference leak, whatever holds it.
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from collections.abc import Iterable

from preprocessors.base import Cancelled
from proxy.payload.rawjson import Span

# Bytes ``hold`` copies in one ``b"".join``, holding the loop for the whole copy: one exact-size copy costs a
# third of growing a buffer (a 6 MB body: 2.1 ms against 6.4 ms, each growth of a buffer this big a fresh mapping
# under ``runtime.memory``'s threshold); bench/loop_stall.py measures what the hold costs other requests.
ONE_COPY_MAX = 16 << 20
JOIN_STEP = 4 << 20  # bytes appended between two turns of the event loop, for a body over ONE_COPY_MAX


class BufferLedger:
    """Counts the live owners of one app and the bytes they hold (read by the gauges at scrape time)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # finalizers run in whichever thread dropped the last reference
        self.bytes_live = 0
        self.owners_live = 0
        self.owners_total = 0  # ever made: lets a test show an owner existed before asserting it is gone

    async def hold(self, chunks: list[bytes]) -> MediaBuffer:
        """The chunks a body arrived in, joined into one owned buffer (one chunk, such as the buffer ``read_body``
        gathered a media body into, is taken as it is); the list is emptied, so the owner is the only holder of
        the bytes. Up to ``ONE_COPY_MAX`` bytes in one copy (``b"".join``); a bigger body is
        appended to one growing ``bytearray`` ``JOIN_STEP`` bytes at a time, letting the loop serve others
        between two steps, and each chunk is let go once copied: a body that big is never held twice, a
        chunk's worth at most. Growing costs no copy: glibc maps a buffer this big on its own
        (``memory.tune_process``) and grows it with ``mremap``; ``bytearray(total)`` would zero it all first, in
        one call."""
        if len(chunks) == 1:
            return MediaBuffer(chunks.pop(), self)
        total = sum(map(len, chunks))
        if total <= ONE_COPY_MAX:
            body = b"".join(chunks)
            chunks.clear()
            return MediaBuffer(body, self)
        out = bytearray()
        copied = 0
        for i, chunk in enumerate(chunks):
            out += chunk
            chunks[i] = b""
            copied += len(chunk)
            if copied >= JOIN_STEP:
                copied = 0
                await asyncio.sleep(0)
        chunks.clear()
        # A bytes-like buffer: everything downstream reads it through find, slices and memoryviews.
        return MediaBuffer(out, self)

    def _change(self, size_delta: int, owners_delta: int = 0) -> None:
        with self._lock:
            self.bytes_live += size_delta
            self.owners_live += owners_delta
            if owners_delta > 0:
                self.owners_total += owners_delta

    def _owner_gone(self, size: list[int]) -> None:
        # An owner that dies still holding bytes gives them back here, so the bytes count cannot drift.
        self._change(-size[0], -1)


class MediaBuffer:
    """The one owner of a media request's body: ``data`` until ``release()``, then nothing."""

    __slots__ = ("__weakref__", "_data", "_ledger", "_size")

    def __init__(self, data: bytes, ledger: BufferLedger) -> None:
        self._data: bytes | None = data
        self._size = [len(data)]  # shared with the finalizer, which must not reference self
        self._ledger = ledger
        ledger._change(len(data), 1)
        weakref.finalize(self, ledger._owner_gone, self._size)

    @property
    def data(self) -> bytes:
        """The bytes; raises ``Cancelled`` once released: work for an ended request stops here."""
        if self._data is None:
            raise Cancelled()
        return self._data

    @property
    def released(self) -> bool:
        return self._data is None

    def __len__(self) -> int:
        return self._size[0]

    def splice(self, replacements: Iterable[tuple[Span, bytes]]) -> None:
        """Rewrite the body: each span's token replaced (``splice``). The old bytes are dropped with this owner's
        reference, so the body is never held twice past the join."""
        data = splice(self.data, replacements)
        self._ledger._change(len(data) - self._size[0])
        self._data, self._size[0] = data, len(data)

    def release(self) -> None:
        """Let go of the bytes (idempotent): called at handoff and when the request ends."""
        if self._data is not None:
            self._data = None
            self._ledger._change(-self._size[0])
            self._size[0] = 0



def splice(body: bytes, replacements: Iterable[tuple[Span, bytes]]) -> bytes:
    """``body`` with each span's whole token replaced by the given bytes (a complete JSON string
    token, quotes included); every other byte identical. One new bytes object, built in one join."""
    ordered = sorted(replacements, key=lambda item: item[0].start)
    view = memoryview(body)
    parts: list[bytes | memoryview] = []
    pos = 0
    for span, token in ordered:
        if span.start < pos or span.end > len(body) or span.end < span.start:
            raise ValueError(f"overlapping or out-of-range span {span}")
        parts.append(view[pos : span.start])
        parts.append(token)
        pos = span.end
    parts.append(view[pos:])
    try:
        return b"".join(parts)
    finally:
        del parts, view
