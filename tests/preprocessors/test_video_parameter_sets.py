"""Every parameter set a clip carries is judged against the pixel limit, whether or not a key frame uses it
(``preprocessors/parameter_sets.py``): an H.264 stream that switches to 8K on open-GOP I slices, which
FFmpeg's ``skip_frame=nokey`` never activates, is refused. The attack's SPS, PPS and slice are written bit by
bit here (no 8K encode): a plain PyAV decode of the same clip shows 7680x4320 frames."""

from __future__ import annotations

import io
from fractions import Fraction
from typing import Any

import aiohttp
import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from preprocessors.parameter_sets import (
    ParameterSetReader,
    UncheckableParameterSet,
    av1_sequence_header_size,
    h264_sps_size,
    hevc_sps_size,
)
from testkit.media import chat_with_video, data_uri, video_clip
from tests.conftest import Proxy, StartProxy, Upstream


class BitWriter:
    """An RBSP written field by field, escaped (``00 00 03``) as a NAL unit's payload."""

    def __init__(self) -> None:
        self.bits: list[int] = []

    def u(self, count: int, value: int) -> None:
        self.bits += [(value >> (count - 1 - index)) & 1 for index in range(count)]

    def ue(self, value: int) -> None:
        value += 1
        self.u(value.bit_length() - 1, 0)
        self.u(value.bit_length(), value)

    def se(self, value: int) -> None:
        self.ue(2 * value - 1 if value > 0 else -2 * value)

    def raw(self) -> bytes:
        bits = [*self.bits, 1]  # rbsp_stop_one_bit (AV1: trailing_one_bit), then zeros to a byte
        bits += [0] * (-len(bits) % 8)
        return bytes(int("".join(map(str, bits[at:at + 8])), 2) for at in range(0, len(bits), 8))

    def payload(self) -> bytes:
        escaped, zeros = bytearray(), 0
        for byte in self.raw():
            if zeros >= 2 and byte <= 3:
                escaped.append(3)
                zeros = 0
            escaped.append(byte)
            zeros = zeros + 1 if byte == 0 else 0
        return bytes(escaped)


def nal(kind: int, bits: BitWriter) -> bytes:
    return b"\x00\x00\x00\x01" + bytes([0x60 | kind]) + bits.payload()


