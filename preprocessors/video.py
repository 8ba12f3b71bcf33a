"""The video probe: what a clip is, read from its container, before the backend decodes a frame of it.

A video part is forwarded byte for byte; what mmgate adds is a look at it with FFmpeg's own demuxers (PyAV,
the optional ``video`` extra): the container, its streams and their codecs against allowlists, the frame size,
the frame count, the duration and the frame rate against ``VideoPolicy``'s limits. The clip is judged as a
whole, not by its first stream or its first bytes:

- Before FFmpeg opens an MP4, the sample counts its tables declare are judged (``mp4_tables``): its demuxer
  builds an index entry per sample inside ``av.open``, and a constant ``stsz`` or an empty ``trun`` states
  millions of samples in a few bytes. The video track is held to the frame limit, another track to
  ``_SAMPLES_PER_SECOND`` over the duration limit.
- FFmpeg reads from the bytes in memory (``av.open`` on a ``BytesIO``), only through the demuxers of the
  allowed containers (``format_whitelist``), with ``probesize``/``analyzeduration`` bounding what it reads
  to find the streams and ``max_streams`` bounding how many it opens: one past ``MAX_STREAMS``, so that a
  clip with more is seen and refused (each stream costs a decoder context while the streams are found).
- Exactly one video stream. A backend picks the stream it decodes by its own rule (FFmpeg's best stream
  favours the largest picture and the ``default`` disposition; others take the first), so a second video
  stream would be one the probe did not choose; refusing it leaves no choice to disagree on. Audio streams
  are allowed in ``ALLOWED_AUDIO_CODECS`` (the clip is forwarded with them, and some models hear them), data
  streams (timecodes, camera metadata) since nothing decodes them; anything else is refused.
- ``avformat_find_stream_info`` may open a decoder to fill in what a header leaves out; it is told to skip
  every frame (``skip_frame=all``) and to refuse a picture over the pixel limit (``max_pixels``), so the
  probe never holds a full-size frame. A stream whose frame size stays unknown is refused.
- Every packet of the video stream is demuxed, never more than one past the frame limit, whatever the
  index says: a fragmented MP4's index lists only the samples before its first fragment. The count is the
  larger of the two, so a clip is over the limit if either says so.
- A clip may change its frame size mid-stream (a new sequence parameter set, a VP9 key frame of another
  size), so the size of every frame that states one is checked as the packets go by. VP8 and VP9 state it
  in a header read without decoding (``vpx``); H.264, HEVC and AV1 packets go to the stream's decoder with
  ``skip_frame=nokey`` and ``max_pixels``: it parses every packet's headers, by the bitstream's own idea of
  a key frame rather than the container's flag (which the sender sets), reconstructs key frames only, and
  refuses one over the pixel limit before it allocates it. A size that only a VP9 or AV1 inter frame states
  (reference scaling) is left to the backend's own limits.
- The decoder activates a new H.264/HEVC sequence parameter set only for a slice it decodes, and with
  ``skip_frame=nokey`` that is a key frame by its own rule; a backend's decoder activates one for any slice,
  an open-GOP I slice included. So every parameter set the stream carries (its header's, every packet's,
  a packet's new extradata) is read from the bitstream (``parameter_sets``) and its coded size judged, used
  or not; one that cannot be read is refused.
- The request's checkpoint (its deadline) is called every ``_CHECK_EVERY`` packets and after every picture
  decoded, so the work per clip is bounded by the frame limit, the pixel limit and the deadline, and its
  memory by ``MAX_STREAMS`` streams' discovery and pictures within the pixel limit.

PyAV is imported on the first video item a worker sees; without it a video part is refused
(``video_unavailable``), since an unchecked clip is what this module exists to keep from the backend.
"""

from __future__ import annotations

import errno
import importlib
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from io import BytesIO
from typing import Any, NoReturn

