"""The frame sizes an H.264, HEVC or AV1 stream declares in its parameter sets, read from the bitstream.

A decoder takes a new frame size from a parameter set it activates: an H.264 or HEVC sequence parameter set,
an AV1 sequence header. A clip may carry several, in the container's header (``avcC``, ``hvcC``, ``av1C``:
FFmpeg's extradata) and in-band in any packet, and a backend's decoder activates one whenever a slice refers
to it, key frame or not (an open-GOP I slice without a recovery point is no key frame to FFmpeg's
``skip_frame=nokey``, yet a plain decode shows it). So every parameter set the clip carries is read here and
its size judged, used or not; one that cannot be read is no size that can be checked, and the clip is refused.

The size is the coded one, what a decoder allocates: H.264 (ITU-T H.264 7.3.2.1.1) ``pic_width_in_mbs_minus1``
and ``pic_height_in_map_units_minus1`` in macroblocks, doubled for fields (``frame_mbs_only_flag`` 0), cropping
ignored; subset SPS (NAL type 15) starts with the same fields and is read too. HEVC (ITU-T H.265 7.3.2.2)
``pic_width_in_luma_samples`` and ``pic_height_in_luma_samples``, after ``profile_tier_level``; a multi-layer
SPS (``nuh_layer_id`` > 0 with ``sps_ext_or_max_sub_layers_minus1`` 7) takes its size from a VPS extension
and is refused. AV1 (AV1 Bitstream Specification 5.5) ``max_frame_width_minus_1`` and
``max_frame_height_minus_1``: every frame of the sequence is at most that size, superres included.

Packets in MP4 and Matroska hold NAL units behind a length prefix whose size the ``avcC``/``hvcC`` record
states; without such a record (Annex B extradata) they are split at start codes, as FFmpeg's decoders do.
"""

from __future__ import annotations

from collections.abc import Generator, Iterator

Size = tuple[int, int]

_H264_SPS, _H264_SUBSET_SPS = 7, 15
_HEVC_SPS = 33
_AV1_SEQUENCE_HEADER = 1
# profile_idc values whose SPS carries chroma_format_idc, bit depths and scaling matrices (7.3.2.1.1)
_H264_HIGH_PROFILES = frozenset((100, 110, 122, 244, 44, 83, 86, 118, 128, 138, 139, 134, 135))
_MAX_READ = 4096  # bytes of a parameter set read: the size fields come long before


class UncheckableParameterSet(ValueError):
    """A parameter set, or the framing around it, that cannot be read: its message says what."""


