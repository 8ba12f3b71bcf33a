"""The media step with the cache on (MMGATE_CACHE_MB > 0): look up before admission, decode only misses, once.

1. **Hash** each item's base64 payload (``cache.media_digest`` in pieces, in the cache's hasher threads, so the
   loop only hands the work over; a small payload is hashed in place). The job reaches the body through a weak
   reference, piece by piece, like a decode job: a request that ends stops its hash.
2. **Look up.** A cached verdict is a hit. A key another request is deciding is waited for, *before* this
   request leads anything, so two requests can never wait on each other. A leader that stopped for a reason
   not the media's settles its key with None and the waiter looks again (at most ``FOLLOW_ROUNDS`` times,
   then decodes for itself). A cached refusal refuses the request here, with nothing decoded or admitted.
3. **Lead** every key still missing (a key twice in one request is decoded once) and pass the gate weighing
   only those items: hits hold a slot (the request is still forwarded) but nothing of the byte budget.
4. **Decode** the misses on the pool (``media.media_job``, thread or process); each finished item settles
   its key, the refusal included, even when another item of the batch failed or the deadline passed.
5. **Apply** each verdict to its part (``media.outcome_for``): the same replacements as with the cache off.
"""

from __future__ import annotations

import asyncio
import time
import weakref
from concurrent.futures import Future
from functools import partial

from preprocessors.base import Cancelled
from preprocessors.errors import MediaError
from proxy.exchange import Exchange
from proxy.fetch.fetcher import Fetched
from proxy.media.buffers import MediaBuffer
from proxy.media.cache import (
    HASH_CHUNK,
    HASH_INLINE_BYTES,
    MediaCache,
    Verdict,
    cache_key,
    media_digest,
    new_hasher,
    refused,
)
from proxy.media.step import (
    Rewrites,
    count_items,
    media_job,
    outcome_for,
    payload_text,
    refusal_for,
    rewrites_for,
)
from proxy.media.step import _item_value as item_value
from proxy.payload.locate import Item, Plan
from proxy.state import AppState

FOLLOW_ROUNDS = 3


async def run_plan_cached(state: AppState, ex: Exchange, plan: Plan, media: MediaBuffer,
                          identity: str = "") -> Rewrites:
    """Admit ``plan`` (into ``ex.lease``) weighing only its misses, decode those once, and return the
    replacements, exactly as ``_prepare_media`` would with the cache off. ``identity`` joins every key (e.g.
    the model, where media is processed per model)."""
    cache = state.cache
    assert cache is not None
    settings = state.settings
    started = time.perf_counter()
    media_ref = weakref.ref(media)
    keys = await _keys(cache, plan, media_ref, identity)
    verdicts: dict[bytes, Verdict] = {}
    misses = await _look_up(cache, keys, verdicts)
    if misses and cache.peers is not None:  # another front process may have decoded them
        for key, peer_verdict in (await cache.peers(misses)).items():
            cache.put(key, peer_verdict)
            verdicts[key] = peer_verdict
        misses = await _look_up(cache, keys, verdicts)  # again: a lead may have started here meanwhile
    for item, key in zip(plan.items, keys, strict=True):  # a cached refusal: refused again, nothing decoded
        verdict = verdicts.get(key)
        if verdict is not None and verdict.refusal is not None:
            cache.count_hit()
            count_items(state, plan.items, "rejected")
            raise verdict.refusal.error().at(item.part.path)
    # From here to the gate nothing awaits: a leader is in line before any request that could wait on it.
    led = [key for key in misses if cache.lead(key)]
    ex.watch.add("preprocess", time.perf_counter() - started)
    try:
        first = {key: keys.index(key) for key in misses}
        started = time.perf_counter()
        ex.lease = await state.gate.acquire(sum(plan.items[index].size for index in first.values()),
                                            settings.timeouts.queue_timeout, ex.place, ex.image_tokens, ex.flow)
        ex.place = None
        ex.watch.add("queue", time.perf_counter() - started)
        if first:
            started = time.perf_counter()
            try:
                await _decode(state, ex, plan, media_ref, first, verdicts)
            finally:
                ex.watch.add("preprocess", time.perf_counter() - started)
    finally:
        for key in led:  # whatever did not finish: the waiters look again
            cache.settle(key, None)
    for _hit in range(len(keys) - len(first)):  # every item this request did not decode itself
        cache.count_hit()
    outcomes = [outcome_for(item, verdicts[key], partial(payload_text, media_ref, item))
                for item, key in zip(plan.items, keys, strict=True)]
    return rewrites_for(state, plan, outcomes)


