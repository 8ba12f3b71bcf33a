"""The link between a front process and the shared gate (``processes.remote_gate``): one Unix socket pair per
front, framed messages (``processes.messages``).

A frame is a 4-byte big-endian length, then the message's bytes (``messages.encode``). A frame that does not
decode is a fault, and ends the link like a closed socket.
"""

from __future__ import annotations

import asyncio
import socket
import struct

from proxy.processes.messages import Message, decode, encode

_LENGTH = struct.Struct(">I")
MAX_FRAME = 64 << 20  # a report of every metric series is well under this; anything bigger is a fault


class Link:
    """One end of a front's socket pair: messages written at once, read by ``receive``."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    @classmethod
    async def over(cls, sock: socket.socket) -> Link:
        reader, writer = await asyncio.open_unix_connection(sock=sock)
        return cls(reader, writer)

    def send(self, sent: Message) -> None:
        if self.writer.is_closing():
            return
        data = encode(sent)
        self.writer.write(_LENGTH.pack(len(data)) + data)

    async def receive(self) -> Message | None:
        """The next message, or None once the other end is gone (or sent what is no message)."""
        try:
            head = await self.reader.readexactly(_LENGTH.size)
            (length,) = _LENGTH.unpack(head)
            if length > MAX_FRAME:
                raise ValueError(f"a frame of {length} bytes")
            return decode(await self.reader.readexactly(length))
        except (asyncio.IncompleteReadError, ConnectionError, ValueError, TypeError):
            return None

    def close(self) -> None:
        self.writer.close()
