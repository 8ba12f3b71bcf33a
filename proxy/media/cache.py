"""The processed-media cache: what mmgate made of media it has seen, so a chat that resends its photo every
turn pays for the decode once.

Content-addressed. A key is the SHA-256 of the media (``media_digest``: the base64 text of inline media, or
the raw bytes of fetched media; a fixed domain prefix keeps the two apart) joined with a fingerprint of
everything else that shapes the answer (``context_fingerprint``: the settings, the part's kind and declared
audio format, and a fetched body's declared type). A value is a ``Verdict``: the processed
file as base64 (or "unchanged") with the true type, or the refusal, so a bomb is refused again without a
decode. Entries are bounded by bytes (MMGATE_CACHE_MB) and evicted least recently used first.

Single flight: the first request to miss a key ``lead``s it; a later one ``in_flight`` finds the leader's
future and waits. The leader ``settle``s it with the verdict, or with None when it stopped for a reason
that is not the media's (timeout, cancellation, client gone, refused admission): a waiter then looks again
instead of inheriting a wrong answer. ``follow``, ``settle_decoded`` and ``give_up`` do this for all of one
request's keys at once (the media step's calls). All methods run on the event loop; hashing runs in
``hasher`` threads (hashlib releases the GIL on buffers over 2 KiB).

The key's digest is of the item's bytes as they arrived, from one of two places (``MediaItem.source``):
**inline**, the item's base64 text, read from the request body through a weak reference to its owner
(``buffers.MediaBuffer``), so a hash still running after the request let go stops with ``Cancelled`` instead
of keeping the body alive; or **fetched** (``MMGATE_MEDIA_URLS=fetch``), the body read from the item's URL.
``digests`` is the one digest function: the SHA-256 of the payload (a fixed domain prefix keeps base64 text and
raw bytes apart). A payload that repeats an earlier one of the same request byte for byte reuses its digest:
comparing costs a memcmp, about a ninth of hashing.

With MMGATE_CACHE_MB=0 a ``NoCache`` takes the cache's place: the same interface, holding nothing and hashing
nothing (each item gets a key of its own), so the media step runs one way whether the cache is on or off.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Literal

from preprocessors.base import Cancelled
from preprocessors.errors import MediaError
from preprocessors.job import Refusal, Verdict
from preprocessors.pool import lower_priority
from proxy.payload.item import BodyRef, MediaItem
from proxy.settings import Settings, verdict_settings

Encoding = Literal["base64", "raw"]

DIGEST_BYTES = 32
# Dict slot, key, Verdict object and its small fields, counted against the bound with the payload.
ENTRY_OVERHEAD = 320
# Bump when the meaning of a cached verdict changes, so no old entry is read with new eyes.
_FORMAT = 1
# How often a request waits for other requests' leads of its keys before it decodes them itself.
FOLLOW_ROUNDS = 3


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
    found: list[bytes] = []
    for n, item in enumerate(items):
        for earlier in range(n):
            if _same_payload(body, items[earlier], item):
                found.append(found[earlier])
                break
        else:
            found.append(_digest(body, item))
    return found


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


@dataclass(frozen=True, slots=True)
class LookedUp:
    """What a look-up (``MediaCache.look_up``) found of some items: each item's key, in the items' order; the keys
    still missing, each once, in that order; and those of them the request now leads, where no other request
    does."""

    keys: list[bytes]
    misses: list[bytes]
    leads: list[bytes]


def media_digest(data: bytes | memoryview, encoding: Encoding) -> bytes:
    """The content address of ``data``: base64 text of inline media, or the raw bytes of fetched media."""
    hasher = new_hasher(encoding)
    hasher.update(data)
    return hasher.digest()


def settings_fingerprint(settings: Settings) -> str:
    """Every setting that changes what a media item becomes (``verdict_settings``: the workers' policies, the item
    limit, the model), with the entries' format."""
    return f"v{_FORMAT};" + ";".join(f"{name}={value!r}" for name, value in verdict_settings(settings))


def context_fingerprint(settings_print: str, kind: str, audio_format: str | None, extra: str = "") -> bytes:
    """What a key adds to the media digest: the settings, how the part asks to be read, and ``extra`` (a
    fetched body's declared type, which names an audio file's type when its bytes do not)."""
    text = "\x1f".join((settings_print, kind, audio_format or "", extra))
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()[:16]


def cache_key(digest: bytes, context: bytes) -> bytes:
    return digest + context