class _Bits:
    """Big-endian bits of an RBSP; reading past its end raises ``UncheckableParameterSet``."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.at = 0
        self.end = 8 * len(data)

    def u(self, count: int) -> int:
        if self.at + count > self.end:
            raise UncheckableParameterSet("a parameter set ends before its frame size")
        value = 0
        for _ in range(count):
            value = (value << 1) | ((self.data[self.at >> 3] >> (7 - (self.at & 7))) & 1)
            self.at += 1
        return value

    def skip(self, count: int) -> None:
        if self.at + count > self.end:
            raise UncheckableParameterSet("a parameter set ends before its frame size")
        self.at += count

    def ue(self) -> int:
        """Exp-Golomb ``ue(v)``, at most 32 bits of value as decoders read it."""
        zeros = 0
        while self.u(1) == 0:
            zeros += 1
            if zeros > 31:
                raise UncheckableParameterSet("a parameter set holds an Exp-Golomb code over 32 bits")
        return (1 << zeros) - 1 + self.u(zeros)

    def se(self) -> int:
        code = self.ue()
        return (code + 1) // 2 if code & 1 else -(code // 2)


def _rbsp(nal_payload: bytes | memoryview) -> bytes:
    """The payload with emulation-prevention bytes (``00 00 03``) taken out, its head only."""
    return bytes(nal_payload[:_MAX_READ]).replace(b"\x00\x00\x03", b"\x00\x00")


def h264_sps_size(nal: bytes | memoryview) -> Size:
    """The coded ``(width, height)`` of an H.264 SPS or subset SPS NAL unit (header byte included)."""
    bits = _Bits(_rbsp(nal[1:]))
    profile_idc = bits.u(8)
    bits.skip(16)  # constraint flags, level_idc
    bits.ue()  # seq_parameter_set_id
    if profile_idc in _H264_HIGH_PROFILES:
        chroma_format_idc = bits.ue()
        if chroma_format_idc == 3:
            bits.skip(1)  # separate_colour_plane_flag
        bits.ue()  # bit_depth_luma_minus8
        bits.ue()  # bit_depth_chroma_minus8
        bits.skip(1)  # qpprime_y_zero_transform_bypass_flag
        if bits.u(1):  # seq_scaling_matrix_present_flag
            for index in range(8 if chroma_format_idc != 3 else 12):
                if bits.u(1):
                    _skip_scaling_list(bits, 16 if index < 6 else 64)
    bits.ue()  # log2_max_frame_num_minus4
    pic_order_cnt_type = bits.ue()
    if pic_order_cnt_type == 0:
        bits.ue()  # log2_max_pic_order_cnt_lsb_minus4
    elif pic_order_cnt_type == 1:
        bits.skip(1)  # delta_pic_order_always_zero_flag
        bits.se()  # offset_for_non_ref_pic
        bits.se()  # offset_for_top_to_bottom_field
        cycle = bits.ue()
        if cycle > 255:
            raise UncheckableParameterSet("an H.264 SPS states more than 255 reference frames in its POC cycle")
        for _ in range(cycle):
            bits.se()
    bits.ue()  # max_num_ref_frames
    bits.skip(1)  # gaps_in_frame_num_value_allowed_flag
    width_mbs = bits.ue() + 1
    height_map_units = bits.ue() + 1
    frame_mbs_only = bits.u(1)
    return 16 * width_mbs, 16 * height_map_units * (2 - frame_mbs_only)


def _skip_scaling_list(bits: _Bits, size: int) -> None:
    last = next_scale = 8
    for _ in range(size):
        if next_scale:
            next_scale = (last + bits.se() + 256) % 256
        last = next_scale or last


def hevc_sps_size(nal: bytes | memoryview) -> Size:
    """The coded ``(width, height)`` of an HEVC SPS NAL unit (two header bytes included)."""
    if len(nal) < 2:
        raise UncheckableParameterSet("an HEVC SPS ends before its frame size")
    layer_id = ((nal[0] & 1) << 5) | (nal[1] >> 3)
    bits = _Bits(_rbsp(nal[2:]))
    bits.skip(4)  # sps_video_parameter_set_id
    sub_layers_minus1 = bits.u(3)
    if layer_id > 0 and sub_layers_minus1 == 7:
        raise UncheckableParameterSet("the clip carries a multi-layer HEVC SPS, whose frame size mmgate does not "
                                      "read: send a single-layer stream")
    bits.skip(1)  # sps_temporal_id_nesting_flag
    bits.skip(88 + 8)  # general profile, tier, flags and level_idc
    profile_present, level_present = [], []
    for _ in range(sub_layers_minus1):
        profile_present.append(bits.u(1))
        level_present.append(bits.u(1))
    if sub_layers_minus1 > 0:
        bits.skip(2 * (8 - sub_layers_minus1))  # reserved_zero_2bits
    for profile, level in zip(profile_present, level_present, strict=True):
        bits.skip(88 * profile + 8 * level)
    bits.ue()  # sps_seq_parameter_set_id
    if bits.ue() == 3:  # chroma_format_idc
        bits.skip(1)  # separate_colour_plane_flag
    width = bits.ue()
    height = bits.ue()
    return width, height


def av1_sequence_header_size(payload: bytes | memoryview) -> Size:
    """``(max_frame_width, max_frame_height)`` of an AV1 sequence header OBU's payload."""
    bits = _Bits(bytes(payload[:_MAX_READ]))
    bits.skip(3)  # seq_profile
    bits.skip(1)  # still_picture
    if bits.u(1):  # reduced_still_picture_header
        bits.skip(5)  # seq_level_idx[0]
    else:
        decoder_model_info_present = 0
        buffer_delay_length = 0
        if bits.u(1):  # timing_info_present_flag
            bits.skip(64)  # num_units_in_display_tick, time_scale
            if bits.u(1):  # equal_picture_interval
                _uvlc(bits)  # num_ticks_per_picture_minus_1
            decoder_model_info_present = bits.u(1)
            if decoder_model_info_present:
                buffer_delay_length = bits.u(5) + 1
                bits.skip(32 + 5 + 5)  # num_units_in_decoding_tick, two length fields
        initial_display_delay_present = bits.u(1)
        for _ in range(bits.u(5) + 1):  # operating_points_cnt_minus_1
            bits.skip(12)  # operating_point_idc
            if bits.u(5) > 7:  # seq_level_idx
                bits.skip(1)  # seq_tier
            if decoder_model_info_present and bits.u(1):  # decoder_model_present_for_this_op
                bits.skip(2 * buffer_delay_length + 1)  # two buffer delays, low_delay_mode_flag
            if initial_display_delay_present and bits.u(1):
                bits.skip(4)  # initial_display_delay_minus_1
    width_bits = bits.u(4) + 1
    height_bits = bits.u(4) + 1
    return bits.u(width_bits) + 1, bits.u(height_bits) + 1


