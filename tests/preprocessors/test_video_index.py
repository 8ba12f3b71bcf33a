"""An MP4's declared sample counts are judged before FFmpeg builds an index entry per sample
(``preprocessors/mp4_tables.py``): a file of a few hundred bytes stating millions of samples by a constant
``stsz`` or a ``trun`` without per-sample fields is refused before ``av.open``, and costs the worker nothing.
The files are PyAV's own, their tables rewritten box by box here."""

from __future__ import annotations

import io
import struct
import subprocess
import sys

import aiohttp
import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from preprocessors.base import VideoPolicy, no_checkpoint
from preprocessors.errors import MediaError
from preprocessors.mp4_tables import TableError, declared_tracks
from preprocessors.video import probe_video
from testkit.media import chat_with_video, data_uri, video_clip
from tests.conftest import Proxy, Upstream

_CONTAINERS = frozenset((b"moov", b"trak", b"edts", b"mdia", b"minf", b"stbl", b"moof", b"traf"))


def rewritten(data: bytes, tables: dict[bytes, bytes]) -> bytes:
    """``data``'s boxes with the payloads of ``tables`` replaced, every enclosing box's size updated (the
    ``mdat`` comes before the ``moov`` and ``moof`` in what PyAV writes, so no chunk offset moves)."""
    out, at = bytearray(), 0
    while at + 8 <= len(data):
        size, kind = struct.unpack_from(">I4s", data, at)
        payload = data[at + 8:at + size]
        if kind in _CONTAINERS:
            payload = rewritten(payload, tables)
        elif kind in tables:
            payload = tables[kind]
        out += struct.pack(">I4s", 8 + len(payload), kind) + payload
        at += size
    return bytes(out)


def constant_size_samples(count: int) -> bytes:
    """One 16x16 frame whose ``stsz`` states ``count`` samples of one byte, in one chunk."""
    return rewritten(video_clip(16, 16, 1), {
        b"stsz": struct.pack(">III", 0, 1, count), b"stts": struct.pack(">IIII", 0, 1, count, 512),
        b"stsc": struct.pack(">IIIII", 0, 1, 1, count, 1)})


def empty_fragment_samples(count: int) -> bytes:
    """A fragmented MP4 whose first ``trun`` states ``count`` samples and no per-sample field."""
    import av
    import numpy

    buffer = io.BytesIO()
    with av.open(buffer, "w", format="mp4", options={"movflags": "frag_keyframe+empty_moov"}) as output:
        stream = output.add_stream("libx264", rate=10)
        assert isinstance(stream, av.VideoStream)
        stream.width = stream.height = 16
        stream.pix_fmt = "yuv420p"
        for index in range(2):
            frame = av.VideoFrame.from_ndarray(numpy.zeros((24, 16), numpy.uint8), format="yuv420p")
            frame.pts = index
            output.mux(stream.encode(frame))
        output.mux(stream.encode(None))
    return rewritten(buffer.getvalue(), {b"trun": struct.pack(">III", 1, count, 0)})


def repeated_edits(samples: int, edits: int) -> bytes:
    """``samples`` one-byte samples (within the frame limit), and an edit list that plays them all ``edits``
    times: FFmpeg's edit-list pass copies the index once per edit."""
    clip = video_clip(16, 16, 1)
    at = clip.find(b"elst")
    duration, media_time, rate = struct.unpack_from(">IiI", clip, at + 12)
    edit = struct.pack(">IiI", duration * samples, media_time, rate)
    return rewritten(clip, {
        b"elst": struct.pack(">II", 0, edits) + edit * edits, b"stsz": struct.pack(">III", 0, 1, samples),
        b"stts": struct.pack(">IIII", 0, 1, samples, 512), b"stsc": struct.pack(">IIIII", 0, 1, 1, samples, 1)})


_PEAK = """
import resource, sys
from preprocessors.base import VideoPolicy, no_checkpoint
from preprocessors.errors import MediaError
from preprocessors.errors import MediaError
from preprocessors.video import probe_video, import_pyav
import_pyav()
clip = sys.stdin.buffer.read()
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
try:
    probe_video(clip, VideoPolicy(), no_checkpoint)
except MediaError as error:
    print(error.code, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)
"""


