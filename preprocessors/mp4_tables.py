"""How many samples an MP4/QuickTime file's tables declare per track, read from its boxes before FFmpeg does.

FFmpeg's MP4 demuxer builds its index inside ``av.open``: an entry (24 bytes and more) per sample, whatever the
file's size. Most tables hold an entry per sample in the file, but some state a count that costs no bytes:
``stsz`` with one constant sample size, the runs of ``stts`` and ``ctts`` (sample_count, value), ``stsc``'s
samples per chunk, and a fragment's ``trun`` with no per-sample fields. A 1.4 KB file declaring 89 million
samples costs a worker 3 GB before the frame count can be judged; so the boxes are walked here first
(ISO/IEC 14496-12: ``moov/trak/mdia/minf/stbl`` and ``moof/traf``) and the video probe refuses a count over
its limits before ``av.open``. A table whose entry count does not fit in its own box is malformed and
refused too (``TableError``): FFmpeg would allocate for the count before it finds the bytes missing.

A track's count is the largest its tables state (``stsz``/``stz2``, the sum of ``stts`` and of ``ctts``,
``stsc`` over the chunks of ``stco``/``co64``), plus its fragments' ``trun`` counts. Its edit list (``elst``)
multiplies the index: FFmpeg copies the entries each edit plays, so a 60 KB file of 5,000 edits over 3,600
one-byte samples took 415 MiB; ``edited_entries`` is the bound the probe judges.
"""

from __future__ import annotations

import operator
import struct
import sys
from array import array
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from itertools import chain, islice, repeat

_STREAM_TABLES = frozenset((b"mdia", b"minf", b"stbl", b"edts"))  # walked inside a trak
_CHECK_EVERY = 4096
# Tables are read as arrays of 32-bit words, in C and without numpy: a decode worker that imports numpy for
# the first MP4 spends about 0.1 s of its start on it.
_WORD = next(code for code in "IL" if array(code).itemsize == 4)


class TableError(ValueError):
    """A box or table that is malformed: its message says which."""


@dataclass(slots=True)
class TrackTables:
    """One track's declared sample count; ``handler`` is its ``hdlr`` type (``vide``, ``soun``...), and
    ``unit_samples`` says that ``stts`` is one run of duration 1: FFmpeg then indexes audio by chunk, not by
    sample (uncompressed audio)."""

    track_id: int = 0
    handler: str = ""
    samples: int = 0
    unit_samples: bool = False
    chunks: int = 0
    chunk_runs: tuple[array[int], array[int]] | None = None  # stsc: its first_chunk and samples_per_chunk columns
    edits: int = 0  # elst entries that play media (not empty edits)

    @property
    def edited_entries(self) -> int:
        """At most how many index entries FFmpeg's edit-list pass makes: each edit that plays media copies
        the entries it covers, and one may cover them all (chunks for audio indexed by the chunk)."""
        return max(self.edits, 1) * (self.chunks if self.unit_samples else self.samples)


def declared_tracks(data: bytes | memoryview, max_boxes: int, checkpoint: Callable[[], None] = lambda: None
                    ) -> list[TrackTables]:
    """Every track's tables, ``trak`` by ``trak``, with its fragments' counts added by ``track_ID``; a fragment
    of a track that no ``trak`` declares is a track of its own. More than ``max_boxes`` boxes walked is a
    ``TableError`` (a file of millions of empty boxes would keep the walk busy for seconds), and
    ``checkpoint`` is called every ``_CHECK_EVERY`` boxes."""
    view = memoryview(data)
    boxes = _Boxes(view, max_boxes, checkpoint)
    tracks: list[TrackTables] = []
    fragments: dict[int, int] = {}
    for kind, start, end in boxes(0, len(view)):
        if kind == b"moov":
            for inner, inner_start, inner_end in boxes(start, end):
                if inner == b"trak":
                    tracks.append(_track(boxes, inner_start, inner_end))
        elif kind == b"moof":
            for inner, inner_start, inner_end in boxes(start, end):
                if inner == b"traf":
                    track_id, samples = _fragment(boxes, inner_start, inner_end)
                    fragments[track_id] = fragments.get(track_id, 0) + samples
    by_id = {track.track_id: track for track in tracks}
    for track_id, samples in fragments.items():
        if track_id not in by_id:
            by_id[track_id] = TrackTables(track_id)
            tracks.append(by_id[track_id])
        by_id[track_id].samples += samples
    return tracks


