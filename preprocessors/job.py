"""One media job as plain data: what a decode worker needs (``MediaTask``), what it hands back (``Verdict``).

The payload is the item's base64 text (inline media) or a fetched body (a media URL with
MMGATE_MEDIA_URLS=fetch). Everything here pickles, so the same job runs in a decode thread (``MediaJob``
called with a checkpoint) or in a decode process (the task pickled, the payload passed through a memfd;
``preprocessors/workers``).
The payload is never part of the task: a thread reads it from the request's body when it starts, a process
pool copies it into the worker's memfd when a worker is free, so a queued job holds no bytes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial

from .audio import sniff_audio_format, validate_audio
from .base import AudioPolicy, Checkpoint, ImagePolicy, MediaKind, VideoPolicy, no_checkpoint
from .dataurl import Base64Ends, decode_base64, encode_base64
from .dimensions import Dimensions
from .errors import MediaError, MmgateError, rebuild
from .formats import image_mime
from .geometry import KnownTargets, known_targets, planned_targets
from .image import judge_header, process_image
from .video import import_pyav, probe_video, pyav_available

Payload = Callable[[], "bytes | memoryview"]


@dataclass(frozen=True, slots=True)
class MediaTask:
    """One media item, without its bytes, and without anything of the request that carried it: the same
    task on the same bytes gives the same ``Verdict``, which is what lets the proxy's cache keep it."""

    kind: MediaKind
    path: str  # the JSON path of the part, named by errors
    max_bytes: int
    image_policy: ImagePolicy
    audio_policy: AudioPolicy
    audio_format: str | None = None
    fetched_mime: str | None = None  # a fetched body (MMGATE_MEDIA_URLS=fetch) and its declared type; None: base64
    video_policy: VideoPolicy = field(default_factory=VideoPolicy)
    # With a served model: ``resize_target``'s answers the proxy worked out from the image's header
    # (``geometry.planned_targets``), so a worker process never imports the processor's helpers for them.
    known_targets: KnownTargets = ()


@dataclass(frozen=True, slots=True)
class Refusal:
    """A ``MediaError`` as plain data; ``error()`` makes a fresh one each time (errors get a path), of the
    class its registry entry names."""

    status: int
    code: str
    message: str

    def error(self) -> MmgateError:
        return rebuild(self.status, self.code, self.message)


@dataclass(frozen=True, slots=True)
class Verdict:
    """What one media item became, independent of the request that carried it.

    ``sniffed_mime``: the true type of an image ("" for other kinds); ``video``: what the probe read of a clip
    (``preprocessors/video.py``); ``encoded``: the file to forward as
    base64 with its ``mime`` (the rewritten image; for a fetched body always, the bytes as fetched when they
    needed no change), or None when the item is forwarded unchanged; ``refusal``: set instead when the item
    is refused (kept by the proxy's cache, never made by a worker, which raises)."""

    size_in: int
    size_out: int
    sniffed_mime: bytes = b""
    mime: bytes = b""
    encoded: bytes | None = None
    refusal: Refusal | None = None
    video: tuple[int, int, int] | None = None  # a probed clip: (frames, width, height)


@dataclass(frozen=True, slots=True)
class MediaJob:
    """A task and where its payload comes from (``payload()`` raises ``Cancelled`` once the request let go)."""

    task: MediaTask
    payload: Payload

    def __call__(self, checkpoint: Checkpoint) -> Verdict:
        return run_task(self.task, self.payload, checkpoint)


def run_task(task: MediaTask, payload: Payload, checkpoint: Checkpoint) -> Verdict:
    """The item's work; MediaError names ``task.path``. ``payload`` is called once, and what it returns is
    not kept: an inline item's payload is a view into the request's body, which must not outlive the read."""
    try:
        with known_targets(task.known_targets):
            if task.fetched_mime is not None:
                return _judge(task, _fetched(payload), checkpoint)
            return _judge(task, decode_base64(payload(), max_bytes=task.max_bytes), checkpoint)
    except MediaError as error:
        raise error.at(task.path) from None


def with_planned_targets(task: MediaTask, found: Dimensions | None) -> MediaTask:
    """``task`` carrying the served model's answers for its image (``geometry.planned_targets``), worked out here
    from the size its header says (``found``), where the processor's helpers are loaded already: a decode
    worker process then never imports them. The task as it is without a model, for other media, or where the
    header does not say the image's size."""
    geometry = task.image_policy.geometry
    if task.kind != "image" or geometry is None or found is None:
        return task
    return replace(task, known_targets=planned_targets(geometry, found.width, found.height))


