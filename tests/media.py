"""Small builders for media requests used by several test modules."""

from __future__ import annotations

import asyncio
import base64
import io
import threading
from typing import Any, Callable

from PIL import Image

from preprocessors.pool import DecodePool


def image_bytes(width: int = 64, height: int = 48, fmt: str = "PNG", mode: str = "RGB", color: Any = "red") -> bytes:
    buf = io.BytesIO()
    Image.new(mode, (width, height), color).save(buf, fmt)
    return buf.getvalue()


def data_uri(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def chat_with_image(uri: str, text: str = "what is this?", **extra: Any) -> dict[str, Any]:
    return {
        "model": "m",
        "messages": [{"role": "user", "content": [
            {"type": "text", "text": text},
            {"type": "image_url", "image_url": {"url": uri}},
        ]}],
        **extra,
    }


def decode_uri(uri: str) -> tuple[str, Image.Image]:
    head, payload = uri.split(",", 1)
    return head, Image.open(io.BytesIO(base64.b64decode(payload)))


async def eventually(condition: Callable[[], bool], what: str = "condition") -> None:
    """Wait (bounded) for a counter the proxy updates when it notices something on a socket: there is no
    event to await for "the server saw the client leave", so this polls the proxy's own state."""
    for _ in range(2000):
        if condition():
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"never happened: {what}")


class BlockedPool:
    """Occupies every decode thread until released, so a request's items stay queued: deterministic
    timeouts and disconnects during preprocessing without relying on how long a decode takes."""

    def __init__(self, pool: DecodePool | None) -> None:
        assert pool is not None and pool._executor is not None
        self.go = threading.Event()
        self.futures = [pool._executor.submit(self.go.wait) for _ in range(pool.workers)]

    def release(self) -> None:
        self.go.set()
        for future in self.futures:
            future.result()
