"""The media step: every item of a plan decoded, checked and maybe rewritten once, behind the gate, on the
decode pool (threads or worker processes), and turned into replacements for ``rawjson.splice``.

One way through, whether the cache is on or off (off: ``cache.NoCache``, which holds nothing) and wherever an
item's bytes come from (``pieces.Piece.source``: inline base64, or a fetched URL):

1. **Judge by the header** every inline image its header decides (header validation, nothing to resize:
   ``job.judge_head``), here on the loop from the head of its base64: hashing it would cost more than judging
   it, so it is never keyed, cached or sent to the pool. It is weighed at the gate all the same.
2. **Key** every other inline item (``pieces.key_pieces``: the payload's digest and the part's context).
3. **Look up.** A cached verdict is a hit. A key another request is deciding is waited for *before* this
   request leads anything, so two requests can never wait on each other. A leader that stopped for a reason not
   the media's settles its key with None and the waiter looks again (at most ``FOLLOW_ROUNDS`` times, then
   decodes for itself). With several front processes a miss is asked of the other fronts' caches. A cached
   refusal refuses the request here, with nothing decoded or admitted.
4. **Lead and admit.** Every inline key still missing is led (a key twice in one request is decoded once),
   then the gate weighs those misses and each URL item at the per-item cap: a URL's bytes are unknown until
   read, and they are read only once admitted, so the cap bounds what the fetch may bring in. Hits hold a
   slot (the request is still forwarded) but nothing of the byte budget.
5. **Fetch** the URL items (``fetch.fetcher``), then key them by the bytes fetched (the raw bytes and their
   declared type) and look them up as in step 3: a hit, or a key another request is deciding, is not decoded
   again, so two identical first fetches decode once. Waiting is safe only while this request leads nothing;
   a request that already leads inline keys decodes such a fetched key itself rather than risk two requests
   waiting on each other. (A fetched key's leader is past the gate and past every wait of its own, so a
   waiter that holds a slot waits only on work already running.) The lease then weighs only what is still a
   miss (``Lease.lower``): a fetched hit costs nothing at the gate once its bytes are known.
6. **Decode** the misses in one batch within MMGATE_PREPROCESS_TIMEOUT (``outcomes.media_job``); each
   finished item settles its key, the refusal included, even when another item failed or the deadline passed.
   If the batch fails, the lease is given back only once its work has really stopped: a slot freed earlier
   would let more decode work run than the gate allows.
7. **Apply** each verdict to its part (``outcomes.outcome_for``) and count the items.

The request's body has one owner (``buffers.MediaBuffer``); hashes and jobs reach it through a weak reference
only, so a request that ended stops them instead of being kept alive by them.
"""

from __future__ import annotations

import asyncio
import time
import weakref
from collections.abc import Sequence
from concurrent.futures import Future
from functools import partial

from preprocessors.errors import MediaError
from preprocessors.job import Verdict, judge_head
from proxy.admission.client import GateLease
from proxy.exchange import Exchange
from proxy.fetch.fetcher import fetch_plan
from proxy.media.buffers import MediaBuffer
from proxy.media.cache import VerdictCache, refused
from proxy.media.outcomes import Rewrites, count_items, media_job, outcome_for, refusal_for, rewrites_for
from proxy.media.pieces import BodyRef, Piece, key_pieces
from proxy.payload.locate import Plan
from proxy.state import AppState

FOLLOW_ROUNDS = 3