def judge_head(task: MediaTask, ends: Base64Ends) -> Verdict | None:
    """An inline image's verdict from the ends of its base64 alone, where its header decides
    (``image.judge_header``: header validation, nothing to resize): the decoded size from the payload's length,
    format, size and frames from its first bytes, and whether it is whole from its last; nothing between them is
    decoded, so the rest of the file (its base64 included) is the backend's to read, as it reads every image
    anyway. None: a decode worker judges the item (``run_task``), a truncated one already refused here.
    MediaError names ``task.path``."""
    if task.kind != "image" or task.fetched_mime is not None or task.image_policy.validate != "header":
        return None
    try:
        size = ends.checked_size(task.max_bytes)
        mime = judge_header(ends.image_format(), ends.head, ends.tail, size, task.image_policy)
    except MediaError as error:
        raise error.at(task.path) from None
    return None if mime is None else Verdict(size, size, mime.encode())


def _fetched(payload: Payload) -> bytes:
    data = payload()
    return data if isinstance(data, bytes) else bytes(data)


_AUDIO_MIME = {"wav": "audio/wav", "mp3": "audio/mpeg", "flac": "audio/flac", "ogg": "audio/ogg"}


def _judge(task: MediaTask, data: bytes, checkpoint: Checkpoint) -> Verdict:
    """Media bytes (decoded inline media or a fetched body) → validate → (resize → re-encode). The bytes come
    as an argument the caller does not keep, so they are dropped (``del``) before the encode. A fetched body is
    always encoded: the URL's place takes a data URI, of the processed media or of the bytes as fetched."""
    size = len(data)
    fetched = task.fetched_mime is not None
    checkpoint()
    if task.kind == "image":
        sniffed = image_mime(data).encode()
        processed = process_image(data, task.image_policy, checkpoint)
        if processed is None:
            if fetched:
                return Verdict(size, size, sniffed, sniffed, encode_base64(data))
            return Verdict(size, size, sniffed)
        del data
        mime = processed.mime.encode()
        out_size = len(processed.data)
        encoded = encode_base64(processed.data)
        del processed
        return Verdict(size, out_size, sniffed, mime, encoded)
    if task.kind == "audio":
        validate_audio(data, task.audio_format, task.audio_policy, checkpoint)
        if fetched:  # validated, so the format is known
            mime = _AUDIO_MIME.get(sniff_audio_format(data) or "", task.fetched_mime or "").encode()
            return Verdict(size, size, b"", mime, encode_base64(data))
    if task.kind == "video":  # probed, never decoded, and forwarded byte for byte
        info = probe_video(data, task.video_policy, checkpoint)
        return Verdict(size, size, video=(info.frames, info.width, info.height))
    return Verdict(size, size)  # audio is validated and forwarded unchanged


def warm_up(policy: ImagePolicy | None = None, *, formats: bool = True) -> None:
    """One tiny image of each common format through the whole job (decode, resize, encode, each output format),
    so Pillow's plugins and codecs are loaded at start-up and not on the first client's item; PyAV too, where
    installed. With the served model's ``policy``, its geometry runs once too: the processor's helpers are
    imported here, not on the first image the model would shrink. ``formats=False``: the geometry alone (a
    model found after start-up, whose formats are warm already)."""
    from io import BytesIO

    from PIL import Image

    generic = ImagePolicy(resize_max_side=8)
    policies = [replace(generic, output_format=fmt) for fmt in ("auto", "png", "bmp")] if formats else []
    if policy is not None and policy.geometry is not None:  # a tiny image the model enlarges: its helpers load
        policies.append(replace(generic, geometry=policy.geometry))
    for fmt in ("JPEG", "PNG", "WEBP"):
        buf = BytesIO()
        Image.new("RGB", (16, 12), "teal").save(buf, fmt)
        payload = encode_base64(buf.getvalue())
        for each in policies:
            run_task(MediaTask("image", "warm-up", 1 << 20, each, AudioPolicy()), partial(bytes, payload),
                     no_checkpoint)
    if formats and pyav_available():
        import_pyav()