from .base import Checkpoint, VideoPolicy
from .errors import VIDEO_INVALID, VIDEO_TOO_LARGE, VIDEO_UNAVAILABLE
from .mp4_tables import TableError, declared_tracks
from .parameter_sets import ParameterSetReader, UncheckableParameterSet
from .vpx import vp8_sizes, vp9_sizes

# FFmpeg's demuxer names: MP4/QuickTime (one demuxer, "mov,mp4,m4a,3gp,3g2,mj2") and Matroska/WebM.
ALLOWED_FORMATS = ("mov", "mp4", "matroska", "webm")
ALLOWED_CODECS = ("h264", "hevc", "vp8", "vp9", "av1")
ALLOWED_AUDIO_CODECS = ("aac", "mp3", "opus", "vorbis", "flac", "alac", "pcm_s16le", "pcm_s16be", "pcm_s24le",
                        "pcm_s24be", "pcm_f32le")
MAX_STREAMS = 8  # a video, its audio and a camera's metadata tracks fit
_FORMAT_WHITELIST = "mov,mp4,m4a,3gp,3g2,mj2,matroska,webm"
_PROBE_BYTES = 5_000_000  # FFmpeg's default: what it reads to find the streams
_PROBE_MICROSECONDS = 5_000_000
_CHECK_EVERY = 64  # packets demuxed between two checkpoints
_EBML_MAGIC = b"\x1a\x45\xdf\xa3"  # Matroska and WebM
# A non-video track's packets a second: compressed audio and metadata (Opus at 2.5 ms is 400), and
# uncompressed audio indexed by the sample (384 kHz), which FFmpeg's MP4 demuxer indexes by the chunk.
_SAMPLES_PER_SECOND = (1000, 384_000)
# An edit list that plays media several times makes FFmpeg copy index entries per edit: a track's edits
# may make this many times its allowed samples (a few edits over a whole track are editing, not this).
_EDITED_ENTRIES_PER_SAMPLE = 4
# Boxes an MP4 may hold: a few hundred in its moov, and a fragmented one up to a fragment a frame, each a
# moof and an mdat around a few boxes per track (tfhd, tfdt, trun...).
_MAX_BOXES = 100_000
_BOXES_PER_FRAME = 24
_OVER_MAX_PIXELS = (errno.EINVAL, errno.ERANGE)  # a picture over max_pixels: FFmpeg's own decoders, dav1d


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
    """PyAV (a decode worker's warm-up, never a start without video)."""
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
    if data[:4] != _EBML_MAGIC:  # what is not Matroska can only open as MP4/QuickTime, or not at all
        _judge_tables(data, policy, checkpoint)
    options = {"format_whitelist": _FORMAT_WHITELIST, "probesize": str(_PROBE_BYTES),
               "analyzeduration": str(_PROBE_MICROSECONDS), "max_streams": str(MAX_STREAMS + 1),
               "skip_frame": "all", "max_pixels": str(policy.max_pixels)}
    try:
        container = av.open(BytesIO(data), mode="r", options=options, **_metadata_arguments(av))
    except av.MemoryError:  # the MP4 demuxer's answer to a stream past max_streams
        raise VIDEO_INVALID.error(f"the clip holds more than {MAX_STREAMS} streams, or tables out of proportion "
                                  "to its size: send one video stream, with its audio if it has any") from None
    except (av.FFmpegError, ValueError, OSError) as error:
        raise VIDEO_INVALID.error(f"the data is not a readable video in an accepted container "
                                  f"({', '.join(ALLOWED_FORMATS)}): {_reason(error)}") from None
    try:
        return _judge(av, container, policy, checkpoint)
    finally:
        container.close()


def _metadata_arguments(av: Any) -> dict[str, str]:
    """What ``av.open`` needs so that a tag that is not UTF-8 (a camera's title in Latin-1) does not fail the
    probe: PyAV before 19 decodes tags strictly unless told ``metadata_errors="ignore"``; PyAV 19 removed the
    argument and always decodes with ``surrogateescape``, which cannot fail."""
    major = int(str(av.__version__).split(".", 1)[0])
    return {"metadata_errors": "ignore"} if major < 19 else {}