def _uvlc(bits: _Bits) -> int:
    zeros = 0
    while bits.u(1) == 0:
        zeros += 1
        if zeros >= 32:
            return (1 << 32) - 1
    return (1 << zeros) - 1 + bits.u(zeros)


class ParameterSetReader:
    """The frame sizes of the parameter sets in a stream of ``codec`` (FFmpeg's name: ``h264``, ``hevc``,
    ``av1``), framed as its ``extradata`` says: ``extradata_sizes`` for the header's, ``packet_sizes`` for a
    packet's (or a packet's new extradata, given to ``extradata_sizes``)."""

    def __init__(self, codec: str, extradata: bytes | None) -> None:
        if codec not in ("h264", "hevc", "av1"):
            raise ValueError(f"no parameter sets are read for {codec}")
        self.codec = codec
        self.length_size = 0  # 0: Annex B start codes
        self._record(extradata or b"")

    def _is_record(self, extradata: bytes) -> bool:
        """Whether extradata is a decoder configuration record rather than Annex B, by FFmpeg's decoders' rule:
        an ``avcC`` starts with version 1; an ``hvcC`` with anything but a start code's ``00 00 00``/``00 00 01``."""
        if self.codec == "h264":
            return extradata[:1] == b"\x01"
        return len(extradata) > 3 and (extradata[0] != 0 or extradata[1] != 0 or extradata[2] > 1)

    def _record(self, extradata: bytes) -> None:
        if self.codec == "av1" or not self._is_record(extradata):
            return
        if self.codec == "h264" and len(extradata) >= 7:
            self.length_size = (extradata[4] & 3) + 1
        elif self.codec == "hevc" and len(extradata) >= 23:
            self.length_size = (extradata[21] & 3) + 1

    def extradata_sizes(self, extradata: bytes) -> list[Size]:
        """The sizes of every parameter set in a header record (``avcC``, ``hvcC``, ``av1C``) or Annex B."""
        self._record(extradata)
        if self.codec == "av1":
            if len(extradata) >= 4 and extradata[0] & 0x80:  # av1C: marker bit, then its config OBUs
                return list(self._obu_sizes(memoryview(extradata)[4:]))
            return list(self._obu_sizes(memoryview(extradata)))
        if not self._is_record(extradata):
            return list(self._nal_sizes(_annex_b_units(extradata)))
        if self.codec == "h264":
            return list(self._nal_sizes(_avcc_units(memoryview(extradata))))
        return list(self._nal_sizes(_hvcc_units(memoryview(extradata))))

    def packet_sizes(self, packet: bytes | memoryview) -> list[Size]:
        """The sizes of every parameter set in one packet's data."""
        if self.codec == "av1":
            return list(self._obu_sizes(memoryview(packet)))
        if self.length_size:
            return self._length_prefixed_sizes(memoryview(packet))
        return list(self._nal_sizes(_annex_b_units(bytes(packet))))

    def _length_prefixed_sizes(self, data: memoryview) -> list[Size]:
        """``_nal_sizes`` of a packet's NAL units, each after its ``length_size``-byte length, in one loop: it
        runs on every packet of a clip, where layers of generators cost more than the walk."""
        found: list[Size] = []
        length_size, end, at = self.length_size, len(data), 0
        while at < end:
            if at + length_size > end:
                raise UncheckableParameterSet("a packet's NAL unit length runs past its end")
            size = int.from_bytes(data[at:at + length_size], "big")
            at += length_size
            if at + size > end:
                raise UncheckableParameterSet("a packet's NAL unit runs past its end")
            if size and self._is_sps(data[at]):
                found.append(self._sps_size(data[at:at + size]))
            at += size
        return found

    def _nal_sizes(self, units: Iterator[memoryview | bytes]) -> Iterator[Size]:
        for unit in units:
            if unit and self._is_sps(unit[0]):
                yield self._sps_size(unit)

    def _is_sps(self, nal_header: int) -> bool:
        """Whether a NAL unit whose first byte is ``nal_header`` is a sequence parameter set (H.264's subset SPS
        included)."""
        if self.codec == "h264":
            return nal_header & 0x1F in (_H264_SPS, _H264_SUBSET_SPS)
        return (nal_header >> 1) & 0x3F == _HEVC_SPS

    def _sps_size(self, unit: memoryview | bytes) -> Size:
        return h264_sps_size(unit) if self.codec == "h264" else hevc_sps_size(unit)

    @staticmethod
    def _obu_sizes(data: memoryview) -> Iterator[Size]:
        at = 0
        while at < len(data):
            header = data[at]
            kind, extension, has_size = (header >> 3) & 0xF, (header >> 2) & 1, (header >> 1) & 1
            at += 1 + extension
            if has_size:
                size, at = _leb128(data, at)
            else:
                size = len(data) - at
            if at + size > len(data):
                raise UncheckableParameterSet("an AV1 OBU runs past the end of its packet")
            if kind == _AV1_SEQUENCE_HEADER:
                yield av1_sequence_header_size(data[at:at + size])
            at += size