async def run_fetched_plan_cached(state: AppState, ex: Exchange, plan: Plan, media: MediaBuffer,
                                  fetched: dict[int, Fetched]) -> Rewrites:
    """A plan with media URLs (MMGATE_MEDIA_URLS=fetch), once admitted and fetched: every item is looked up by
    its bytes (a fetched body as read, keyed apart from base64 text), only the misses are decoded, and what
    they make is kept. A URL's bytes are unknown until fetched, and it is fetched only once admitted, so here a
    hit saves the decode but not the byte budget, and two first fetches of one image are not merged."""
    cache = state.cache
    assert cache is not None
    media_ref = weakref.ref(media)
    started = time.perf_counter()
    keys = await asyncio.get_running_loop().run_in_executor(cache.hasher, _mixed_keys, cache, plan, media_ref,
                                                            fetched)
    verdicts = {key: verdict for key in keys if (verdict := cache.get(key)) is not None}
    for item, key in zip(plan.items, keys, strict=True):
        verdict = verdicts.get(key)
        if verdict is not None and verdict.refusal is not None:
            cache.count_hit()
            count_items(state, plan.items, "rejected")
            raise verdict.refusal.error().at(item.part.path)
    first: dict[bytes, int] = {}
    for index, key in enumerate(keys):
        if key not in verdicts and key not in first:
            first[key] = index
    ex.watch.add("preprocess", time.perf_counter() - started)
    if first:
        started = time.perf_counter()
        try:
            await _decode(state, ex, plan, media_ref, first, verdicts, fetched)
        finally:
            ex.watch.add("preprocess", time.perf_counter() - started)
    for _hit in range(len(keys) - len(first)):
        cache.count_hit()
    outcomes = [outcome_for(item, verdicts[key], partial(payload_text, media_ref, item))
                for item, key in zip(plan.items, keys, strict=True)]
    return rewrites_for(state, plan, outcomes)


def _mixed_keys(cache: MediaCache, plan: Plan, media_ref: weakref.ref[MediaBuffer],
                fetched: dict[int, Fetched]) -> list[bytes]:
    """In a hasher thread: each item's key, a fetched body by its raw bytes and declared type (which names an
    audio file's type when its bytes do not), inline media by its base64 text."""
    keys = []
    for index, item in enumerate(plan.items):
        part = item.part
        body = fetched.get(index)
        if body is not None:
            digest = media_digest(body.data, "raw")
            keys.append(cache_key(digest, cache.context(part.kind, part.audio_format, body.mime)))
        else:
            keys.append(cache_key(_digest(media_ref, item), cache.context(part.kind, part.audio_format)))
    return keys


async def _keys(cache: MediaCache, plan: Plan, media_ref: weakref.ref[MediaBuffer], identity: str) -> list[bytes]:
    """One key per item, in plan order: the payload's digest and the part's context."""
    if sum(item.size for item in plan.items) * 4 // 3 > HASH_INLINE_BYTES:
        digests = await asyncio.get_running_loop().run_in_executor(cache.hasher, _digests, media_ref, plan.items)
    else:
        digests = _digests(media_ref, plan.items)
    return [cache_key(digest, cache.context(item.part.kind, item.part.audio_format, identity))
            for digest, item in zip(digests, plan.items, strict=True)]


def _digests(media_ref: weakref.ref[MediaBuffer], items: list[Item]) -> list[bytes]:
    """Each item's digest. A payload that repeats an earlier one byte for byte (a chat resending its photo)
    reuses that digest: comparing costs a memcmp, about a ninth of hashing."""
    digests: list[bytes] = []
    for n, item in enumerate(items):
        for earlier in range(n):
            if _same_payload(media_ref, items[earlier], item):
                digests.append(digests[earlier])
                break
        else:
            digests.append(_digest(media_ref, item))
    return digests


def _payload_range(item: Item) -> tuple[int, int] | None:
    """Where an unescaped item's base64 lies in the body; None for an escaped string or a literal."""
    span = item.part.span
    if span is None or span.escaped:
        return None
    return span.start + 1 + item.payload_offset, span.end - 1


