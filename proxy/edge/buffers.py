"""Who holds a media request's bytes, and until when (docs/architecture.md, "Invariants").

A request body that may carry media gets exactly one owner, a ``MediaBuffer``. The pipeline hands the owner
along (locate → decode workers → splice → ``OneShotBody``) and nobody else keeps the bytes: the upstream
payload releases the owner as soon as the last byte is on the wire (the handoff), and the handler's
``finally`` releases it on every other way out (error, timeout, disconnect).

``weakref`` cannot point at ``bytes``, so the owner is what a test or an operator watches. The ledger keeps
two gauges: ``mmgate_media_bytes_live`` (bytes owners still hold; drops to 0 at handoff) and
``mmgate_media_buffers_live`` (owner objects not yet garbage, counted with ``weakref.finalize``). Both
must be 0 whenever the proxy is idle; a count that stays up is a reference leak, whatever holds it.
"""

from __future__ import annotations

import threading
import weakref

from preprocessors.base import Cancelled


class BufferLedger:
    """Counts the live owners of one app and the bytes they hold (read by the gauges at scrape time)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # finalizers run in whichever thread dropped the last reference
        self.bytes_live = 0
        self.owners_live = 0
        self.owners_total = 0  # ever made: lets a test show an owner existed before asserting it is gone

    def hold(self, data: bytes) -> MediaBuffer:
        """Make ``data`` owned; the caller must drop its own reference to ``data`` right after."""
        return MediaBuffer(data, self)

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

    def replace(self, data: bytes) -> None:
        """Swap in a new body (the spliced one); the old bytes are dropped with this owner's reference."""
        self._ledger._change(len(data) - self._size[0])
        self._data, self._size[0] = data, len(data)

    def release(self) -> None:
        """Let go of the bytes (idempotent): called at handoff and when the request ends."""
        if self._data is not None:
            self._data = None
            self._ledger._change(-self._size[0])
            self._size[0] = 0