def entry_bytes(verdict: Verdict) -> int:
    """What an entry holds, for the byte bound: its payload, key and a fixed overhead."""
    held = len(verdict.encoded or b"") + len(verdict.mime) + len(verdict.sniffed_mime)
    if verdict.refusal is not None:
        held += len(verdict.refusal.message) + len(verdict.refusal.code)
    return held + ENTRY_OVERHEAD + DIGEST_BYTES + 16


def refused(error: MediaError, size_in: int) -> Verdict:
    return Verdict(size_in, size_in, refusal=Refusal(error.status, error.code, error.message))


class MediaCache:
    """LRU of verdicts bounded by bytes, with single-flight leads. Runs on the event loop only.

    ``on_hit``, ``on_miss``, ``on_evict`` feed the Prometheus counters; ``bytes_held`` and ``entries`` are
    read by the gauges at scrape time."""

    def __init__(self, max_bytes: int, settings_print: str, hash_threads: int = 2,
                 on_hit: Callable[[], None] = lambda: None, on_miss: Callable[[], None] = lambda: None,
                 on_evict: Callable[[], None] = lambda: None) -> None:
        self.max_bytes = max_bytes
        self.settings_print = settings_print
        self.bytes_held = 0
        self.waiting = 0  # requests waiting for another request's decode of the same media
        self._entries: OrderedDict[bytes, Verdict] = OrderedDict()
        self._leads: dict[bytes, asyncio.Future[Verdict | None]] = {}
        # Hashing is media work: its threads yield the CPU to the event loop, as decode threads do.
        self.hasher = ThreadPoolExecutor(max(1, hash_threads), thread_name_prefix="mmgate-hash",
                                         initializer=lower_priority)
        self.count_hit, self.count_miss, self._count_evict = on_hit, on_miss, on_evict
        # With several front processes: what the other fronts' caches hold of some keys (``Fleet.share_cache``).
        self.peers: Callable[[list[bytes]], Awaitable[dict[bytes, Verdict]]] | None = None

    @property
    def entries(self) -> int:
        return len(self._entries)

    def context(self, kind: str, audio_format: str | None, extra: str = "") -> bytes:
        return context_fingerprint(self.settings_print, kind, audio_format, extra)

    async def _keys(self, items: Sequence[MediaItem], body: BodyRef) -> list[bytes]:
        """Every item's key: its payload's digest joined with its context."""
        # A fetched body's declared type joins its key: it names an audio file's type when its bytes do not.
        return [cache_key(digest, self.context(item.kind, item.audio_format, item.fetched_mime))
                for item, digest in zip(items, await digests(self.hasher, items, body), strict=True)]

    async def look_up(self, items: Sequence[MediaItem], body: BodyRef, verdicts: dict[bytes, Verdict], *,
                      may_wait: bool) -> LookedUp:
        """Key ``items`` and fill ``verdicts`` with what this cache holds of them, and with several front processes
        what the other fronts' caches hold of the rest (``peers``). Waits for the leaders of keys being decoded
        now only when ``may_wait`` (``follow``)."""
        keys = await self._keys(items, body)
        peers = self.peers
        misses, leads = await self.follow(keys, verdicts, may_wait=may_wait, lead=peers is None)
        if misses and peers is not None:  # another front process may have decoded them
            for key, peer_verdict in (await peers(misses)).items():
                self.put(key, peer_verdict)
                verdicts[key] = peer_verdict
            # Again: a lead may have started meanwhile.
            misses, leads = await self.follow(keys, verdicts, may_wait=may_wait, lead=True)
        return LookedUp(keys, misses, leads)

    def get(self, key: bytes) -> Verdict | None:
        verdict = self._entries.get(key)
        if verdict is not None:
            self._entries.move_to_end(key)
        return verdict

    def put(self, key: bytes, verdict: Verdict) -> None:
        """Keep ``verdict``, evicting the least recently used entries past the bound. A verdict bigger than
        the whole bound is not kept."""
        size = entry_bytes(verdict)
        if size > self.max_bytes:
            return
        old = self._entries.pop(key, None)
        if old is not None:
            self.bytes_held -= entry_bytes(old)
        self._entries[key] = verdict
        self.bytes_held += size
        while self.bytes_held > self.max_bytes:
            _, evicted = self._entries.popitem(last=False)
            self.bytes_held -= entry_bytes(evicted)
            self._count_evict()

    def in_flight(self, key: bytes) -> asyncio.Future[Verdict | None] | None:
        """The future of the request now deciding ``key``, if one is."""
        return self._leads.get(key)

    def lead(self, key: bytes) -> bool:
        """Claim ``key`` for this request; False when another request leads it already."""
        if key in self._leads:
            return False
        self._leads[key] = asyncio.get_running_loop().create_future()
        return True

    def settle(self, key: bytes, verdict: Verdict | None) -> None:
        """End a lead: keep ``verdict`` and hand it to the waiters, or tell them (None) to look again."""
        future = self._leads.pop(key, None)
        if verdict is not None:
            self.put(key, verdict)
        if future is not None and not future.done():
            future.set_result(verdict)

    async def follow(self, keys: list[bytes], verdicts: dict[bytes, Verdict], *, may_wait: bool,
                     lead: bool) -> tuple[list[bytes], list[bytes]]:
        """Fill ``verdicts`` with what the cache holds of ``keys``; while other requests lead some of the rest
        (and ``may_wait``), wait for them and look again (at most ``FOLLOW_ROUNDS`` times). The keys still
        missing, each once, in order, and (with ``lead``) those of them this request now leads. Leads nothing
        before its last look, so it can wait on anyone."""
        for round_ in range(FOLLOW_ROUNDS + 1):
            missing: list[bytes] = []
            waits: set[asyncio.Future[Verdict | None]] = set()
            for key in dict.fromkeys(keys):
                if key in verdicts:
                    continue
                verdict = self.get(key)
                if verdict is not None:
                    verdicts[key] = verdict
                    continue
                missing.append(key)
                future = self.in_flight(key)
                if future is not None:
                    waits.add(future)
            if not waits or not may_wait or round_ == FOLLOW_ROUNDS:
                return missing, [key for key in missing if self.lead(key)] if lead else []
            # asyncio.wait never cancels what it waits for: a waiter that leaves does not stop its leader.
            self.waiting += 1
            try:
                await asyncio.wait(waits)
            finally:
                self.waiting -= 1
        raise AssertionError("unreachable")

    def settle_decoded(self, decoded: dict[bytes, Verdict]) -> None:
        """Settle each key a decode answered (each a miss of the cache's)."""
        # A copy taken in one C call: after a timeout, a worker still running may add to ``decoded`` meanwhile.
        for key, verdict in list(decoded.items()):
            self.count_miss()
            self.settle(key, verdict)

    def give_up(self, keys: Iterable[bytes]) -> None:
        """End the leads of ``keys`` that did not finish: their waiters look again."""
        for key in keys:
            self.settle(key, None)

    def close(self) -> None:
        self.hasher.shutdown(wait=False, cancel_futures=True)
        self.give_up(list(self._leads))