def _judge_tables(data: bytes, policy: VideoPolicy, checkpoint: Checkpoint) -> None:
    """The sample counts an MP4's tables declare (``mp4_tables``), judged before FFmpeg builds an index entry
    for each: a video track's against the frame limit, another track's against what the duration limit allows
    a track of audio or metadata (``_SAMPLES_PER_SECOND`` packets a second, uncompressed audio by the sample)."""
    try:
        tracks = declared_tracks(data, max(_MAX_BOXES, _BOXES_PER_FRAME * policy.max_frames), checkpoint)
    except TableError as error:
        raise VIDEO_INVALID.error(f"the clip's MP4 index is malformed: {error}") from None
    for track in tracks:
        if track.handler == "vide":
            if track.samples > policy.max_frames:
                _over_frames(f"{track.samples}", policy)
            most, setting = policy.max_frames, "MMGATE_MAX_VIDEO_FRAMES"
        else:
            rate = _SAMPLES_PER_SECOND[1] if track.unit_samples else _SAMPLES_PER_SECOND[0]
            most = max(policy.max_frames, int(policy.max_seconds * rate))
            setting = "MMGATE_MAX_VIDEO_SECONDS"
            if track.samples > most:
                raise VIDEO_TOO_LARGE.error(
                    f"a {track.handler or 'untyped'} track of the clip declares {track.samples} samples, more "
                    f"than the {most} that {policy.max_seconds:g} s ({setting}) allow: send a shorter clip")
        if track.edited_entries > _EDITED_ENTRIES_PER_SAMPLE * max(most, 1) and track.edits > 1:
            raise VIDEO_TOO_LARGE.error(
                f"the clip's edit list holds {track.edits} edits of its {track.handler or 'untyped'} track, whose "
                f"index they may repeat up to {track.edited_entries} times, more than "
                f"{_EDITED_ENTRIES_PER_SAMPLE} times the {most} samples {setting} allows: send the clip without "
                "its edits")


def _reason(error: Exception) -> str:
    return str(getattr(error, "strerror", None) or error)[:120]


def _judge(av: Any, container: Any, policy: VideoPolicy, checkpoint: Checkpoint) -> VideoInfo:
    names = str(container.format.name).split(",")
    if not any(name in ALLOWED_FORMATS for name in names):
        raise VIDEO_INVALID.error(f"the container {container.format.name!r} is not accepted: send "
                                  f"{', '.join(ALLOWED_FORMATS)}")
    stream = _the_video_stream(container)
    codec = _codec_name(stream)
    if codec not in ALLOWED_CODECS:
        raise VIDEO_INVALID.error(f"the video codec {codec or 'unknown'!r} is not accepted: send "
                                  f"{', '.join(ALLOWED_CODECS)}")
    width, height = int(stream.codec_context.width), int(stream.codec_context.height)
    if width <= 0 or height <= 0:
        raise VIDEO_INVALID.error(
            "the video's frame size cannot be read without decoding a frame over "
            f"the pixel limit of {policy.max_pixels} (MMGATE_MAX_VIDEO_PIXELS), or it is unreadable")
    _check_pixels(width, height, policy)
    rate = stream.average_rate or stream.guessed_rate
    fps = float(rate) if rate else 0.0
    indexed = int(stream.frames or 0)
    if indexed > policy.max_frames:
        _over_frames(f"{indexed}", policy)
    demuxed, end = _walk(av, container, stream, policy, checkpoint)
    frames = max(indexed, demuxed)
    seconds = max(_seconds(container, stream), end)
    if frames <= 0:
        raise VIDEO_INVALID.error("the video stream holds no frames")
    if frames > policy.max_frames:
        _over_frames(f"more than {policy.max_frames}", policy)  # demuxing stops one past it
    if seconds > policy.max_seconds:
        raise VIDEO_TOO_LARGE.error(f"the video lasts {seconds:.1f} s, over the limit of "
                                    f"{policy.max_seconds:g} s (MMGATE_MAX_VIDEO_SECONDS): send a shorter clip")
    return VideoInfo(names[0], codec, width, height, frames, seconds, fps)


