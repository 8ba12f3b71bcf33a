"""Running a media plan on the decode pool: each item decoded, checked and maybe rewritten in a worker
thread; the answers come back as replacements for ``rawjson.splice``.

The request's body has one owner (``buffers.MediaBuffer``) and the jobs reach it through a weak
reference only: a job still queued, or finishing in its thread after the request moved on or ended,
must not keep the bytes alive. Once the owner let go, the next read raises ``Cancelled`` and the job stops.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from preprocessors.audio import sniff_audio_format, validate_audio
from preprocessors.base import Cancelled, Checkpoint
from preprocessors.dataurl import decode_base64, encode_base64
from preprocessors.image import image_mime, process_image
from preprocessors.pool import Batch

from .admission import Lease
from .buffers import MediaBuffer
from .cache import Verdict
from .dialects import MediaPart
from .errors import MediaError, MmgateError
from .fetch import Fetched
from .locate import Item, Plan
from .rawjson import Span, string_value
from .state import AppState


@dataclass(slots=True)
class Outcome:
    """What a worker made of one item: the new JSON string token (None = forward unchanged), its MIME,
    and the decoded sizes in and out (for the media byte counters)."""

    size_in: int
    size_out: int
    token: bytes | None = None
    mime: bytes = b""
    true_mime: bytes = b""  # set when the bytes are not the type the client declared


@dataclass(slots=True)
class Rewrites:
    """What the media step hands back: the body's new tokens and the media bytes seen in and out."""

    replacements: list[tuple[Span, bytes]]
    media_in: int
    media_out: int


async def run_plan(state: AppState, plan: Plan, media: MediaBuffer, lease: Lease,
                   fetched: dict[int, Fetched] | None = None) -> Rewrites:
    """Decode and check every item of ``plan`` on the pool, within MMGATE_PREPROCESS_TIMEOUT; a URL item
    (MMGATE_MEDIA_URLS=fetch) takes its bytes from ``fetched`` (by item index) instead of the body.

    If the batch fails (a bad item, the deadline, the request cancelled) the error goes out at once, but
    ``lease`` is given back only when the batch's work has really stopped: a slot freed earlier would let
    more decode work run than the gate allows."""
    settings = state.settings
    assert state.pool is not None
    batch = state.pool.batch()
    media_ref = weakref.ref(media)
    fetched = fetched or {}
    jobs = [partial(_process_fetched, fetched.pop(i), item, state) if item.part.is_url
            else partial(_process_item, media_ref, item, state) for i, item in enumerate(plan.items)]
    try:
        outcomes = await batch.run(jobs, settings.preprocess_timeout)
    except (MediaError, TimeoutError) as exc:
        lease.release_after(batch.stopped())
        raise _refusal(state, plan, batch, exc) from None
    except BaseException:
        lease.release_after(batch.stopped())
        raise
    return _rewrites(state, plan, outcomes)


def _refusal(state: AppState, plan: Plan, batch: Batch, exc: MediaError | TimeoutError) -> MmgateError:
    """What the client is told when an item was bad or the deadline passed; the items are counted by why."""
    if isinstance(exc, MediaError):
        _count_items(state, plan.items, "rejected")
        return exc
    _count_items(state, plan.items, "timeout")
    timeout = state.settings.preprocess_timeout
    if batch.started == 0:  # every decode worker stayed busy: not the client's media at fault
        return MmgateError(504, "preprocess_timeout",
                           f"no decode worker became free within {timeout:g} s "
                           "(MMGATE_PREPROCESS_TIMEOUT): the proxy is overloaded, retry later")
    return MmgateError(504, "preprocess_timeout",
                       f"media preprocessing took longer than {timeout:g} s "
                       "(MMGATE_PREPROCESS_TIMEOUT): send smaller media")


def _rewrites(state: AppState, plan: Plan, outcomes: list[Outcome]) -> Rewrites:
    metrics = state.metrics
    rewrites = Rewrites([], 0, 0)
    for item, outcome in zip(plan.items, outcomes, strict=True):
        rewrites.media_in += outcome.size_in
        rewrites.media_out += outcome.size_out
        kind = item.part.kind
        if outcome.true_mime:
            metrics.media_type_corrected.labels(kind).inc()
        if outcome.token is None:
            metrics.media_items.labels(kind, "unchanged").inc()
            if outcome.true_mime and item.declared_span is not None:
                rewrites.replacements.append((item.declared_span, _mime_text(item, outcome.true_mime)))
            continue
        metrics.media_items.labels(kind, "rewritten").inc()
        assert item.part.span is not None
        rewrites.replacements.append((item.part.span, outcome.token))
        if item.part.mime_span is not None:
            rewrites.replacements.append((item.part.mime_span, b'"' + outcome.mime + b'"'))
    metrics.media_bytes.labels("in").inc(rewrites.media_in)
    metrics.media_bytes.labels("out").inc(rewrites.media_out)
    return rewrites