def _same_payload(media_ref: weakref.ref[MediaBuffer], first: Item, second: Item) -> bool:
    """Whether two items' base64 payloads are the same bytes, compared a piece at a time (each piece holds the
    GIL for a memcmp only)."""
    a, b = _payload_range(first), _payload_range(second)
    if a is None or b is None or a[1] - a[0] != b[1] - b[0]:
        return False
    for low in range(0, a[1] - a[0], HASH_CHUNK):
        media = media_ref()
        if media is None:
            raise Cancelled()
        data = media.data
        del media
        with memoryview(data) as view:
            if not data.startswith(view[a[0] + low : min(a[0] + low + HASH_CHUNK, a[1])], b[0] + low):
                return False
        del data
    return True


def _digest(media_ref: weakref.ref[MediaBuffer], item: Item) -> bytes:
    """SHA-256 of the item's base64 payload, read from the body a piece at a time (Cancelled once the request
    let go of it). An escaped string is unescaped whole first (rare: base64 needs no escape)."""
    hasher = new_hasher("base64")
    where = _payload_range(item)
    if where is None:
        hasher.update(item_value(media_ref, item))
        return hasher.digest()
    start, end = where
    for low in range(start, end, HASH_CHUNK):
        media = media_ref()
        if media is None:
            raise Cancelled()
        with memoryview(media.data) as view:
            del media
            hasher.update(view[low : min(low + HASH_CHUNK, end)])
    return hasher.digest()


async def _look_up(cache: MediaCache, keys: list[bytes], verdicts: dict[bytes, Verdict]) -> list[bytes]:
    """Fill ``verdicts`` from the cache, waiting for the leaders of keys being decoded now; return the keys
    still missing (each once, in plan order). Leads nothing, so it can wait on anyone."""
    for _round in range(FOLLOW_ROUNDS + 1):
        missing: list[bytes] = []
        waits: set[asyncio.Future[Verdict | None]] = set()
        for key in dict.fromkeys(keys):
            if key in verdicts:
                continue
            verdict = cache.get(key)
            if verdict is not None:
                verdicts[key] = verdict
                continue
            missing.append(key)
            future = cache.in_flight(key)
            if future is not None:
                waits.add(future)
        if not waits or _round == FOLLOW_ROUNDS:
            return missing
        # asyncio.wait never cancels what it waits for: a waiter that leaves does not stop its leader.
        cache.waiting += 1
        try:
            await asyncio.wait(waits)
        finally:
            cache.waiting -= 1
    raise AssertionError("unreachable")


async def _decode(state: AppState, ex: Exchange, plan: Plan, media_ref: weakref.ref[MediaBuffer],
                  first: dict[bytes, int], verdicts: dict[bytes, Verdict],
                  fetched: dict[int, Fetched] | None = None) -> None:
    """Decode the missed items (key → the index of its first item) on the pool; settle each key as its item
    finishes (refusals too). A URL item takes its bytes from ``fetched``."""
    cache = state.cache
    assert cache is not None and state.pool is not None and ex.lease is not None
    batch = state.pool.batch()
    fetched = fetched or {}
    missed = [(key, plan.items[index]) for key, index in first.items()]
    done: dict[bytes, Verdict] = {}  # filled in the decode threads: a dict store is atomic

    def record(index: int, future: Future[Verdict]) -> None:
        if future.cancelled():
            return
        key, item = missed[index]
        error = future.exception()
        if error is None:
            done[key] = future.result()
        elif isinstance(error, MediaError):  # the media's own fault: kept, so it is refused again undecoded
            done[key] = refused(error, item.size)

    jobs = [media_job(state, media_ref, plan.items[index], fetched.pop(index, None)) for index in first.values()]
    try:
        await batch.run(jobs, state.settings.timeouts.preprocess_timeout, record)
    except (MediaError, TimeoutError) as exc:
        # Raised from inside the clause, which unbinds ``exc``: a local holding it would make a cycle through
        # the traceback's frames that keeps the request's body alive until a GC pass.
        ex.lease.release_after(batch.stopped())
        _settle(cache, done)
        raise refusal_for(state, plan, batch, exc) from None
    except BaseException:
        ex.lease.release_after(batch.stopped())
        _settle(cache, done)
        raise
    _settle(cache, done)
    verdicts.update(done)


def _settle(cache: MediaCache, done: dict[bytes, Verdict]) -> None:
    # A copy taken in one C call: after a timeout, a worker still running may add to ``done`` meanwhile.
    for key, verdict in list(done.items()):
        cache.count_miss()
        cache.settle(key, verdict)