def h264_sps(width_mbs: int, height_mbs: int, *, sps_id: int = 1, profile: int = 66, frame_mbs_only: int = 1,
             poc_type: int = 2, scaling: bool = False) -> bytes:
    """A sequence parameter set (ITU-T H.264 7.3.2.1.1) of ``width_mbs`` x ``height_mbs`` macroblocks."""
    bits = BitWriter()
    bits.u(8, profile)
    bits.u(8, 0)
    bits.u(8, 51)
    bits.ue(sps_id)
    if profile == 100:
        bits.ue(1)  # chroma_format_idc 4:2:0
        bits.ue(0)
        bits.ue(0)
        bits.u(1, 0)
        bits.u(1, int(scaling))
        if scaling:
            for index in range(8):
                bits.u(1, 1)
                for _ in range(16 if index < 6 else 64):
                    bits.se(3)
    bits.ue(0)  # log2_max_frame_num_minus4
    bits.ue(poc_type)
    if poc_type == 0:
        bits.ue(2)
    elif poc_type == 1:
        bits.u(1, 0)
        bits.se(-1)
        bits.se(2)
        bits.ue(3)
        for offset in (1, -2, 3):
            bits.se(offset)
    bits.ue(1)  # max_num_ref_frames
    bits.u(1, 0)
    bits.ue(width_mbs - 1)
    bits.ue((height_mbs if frame_mbs_only else height_mbs // 2) - 1)
    bits.u(1, frame_mbs_only)
    if not frame_mbs_only:
        bits.u(1, 0)
    bits.u(1, 1)
    bits.u(1, 0)
    bits.u(1, 0)
    return nal(7, bits)


def h264_pps(pps_id: int = 1, sps_id: int = 1) -> bytes:
    """A CAVLC picture parameter set (7.3.2.2) with deblocking control."""
    bits = BitWriter()
    bits.ue(pps_id)
    bits.ue(sps_id)
    bits.u(2, 0)
    bits.ue(0)
    bits.ue(0)
    bits.ue(0)
    bits.u(3, 0)
    bits.se(0)
    bits.se(0)
    bits.se(0)
    bits.u(3, 0b100)
    return nal(8, bits)


def open_gop_i_slice(frame_num: int, pps_id: int = 1) -> bytes:
    """A non-IDR I slice (NAL type 1) of one flat macroblock, with no recovery point: no key frame to
    ``skip_frame=nokey``; a decoder conceals the rest of the picture."""
    bits = BitWriter()
    bits.ue(0)  # first_mb_in_slice
    bits.ue(7)  # slice_type: I, every slice of the picture
    bits.ue(pps_id)
    bits.u(4, frame_num)
    bits.u(1, 0)  # adaptive_ref_pic_marking_mode_flag
    bits.se(0)  # slice_qp_delta
    bits.ue(1)  # disable_deblocking_filter_idc
    bits.ue(3)  # mb_type I_16x16, DC prediction, no coded blocks
    bits.ue(0)  # intra_chroma_pred_mode
    bits.se(0)  # mb_qp_delta
    bits.u(1, 1)  # the DC block's coeff_token: no coefficients
    return nal(1, bits)


def open_gop_switch(container: str, large_mbs: tuple[int, int], small: int = 64, frames: int = 10) -> bytes:
    """``frames`` IDR-led frames of ``small`` square from x264, then a second SPS/PPS (id 1) of ``large_mbs``
    macroblocks, used only by open-GOP I slices."""
    import av
    import numpy

    buffer = io.BytesIO()
    with av.open(buffer, "w", format=container) as output:
        stream = output.add_stream("libx264", rate=10)
        assert isinstance(stream, av.VideoStream)
        stream.width = stream.height = small
        stream.pix_fmt, stream.options = "yuv420p", {"preset": "ultrafast", "tune": "zerolatency"}
        plane = numpy.zeros((small * 3 // 2, small), numpy.uint8)
        for index in range(frames):
            frame = av.VideoFrame.from_ndarray(plane, format="yuv420p")
            frame.pts = index
            output.mux(stream.encode(frame))
        output.mux(stream.encode(None))
        for index in range(4):
            data = (h264_sps(*large_mbs) + h264_pps() if index == 0 else b"") + open_gop_i_slice(index)
            packet = av.Packet(data)
            packet.pts = packet.dts = frames + index
            packet.stream, packet.time_base = stream, Fraction(1, 10)
            output.mux(packet)
    return buffer.getvalue()


def decoded_sizes(clip: bytes) -> set[tuple[int, int]]:
    """The frame sizes a plain decode (a backend's) shows."""
    import av

    with av.open(io.BytesIO(clip), "r") as container:
        return {(frame.width, frame.height) for frame in container.decode(video=0)}


async def post(proxy: Proxy, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    async with aiohttp.ClientSession() as session, session.post(
            proxy.url + "/v1/chat/completions", data=orjson.dumps(body),
            headers={"Content-Type": "application/json"}) as response:
        return response.status, orjson.loads(await response.read())


@pytest.mark.parametrize("container", ["mp4", "matroska"])
async def test_an_open_gop_switch_to_8k_is_refused(upstream: Upstream, proxy: Proxy, container: str) -> None:
    clip = open_gop_switch(container, (480, 270))
    assert len(clip) < 4096 and (7680, 4320) in decoded_sizes(clip)  # what a backend would decode
    status, doc = await post(proxy, chat_with_video(data_uri(clip, "video/mp4")))
    assert status == 400 and doc["error"]["code"] == "video_too_large"
    message = doc["error"]["message"]
    assert "7680x4320" in message and "MMGATE_MAX_VIDEO_PIXELS" in message and "from 1.0 s" in message
    assert not upstream.seen


async def test_an_open_gop_switch_within_the_limit_goes_through(upstream: Upstream,
                                                                start_proxy: StartProxy) -> None:
    proxy = await start_proxy(upstream.url, MMGATE_MAX_VIDEO_PIXELS=str(128 * 128))
    clip = open_gop_switch("mp4", (8, 8))
    assert (128, 128) in decoded_sizes(clip)
    status, _doc = await post(proxy, chat_with_video(data_uri(clip, "video/mp4")))
    assert status == 200
    status, doc = await post(proxy, chat_with_video(data_uri(open_gop_switch("mp4", (8, 9)), "video/mp4")))
    assert status == 400 and "128x144" in doc["error"]["message"]
    assert len(upstream.seen) == 1


async def test_a_parameter_set_that_cannot_be_read_is_refused(upstream: Upstream, proxy: Proxy) -> None:
    """An SPS cut before its frame size says no size: the clip is refused, not let through unchecked."""
    import av

    buffer = io.BytesIO()
    with av.open(buffer, "w", format="matroska") as output:
        stream = output.add_stream("libx264", rate=10)
        assert isinstance(stream, av.VideoStream)
        stream.width = stream.height = 32
        stream.pix_fmt, stream.options = "yuv420p", {"preset": "ultrafast"}
        for packet in [*stream.encode(av.VideoFrame(32, 32, "yuv420p")), *stream.encode(None)]:
            output.mux(packet)
        cut = av.Packet(h264_sps(480, 270)[:8] + open_gop_i_slice(1))
        cut.pts = cut.dts = 1
        cut.stream, cut.time_base = stream, Fraction(1, 10)
        output.mux(cut)
    status, doc = await post(proxy, chat_with_video(data_uri(buffer.getvalue(), "video/mp4")))
    assert status == 400 and doc["error"]["code"] == "video_invalid"
    assert "cannot be checked" in doc["error"]["message"]
    assert not upstream.seen


@given(width_mbs=st.integers(1, 600), height_mbs=st.integers(1, 300), profile=st.sampled_from([66, 100]),
       frame_mbs_only=st.integers(0, 1), poc_type=st.integers(0, 2), scaling=st.booleans())
def test_an_h264_sps_states_its_coded_size(width_mbs: int, height_mbs: int, profile: int, frame_mbs_only: int,
                                           poc_type: int, scaling: bool) -> None:
    height_mbs += height_mbs % 2 * (1 - frame_mbs_only)  # a field pair has an even number of rows
    sps = h264_sps(width_mbs, height_mbs, profile=profile, frame_mbs_only=frame_mbs_only, poc_type=poc_type,
                   scaling=scaling)
    assert h264_sps_size(sps[4:]) == (16 * width_mbs, 16 * height_mbs)
    reader = ParameterSetReader("h264", None)
    assert reader.packet_sizes(sps + h264_pps()) == [(16 * width_mbs, 16 * height_mbs)]


@pytest.mark.parametrize(("codec", "width", "height", "coded"), [
    ("libx264", 1920, 1080, (1920, 1088)), ("libx264", 64, 48, (64, 48)), ("libx265", 640, 360, (640, 360)),
    ("libx265", 200, 120, (200, 120)), ("libsvtav1", 64, 48, (64, 48)), ("libsvtav1", 320, 200, (320, 200))])
@pytest.mark.parametrize("container", ["mp4", "matroska"])
def test_the_encoders_parameter_sets_are_read(codec: str, width: int, height: int, coded: tuple[int, int],
                                              container: str) -> None:
    """The header record (avcC, hvcC, av1C) of x264, x265 and SVT-AV1 clips, and AV1's in-band header."""
    import av

    with av.open(io.BytesIO(video_clip(width, height, codec=codec, container=container)), "r") as clip:
        stream = clip.streams.video[0]
        context = stream.codec_context
        reader = ParameterSetReader(context.codec.canonical_name, context.extradata)
        assert context.extradata is not None and reader.extradata_sizes(context.extradata) == [coded]
        in_band = [size for packet in clip.demux(stream) for size in reader.packet_sizes(memoryview(packet))]
    assert set(in_band) <= {coded}


def hevc_sps(width: int, height: int, sub_layers: list[tuple[bool, bool]], chroma_format_idc: int) -> bytes:
    """An HEVC SPS (ITU-T H.265 7.3.2.2) up to its size: ``sub_layers`` says, per sub-layer, whether its
    profile and its level are present in ``profile_tier_level``."""
    bits = BitWriter()
    bits.u(4, 0)  # sps_video_parameter_set_id
    bits.u(3, len(sub_layers))  # sps_max_sub_layers_minus1
    bits.u(1, 1)
    bits.u(8, 1)  # general profile space, tier, profile_idc 1
    bits.u(32, 0x60000000)
    bits.u(48, 0x900000000000)  # four source flags, 43 zero bits and one more
    bits.u(8, 93)  # general_level_idc
    for profile, level in sub_layers:
        bits.u(1, int(profile))
        bits.u(1, int(level))
    if sub_layers:
        bits.u(2 * (8 - len(sub_layers)), 0)
    for profile, level in sub_layers:
        if profile:
            bits.u(88, 1 << 80)
        if level:
            bits.u(8, 90)
    bits.ue(0)  # sps_seq_parameter_set_id
    bits.ue(chroma_format_idc)
    if chroma_format_idc == 3:
        bits.u(1, 0)
    bits.ue(width)
    bits.ue(height)
    bits.u(1, 0)  # conformance_window_flag
    return b"\x00\x00\x00\x01" + bytes([_HEVC_SPS << 1, 1]) + bits.payload()


_HEVC_SPS = 33


@given(width=st.integers(8, 20000), height=st.integers(8, 20000), chroma_format_idc=st.integers(0, 3),
       sub_layers=st.lists(st.tuples(st.booleans(), st.booleans()), max_size=6))
def test_an_hevc_sps_states_its_size(width: int, height: int, chroma_format_idc: int,
                                     sub_layers: list[tuple[bool, bool]]) -> None:
    sps = hevc_sps(width, height, sub_layers, chroma_format_idc)
    assert hevc_sps_size(sps[4:]) == (width, height)
    assert ParameterSetReader("hevc", None).packet_sizes(sps) == [(width, height)]


def av1_sequence_header(width: int, height: int, *, reduced: bool, timing: bool, decoder_model: bool,
                        display_delay: bool, levels: list[int]) -> bytes:
    """An AV1 sequence header OBU (AV1 Bitstream Specification 5.5) with a size field, up to its frame size
    and a few fields more."""
    bits = BitWriter()
    bits.u(3, 0)  # seq_profile
    bits.u(1, int(reduced))  # still_picture
    bits.u(1, int(reduced))  # reduced_still_picture_header
    if reduced:
        bits.u(5, 8)
    else:
        bits.u(1, int(timing))
        if timing:
            bits.u(32, 1001)
            bits.u(32, 30000)
            bits.u(1, 1)  # equal_picture_interval
            bits.u(3, 0b010)  # uvlc: num_ticks_per_picture_minus_1 = 1
            bits.u(1, int(decoder_model))
            if decoder_model:
                bits.u(5, 9)  # buffer_delay_length_minus_1
                bits.u(32, 1)
                bits.u(10, 0)
        bits.u(1, int(display_delay))
        bits.u(5, len(levels) - 1)
        for level in levels:
            bits.u(12, 0x103)
            bits.u(5, level)
            if level > 7:
                bits.u(1, 1)
            if timing and decoder_model:
                bits.u(1, 1)
                bits.u(10, 500)
                bits.u(10, 600)
                bits.u(1, 0)
            if display_delay:
                bits.u(1, 1)
                bits.u(4, 9)
    width_bits, height_bits = max(1, (width - 1).bit_length()), max(1, (height - 1).bit_length())
    bits.u(4, width_bits - 1)
    bits.u(4, height_bits - 1)
    bits.u(width_bits, width - 1)
    bits.u(height_bits, height - 1)
    bits.u(3, 0b101)
    payload = bits.raw()
    assert len(payload) < 128
    return bytes([_AV1_SEQUENCE_HEADER << 3 | 2, len(payload)]) + payload


_AV1_SEQUENCE_HEADER = 1


@given(width=st.integers(1, 65536), height=st.integers(1, 65536), reduced=st.booleans(), timing=st.booleans(),
       decoder_model=st.booleans(), display_delay=st.booleans(), levels=st.lists(st.integers(0, 31), min_size=1,
                                                                                  max_size=4))
def test_an_av1_sequence_header_states_its_largest_frame(width: int, height: int, reduced: bool, timing: bool,
                                                         decoder_model: bool, display_delay: bool,
                                                         levels: list[int]) -> None:
    obu = av1_sequence_header(width, height, reduced=reduced, timing=timing, decoder_model=decoder_model,
                              display_delay=display_delay, levels=levels)
    assert av1_sequence_header_size(obu[2:]) == (width, height)
    temporal_delimiter = b"\x12\x00"
    reader = ParameterSetReader("av1", None)
    assert reader.packet_sizes(temporal_delimiter + obu + b"\x32\x01\x00") == [(width, height)]
    assert reader.extradata_sizes(b"\x81\x00\x0c\x00" + obu) == [(width, height)]  # av1C


def test_a_multi_layer_hevc_sps_is_refused_as_unchecked() -> None:
    with pytest.raises(UncheckableParameterSet, match="multi-layer"):
        hevc_sps_size(bytes([33 << 1, 1 << 3, 0x0E]) + bytes(40))  # nuh_layer_id 1, sps_ext_or_max... 7


@pytest.mark.parametrize("codec", ["h264", "hevc", "av1"])
@given(data=st.binary(max_size=200), length_size=st.sampled_from([None, 1, 2, 4]))
def test_any_bytes_are_sizes_or_an_uncheckable_parameter_set(codec: str, data: bytes,
                                                             length_size: int | None) -> None:
    """Whatever a packet or a header record holds, the reader answers sizes or ``UncheckableParameterSet``,
    never another exception (which would be a 500)."""
    record = None
    if length_size is not None and codec == "h264":
        record = bytes([1, 100, 0, 40, 0xFC | (length_size - 1), 0xE0, 0])
    reader = ParameterSetReader(codec, record)
    for read in (reader.packet_sizes, reader.extradata_sizes):
        try:
            sizes = read(data)
        except UncheckableParameterSet:
            continue
        assert all(width >= 0 and height >= 0 for width, height in sizes)
    try:
        av1_sequence_header_size(data)
    except UncheckableParameterSet:
        pass