async def run_media_step(state: AppState, ex: Exchange, plan: Plan, media: MediaBuffer) -> Rewrites:
    """Admit ``plan`` (into ``ex.lease``) weighing only its misses, fetch its URLs, decode the misses once,
    and return the replacements."""
    cache = state.cache
    body = weakref.ref(media)
    pieces = [Piece(index, item) for index, item in enumerate(plan.items)]
    inline = [piece for piece in pieces if piece.source == "inline"]
    urls = [piece for piece in pieces if piece.source == "fetched"]
    verdicts: dict[bytes, Verdict] = {}
    led: list[bytes] = []
    try:
        started = time.perf_counter()
        headed = _judge_heads(state, plan, inline, body, verdicts)
        inline = [piece for piece in inline if piece.key not in verdicts]
        await key_pieces(cache, inline, body)
        misses = await _look_up(cache, inline, verdicts, may_wait=True)
        _refuse_cached(state, plan, inline, verdicts)
        # From here to the gate nothing awaits: a leader is in line before any request that could wait on it.
        led += [key for key in misses if cache.lead(key)]
        ex.watch.add("preprocess", time.perf_counter() - started)

        started = time.perf_counter()
        judged = sum(piece.size for piece in headed)
        ex.lease = await state.gate.acquire(judged + _weight(inline, misses) + sum(piece.size for piece in urls),
                                            state.settings.timeouts.queue_timeout, ex.place, ex.image_tokens, ex.flow)
        ex.place = None
        ex.watch.add("queue", time.perf_counter() - started)

        if urls:
            await _fetch(state, ex, plan, urls)
            started = time.perf_counter()
            await key_pieces(cache, urls, body)
            fetched_misses = await _look_up(cache, urls, verdicts, may_wait=not led)
            _refuse_cached(state, plan, urls, verdicts)
            led += [key for key in fetched_misses if cache.lead(key)]
            misses += fetched_misses
            ex.lease.lower(judged + _weight(pieces, misses))
            ex.watch.add("preprocess", time.perf_counter() - started)

        if misses:
            started = time.perf_counter()
            try:
                await _decode(state, ex.lease, plan, _first_of_each(pieces, misses), body, verdicts)
            finally:
                ex.watch.add("preprocess", time.perf_counter() - started)
    finally:
        for key in led:  # whatever did not finish: the waiters look again
            cache.settle(key, None)
    for _hit in range(len(pieces) - len(misses) - len(headed)):  # every item the cache answered
        cache.count_hit()
    outcomes = [outcome_for(piece.item, verdicts[piece.key], partial(piece.text, body)) for piece in pieces]
    return rewrites_for(state, plan, outcomes)


def _judge_heads(state: AppState, plan: Plan, inline: list[Piece], body: BodyRef,
                 verdicts: dict[bytes, Verdict]) -> list[Piece]:
    """The inline images whose header alone decides them (``job.judge_head``), judged here on the loop from the
    head of their base64: nothing to hash, cache or decode. Each gets a key of its own and its verdict; a
    refusal refuses the request."""
    headed = []
    for piece in inline:
        try:
            verdict = judge_head(media_job(state, piece, body).task, piece.payload(body))
        except MediaError:
            count_items(state, plan.items, "rejected")
            raise
        if verdict is not None:
            piece.key = piece.own_key
            verdicts[piece.key] = verdict
            headed.append(piece)
    return headed


async def _look_up(cache: VerdictCache, pieces: Sequence[Piece], verdicts: dict[bytes, Verdict], *,
                   may_wait: bool) -> list[bytes]:
    """Fill ``verdicts`` from the cache (and the other fronts' caches); return the keys still missing, each
    once, in plan order. Waits for the leaders of keys being decoded now only when ``may_wait``."""
    keys = [piece.key for piece in pieces]
    misses = await _follow(cache, keys, verdicts, may_wait)
    if misses and cache.peers is not None:  # another front process may have decoded them
        for key, peer_verdict in (await cache.peers(misses)).items():
            cache.put(key, peer_verdict)
            verdicts[key] = peer_verdict
        misses = await _follow(cache, keys, verdicts, may_wait)  # again: a lead may have started meanwhile
    return misses


