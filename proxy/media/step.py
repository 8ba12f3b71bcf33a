"""The media step: every item of a plan decoded, checked and maybe rewritten once, behind the gate, on the
decode pool (threads or worker processes), and turned into replacements for ``buffers.MediaBuffer.splice``.

``MediaStep`` is built once per app with what the step uses (the cache, the pool, the gate, the fetcher, the
metrics, the policies and limits, the served model); ``MediaStep.run`` takes one request's plan and body and
returns a ``MediaResult``: the lease it was admitted with, the replacements, the media bytes in and out. Once
admitted, whatever goes wrong gives the lease back (only once the work it stands for has stopped) and is
raised. The pipeline keeps what it owns: the queue place (``Gate.acquire`` uses it up) and the response.

One way through, whether the cache is on or off (off: ``cache.NoCache``, which holds nothing) and wherever an
item's bytes come from (``MediaItem.source``: inline base64, or a fetched URL):

1. **Judge by the header** every inline image its header decides (header validation, nothing to resize:
   ``job.judge_head``), here on the loop from the head of its base64: hashing it would cost more than judging
   it, so it is never keyed, cached or sent to the pool. It is weighed at the gate all the same. Each inline
   image's base64 is read at its ends once (``dataurl.Base64Ends``), for this judge and, where images are
   resized, for the header of each image it did not decide (``header.inline_header``), read once for the bound
   below and the served model's plan of its resize.
2. **Bound what is forwarded** (``forwarded.estimate``): what each image mmgate will rewrite becomes, from its
   header, the resize and the handoff format. A body that would be forwarded over MMGATE_MAX_BODY_MB is
   refused here, 413 ``body_too_large``, with nothing hashed, admitted or decoded: what mmgate sends upstream
   is bounded as what it receives is.
3. **Key** every other inline item (``cache.MediaCache.look_up``: the payload's digest and the item's context).
4. **Look up.** A cached verdict is a hit. A key another request is deciding is waited for *before* this
   request leads anything, so two requests can never wait on each other. A leader that stopped for a reason not
   the media's settles its key with None and the waiter looks again (at most ``cache.FOLLOW_ROUNDS`` times, then
   decodes for itself). With several front processes a miss is asked of the other fronts' caches. A cached
   refusal refuses the request here, with nothing decoded or admitted.
5. **Lead and admit.** Every inline key still missing is led (a key twice in one request is decoded once),
   then the gate weighs what the request will hold: each miss's decoded bytes, once, and every rewritten
   item's forwarded base64 (a miss's from its header, a hit's exactly: a cached rewrite weighs what it
   forwards), and each URL item at the per-item cap: a URL's bytes are unknown until read, and they are read
   only once admitted, so the cap bounds what the fetch may bring in.
6. **Fetch** the URL items (``fetch.fetcher``), then key them by the bytes fetched (the raw bytes and their
   declared type) and look them up as in step 3: a hit, or a key another request is deciding, is not decoded
   again, so two identical first fetches decode once. Waiting is safe only while this request leads nothing;
   a request that already leads inline keys decodes such a fetched key itself rather than risk two requests
   waiting on each other. (A fetched key's leader is past the gate and past every wait of its own, so a
   waiter that holds a slot waits only on work already running.) The lease then weighs only what is still a
   miss and what is forwarded (``Lease.lower``, which never raises it), and the body is bounded again with
   the fetched items' headers, before any decode.
7. **Decode** the misses in one batch within MMGATE_PREPROCESS_TIMEOUT; each finished item settles its key,
   the refusal included, even when another item failed or the deadline passed. If the batch fails, the lease
   is given back only once its work has really stopped: a slot freed earlier would let more decode work run
   than the gate allows.
8. **Apply** each verdict to its item (``MediaItem.apply``: what it makes of the item) and count the items; the
   body's exact new size is checked against MMGATE_MAX_BODY_MB before it is spliced (a lossy encoder can pass
   the header's bound on noise).

Items are values (``payload.item``): the step keeps what it decides in its own tables, each item's key by plan
index and each key's verdict, and a URL item comes back from the fetch as a new item with its body.

The request's body has one owner (``buffers.MediaBuffer``); hashes and jobs reach it through a weak reference
only, so a request that ended stops them instead of being kept alive by them.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from functools import partial

from preprocessors.base import AudioPolicy, ImagePolicy, VideoPolicy
from preprocessors.dataurl import Base64Ends
from preprocessors.errors import BODY_TOO_LARGE, PREPROCESS_TIMEOUT, MediaError, MmgateError
from preprocessors.header import Header, fetched_header, inline_header
from preprocessors.job import MediaJob, MediaTask, Verdict, judge_head, with_planned_targets
from preprocessors.pool import Batch, DecodePool
from proxy.admission.client import GateClient, GateLease, GatePlace
from proxy.admission.flows import Flow
from proxy.edge.buffers import MediaBuffer
from proxy.fetch.fetcher import Fetcher, fetch_items
from proxy.media.cache import VerdictCache, refused
from proxy.media.forwarded import ForwardEstimate, estimate
from proxy.media.model import Model
from proxy.ops.metrics import Metrics, Stopwatch
from proxy.payload.item import BodyRef, MediaItem
from proxy.payload.locate import Plan
from proxy.payload.rawjson import Span


@dataclass(frozen=True, slots=True)
class MediaResult:
    """What the media step hands the pipeline: the lease the request holds, the body's new tokens, the media
    bytes seen in and out, and (with MMGATE_MODEL) what the probed clips make in video tokens."""

    lease: GateLease
    replacements: list[tuple[Span, bytes]]
    media_in: int
    media_out: int
    video_tokens: int = 0


@dataclass(frozen=True, slots=True)
class Policies:
    """What every item's decode task is checked against (from the settings)."""

    max_item_bytes: int
    image: ImagePolicy
    audio: AudioPolicy
    video: VideoPolicy


