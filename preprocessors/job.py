"""One media job as plain data: what a decode worker needs (``MediaTask``), what it hands back (``Outcome``).

The payload is the item's base64 text (inline media) or a fetched body (a media URL with
MMGATE_MEDIA_URLS=fetch). Everything here pickles, so the same job runs in a decode thread (``MediaJob``
called with a checkpoint) or in a decode process (the task pickled, the payload passed through a memfd;
``preprocessors/workers``).
The payload is never part of the task: a thread reads it from the request's body when it starts, a process
pool copies it into the worker's memfd when a worker is free, so a queued job holds no bytes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .audio import sniff_audio_format, validate_audio
from .base import AudioPolicy, Checkpoint, ImagePolicy, MediaError, MediaKind
from .dataurl import decode_base64, encode_base64
from .image import image_mime, process_image

Payload = Callable[[], "bytes | memoryview"]


@dataclass(frozen=True, slots=True)
class MediaTask:
    """One inline media item, without its bytes.

    ``rewritable``: the item is a string in the body, so a new token may replace it. ``data_uri``: that
    token is a data URI (else bare base64). ``declared_outside``: the declared type is written in a span
    of its own (Anthropic ``media_type``, a data URI's type); when not, and the true type differs, the
    whole token is written anew.
    """

    kind: MediaKind
    path: str  # the JSON path of the part, named by errors
    max_bytes: int
    image_policy: ImagePolicy
    audio_policy: AudioPolicy
    declared_mime: str = ""
    audio_format: str | None = None
    rewritable: bool = True
    data_uri: bool = True
    declared_outside: bool = True
    fetched_mime: str | None = None  # a fetched body (MMGATE_MEDIA_URLS=fetch) and its declared type; None: base64


@dataclass(slots=True)
class Outcome:
    """What a worker made of one item: the new JSON string token (None = forward unchanged), its MIME,
    and the decoded sizes in and out (for the media byte counters)."""

    size_in: int
    size_out: int
    token: bytes | None = None
    mime: bytes = b""
    true_mime: bytes = b""  # set when the bytes are not the type the client declared


@dataclass(frozen=True, slots=True)
class MediaJob:
    """A task and where its payload comes from (``payload()`` raises ``Cancelled`` once the request let go)."""

    task: MediaTask
    payload: Payload

    def __call__(self, checkpoint: Checkpoint) -> Outcome:
        return run_task(self.task, self.payload, checkpoint)


def run_task(task: MediaTask, payload: Payload, checkpoint: Checkpoint) -> Outcome:
    """The item's work; MediaError names ``task.path``. ``payload`` is called once, and what it returns is
    not kept: an inline item's payload is a view into the request's body, which must not outlive the read."""
    try:
        if task.fetched_mime is not None:
            return _run_fetched(task, _fetched(payload), checkpoint)
        return _run_bytes(task, decode_base64(payload(), max_bytes=task.max_bytes), checkpoint)
    except MediaError as error:
        raise error.at(task.path) from None


def _fetched(payload: Payload) -> bytes:
    data = payload()
    return data if isinstance(data, bytes) else bytes(data)


def _run_fetched(task: MediaTask, data: bytes, checkpoint: Checkpoint) -> Outcome:
    """A fetched body: the URL is always replaced by a data URI, of the processed media or, when that needed
    no change, of the bytes as fetched with their sniffed type."""
    outcome = _run_bytes(task, data, checkpoint)
    if outcome.token is None:
        if task.kind == "image":
            mime = image_mime(data).encode()
        else:  # validated above, so the format is known
            mime = _AUDIO_MIME.get(sniff_audio_format(data) or "", task.fetched_mime or "").encode()
        outcome.token, outcome.mime = _token(task, mime, encode_base64(data)), mime
    return outcome


_AUDIO_MIME = {"wav": "audio/wav", "mp3": "audio/mpeg", "flac": "audio/flac", "ogg": "audio/ogg"}


def _run_bytes(task: MediaTask, data: bytes, checkpoint: Checkpoint) -> Outcome:
    """Media bytes (decoded inline media or a fetched body) → validate → (resize → re-encode → token). The
    bytes come as an argument the caller does not keep, so they are dropped (``del``) before the encode."""
    size = len(data)
    checkpoint()
    if task.kind == "image":
        true_mime = image_mime(data).encode()
        if task.declared_mime.encode() in (true_mime, b""):
            true_mime = b""
        processed = process_image(data, task.image_policy, checkpoint)
        if processed is None and true_mime and not task.declared_outside and task.rewritable:
            # The declared type is inside an escaped token: the whole token is written anew.
            return Outcome(size, size, _token(task, true_mime, encode_base64(data)), true_mime, true_mime)
        del data
        if processed is None or not task.rewritable:
            return Outcome(size, size, true_mime=true_mime)
        mime = processed.mime.encode()
        out_size = len(processed.data)
        encoded = encode_base64(processed.data)
        del processed
        return Outcome(size, out_size, _token(task, mime, encoded), mime, true_mime)
    if task.kind == "audio":
        validate_audio(data, task.audio_format, task.audio_policy, checkpoint)
    return Outcome(size, size)  # audio and video are validated / size-checked and forwarded unchanged


def _token(task: MediaTask, mime: bytes, encoded: bytes) -> bytes:
    """The JSON string token for rewritten media: a data URI when the client sent one, else bare base64."""
    if task.data_uri:
        return b"".join((b'"data:', mime, b";base64,", encoded, b'"'))
    return b"".join((b'"', encoded, b'"'))