class NoCache:
    """The cache's place when MMGATE_CACHE_MB is 0: holds nothing, so every look-up misses and every key is led
    by the request that asks (each item gets a key of its own, nothing is hashed: ``look_up``)."""

    waiting = 0
    bytes_held = 0
    entries = 0
    peers: Callable[[list[bytes]], Awaitable[dict[bytes, Verdict]]] | None = None

    def __init__(self) -> None:
        # Kept as given, though no key is made from it (the served model's fingerprint, ``app._put_in_force``).
        self.settings_print = ""

    async def look_up(self, items: Sequence[MediaItem], body: BodyRef, verdicts: dict[bytes, Verdict], *,
                      may_wait: bool) -> LookedUp:
        """Nothing is hashed: each item is keyed by itself, so no two items share a key; each is missing, and
        led by this request."""
        keys = [item.own_key for item in items]
        missing = [key for key in keys if key not in verdicts]
        return LookedUp(keys, missing, list(missing))

    def get(self, key: bytes) -> Verdict | None:
        return None

    def in_flight(self, key: bytes) -> asyncio.Future[Verdict | None] | None:
        return None

    def lead(self, key: bytes) -> bool:
        return True

    def settle(self, key: bytes, verdict: Verdict | None) -> None:
        pass

    def settle_decoded(self, decoded: dict[bytes, Verdict]) -> None:
        pass

    def give_up(self, keys: Iterable[bytes]) -> None:
        pass

    def put(self, key: bytes, verdict: Verdict) -> None:
        pass

    def count_hit(self) -> None:
        pass

    def count_miss(self) -> None:
        pass

    def close(self) -> None:
        pass


VerdictCache = MediaCache | NoCache
