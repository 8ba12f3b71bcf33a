"""Validation of ``input_audio`` items: the format is sniffed from the content, never taken on trust.

Only magic bytes are read by hand; everything deeper comes from the standard library (``wave``), so
there is no codec parser of our own to get wrong. Consequence: the duration limit is enforced for WAV
(PCM) only. MP3, FLAC and OGG are checked by signature and size (the size cap is applied before
decoding base64, in dataurl); their duration is left to the backend.
"""

from __future__ import annotations

import wave
from io import BytesIO

from .base import AudioPolicy, Checkpoint, no_checkpoint
from .errors import AUDIO_INVALID

AUDIO_FORMATS = ("wav", "mp3", "flac", "ogg")


def sniff_audio_format(data: bytes) -> str | None:
    """``wav``, ``mp3``, ``flac`` or ``ogg`` from the first bytes of ``data``; None when unknown."""
    if data[:4] == b"RIFF" and data[8:12] == b"WAVE":
        return "wav"
    if data[:4] == b"fLaC":
        return "flac"
    if data[:4] == b"OggS":
        return "ogg"
    if data[:3] == b"ID3":
        return "mp3"
    # MPEG audio frame sync: 11 set bits (0xFFE), then a layer field that is not 00 -- layer 00 is
    # AAC's ADTS header (0xFFF1 / 0xFFF9), which is not MP3.
    if len(data) >= 2 and data[0] == 0xFF and data[1] & 0xE0 == 0xE0 and data[1] & 0x06:
        return "mp3"
    return None


def validate_audio(
    data: bytes,
    declared_format: str | None,
    policy: AudioPolicy,
    checkpoint: Checkpoint = no_checkpoint,
) -> None:
    """Refuse audio that is not WAV, MP3, FLAC or OGG, that contradicts its declared ``format``, or
    (WAV only, see the module docstring) that is longer than ``policy.max_seconds``.

    Raises MediaError("audio_invalid") with what to fix, or Cancelled from ``checkpoint``.
    """
    checkpoint()
    declared = declared_format.lower() if declared_format is not None else None
    if declared is not None and declared not in AUDIO_FORMATS:
        raise AUDIO_INVALID.error(
            f"audio format {declared_format!r} is not supported; use one of {', '.join(AUDIO_FORMATS)}",
        )
    actual = sniff_audio_format(data)
    if actual is None:
        raise AUDIO_INVALID.error(
            f"audio data is not {', '.join(AUDIO_FORMATS)} (unrecognised header {data[:4]!r})",
        )
    if declared is not None and declared != actual:
        raise AUDIO_INVALID.error(
            f"audio is declared as {declared!r} but the data is {actual}; "
            f"set \"format\": {actual!r} or send {declared} data",
        )
    if actual == "wav":
        seconds = _wav_seconds(data)
        if seconds > policy.max_seconds:
            raise AUDIO_INVALID.error(
                f"audio is {seconds:.1f} s long, which exceeds the {policy.max_seconds:g} s limit; "
                "send a shorter clip",
            )


def _wav_seconds(data: bytes) -> float:
    """Duration of a PCM WAV from its header (``wave``), bounded by the bytes actually present.

    A streamed WAV often claims a data size of 0xFFFFFFFF, and a truncated one more than it holds, so
    the header alone could overstate the length; ``len(data)`` bounds it without reading samples.
    Non-PCM WAV (float, extensible) is not readable by ``wave`` in Python 3.11: like MP3, it is accepted
    without a duration check (0 is returned).
    """
    try:
        with wave.open(BytesIO(data), "rb") as wav:
            frames, rate = wav.getnframes(), wav.getframerate()
            frame_bytes = wav.getnchannels() * wav.getsampwidth()
    except wave.Error as e:
        if str(e).startswith("unknown format"):
            return 0.0
        raise AUDIO_INVALID.error(f"WAV header is invalid: {e}") from None
    except EOFError:
        raise AUDIO_INVALID.error("WAV header is truncated") from None
    except RuntimeError:  # wave's chunk reader, when a chunk size points outside its parent
        raise AUDIO_INVALID.error("WAV chunk sizes point past the end of the file") from None
    if rate <= 0:
        raise AUDIO_INVALID.error("WAV header has a sample rate of 0")
    return min(frames, len(data) // frame_bytes) / rate