async def _follow(cache: VerdictCache, keys: list[bytes], verdicts: dict[bytes, Verdict],
                  may_wait: bool) -> list[bytes]:
    """One look at the cache, and while leaders decode some of the keys (and ``may_wait``), a wait for them
    and another look. Leads nothing, so it can wait on anyone."""
    for round_ in range(FOLLOW_ROUNDS + 1):
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
        if not waits or not may_wait or round_ == FOLLOW_ROUNDS:
            return missing
        # asyncio.wait never cancels what it waits for: a waiter that leaves does not stop its leader.
        cache.waiting += 1
        try:
            await asyncio.wait(waits)
        finally:
            cache.waiting -= 1
    raise AssertionError("unreachable")


def _refuse_cached(state: AppState, plan: Plan, pieces: Sequence[Piece], verdicts: dict[bytes, Verdict]) -> None:
    """A cached refusal refuses the request again, nothing decoded."""
    for piece in pieces:
        verdict = verdicts.get(piece.key)
        if verdict is not None and verdict.refusal is not None:
            state.cache.count_hit()
            count_items(state, plan.items, "rejected")
            raise verdict.refusal.error().at(piece.item.part.path)


def _first_of_each(pieces: Sequence[Piece], keys: list[bytes]) -> list[Piece]:
    """For each key, the first piece that has it: the one decoded for all."""
    first: dict[bytes, Piece] = {}
    for piece in pieces:
        first.setdefault(piece.key, piece)
    return [first[key] for key in keys if key in first]


def _weight(pieces: Sequence[Piece], misses: list[bytes]) -> int:
    """What the gate weighs: the decoded bytes of each missing key, once."""
    return sum(piece.size for piece in _first_of_each(pieces, misses))


async def _fetch(state: AppState, ex: Exchange, plan: Plan, urls: list[Piece]) -> None:
    """Read every URL piece's bytes (concurrently; the first refusal cancels the rest)."""
    fetcher = state.fetcher
    assert fetcher is not None  # a plan holds URL items only with MMGATE_MEDIA_URLS=fetch, which builds it
    started, read = time.perf_counter(), [0]
    try:
        fetched = await fetch_plan(fetcher, plan, state.settings.limits.max_media_item_bytes, read)
    finally:
        ex.watch.add("fetch", time.perf_counter() - started)
        ex.fetched = read[0]
    for piece in urls:
        piece.fetched = fetched.pop(piece.index)


async def _decode(state: AppState, lease: GateLease, plan: Plan, missed: list[Piece], body: BodyRef,
                  verdicts: dict[bytes, Verdict]) -> None:
    """Decode ``missed`` on the pool; settle each key as its piece finishes (refusals too)."""
    cache = state.cache
    batch = state.pool.batch()
    done: dict[bytes, Verdict] = {}  # filled in the decode threads: a dict store is atomic

    def record(index: int, future: Future[Verdict]) -> None:
        if future.cancelled():
            return
        piece = missed[index]
        error = future.exception()
        if error is None:
            done[piece.key] = future.result()
        elif isinstance(error, MediaError):  # the media's own fault: kept, so it is refused again undecoded
            done[piece.key] = refused(error, piece.item.size)

    jobs = [media_job(state, piece, body) for piece in missed]
    try:
        await batch.run(jobs, state.settings.timeouts.preprocess_timeout, record)
    except (MediaError, TimeoutError) as exc:
        # Raised from inside the clause, which unbinds ``exc``: a local holding it would make a cycle through
        # the traceback's frames that keeps the request's body alive until a GC pass.
        lease.release_after(batch.stopped())
        _settle(cache, done)
        raise refusal_for(state, plan, batch, exc) from None
    except BaseException:
        lease.release_after(batch.stopped())
        _settle(cache, done)
        raise
    _settle(cache, done)
    verdicts.update(done)


def _settle(cache: VerdictCache, done: dict[bytes, Verdict]) -> None:
    # A copy taken in one C call: after a timeout, a worker still running may add to ``done`` meanwhile.
    for key, verdict in list(done.items()):
        cache.count_miss()
        cache.settle(key, verdict)