def _leb128(data: memoryview, at: int) -> tuple[int, int]:
    value = 0
    for index in range(8):
        if at >= len(data):
            break
        byte = data[at]
        at += 1
        value |= (byte & 0x7F) << (7 * index)
        if not byte & 0x80:
            return value, at
    raise UncheckableParameterSet("an AV1 OBU's size field is malformed")


def _annex_b_units(data: bytes) -> Iterator[bytes]:
    """NAL units between ``00 00 01`` start codes (a four-byte code leaves a trailing zero, harmless here)."""
    at = data.find(b"\x00\x00\x01")
    while at >= 0:
        start = at + 3
        at = data.find(b"\x00\x00\x01", start)
        yield data[start:at if at >= 0 else len(data)]


def _avcc_units(record: memoryview) -> Iterator[memoryview]:
    """The SPS and PPS of an ``AVCDecoderConfigurationRecord`` (ISO/IEC 14496-15 5.3.3.1), and the SPS
    extensions a High-profile record may add."""
    at = 5
    for mask in (0x1F, 0xFF):  # numOfSequenceParameterSets, numOfPictureParameterSets
        if at >= len(record):
            return
        count = record[at] & mask
        at = yield from _sized_units(record, at + 1, count, "avcC")


def _hvcc_units(record: memoryview) -> Iterator[memoryview]:
    """The NAL units of an ``HEVCDecoderConfigurationRecord`` (ISO/IEC 14496-15 8.3.3.1)."""
    if len(record) < 23:
        raise UncheckableParameterSet("the hvcC record is shorter than its header")
    at = 23
    for _ in range(record[22]):  # numOfArrays
        if at + 3 > len(record):
            raise UncheckableParameterSet("the hvcC record ends inside its parameter sets")
        count = int.from_bytes(record[at + 1:at + 3], "big")
        at = yield from _sized_units(record, at + 3, count, "hvcC")


def _sized_units(record: memoryview, at: int, count: int, name: str) -> Generator[memoryview, None, int]:
    """``count`` units from ``at``, each after its 16-bit big-endian size (both records lay them out so);
    returns where the last one ends."""
    for _ in range(count):
        if at + 2 > len(record):
            raise UncheckableParameterSet(f"the {name} record ends inside its parameter sets")
        size = int.from_bytes(record[at:at + 2], "big")
        at += 2
        if at + size > len(record):
            raise UncheckableParameterSet(f"the {name} record ends inside its parameter sets")
        yield record[at:at + size]
        at += size
    return at