@dataclass(frozen=True, slots=True)
class _UrlItems:
    """The URL items to fetch, and the fetcher that reads them: a plan has some only with
    MMGATE_MEDIA_URLS=fetch, the only mode that builds a fetcher."""

    fetcher: Fetcher
    items: list[MediaItem]


@dataclass(slots=True)
class MediaStep:
    """The media step of every request (see the module's docstring)."""

    cache: VerdictCache
    pool: DecodePool
    gate: GateClient
    fetcher: Fetcher | None  # MMGATE_MEDIA_URLS=fetch
    metrics: Metrics
    policies: Policies
    queue_timeout: float
    preprocess_timeout: float
    model: Model | None  # MMGATE_MODEL: the probed clips' video tokens
    max_body_bytes: int  # MMGATE_MAX_BODY_MB: bounds the body forwarded as it bounds the body received

    async def run(self, plan: Plan, media: MediaBuffer, *, place: GatePlace | None, flow: Flow, image_tokens: int,
                  watch: Stopwatch, fetched: list[int]) -> MediaResult:
        """Admit ``plan`` weighing only its misses, fetch its URLs (``fetched[0]`` grows by the bytes read),
        decode the misses once, and return the lease and the replacements. The stages' times go to
        ``watch``. Those two are the request's meters, not results: a refused request's access log line shows
        the bytes it fetched and the time each stage took before the refusal, and a refusal returns no
        ``MediaResult``."""
        body = weakref.ref(media)
        items = plan.items
        urls = self._url_items(items)
        inline = [item for item in items if item.source == "inline"]
        keys: dict[int, bytes] = {}  # each item's key, by plan index: its cache key, or one of its own
        verdicts: dict[bytes, Verdict] = {}  # by key: what the header judge, the cache or the decode decided
        leading: list[bytes] = []  # the keys this request leads: settled when it decodes them, given up otherwise
        try:
            started = time.perf_counter()
            # Each inline image's header is read once, here: its ends are let go before the first await.
            ends = {item.index: Base64Ends(item.payload(body)) for item in inline if item.kind == "image"}
            judged_by_header = self._judge_heads(plan, inline, ends, keys, verdicts)
            inline = [item for item in inline if item.index not in keys]
            # Read after the judge: an image it decided is forwarded as it came, and needs no more of its header.
            headers = {item.index: inline_header(ends[item.index]) for item in inline
                       if item.index in ends} if self.policies.image.resizes else {}
            del ends
            forward = estimate(inline, headers, len(media.data), self.policies.image)
            self._bound_forward(plan, forward)
            misses = await self._look_up(inline, body, keys, verdicts, leading, may_wait=True)
            self._refuse_cached(plan, inline, keys, verdicts)
            watch.add("preprocess", time.perf_counter() - started)

            # From the last look (which leads the misses) to the gate nothing awaits: a leader is in line before
            # any request that could wait on it.
            started = time.perf_counter()
            judged_weight = sum(item.weight for item in judged_by_header)
            url_cost = sum(item.weight for item in urls.items) if urls is not None else 0
            lease = await self.gate.acquire(judged_weight + _weight(inline, keys, misses, verdicts, forward) + url_cost,
                                            self.queue_timeout, place, image_tokens, flow)
            watch.add("queue", time.perf_counter() - started)
            try:
                if urls is not None:
                    read = await self._fetch(urls, watch, fetched)
                    started = time.perf_counter()
                    by_index = {item.index: item for item in read}
                    items = [by_index.get(item.index, item) for item in items]  # each URL item with its body
                    misses += await self._look_up(read, body, keys, verdicts, leading, may_wait=not leading)
                    self._refuse_cached(plan, read, keys, verdicts)
                    headers.update({item.index: fetched_header(item.fetched) for item in read
                                    if item.kind == "image" and item.fetched is not None})
                    fetched_forward = estimate(read, headers, 0, self.policies.image)
                    forward.replaced.update(fetched_forward.replaced)
                    forward.token_bytes.update(fetched_forward.token_bytes)
                    self._bound_forward(plan, forward)
                    lease.lower(judged_weight + _weight(items, keys, misses, verdicts, forward))
                    watch.add("preprocess", time.perf_counter() - started)
                if misses:
                    started = time.perf_counter()
                    try:
                        await self._decode(lease, plan, _first_of_each(items, keys, misses), body, headers, keys,
                                           verdicts)
                    finally:
                        watch.add("preprocess", time.perf_counter() - started)
                for _hit in range(len(items) - len(misses) - len(judged_by_header)):  # every item the cache answered
                    self.cache.count_hit()
                return self._result(plan, lease, items, keys, verdicts, body, forward.received)
            except BaseException:
                lease.release()
                raise
        except BaseException:
            self.cache.give_up(leading)  # whatever did not finish: the waiters look again
            raise

    def count_urls(self, urls: list[MediaItem]) -> None:
        """URL items are forwarded as they are (MMGATE_MEDIA_URLS=forward): counted, never fetched."""
        for item in urls:
            self.metrics.media_items.labels(item.kind, "url").inc()

    def task(self, item: MediaItem) -> MediaTask:
        """The item's decode task: plain data, the same for the same item whichever request carried it."""
        policies = self.policies
        return MediaTask(
            kind=item.kind, path=item.path, max_bytes=policies.max_item_bytes, image_policy=policies.image,
            audio_policy=policies.audio, audio_format=item.audio_format,
            fetched_mime=item.fetched_mime if item.fetched is not None else None, video_policy=policies.video,
        )

    def _url_items(self, items: list[MediaItem]) -> _UrlItems | None:
        if self.fetcher is None:
            return None
        urls = [item for item in items if item.source == "fetched"]
        return _UrlItems(self.fetcher, urls) if urls else None

    def _planned(self, item: MediaItem, header: Header | None) -> MediaTask:
        """The item's task, with the served model's answers for its image where its ``header`` (an inline
        image's, or a fetched body's) says its size (``job.with_planned_targets``)."""
        task = self.task(item)
        if task.kind != "image" or task.image_policy.geometry is None:
            return task
        return with_planned_targets(task, header.dimensions if header is not None else None)

    def _job(self, item: MediaItem, body: BodyRef, header: Header | None) -> MediaJob:
        """The item as a job for either pool: its task, planned from its ``header`` (``_planned``), and its payload
        read on demand (``MediaItem.payload``)."""
        return MediaJob(self._planned(item, header), partial(item.payload, body))

    def _judge_heads(self, plan: Plan, inline: list[MediaItem], ends: dict[int, Base64Ends], keys: dict[int, bytes],
                     verdicts: dict[bytes, Verdict]) -> list[MediaItem]:
        """The inline images whose header alone decides them (``job.judge_head``), judged here on the loop from
        the ``ends`` of their base64: nothing to hash, cache or decode. Each gets a key of its own in ``keys``
        and its verdict; a refusal refuses the request."""
        judged_by_header = []
        for item in inline:
            if item.index not in ends:
                continue
            try:
                verdict = judge_head(self.task(item), ends[item.index])
            except MediaError:
                self._count_items(plan.items, "rejected")
                raise
            if verdict is not None:
                keys[item.index] = item.own_key
                verdicts[item.own_key] = verdict
                judged_by_header.append(item)
        return judged_by_header

    async def _look_up(self, items: Sequence[MediaItem], body: BodyRef, keys: dict[int, bytes],
                       verdicts: dict[bytes, Verdict], leading: list[bytes], *, may_wait: bool) -> list[bytes]:
        """Key ``items`` into ``keys`` and fill ``verdicts`` from the cache (``cache.MediaCache.look_up``); return the
        keys still missing, and add those this request now leads to ``leading``."""
        found = await self.cache.look_up(items, body, verdicts, may_wait=may_wait)
        keys.update(zip((item.index for item in items), found.keys, strict=True))
        leading += found.leads
        return found.misses

    def _bound_forward(self, plan: Plan, forward: ForwardEstimate) -> None:
        """413 ``body_too_large`` for a body that would be forwarded over MMGATE_MAX_BODY_MB once its images
        are rewritten, judged from their headers: nothing of it is hashed, admitted or decoded."""
        bound = forward.body_bytes
        if bound <= self.max_body_bytes:
            return
        self._count_items(plan.items, "rejected")
        # The body as received is within the limit (``body.read_body``): only rewritten items take it past.
        rewritten = [item for item in plan.items if forward.of(item.index)]
        largest = max(rewritten, key=lambda item: forward.of(item.index))
        raise BODY_TOO_LARGE.error(
            f"the request would be forwarded as up to {bound} bytes ({bound / 2**20:.1f} MiB) once its "
            f"{len(rewritten)} rewritten item(s) are resized and re-encoded for the backend (judged from their "
            f"headers; the largest is {forward.of(largest.index)} bytes of base64), over the limit of "
            f"{self.max_body_bytes} bytes ({self.max_body_bytes / 2**20:g} MiB, MMGATE_MAX_BODY_MB); send fewer "
            "or smaller images", param=largest.path)

    def _refuse_cached(self, plan: Plan, items: Sequence[MediaItem], keys: dict[int, bytes],
                       verdicts: dict[bytes, Verdict]) -> None:
        """A cached refusal refuses the request again, nothing decoded."""
        for item in items:
            verdict = verdicts.get(keys[item.index])
            if verdict is not None and verdict.refusal is not None:
                self.cache.count_hit()
                self._count_items(plan.items, "rejected")
                raise verdict.refusal.error().at(item.path)

    async def _fetch(self, urls: _UrlItems, watch: Stopwatch, fetched: list[int]) -> list[MediaItem]:
        """Every URL item with its bytes read (concurrently; the first refusal cancels the rest)."""
        started = time.perf_counter()
        try:
            return await fetch_items(urls.fetcher, urls.items, self.policies.max_item_bytes, fetched)
        finally:
            watch.add("fetch", time.perf_counter() - started)

    async def _decode(self, lease: GateLease, plan: Plan, missed: list[MediaItem], body: BodyRef,
                      headers: dict[int, Header | None], keys: dict[int, bytes],
                      verdicts: dict[bytes, Verdict]) -> None:
        """Decode ``missed`` on the pool, each planned from its header where one was read; settle each key as its
        item finishes (refusals too)."""
        cache = self.cache
        batch = self.pool.batch()
        done: dict[bytes, Verdict] = {}  # filled in the decode threads: a dict store is atomic

        def record(index: int, future: Future[Verdict]) -> None:
            if future.cancelled():
                return
            item = missed[index]
            error = future.exception()
            if error is None:
                done[keys[item.index]] = future.result()
            elif isinstance(error, MediaError):  # the media's own fault: kept, so it is refused again undecoded
                done[keys[item.index]] = refused(error, item.size)

        jobs = [self._job(item, body, headers.get(item.index)) for item in missed]
        try:
            await batch.run(jobs, self.preprocess_timeout, record)
        except (MediaError, TimeoutError) as exc:
            # Raised from inside the clause, which unbinds ``exc``: a local holding it would make a cycle through
            # the traceback's frames that keeps the request's body alive until a GC pass.
            lease.release_after(batch.stopped())
            cache.settle_decoded(done)
            raise self._refusal_for(plan, batch, exc) from None
        except BaseException:
            lease.release_after(batch.stopped())
            cache.settle_decoded(done)
            raise
        cache.settle_decoded(done)
        verdicts.update(done)

    def _refusal_for(self, plan: Plan, batch: Batch, exc: MediaError | TimeoutError) -> MmgateError:
        """What the client is told when an item was bad or the deadline passed; the items are counted by why."""
        if isinstance(exc, MediaError):
            self._count_items(plan.items, "rejected")
            return exc
        self._count_items(plan.items, "timeout")
        timeout = self.preprocess_timeout
        if batch.started == 0:  # every decode worker stayed busy: not the client's media at fault
            return PREPROCESS_TIMEOUT.error(f"no decode worker became free within {timeout:g} s "
                                            "(MMGATE_PREPROCESS_TIMEOUT): the proxy is overloaded, retry later")
        # Slow media, a stalled or starved worker, a busy machine: the deadline cannot tell which, so it names
        # itself and blames nobody.
        return PREPROCESS_TIMEOUT.error(f"media preprocessing did not finish within the {timeout:g} s deadline "
                                        "(MMGATE_PREPROCESS_TIMEOUT); the work was stopped and nothing was forwarded")

    def _result(self, plan: Plan, lease: GateLease, items: list[MediaItem], keys: dict[int, bytes],
                verdicts: dict[bytes, Verdict], body: BodyRef, received: int) -> MediaResult:
        """Each verdict applied to its item, the items counted, and what the pipeline needs of them; 413 for a
        body whose rewritten items make it, exactly, larger than MMGATE_MAX_BODY_MB."""
        metrics, model = self.metrics, self.model
        replacements: list[tuple[Span, bytes]] = []
        media_in = media_out = video_tokens = 0
        for item in items:
            applied = item.apply(verdicts[keys[item.index]], partial(_text, item, body))
            media_in += applied.size_in
            media_out += applied.size_out
            if applied.video is not None and model is not None and model.counts_video:
                try:
                    video_tokens += model.video_tokens(*applied.video)
                except MediaError as error:
                    raise error.at(item.path) from None
            if applied.true_mime:
                metrics.media_type_corrected.labels(item.kind).inc()
            metrics.media_items.labels(item.kind, applied.outcome).inc()
            replacements += applied.replacements
        forwarded = received + sum(len(token) - (span.end - span.start) for span, token in replacements)
        if forwarded > self.max_body_bytes:
            self._count_items(plan.items, "rejected")
            raise BODY_TOO_LARGE.error(
                f"the request's media, resized and re-encoded for the backend, make a body of {forwarded} bytes "
                f"({forwarded / 2**20:.1f} MiB), over the limit of {self.max_body_bytes} bytes "
                f"({self.max_body_bytes / 2**20:g} MiB, MMGATE_MAX_BODY_MB); send fewer or smaller images")
        metrics.media_bytes.labels("in").inc(media_in)
        metrics.media_bytes.labels("out").inc(media_out)
        return MediaResult(lease, replacements, media_in, media_out, video_tokens)

    def _count_items(self, items: list[MediaItem], outcome: str) -> None:
        for item in items:
            self.metrics.media_items.labels(item.kind, outcome).inc()


