"""Video parts are probed in the decode workers before the backend sees them: allowed container and codec,
frame size, frame count and duration within the limits, the clip forwarded byte for byte. Clips are encoded
with PyAV itself, in memory."""

from __future__ import annotations

import base64
import functools
import io
import subprocess
import sys
from collections.abc import Iterator
from fractions import Fraction
from typing import Any

import aiohttp
import openai
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from preprocessors.base import VideoPolicy, no_checkpoint
from preprocessors.errors import MediaError
from preprocessors.video import MAX_STREAMS, probe_video
from testkit.media import chat_with_video, data_uri, video_clip
from tests.conftest import Proxy, StartProxy, Upstream


@functools.cache
def clip_8k() -> bytes:
    """Three frames of 7680x4320: a few hundred KB that a backend would decode to 150 MB of pixels."""
    return video_clip(7680, 4320, 3)


async def post(proxy: Proxy, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    async with aiohttp.ClientSession() as session, session.post(
            proxy.url + "/v1/chat/completions", data=orjson.dumps(body),
            headers={"Content-Type": "application/json"}) as response:
        return response.status, orjson.loads(await response.read())


@pytest.mark.parametrize(("codec", "container"), [("libx264", "mp4"), ("libvpx-vp9", "webm"),
                                                  ("libx264", "matroska"), ("libsvtav1", "mp4")])
async def test_a_valid_clip_reaches_the_upstream_byte_for_byte(upstream: Upstream, proxy: Proxy, codec: str,
                                                               container: str) -> None:
    mime = "video/webm" if container == "webm" else "video/mp4"
    body = orjson.dumps(chat_with_video(data_uri(video_clip(codec=codec, container=container), mime)))
    async with aiohttp.ClientSession() as session, session.post(
            proxy.url + "/v1/chat/completions", data=body, headers={"Content-Type": "application/json"}) as response:
        assert response.status == 200
    assert upstream.seen[-1].body == body


def with_a_latin1_title(clip_of: str) -> bytes:
    """A clip whose container and stream titles are Latin-1, not UTF-8, as some cameras and old muxers write
    them: written as UTF-8 ``é`` (two bytes), then swapped for Latin-1's one-byte ``é`` and a space."""
    import av

    buffer = io.BytesIO()
    with av.open(buffer, "w", format=clip_of) as output:
        output.metadata["title"] = "caf\u00e9 title"
        stream = output.add_stream("libx264", rate=10)
        assert isinstance(stream, av.VideoStream)
        stream.width, stream.height, stream.pix_fmt = 32, 32, "yuv420p"
        stream.metadata["title"] = "caf\u00e9 title"
        for frame in flat_frames(32, 32, 3):
            output.mux(stream.encode(frame))
        output.mux(stream.encode(None))
    clip = buffer.getvalue()
    assert b"caf\xc3\xa9 title" in clip
    return clip.replace(b"caf\xc3\xa9 title", b"caf\xe9  title")


@pytest.mark.parametrize("container", ["mp4", "matroska"])
async def test_a_clip_whose_titles_are_not_utf8_reaches_the_upstream(upstream: Upstream, proxy: Proxy,
                                                                     container: str) -> None:
    """Tags are not the probe's business: one in another encoding passes, on every PyAV the extra allows."""
    body = orjson.dumps(chat_with_video(data_uri(with_a_latin1_title(container), "video/mp4")))
    async with aiohttp.ClientSession() as session, session.post(
            proxy.url + "/v1/chat/completions", data=body, headers={"Content-Type": "application/json"}) as response:
        assert response.status == 200, await response.text()
    assert upstream.seen[-1].body == body


async def test_a_valid_clip_through_the_openai_sdk(upstream: Upstream, proxy: Proxy) -> None:
    uri = data_uri(video_clip(), "video/mp4")
    client = openai.AsyncOpenAI(base_url=proxy.url + "/v1", api_key="k", max_retries=0)
    try:
        await client.chat.completions.with_raw_response.create(
            model="m", messages=chat_with_video(uri)["messages"])
    finally:
        await client.close()
    sent = orjson.loads(upstream.seen[-1].body)
    assert sent["messages"][0]["content"][1] == {"type": "video_url", "video_url": {"url": uri}}


async def test_an_8k_clip_of_a_few_hundred_kb_is_refused_naming_the_pixel_limit(upstream: Upstream,
                                                                                proxy: Proxy) -> None:
    clip = clip_8k()
    assert len(clip) < 1 << 20
    client = openai.AsyncOpenAI(base_url=proxy.url + "/v1", api_key="k", max_retries=0)
    try:
        with pytest.raises(openai.BadRequestError) as caught:
            await client.chat.completions.create(model="m", messages=chat_with_video(
                data_uri(clip, "video/mp4"))["messages"])
    finally:
        await client.close()
    error = caught.value.body
    assert isinstance(error, dict)
    assert error["code"] == "video_too_large" and "MMGATE_MAX_VIDEO_PIXELS" in error["message"]
    assert error["param"] == "messages[0].content[1]"
    assert not upstream.seen


async def test_generate_video_data_in_base64_is_probed_too(upstream: Upstream, proxy: Proxy) -> None:
    """SGLang's ``/generate``: ``video_data`` as bare base64 (a batch here) goes through the same probe."""
    good = base64.b64encode(video_clip()).decode()
    body = orjson.dumps({"text": ["a", "b"], "video_data": [good, base64.b64encode(clip_8k()).decode()]})
    async with aiohttp.ClientSession() as session, session.post(
            proxy.url + "/generate", data=body, headers={"Content-Type": "application/json"}) as response:
        doc = orjson.loads(await response.read())
    assert response.status == 400 and doc["error"]["code"] == "video_too_large"
    assert doc["error"]["param"] == "video_data[1]" and not upstream.seen
    body = orjson.dumps({"text": "a", "video_data": good})
    async with aiohttp.ClientSession() as session, session.post(
            proxy.url + "/generate", data=body, headers={"Content-Type": "application/json"}) as response:
        assert response.status == 200
    assert upstream.seen[-1].body == body


async def test_the_pixel_limit_is_a_setting(upstream: Upstream, start_proxy: StartProxy) -> None:
    proxy = await start_proxy(upstream.url, MMGATE_MAX_VIDEO_PIXELS=str(64 * 48 - 1))
    status, doc = await post(proxy, chat_with_video(data_uri(video_clip(64, 48), "video/mp4")))
    assert status == 400 and doc["error"]["code"] == "video_too_large"
    assert "MMGATE_MAX_VIDEO_PIXELS" in doc["error"]["message"] and "64x48" in doc["error"]["message"]
    status, _doc = await post(proxy, chat_with_video(data_uri(video_clip(32, 48), "video/mp4")))
    assert status == 200


@pytest.mark.parametrize(("codec", "container"), [("libx264", "mp4"), ("libvpx-vp9", "webm")])
async def test_too_many_frames_is_refused_naming_the_frame_limit(upstream: Upstream, start_proxy: StartProxy,
                                                                codec: str, container: str) -> None:
    """MP4 says its frame count in its index; WebM does not, and its packets are counted instead."""
    proxy = await start_proxy(upstream.url, MMGATE_MAX_VIDEO_FRAMES="4")
    status, _doc = await post(proxy, chat_with_video(data_uri(video_clip(frames=4, codec=codec,
                                                                         container=container), "video/mp4")))
    assert status == 200
    status, doc = await post(proxy, chat_with_video(data_uri(video_clip(frames=6, codec=codec,
                                                                        container=container), "video/mp4")))
    assert status == 400 and doc["error"]["code"] == "video_too_large"
    assert "MMGATE_MAX_VIDEO_FRAMES" in doc["error"]["message"]
    assert len(upstream.seen) == 1


async def test_too_long_is_refused_naming_the_duration_limit(upstream: Upstream, start_proxy: StartProxy) -> None:
    proxy = await start_proxy(upstream.url, MMGATE_MAX_VIDEO_SECONDS="2")
    status, doc = await post(proxy, chat_with_video(data_uri(video_clip(frames=3, rate=1), "video/mp4")))
    assert status == 400 and doc["error"]["code"] == "video_too_large"
    assert "MMGATE_MAX_VIDEO_SECONDS" in doc["error"]["message"] and "3.0 s" in doc["error"]["message"]
    assert not upstream.seen


@pytest.mark.parametrize("data", [b"garbage declared as video/mp4" * 50, b"\x00\x00\x00\x18ftypmp42" + bytes(64),
                                  b"", b"GIF89a" + bytes(100)])
async def test_what_is_not_a_video_is_refused(upstream: Upstream, proxy: Proxy, data: bytes) -> None:
    status, doc = await post(proxy, chat_with_video(data_uri(data, "video/mp4")))
    assert status == 400 and doc["error"]["code"] in ("video_invalid", "invalid_base64")
    assert doc["error"]["param"] == "messages[0].content[1]"
    assert not upstream.seen


async def test_a_codec_outside_the_allowlist_is_refused(upstream: Upstream, proxy: Proxy) -> None:
    status, doc = await post(proxy, chat_with_video(data_uri(video_clip(codec="mpeg4"), "video/mp4")))
    assert status == 400 and doc["error"]["code"] == "video_invalid" and "mpeg4" in doc["error"]["message"]
    assert not upstream.seen


def test_a_truncated_clip_is_refused() -> None:
    clip = video_clip(frames=5)  # ftyp, mdat, then moov: the index comes last
    for cut in (len(clip) // 3, len(clip) // 2, clip.find(b"moov") + 64):
        with pytest.raises(MediaError) as caught:
            probe_video(clip[:cut], VideoPolicy(), no_checkpoint)
        assert caught.value.code == "video_invalid"


def test_the_probe_stops_at_the_checkpoint() -> None:
    """Counting packets calls the job's checkpoint (the request's deadline) as it goes."""
    clip = video_clip(16, 16, frames=200, codec="libvpx-vp9", container="webm")
    calls: list[int] = []

    class Stop(Exception):
        pass

    def checkpoint() -> None:
        calls.append(1)
        if len(calls) > 1:
            raise Stop

    with pytest.raises(Stop):
        probe_video(clip, VideoPolicy(), checkpoint)


def test_without_pyav_a_video_part_is_refused_with_the_fix() -> None:
    """The video extra missing (the import fails): the worker refuses the part, naming what to install."""
    script = (
        "import sys; sys.modules['av'] = None\n"
        "from preprocessors.base import AudioPolicy, ImagePolicy, no_checkpoint\n"
        "from preprocessors.errors import MediaError\n"
        "from preprocessors.job import MediaTask, run_task\n"
        "import base64\n"
        "task = MediaTask('video', 'p', 1 << 20, ImagePolicy(), AudioPolicy())\n"
        "try:\n"
        "    run_task(task, lambda: base64.b64encode(b'x' * 64), no_checkpoint)\n"
        "except MediaError as error:\n"
        "    print(error.code, error.message)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    assert out.startswith("video_unavailable ") and "mmgate[video]" in out


@functools.cache
def small_clips() -> tuple[bytes, ...]:
    return (video_clip(32, 32, 4), video_clip(32, 32, 4, codec="libvpx-vp9", container="webm"),
            video_clip(32, 32, 4, container="matroska"))


@settings(max_examples=150, deadline=None)
@given(which=st.integers(0, 2), cut=st.integers(0, 4000),
       flips=st.lists(st.tuples(st.integers(0, 4000), st.integers(0, 255)), max_size=8))
def test_a_damaged_clip_is_a_video_or_a_media_error(which: int, cut: int, flips: list[tuple[int, int]]) -> None:
    """Bytes flipped anywhere, the end cut anywhere: the probe answers with a ``VideoInfo`` within the limits or
    a ``MediaError``, never another exception (which would be a 500)."""
    data = bytearray(small_clips()[which])
    for at, value in flips:
        data[at % len(data)] = value
    policy = VideoPolicy(max_pixels=64 * 64, max_frames=8, max_seconds=5)
    try:
        info = probe_video(bytes(data[: max(1, len(data) - cut)]), policy, no_checkpoint)
    except MediaError as error:
        assert error.code in ("video_invalid", "video_too_large")
        return
    assert info.width * info.height <= policy.max_pixels and 0 < info.frames <= policy.max_frames
    assert info.seconds <= policy.max_seconds


def flat_frames(width: int, height: int, count: int) -> Iterator[Any]:
    import av
    import numpy

    plane = numpy.zeros((height * 3 // 2, width), numpy.uint8)
    for index in range(count):
        frame = av.VideoFrame.from_ndarray(plane, format="yuv420p")
        frame.pts = index
        yield frame


def muxed(container: str, tracks: list[tuple[str, int, int, int]], options: dict[str, str] | None = None,
          audio: str | None = None) -> bytes:
    """A clip of several tracks, each ``(codec, width, height, frames)`` of flat frames, and an audio track."""
    import av

    buffer = io.BytesIO()
    with av.open(buffer, "w", format=container, options=options or {}) as output:
        streams = []  # every stream is added before the first packet writes the header
        for codec, width, height, _frames in tracks:
            stream = output.add_stream(codec, rate=10)
            assert isinstance(stream, av.VideoStream)
            stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
            if codec == "libx264":
                stream.options = {"preset": "ultrafast", "tune": "zerolatency"}
                stream.codec_context.gop_size = 1  # a fragment per frame where the muxer cuts at keyframes
            streams.append(stream)
        sound = output.add_stream(audio, rate=16000) if audio is not None else None
        for stream, (_codec, width, height, frames) in zip(streams, tracks, strict=True):
            for frame in flat_frames(width, height, frames):
                output.mux(stream.encode(frame))
            output.mux(stream.encode(None))
        if sound is not None:
            assert isinstance(sound, av.AudioStream)
            samples = av.AudioFrame(format=sound.format.name, layout="mono", samples=sound.frame_size or 1024)
            samples.sample_rate, samples.pts = 16000, 0
            for plane in samples.planes:
                plane.update(bytes(plane.buffer_size))
            output.mux(sound.encode(samples))
            output.mux(sound.encode(None))
    return buffer.getvalue()


def switching_size(codec: str, container: str, small: int, large: int, small_frames: int) -> bytes:
    """A stream of ``small`` square frames, then a key frame of ``large`` ones, from a second encoder: a VP9
    key frame states its own size, an H.264 or AV1 one carries a new sequence header in-band (an encoder of its
    own writes no global header), so the container's header only knows the first size."""
    import av

    options = {"libvpx-vp9": {"deadline": "realtime", "cpu-used": "8"},
               "libx264": {"preset": "ultrafast", "tune": "zerolatency"}}.get(codec, {})
    encoder = av.CodecContext.create(codec, "w")
    assert isinstance(encoder, av.VideoCodecContext)
    encoder.width = encoder.height = large
    encoder.pix_fmt, encoder.time_base, encoder.options = "yuv420p", Fraction(1, 10), dict(options)
    later = [packet for frame in flat_frames(large, large, 1) for packet in encoder.encode(frame)]
    later += encoder.encode(None)
    buffer = io.BytesIO()
    with av.open(buffer, "w", format=container) as output:
        stream = output.add_stream(codec, rate=10)
        assert isinstance(stream, av.VideoStream)
        stream.width = stream.height = small
        stream.pix_fmt, stream.options = "yuv420p", dict(options)
        for frame in flat_frames(small, small, small_frames):
            output.mux(stream.encode(frame))
        output.mux(stream.encode(None))
        for packet in later:
            assert packet.pts is not None
            packet.pts = packet.dts = packet.pts + small_frames
            packet.stream, packet.time_base = stream, Fraction(1, 10)
            output.mux(packet)
    return buffer.getvalue()


async def test_a_clip_of_more_streams_than_the_bound_is_refused(upstream: Upstream, proxy: Proxy) -> None:
    """Every stream costs the demuxer a decoder context while it finds them: a small clip of many tiny tracks
    would hold hundreds of MB in a worker. The demuxer opens one past the bound, and the clip is refused."""
    for container in ("matroska", "mp4"):
        clip = muxed(container, [("libx264", 16, 16, 1)] * (MAX_STREAMS * 3))
        status, doc = await post(proxy, chat_with_video(data_uri(clip, "video/mp4")))
        assert status == 400 and doc["error"]["code"] == "video_invalid"
        assert f"more than {MAX_STREAMS} streams" in doc["error"]["message"]
    assert not upstream.seen


async def test_a_second_video_stream_is_refused_whatever_its_size_or_codec(upstream: Upstream,
                                                                          start_proxy: StartProxy) -> None:
    """A small stream 0 beside a large stream 1 (which FFmpeg's best-stream choice would decode), or beside
    a codec outside the allowlist: one clip is one video stream."""
    proxy = await start_proxy(upstream.url, MMGATE_MAX_VIDEO_PIXELS=str(64 * 64))
    for second in (("libx264", 256, 256, 1), ("mpeg4", 32, 32, 1)):
        clip = muxed("matroska", [("libx264", 32, 32, 2), second])
        status, doc = await post(proxy, chat_with_video(data_uri(clip, "video/mp4")))
        assert status == 400 and doc["error"]["code"] == "video_invalid"
        assert "2 video streams" in doc["error"]["message"]
    assert not upstream.seen


async def test_audio_in_an_allowed_codec_goes_through_and_another_is_refused(upstream: Upstream,
                                                                            proxy: Proxy) -> None:
    body = chat_with_video(data_uri(muxed("matroska", [("libx264", 32, 32, 2)], audio="aac"), "video/mp4"))
    status, _doc = await post(proxy, body)
    assert status == 200 and upstream.seen[-1].body == orjson.dumps(body)
    clip = muxed("matroska", [("libx264", 32, 32, 2)], audio="mp2")
    status, doc = await post(proxy, chat_with_video(data_uri(clip, "video/mp4")))
    assert status == 400 and doc["error"]["code"] == "video_invalid" and "mp2" in doc["error"]["message"]
    assert len(upstream.seen) == 1


async def test_frames_in_the_fragments_of_an_mp4_count_against_the_frame_limit(upstream: Upstream,
                                                                             start_proxy: StartProxy) -> None:
    """A fragmented MP4's index lists only the samples before its first fragment (one here): the frames
    are counted from the packets too."""
    proxy = await start_proxy(upstream.url, MMGATE_MAX_VIDEO_FRAMES="8")
    fragmented = {"movflags": "frag_keyframe"}
    status, _doc = await post(proxy, chat_with_video(data_uri(
        muxed("mp4", [("libx264", 16, 16, 8)], fragmented), "video/mp4")))
    assert status == 200
    status, doc = await post(proxy, chat_with_video(data_uri(
        muxed("mp4", [("libx264", 16, 16, 40)], fragmented), "video/mp4")))
    assert status == 400 and doc["error"]["code"] == "video_too_large"
    assert "MMGATE_MAX_VIDEO_FRAMES" in doc["error"]["message"]
    assert len(upstream.seen) == 1


@pytest.mark.parametrize(("codec", "container"), [("libvpx-vp9", "webm"), ("libx264", "matroska"),
                                                  ("libx264", "mp4"), ("libsvtav1", "matroska")])
async def test_a_key_frame_that_changes_to_a_size_over_the_pixel_limit_is_refused(
        upstream: Upstream, start_proxy: StartProxy, codec: str, container: str) -> None:
    """The header says 64x64 for the first frames; a later key frame says 256x256, over the limit."""
    proxy = await start_proxy(upstream.url, MMGATE_MAX_VIDEO_PIXELS=str(128 * 128))
    clip = switching_size(codec, container, 64, 256, 12)
    status, doc = await post(proxy, chat_with_video(data_uri(clip, "video/mp4")))
    assert status == 400 and doc["error"]["code"] == "video_too_large"
    message = doc["error"]["message"]
    assert "MMGATE_MAX_VIDEO_PIXELS" in message and "from 1.2 s" in message
    status, _doc = await post(proxy, chat_with_video(data_uri(switching_size(codec, container, 64, 96, 12),
                                                              "video/mp4")))
    assert status == 200 and len(upstream.seen) == 1
