"""One media job as plain data: what a decode worker needs (``MediaTask``), what it hands back (``Outcome``).

Everything here pickles, so the same job runs in a decode thread (``MediaJob`` called with a checkpoint) or
in a decode process (the task pickled, the base64 payload passed through a memfd; ``preprocessors/workers``).
The payload is never part of the task: a thread reads it from the request's body when it starts, a process
pool copies it into the worker's memfd when a worker is free, so a queued job holds no bytes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .audio import validate_audio
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
        return run_task(self.task, self.payload(), checkpoint)


def run_task(task: MediaTask, payload: bytes | memoryview, checkpoint: Checkpoint) -> Outcome:
    """base64 → bytes → validate → (resize → re-encode → base64 token). MediaError names ``task.path``."""
    try:
        data = decode_base64(payload, max_bytes=task.max_bytes)
        del payload
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
    except MediaError as error:
        raise error.at(task.path) from None


def _token(task: MediaTask, mime: bytes, encoded: bytes) -> bytes:
    """The JSON string token for rewritten media: a data URI when the client sent one, else bare base64."""
    if task.data_uri:
        return b"".join((b'"data:', mime, b";base64,", encoded, b'"'))
    return b"".join((b'"', encoded, b'"'))