def _first_of_each(items: Sequence[MediaItem], keys: dict[int, bytes], wanted: list[bytes]) -> list[MediaItem]:
    """For each of the ``wanted`` keys, the first item that has it: the one decoded for all."""
    first: dict[bytes, MediaItem] = {}
    for item in items:
        first.setdefault(keys[item.index], item)
    return [first[key] for key in wanted if key in first]


def _weight(items: Sequence[MediaItem], keys: dict[int, bytes], misses: list[bytes], verdicts: dict[bytes, Verdict],
            forward: ForwardEstimate) -> int:
    """What the gate weighs: the decoded bytes of each missing key, once, and the base64 every item is
    forwarded as in place of its own (each occurrence: each is a token of its own in the spliced body): a
    miss's from its header, a hit's from its verdict."""
    forwarded = 0
    for item in items:
        verdict = verdicts.get(keys[item.index])
        if verdict is None:
            forwarded += forward.of(item.index)
        elif verdict.encoded is not None:
            forwarded += len(verdict.encoded)
    return sum(item.weight for item in _first_of_each(items, keys, misses)) + forwarded


def _text(item: MediaItem, body: BodyRef) -> bytes:
    """The inline item's own base64, as sent: rewrites a whole escaped token without decoding (its
    characters are the base64 alphabet only, as the strict decode accepted them)."""
    return bytes(item.payload(body))
