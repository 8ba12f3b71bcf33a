"""preprocessors/audio.py: audio formats sniffed from the bytes, WAV length bounded, checkpoints honoured."""

from __future__ import annotations

import io
import struct
import wave

import pytest

from preprocessors.audio import AUDIO_FORMATS, sniff_audio_format, validate_audio
from preprocessors.base import AudioPolicy, Cancelled
from tests.preprocessors.conftest import expect_error


def wav(seconds: float, rate: int = 8000) -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(1)
        out.setframerate(rate)
        out.writeframes(b"\x80" * int(seconds * rate))
    return buf.getvalue()


MP3_ID3 = b"ID3\x04\x00\x00\x00\x00\x00\x00" + b"\x00" * 32
MP3_FRAME = b"\xff\xfb\x90\x64" + b"\x00" * 32
FLAC = b"fLaC\x00\x00\x00\x22" + b"\x00" * 32
OGG = b"OggS\x00\x02" + b"\x00" * 32
ADTS_AAC = b"\xff\xf1\x50\x80" + b"\x00" * 32


@pytest.mark.parametrize(
    ("data", "fmt"),
    [
        (wav(0.1), "wav"),
        (MP3_ID3, "mp3"),
        (MP3_FRAME, "mp3"),
        (FLAC, "flac"),
        (OGG, "ogg"),
        (ADTS_AAC, None),
        (b"", None),
    ],
)
def test_sniff_audio(data: bytes, fmt: str | None) -> None:
    assert sniff_audio_format(data) == fmt


@pytest.mark.parametrize(
    ("data", "declared"),
    [(wav(1.0), "wav"), (wav(1.0), None), (MP3_ID3, "mp3"), (FLAC, "FLAC"), (OGG, "ogg")],
)
def test_valid_audio(data: bytes, declared: str | None) -> None:
    assert validate_audio(data, declared, AudioPolicy()) is None


def test_wav_too_long() -> None:
    data = wav(601, rate=1000)
    error = expect_error("audio_invalid", lambda: validate_audio(data, "wav", AudioPolicy()))
    assert "601.0 s" in error.message and "exceeds the 600 s limit" in error.message
    assert validate_audio(data, "wav", AudioPolicy(max_seconds=601)) is None


def test_streamed_wav_length_bounded_by_its_bytes() -> None:
    data = bytearray(wav(1.0))
    data[data.index(b"data") + 4 : data.index(b"data") + 8] = b"\xff\xff\xff\xff"  # "unknown length"
    assert validate_audio(bytes(data), "wav", AudioPolicy(max_seconds=2)) is None


def test_non_pcm_wav_is_accepted_without_duration() -> None:
    fmt = struct.pack("<HHIIHH", 3, 1, 8000, 32000, 4, 32)  # IEEE float: the stdlib cannot read it
    body = b"WAVEfmt " + struct.pack("<I", len(fmt)) + fmt + b"data" + struct.pack("<I", 8) + b"\x00" * 8
    data = b"RIFF" + struct.pack("<I", len(body)) + body
    assert validate_audio(data, "wav", AudioPolicy(max_seconds=0.0)) is None


def test_declared_format_mismatch() -> None:
    error = expect_error("audio_invalid", lambda: validate_audio(wav(0.5), "mp3", AudioPolicy()))
    assert "'mp3'" in error.message and "wav" in error.message


def test_unsupported_declared_format() -> None:
    error = expect_error("audio_invalid", lambda: validate_audio(ADTS_AAC, "aac", AudioPolicy()))
    assert ", ".join(AUDIO_FORMATS) in error.message


@pytest.mark.parametrize(
    "data", [b"garbage, not audio at all", ADTS_AAC, b"RIFF\x10\x00\x00\x00WAVEjunkjunk", wav(1.0)[:30]]
)
def test_garbage_audio(data: bytes) -> None:
    expect_error("audio_invalid", lambda: validate_audio(data, None, AudioPolicy()))


def test_audio_checkpoint_cancels() -> None:
    def cancel() -> None:
        raise Cancelled

    with pytest.raises(Cancelled):
        validate_audio(wav(0.1), "wav", AudioPolicy(), cancel)