def _the_video_stream(container: Any) -> Any:
    """The clip's one video stream, once every stream is known to be allowed."""
    streams = container.streams
    if len(streams) > MAX_STREAMS:
        raise VIDEO_INVALID.error(f"the clip holds more than {MAX_STREAMS} streams: send one video stream, "
                                  "with its audio if it has any")
    for other in streams:
        if other.type == "audio":
            name = _codec_name(other)
            if name not in ALLOWED_AUDIO_CODECS:
                raise VIDEO_INVALID.error(f"the clip's audio codec {name or 'unknown'!r} is not accepted: send "
                                          f"{', '.join(ALLOWED_AUDIO_CODECS)}")
        elif other.type not in ("video", "data"):
            raise VIDEO_INVALID.error(f"the clip holds a {other.type} stream: send video, with its audio")
    if not streams.video:
        raise VIDEO_INVALID.error("the container holds no video stream")
    if len(streams.video) > 1:
        raise VIDEO_INVALID.error(f"the clip holds {len(streams.video)} video streams (cover art counts): "
                                  "send one, so that what is checked is what the backend decodes")
    return streams.video[0]


def _codec_name(stream: Any) -> str:
    """The codec's own name (``av1``, ``mp3``), not the decoder's FFmpeg picked for it (``libdav1d``)."""
    context = stream.codec_context
    return str(context.codec.canonical_name) if context is not None else ""


def _check_pixels(width: int, height: int, policy: VideoPolicy, where: str = "") -> None:
    if width * height > policy.max_pixels:
        raise VIDEO_TOO_LARGE.error(
            f"the video's frames are {width}x{height} = {width * height} pixels{where}, "
            f"over the limit of {policy.max_pixels} (MMGATE_MAX_VIDEO_PIXELS): send a smaller clip")


def _over_frames(shown: str, policy: VideoPolicy) -> NoReturn:
    raise VIDEO_TOO_LARGE.error(f"the video has {shown} frames, over the limit of {policy.max_frames} "
                                "(MMGATE_MAX_VIDEO_FRAMES): send a shorter clip or fewer frames per second")


def _seconds(container: Any, stream: Any) -> float:
    """The longest duration the headers state (the container's and the stream's may differ)."""
    seconds = 0.0
    if container.duration:
        seconds = container.duration / 1_000_000
    if stream.duration and stream.time_base:
        seconds = max(seconds, float(stream.duration * Fraction(stream.time_base)))
    return seconds


def _walk(av: Any, container: Any, stream: Any, policy: VideoPolicy, checkpoint: Checkpoint) -> tuple[int, float]:
    """Packets of ``stream`` (one frame each for the allowed codecs) and the end time of the last, stopping one
    past ``max_frames``; the frame size of every frame that states one is checked on the way."""
    frames, end_ticks = 0, None
    time_base = Fraction(stream.time_base) if stream.time_base else None
    seconds_a_tick = float(time_base) if time_base is not None else 0.0  # for messages; the end is exact
    sizes = _sizes_reader(av, stream, policy)
    try:
        for packet in container.demux(stream):
            if packet.size == 0:  # the flush packet at the end
                continue
            frames += 1
            if frames > policy.max_frames:
                break
            pts = packet.pts
            if pts is not None:
                ends = pts + (packet.duration or 0)
                end_ticks = ends if end_ticks is None or ends > end_ticks else end_ticks
            if sizes(packet, f" from {(pts or 0) * seconds_a_tick:.1f} s") or frames % _CHECK_EVERY == 0:
                checkpoint()
    except av.FFmpegError as error:
        raise VIDEO_INVALID.error(f"the video stream cannot be read: {_reason(error)}") from None
    if time_base is None or end_ticks is None:
        return frames, 0.0
    return frames, max(0.0, float(end_ticks * time_base))


