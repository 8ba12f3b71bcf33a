"""The video probe: what a clip is, read from its container, before the backend decodes a frame of it.

A video part is forwarded byte for byte; what mmgate adds is a look at it with FFmpeg's own demuxers (PyAV,
the optional ``video`` extra): the container and codec against an allowlist, the frame size, the frame count,
the duration and the frame rate against ``VideoPolicy``'s limits. Nothing is decoded for it:

- FFmpeg reads from the bytes in memory (``av.open`` on a ``BytesIO``), only through the demuxers of the
  allowed containers (``format_whitelist``), with ``probesize``/``analyzeduration`` bounding what it reads
  to find the streams.
- ``avformat_find_stream_info`` may open a decoder to fill in what a header leaves out; it is told to skip
  every frame (``skip_frame=all``) and to refuse a picture over the pixel limit (``max_pixels``), so the
  probe never holds a full-size frame. A stream whose frame size stays unknown is refused.
- The frame count comes from the container's index (MP4's sample table) or, where the container has none
  (Matroska/WebM), by demuxing the packets without decoding them, stopping one past the limit and calling
  the job's checkpoint as it goes (the request's deadline).

PyAV is imported on the first video item a worker sees; without it a video part is refused
(``video_unavailable``), since an unchecked clip is what this module exists to keep from the backend.
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from fractions import Fraction
from io import BytesIO
from typing import Any

from .base import Checkpoint, VideoPolicy
from .errors import VIDEO_INVALID, VIDEO_TOO_LARGE, VIDEO_UNAVAILABLE

# FFmpeg's demuxer names: MP4/QuickTime (one demuxer, "mov,mp4,m4a,3gp,3g2,mj2") and Matroska/WebM.
ALLOWED_FORMATS = ("mov", "mp4", "matroska", "webm")
ALLOWED_CODECS = ("h264", "hevc", "vp8", "vp9", "av1")
_FORMAT_WHITELIST = "mov,mp4,m4a,3gp,3g2,mj2,matroska,webm"
_PROBE_BYTES = 5_000_000  # FFmpeg's default: what it reads to find the streams
_PROBE_MICROSECONDS = 5_000_000
_CHECK_EVERY = 64  # packets demuxed between two checkpoints


@dataclass(frozen=True, slots=True)
class VideoInfo:
    """What the probe read: container and codec (FFmpeg's names), frame size, frames, seconds, frame rate."""

    container: str
    codec: str
    width: int
    height: int
    frames: int
    seconds: float
    fps: float


def pyav_available() -> bool:
    """Whether the ``video`` extra (PyAV) is installed, without importing it."""
    return importlib.util.find_spec("av") is not None


def import_pyav() -> Any:
    try:
        return importlib.import_module("av")
    except ImportError:
        raise VIDEO_UNAVAILABLE.error(
            "this mmgate does not accept video: it checks every clip before the backend and needs "
            "PyAV for that (the operator installs it: pip install 'mmgate[video]')") from None


def probe_video(data: bytes, policy: VideoPolicy, checkpoint: Checkpoint) -> VideoInfo:
    """The clip's ``VideoInfo``, checked against ``policy``; MediaError ``video_invalid`` for anything that does
    not probe as an allowed video, ``video_too_large`` naming the limit a clip is over."""
    av = import_pyav()
    checkpoint()
    options = {"format_whitelist": _FORMAT_WHITELIST, "probesize": str(_PROBE_BYTES),
               "analyzeduration": str(_PROBE_MICROSECONDS), "skip_frame": "all",
               "max_pixels": str(policy.max_pixels)}
    try:
        container = av.open(BytesIO(data), mode="r", options=options, metadata_errors="ignore")
    except (av.FFmpegError, ValueError, OSError) as error:
        raise VIDEO_INVALID.error(f"the data is not a readable video in an accepted container "
                                  f"({', '.join(ALLOWED_FORMATS)}): {_reason(error)}") from None
    try:
        return _judge(av, container, policy, checkpoint)
    finally:
        container.close()


def _reason(error: Exception) -> str:
    return str(getattr(error, "strerror", None) or error)[:120]


def _judge(av: Any, container: Any, policy: VideoPolicy, checkpoint: Checkpoint) -> VideoInfo:
    names = str(container.format.name).split(",")
    if not any(name in ALLOWED_FORMATS for name in names):
        raise VIDEO_INVALID.error(f"the container {container.format.name!r} is not accepted: send "
                                  f"{', '.join(ALLOWED_FORMATS)}")
    if not container.streams.video:
        raise VIDEO_INVALID.error("the container holds no video stream")
    stream = container.streams.video[0]
    codec = stream.codec_context.name if stream.codec_context is not None else ""
    if codec not in ALLOWED_CODECS:
        raise VIDEO_INVALID.error(f"the video codec {codec or 'unknown'!r} is not accepted: send "
                                  f"{', '.join(ALLOWED_CODECS)}")
    width, height = int(stream.codec_context.width), int(stream.codec_context.height)
    if width <= 0 or height <= 0:
        raise VIDEO_INVALID.error(
            "the video's frame size cannot be read without decoding a frame over "
            f"the pixel limit of {policy.max_pixels} (MMGATE_MAX_VIDEO_PIXELS), or it is unreadable")
    if width * height > policy.max_pixels:
        raise VIDEO_TOO_LARGE.error(
            f"the video's frames are {width}x{height} = {width * height} pixels, "
            f"over the limit of {policy.max_pixels} (MMGATE_MAX_VIDEO_PIXELS): send a smaller clip")
    rate = stream.average_rate or stream.guessed_rate
    fps = float(rate) if rate else 0.0
    frames = int(stream.frames or 0)
    indexed = frames > 0
    seconds = _seconds(container, stream)
    if not indexed:  # no index (Matroska/WebM): count the packets, decoding none
        frames, end = _demux_count(av, container, stream, policy.max_frames, checkpoint)
        seconds = max(seconds, end)
    if frames <= 0:
        raise VIDEO_INVALID.error("the video stream holds no frames")
    if frames > policy.max_frames:
        shown = f"{frames}" if indexed else f"more than {policy.max_frames}"  # demuxing stops one past it
        raise VIDEO_TOO_LARGE.error(f"the video has {shown} frames, over the limit of {policy.max_frames} "
                                    "(MMGATE_MAX_VIDEO_FRAMES): send a shorter clip or fewer frames per second")
    if seconds > policy.max_seconds:
        raise VIDEO_TOO_LARGE.error(f"the video lasts {seconds:.1f} s, over the limit of "
                                    f"{policy.max_seconds:g} s (MMGATE_MAX_VIDEO_SECONDS): send a shorter clip")
    return VideoInfo(names[0], codec, width, height, frames, seconds, fps)


def _seconds(container: Any, stream: Any) -> float:
    """The longest duration the headers state (the container's and the stream's may differ)."""
    seconds = 0.0
    if container.duration:
        seconds = container.duration / 1_000_000
    if stream.duration and stream.time_base:
        seconds = max(seconds, float(stream.duration * Fraction(stream.time_base)))
    return seconds


def _demux_count(av: Any, container: Any, stream: Any, max_frames: int, checkpoint: Checkpoint) -> tuple[int, float]:
    """Packets of ``stream`` (one frame each for the allowed codecs) and the end time of the last, stopping one
    past ``max_frames``; packets are read, never decoded."""
    frames, end = 0, 0.0
    time_base = Fraction(stream.time_base) if stream.time_base else None
    try:
        for packet in container.demux(stream):
            if packet.size == 0:  # the flush packet at the end
                continue
            frames += 1
            if time_base is not None and packet.pts is not None:
                end = max(end, float((packet.pts + (packet.duration or 0)) * time_base))
            if frames > max_frames:
                break
            if frames % _CHECK_EVERY == 0:
                checkpoint()
    except av.FFmpegError as error:
        raise VIDEO_INVALID.error(f"the video stream cannot be read: {_reason(error)}") from None
    return frames, end