def count_urls(state: AppState, plan: Plan) -> None:
    """URL parts are forwarded as they are (MMGATE_MEDIA_URLS=forward): counted, never fetched."""
    for part in plan.urls:
        state.metrics.media_items.labels(part.kind, "url").inc()


def _count_items(state: AppState, items: list[Item], outcome: str) -> None:
    for item in items:
        state.metrics.media_items.labels(item.part.kind, outcome).inc()


def _mime_text(item: Item, mime: bytes) -> bytes:
    """What replaces ``item.declared_span``: a whole JSON string (Anthropic ``media_type``) or, inside a data
    URI, just the type's characters."""
    return mime if item.part.encoding == "data_uri" else b'"' + mime + b'"'


def _item_value(media_ref: weakref.ref[MediaBuffer], item: Item) -> bytes | memoryview:
    """The item's string value (a view into the body when possible); Cancelled once the request let go."""
    media = media_ref()
    if media is None:
        raise Cancelled()
    part = item.part
    if part.span is not None:
        return string_value(media.data, part.span)
    assert part.literal is not None  # a plan holds inline parts only
    return part.literal.encode("utf-8")


def _process_item(media_ref: weakref.ref[MediaBuffer], item: Item, state: AppState,
                  checkpoint: Checkpoint) -> Outcome:
    """In a decode thread: base64 → bytes → ``judge`` → the part's new token (``outcome_for``)."""
    part = item.part
    try:
        value = _item_value(media_ref, item)
        data = decode_base64(value[item.payload_offset :], max_bytes=state.settings.max_media_item_bytes)
        del value
        verdict = judge(data, part.kind, part.audio_format, state, checkpoint)
        return outcome_for(item, verdict, partial(encode_base64, data))
    except MediaError as error:
        raise error.at(part.path) from None


def _process_fetched(fetched: Fetched, item: Item, state: AppState, checkpoint: Checkpoint) -> Outcome:
    """In a decode thread: a fetched body → ``judge``; the URL is always replaced by a data URI, of the
    processed media or, when that needed no change, of the bytes as fetched with their sniffed type."""
    try:
        data = fetched.data
        verdict = judge(data, item.part.kind, item.part.audio_format, state, checkpoint)
        outcome = outcome_for(item, verdict, partial(encode_base64, data))
        if outcome.token is None:
            if item.part.kind == "image":
                mime = verdict.sniffed_mime
            else:  # validated above, so the format is known
                mime = _AUDIO_MIME.get(sniff_audio_format(data) or "", fetched.mime).encode()
            outcome.token, outcome.mime = _token(item.part, mime, encode_base64(data)), mime
        return outcome
    except MediaError as error:
        raise error.at(item.part.path) from None


_AUDIO_MIME = {"wav": "audio/wav", "mp3": "audio/mpeg", "flac": "audio/flac", "ogg": "audio/ogg"}


def judge(data: bytes, kind: str, audio_format: str | None, state: AppState, checkpoint: Checkpoint) -> Verdict:
    """What the settings make of these decoded bytes, whatever part of whichever request carried them: the
    true type, and the re-encoded file when the image is rewritten. Raises ``MediaError`` (no JSON path)."""
    size = len(data)
    checkpoint()
    if kind == "image":
        sniffed = image_mime(data).encode()
        processed = process_image(data, state.image_policy, checkpoint)
        if processed is None:
            return Verdict(size, size, sniffed)
        mime = processed.mime.encode()
        out_size = len(processed.data)
        encoded = encode_base64(processed.data)
        del processed
        return Verdict(size, out_size, sniffed, mime, encoded)
    if kind == "audio":
        validate_audio(data, audio_format, state.audio_policy, checkpoint)
    return Verdict(size, size)  # audio and video are validated / size-checked and forwarded unchanged


def outcome_for(item: Item, verdict: Verdict, original: Callable[[], bytes]) -> Outcome:
    """A verdict applied to one part: its true type against the declared one, and the token to write.
    ``original`` gives the part's media as base64, needed only to rewrite a whole escaped token."""
    part = item.part
    true_mime = verdict.sniffed_mime
    if item.declared_mime.encode() in (true_mime, b""):
        true_mime = b""
    if verdict.encoded is None:
        if true_mime and item.declared_span is None and part.span is not None:
            # The declared type is inside an escaped token: the whole token is written anew.
            return Outcome(verdict.size_in, verdict.size_in, _token(part, true_mime, original()), true_mime,
                           true_mime)
        return Outcome(verdict.size_in, verdict.size_in, true_mime=true_mime)
    if part.span is None:
        return Outcome(verdict.size_in, verdict.size_in, true_mime=true_mime)
    return Outcome(verdict.size_in, verdict.size_out, _token(part, verdict.mime, verdict.encoded), verdict.mime,
                   true_mime)


def _token(part: MediaPart, mime: bytes, encoded: bytes) -> bytes:
    """The JSON string token for rewritten media: a data URI when the client sent one, else bare base64."""
    if part.encoding == "data_uri":
        return b"".join((b'"data:', mime, b";base64,", encoded, b'"'))
    return b"".join((b'"', encoded, b'"'))