@pytest.mark.parametrize("craft", [constant_size_samples, empty_fragment_samples,
                                   lambda count: repeated_edits(3600, count // 2000)], ids=["stsz", "trun", "elst"])
def test_millions_of_declared_samples_cost_the_probe_no_index(craft: object) -> None:
    """Six million samples cost FFmpeg's index 150 MiB of peak (89 million, 3 GiB), and so do 3,000 edits over
    the 3,600 samples the frame limit allows: refused before ``av.open``, the probe's peak resident size grows
    by less than 16 MiB."""
    assert callable(craft)
    clip = craft(6_000_000)
    assert len(clip) < 40_000
    result = subprocess.run([sys.executable, "-c", _PEAK], input=clip, capture_output=True, check=True)
    code, growth_kib = result.stdout.split()
    assert code == b"video_too_large" and int(growth_kib) < 16 << 10


async def test_a_declared_sample_count_over_the_frame_limit_is_refused(upstream: Upstream, proxy: Proxy) -> None:
    for clip in (constant_size_samples(89_000_000), empty_fragment_samples(89_000_000)):
        async with aiohttp.ClientSession() as session, session.post(
                proxy.url + "/v1/chat/completions", data=orjson.dumps(chat_with_video(data_uri(clip, "video/mp4"))),
                headers={"Content-Type": "application/json"}) as response:
            doc = orjson.loads(await response.read())
        assert response.status == 400 and doc["error"]["code"] == "video_too_large"
        assert "89000000" in doc["error"]["message"] and "MMGATE_MAX_VIDEO_FRAMES" in doc["error"]["message"]
    assert not upstream.seen


def test_the_tables_of_a_clip_with_audio_state_its_samples() -> None:
    """A video track counts its frames; an AAC track its packets, judged against the duration limit."""
    import av
    import numpy

    buffer = io.BytesIO()
    with av.open(buffer, "w", format="mp4") as output:
        video = output.add_stream("libx264", rate=10)
        sound = output.add_stream("aac", rate=16000)
        assert isinstance(video, av.VideoStream) and isinstance(sound, av.AudioStream)
        video.width = video.height = 16
        video.pix_fmt = "yuv420p"
        for index in range(5):
            frame = av.VideoFrame.from_ndarray(numpy.zeros((24, 16), numpy.uint8), format="yuv420p")
            frame.pts = index
            output.mux(video.encode(frame))
        output.mux(video.encode(None))
        samples = av.AudioFrame.from_ndarray(numpy.zeros((1, 16000), numpy.float32), format="fltp", layout="mono")
        samples.sample_rate, samples.pts = 16000, 0
        output.mux(sound.encode(samples))
        output.mux(sound.encode(None))
    tracks = {track.handler: track.samples for track in declared_tracks(buffer.getvalue(), 1000)}
    assert tracks["vide"] == 5 and 15 <= tracks["soun"] <= 20


def test_a_clip_with_a_few_edits_is_not_refused() -> None:
    """An empty edit then two playing the clip (a cut, a repeat): editing, not an index bomb."""
    clip = video_clip(16, 16, 4)
    at = clip.find(b"elst")
    duration, media_time, rate = struct.unpack_from(">IiI", clip, at + 12)
    edits = struct.pack(">IiI", duration, -1, rate) + struct.pack(">IiI", duration, media_time, rate) * 2
    edited = rewritten(clip, {b"elst": struct.pack(">II", 0, 3) + edits})
    (track,) = declared_tracks(edited, 1000)
    assert track.edits == 2 and track.samples == 4
    assert probe_video(edited, VideoPolicy(max_frames=8), no_checkpoint).frames >= 4


def test_a_file_of_more_boxes_than_a_clip_holds_is_refused() -> None:
    """Millions of empty boxes would keep the walk busy for seconds: it stops past the bound, which a
    fragmented clip at the frame limit stays under."""
    fragmented = empty_fragment_samples(2)
    assert declared_tracks(fragmented, 40)
    with pytest.raises(TableError, match="more than 40 boxes"):
        declared_tracks(fragmented + b"\x00\x00\x00\x08free" * 50, 40)
    with pytest.raises(MediaError, match="boxes") as caught:
        probe_video(video_clip(16, 16, 1) + b"\x00\x00\x00\x08free" * 200_000, VideoPolicy(), no_checkpoint)
    assert caught.value.code == "video_invalid"


def test_a_table_larger_than_its_box_is_malformed() -> None:
    clip = rewritten(video_clip(16, 16, 1), {b"stsz": struct.pack(">IIII", 0, 0, 1000, 7)})
    with pytest.raises(TableError, match="stsz"):
        declared_tracks(clip, 1000)


@given(data=st.binary(max_size=300), at=st.integers(0, 2000))
def test_any_bytes_are_tracks_or_a_table_error(data: bytes, at: int) -> None:
    """Bytes anywhere in a clip's boxes: the walk answers tracks or ``TableError``, never another exception."""
    clip = bytearray(video_clip(16, 16, 1))
    at %= len(clip)
    clip[at:at + len(data)] = data
    try:
        declared_tracks(bytes(clip), 1000)
    except TableError:
        pass