class _Boxes:
    """The boxes of ``view``, counted against ``most`` as they are walked."""

    def __init__(self, view: memoryview, most: int, checkpoint: Callable[[], None]) -> None:
        self.view = view
        self.most = most
        self.checkpoint = checkpoint
        self.walked = 0

    def __call__(self, start: int, end: int) -> Iterator[tuple[bytes, int, int]]:
        """``(type, payload start, payload end)`` of the boxes from ``start`` to ``end``; a box running past its
        parent is cut at the parent's end, as FFmpeg reads it."""
        for box in _boxes(self.view, start, end):
            self.walked += 1
            if self.walked > self.most:
                raise TableError(f"the file holds more than {self.most} boxes, more than any clip within the "
                                 "limits")
            if self.walked % _CHECK_EVERY == 0:
                self.checkpoint()
            yield box


def _boxes(view: memoryview, start: int, end: int) -> Iterator[tuple[bytes, int, int]]:
    at = start
    while at + 8 <= end:
        size, kind = struct.unpack_from(">I4s", view, at)
        header = 8
        if size == 1:
            if at + 16 > end:
                return
            (size,) = struct.unpack_from(">Q", view, at + 8)
            header = 16
        elif size == 0:
            size = end - at
        if size < header:
            raise TableError(f"the {kind!r} box states a size smaller than its header")
        yield kind, at + header, min(at + size, end)
        at += size


def _track(boxes: _Boxes, start: int, end: int) -> TrackTables:
    view = boxes.view
    track = TrackTables()
    stack = [(start, end)]
    while stack:
        box_start, box_end = stack.pop()
        for kind, payload, payload_end in boxes(box_start, box_end):
            if kind in _STREAM_TABLES:
                stack.append((payload, payload_end))
            elif kind == b"tkhd" and payload + 24 <= payload_end:
                version = view[payload]
                track.track_id = struct.unpack_from(">I", view, payload + (20 if version == 1 else 12))[0]
            elif kind == b"hdlr" and payload + 12 <= payload_end:
                track.handler = bytes(view[payload + 8:payload + 12]).decode("latin-1")
            else:
                _table(track, kind, view, payload, payload_end)
    if track.chunk_runs is not None and len(track.chunk_runs[0]):
        track.samples = max(track.samples, _chunked_samples(*track.chunk_runs, track.chunks))
    return track


