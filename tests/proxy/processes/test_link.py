"""The front <-> gate link: every message crosses a real socket pair as it was sent, and a frame that holds no
message, or is over its bound, ends the link."""

from __future__ import annotations

import socket
import struct

import pytest

from proxy.processes.link import Link
from tests.proxy.processes.conftest import SAMPLES


async def _pair() -> tuple[Link, Link]:
    one, other = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    return await Link.over(one), await Link.over(other)


async def test_every_message_crosses_a_socket_pair_as_sent() -> None:
    front, gate = await _pair()
    for sample in SAMPLES:
        front.send(sample)
    assert [await gate.receive() for _ in SAMPLES] == SAMPLES
    front.close()
    assert await gate.receive() is None  # the other end is gone
    gate.close()


@pytest.mark.parametrize("frame", [
    b"{}", b"[]", b'["no such message", 1]', b'["release"]', b'["release", 1, 2]', b"not json",
    b'["refused", 1, [0, 0, 0, 0, 0, 0, 1], 499, "cancelled", "", {}]',
    b'["counted", 1, [0, 0]]', b'["place", 1, ["id", 0, "client", "more"]]',
])
async def test_a_frame_that_holds_no_message_ends_the_link(frame: bytes) -> None:
    front, gate = await _pair()
    front.writer.write(struct.pack(">I", len(frame)) + frame)
    assert await gate.receive() is None
    front.close()
    gate.close()


async def test_no_frame_is_read_past_its_bound() -> None:
    front, gate = await _pair()
    front.writer.write(struct.pack(">I", (64 << 20) + 1))
    assert await gate.receive() is None
    front.close()
    gate.close()
