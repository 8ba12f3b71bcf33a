"""What the media step makes of its verdicts: each item's ``Outcome`` (the token to write, the true type, the
sizes), the body's ``Rewrites`` for ``rawjson.splice``, the refusal when a batch failed, the item counters, and
each item as a ``job.MediaJob`` for either pool.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from preprocessors.errors import PREPROCESS_TIMEOUT, MediaError, MmgateError
from preprocessors.job import MediaJob, MediaTask, Verdict
from preprocessors.pool import Batch
from proxy.media.pieces import BodyRef, Piece
from proxy.payload.locate import Item, Plan
from proxy.payload.rawjson import Span
from proxy.payload.walkers import MediaPart
from proxy.state import AppState


@dataclass(slots=True)
class Outcome:
    """A verdict applied to one part: the new JSON string token (None = forward unchanged), its MIME, and the
    decoded sizes in and out (for the media byte counters)."""

    size_in: int
    size_out: int
    token: bytes | None = None
    mime: bytes = b""
    true_mime: bytes = b""  # set when the bytes are not the type the client declared
    video: tuple[int, int, int] | None = None  # a probed clip's (frames, width, height)


@dataclass(slots=True)
class Rewrites:
    """What the media step hands back: the body's new tokens and the media bytes seen in and out."""

    replacements: list[tuple[Span, bytes]]
    media_in: int
    media_out: int
    video_tokens: int = 0  # with MMGATE_MODEL: what the probed clips make for the served model


def refusal_for(state: AppState, plan: Plan, batch: Batch, exc: MediaError | TimeoutError) -> MmgateError:
    """What the client is told when an item was bad or the deadline passed; the items are counted by why."""
    if isinstance(exc, MediaError):
        count_items(state, plan.items, "rejected")
        return exc
    count_items(state, plan.items, "timeout")
    timeout = state.settings.timeouts.preprocess_timeout
    if batch.started == 0:  # every decode worker stayed busy: not the client's media at fault
        return PREPROCESS_TIMEOUT.error(f"no decode worker became free within {timeout:g} s "
                                        "(MMGATE_PREPROCESS_TIMEOUT): the proxy is overloaded, retry later")
    # Slow media, a stalled or starved worker, a busy machine: the deadline cannot tell which, so it names
    # itself and blames nobody.
    return PREPROCESS_TIMEOUT.error(f"media preprocessing did not finish within the {timeout:g} s deadline "
                                    "(MMGATE_PREPROCESS_TIMEOUT); the work was stopped and nothing was forwarded")


def rewrites_for(state: AppState, plan: Plan, outcomes: list[Outcome]) -> Rewrites:
    metrics = state.metrics
    rewrites = Rewrites([], 0, 0)
    model = state.model
    for item, outcome in zip(plan.items, outcomes, strict=True):
        rewrites.media_in += outcome.size_in
        rewrites.media_out += outcome.size_out
        if outcome.video is not None and model is not None and model.counts_video:
            try:
                rewrites.video_tokens += model.video_tokens(*outcome.video)
            except MediaError as error:
                raise error.at(item.part.path) from None
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


def count_items(state: AppState, items: list[Item], outcome: str) -> None:
    for item in items:
        state.metrics.media_items.labels(item.part.kind, outcome).inc()


def _mime_text(item: Item, mime: bytes) -> bytes:
    """What replaces ``item.declared_span``: a whole JSON string (Anthropic ``media_type``) or, inside a data
    URI, just the type's characters."""
    return mime if item.part.encoding == "data_uri" else b'"' + mime + b'"'


def media_job(state: AppState, piece: Piece, body: BodyRef) -> MediaJob:
    """The piece as a job for either pool: the task as plain data, the payload read on demand from where the
    piece's bytes come from (``Piece.payload``)."""
    part = piece.item.part
    task = MediaTask(
        kind=part.kind, path=part.path, max_bytes=state.settings.limits.max_media_item_bytes,
        image_policy=state.image_policy, audio_policy=state.audio_policy, audio_format=part.audio_format,
        fetched_mime=piece.fetched.mime if piece.fetched is not None else None, video_policy=state.video_policy,
    )
    return MediaJob(task, partial(piece.payload, body))


def outcome_for(item: Item, verdict: Verdict, original: Callable[[], bytes]) -> Outcome:
    """A verdict applied to one part: its true type against the declared one, and the token to write.
    ``original`` gives the part's media as base64, needed only to rewrite a whole escaped token."""
    if verdict.video is not None:  # a probed clip goes as it came
        return Outcome(verdict.size_in, verdict.size_in, video=verdict.video)
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
    """The JSON string token for rewritten media: a data URI when the client sent one (and for a fetched URL),
    else bare base64."""
    if part.encoding == "data_uri":
        return b"".join((b'"data:', mime, b";base64,", encoded, b'"'))
    return b"".join((b'"', encoded, b'"'))