def _table(track: TrackTables, kind: bytes, view: memoryview, start: int, end: int) -> None:
    """One ``stbl`` table's count into ``track``; the others are not read."""
    room = end - start
    if kind == b"stsz":
        sample_size, count = _fields(view, start, end, 4, 2)
        if sample_size == 0:
            _fits(kind, count, 4, room - 12)
        track.samples = max(track.samples, count)
    elif kind == b"stz2":
        field_and_count = _fields(view, start, end, 4, 2)
        field_size, count = field_and_count[0] & 0xFF, field_and_count[1]
        _fits(kind, (count * field_size + 7) // 8, 1, room - 12)
        track.samples = max(track.samples, count)
    elif kind in (b"stts", b"ctts"):
        (entries,) = _fields(view, start, end, 4, 1)
        _fits(kind, entries, 8, room - 8)
        counts, values = _columns(view, start + 8, entries, 8)
        track.samples = max(track.samples, sum(counts))
        if kind == b"stts":
            track.unit_samples = entries == 1 and values[0] == 1
    elif kind == b"stsc":
        (entries,) = _fields(view, start, end, 4, 1)
        _fits(kind, entries, 12, room - 8)
        track.chunk_runs = _columns(view, start + 8, entries, 12)
    elif kind in (b"stco", b"co64"):
        (entries,) = _fields(view, start, end, 4, 1)
        _fits(kind, entries, 4 if kind == b"stco" else 8, room - 8)
        track.chunks = entries
    elif kind == b"elst":
        (entries,) = _fields(view, start, end, 4, 1)
        wide = view[start] == 1 if room else False  # version 1: 64-bit duration and media time
        _fits(kind, entries, 20 if wide else 12, room - 8)
        track.edits = entries - _empty_edits(view, start + 8, entries, wide)
    elif kind in (b"stss", b"stps"):
        (entries,) = _fields(view, start, end, 4, 1)
        _fits(kind, entries, 4, room - 8)


def _chunked_samples(first_chunks: array[int], per_chunk: array[int], chunks: int) -> int:
    """The samples ``stsc``'s runs put in ``chunks`` chunks: each run lasts until the next one's first chunk.
    Element by element in ``map`` (C), not in a Python loop: a table may hold millions of runs."""
    firsts = map(max, first_chunks, repeat(1))
    lasts = map(min, chain(islice(first_chunks, 1, None), (chunks + 1,)), repeat(chunks + 1))
    spans = map(max, map(operator.sub, lasts, firsts), repeat(0))
    return sum(map(operator.mul, spans, per_chunk))


def _words(view: memoryview, start: int, count: int) -> array[int]:
    """``count`` big-endian unsigned 32-bit words from ``start``, in the machine's order."""
    words = array(_WORD)
    words.frombytes(view[start:start + 4 * count])
    if sys.byteorder == "little":
        words.byteswap()
    return words


def _columns(view: memoryview, start: int, entries: int, stride: int) -> tuple[array[int], array[int]]:
    """The first two big-endian 32-bit fields of ``entries`` entries of ``stride`` bytes, as two columns."""
    words, step = _words(view, start, entries * stride // 4), stride // 4
    return words[0::step], words[1::step]


def _empty_edits(view: memoryview, start: int, entries: int, wide: bool) -> int:
    """How many of ``elst``'s entries are empty edits (``media_time`` −1: all its bits set). An entry is
    (duration, media_time, rate), 32-bit fields in version 0 and 64-bit duration and time in version 1."""
    if not wide:
        return _words(view, start, entries * 3)[1::3].count(0xFFFFFFFF)
    words = _words(view, start, entries * 5)
    return sum(map(operator.and_, map((0xFFFFFFFF).__eq__, words[2::5]), map((0xFFFFFFFF).__eq__, words[3::5])))


def _fragment(boxes: _Boxes, start: int, end: int) -> tuple[int, int]:
    """A ``traf``'s ``track_ID`` (``tfhd``) and the samples of its ``trun`` boxes."""
    view = boxes.view
    track_id, samples = 0, 0
    for kind, payload, payload_end in boxes(start, end):
        if kind == b"tfhd":
            (_flags, track_id) = _fields(view, payload, payload_end, 0, 2)
        elif kind == b"trun":
            flags, count = _fields(view, payload, payload_end, 0, 2)
            optional = 4 * (bool(flags & 0x1) + bool(flags & 0x4))  # data_offset, first_sample_flags
            per_sample = 4 * sum(bool(flags & bit) for bit in (0x100, 0x200, 0x400, 0x800))
            _fits(kind, count, per_sample, payload_end - payload - 8 - optional)
            samples += count
    return track_id, samples


def _fields(view: memoryview, start: int, end: int, skip: int, count: int) -> tuple[int, ...]:
    """``count`` big-endian 32-bit fields after ``skip`` bytes (a full box's version and flags are the first)."""
    if start + skip + 4 * count > end:
        raise TableError("a table box ends before its counts")
    return struct.unpack_from(f">{count}I", view, start + skip)


def _fits(kind: bytes, entries: int, entry_bytes: int, room: int) -> None:
    if entries * entry_bytes > max(room, 0):
        raise TableError(f"the {kind.decode('latin-1')!r} table states {entries} entries, more than its box "
                         "holds")