def _sizes_reader(av: Any, stream: Any, policy: VideoPolicy) -> Callable[[Any, str], bool]:
    """What checks a packet's frame sizes against the pixel limit, saying whether it decoded a picture.

    VP8 and VP9 state a key frame's size in a header read without decoding (``vpx``). H.264, HEVC and AV1 go
    to the stream's decoder with ``skip_frame=nokey``: it parses every packet's headers, by the bitstream's
    own idea of a key frame (not the container's flag, which the sender sets), and reconstructs key frames
    only, refusing one over ``max_pixels`` before it allocates it."""
    codec = _codec_name(stream)
    if codec in ("vp8", "vp9"):
        stated = vp8_sizes if codec == "vp8" else vp9_sizes

        def header_sizes(packet: Any, where: str) -> bool:
            for width, height in stated(memoryview(packet)):
                _check_pixels(width, height, policy, where)
            return False
        return header_sizes

    declared = _parameter_sets_checker(stream, codec, policy)
    decoder = stream.codec_context
    decoder.options = {"skip_frame": "nokey", "max_pixels": str(policy.max_pixels), "threads": "1"}

    def decoded_sizes(packet: Any, where: str) -> bool:
        declared(packet, where)
        try:
            pictures = decoder.decode(packet)
        except av.FFmpegError as error:
            if getattr(error, "errno", None) in _OVER_MAX_PIXELS:
                raise VIDEO_TOO_LARGE.error(
                    f"the video's frame size changes{where} to one over the limit of {policy.max_pixels} "
                    "pixels (MMGATE_MAX_VIDEO_PIXELS): send a smaller clip") from None
            raise
        _check_pixels(int(decoder.width), int(decoder.height), policy, where)
        for picture in pictures:
            _check_pixels(int(picture.width), int(picture.height), policy, where)
        return bool(pictures)
    return decoded_sizes


def _has_new_extradata(packet: Any) -> bool:
    """Whether the packet brings new extradata (FFmpeg's MP4 demuxer: a sample of another sample description).
    ``iter_sidedata`` walks only what the packet has; ``has_sidedata`` (where PyAV has no ``iter_sidedata``)
    checks its argument's name against a type on every call, a microsecond on each packet of a clip."""
    sides = getattr(packet, "iter_sidedata", None)
    if sides is None:
        return bool(packet.has_sidedata("new_extradata"))
    return any(side.data_type == "new_extradata" for side in sides())


def _parameter_sets_checker(stream: Any, codec: str, policy: VideoPolicy) -> Callable[[Any, str], None]:
    """What checks the frame size of every parameter set a packet carries (``parameter_sets``), in its data or
    as new extradata (an MP4 with several sample descriptions); the stream's header is checked now."""
    extradata = stream.codec_context.extradata
    reader = ParameterSetReader(codec, extradata)

    def check(read: Callable[[bytes | memoryview], list[tuple[int, int]]], data: bytes | memoryview,
              where: str) -> None:
        try:
            found = read(data)
        except UncheckableParameterSet as error:
            raise VIDEO_INVALID.error(f"the video's frame size cannot be checked{where}: {error}") from None
        for width, height in found:
            if width * height > policy.max_pixels:
                raise VIDEO_TOO_LARGE.error(
                    f"the video carries a {codec} parameter set for {width}x{height} = {width * height} "
                    f"pixels{where}, over the limit of {policy.max_pixels} (MMGATE_MAX_VIDEO_PIXELS), whether "
                    "or not a key frame uses it: send a smaller clip")

    if extradata:
        check(reader.extradata_sizes, extradata, " in the container's header")

    def packet_sets(packet: Any, where: str) -> None:
        if _has_new_extradata(packet):
            check(reader.extradata_sizes, bytes(packet.get_sidedata("new_extradata")), where)
        check(reader.packet_sizes, memoryview(packet), where)
    return packet_sets
