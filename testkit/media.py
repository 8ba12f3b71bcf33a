"""Media and the requests that carry it, built the same way for the tests and the benchmarks.

Small images and request builders (``image_bytes``, ``data_uri``, ``chat_with_image``) are what the tests send;
photo-like images of realistic encoded size (``photo_sized``, the cached 12 MP ``photo_jpeg``) and prebuilt
request bodies (``chat_body``) are what the benchmarks send. numpy (test and bench extras) is imported only
by the photo builders, which are the only ones that need it.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import math
import struct
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from PIL import Image

from preprocessors.pool import DecodePool

CACHE = Path(tempfile.gettempdir()) / "mmgate-bench"
PHOTO_SIZE = (4000, 3000)  # 12 MP
PHOTO_QUALITY = 85


def image_bytes(width: int = 64, height: int = 48, fmt: str = "PNG", mode: str = "RGB", color: Any = "red") -> bytes:
    buf = io.BytesIO()
    Image.new(mode, (width, height), color).save(buf, fmt)
    return buf.getvalue()


def data_uri(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def video_clip(width: int = 64, height: int = 48, frames: int = 3, *, codec: str = "libx264",
               container: str = "mp4", rate: int = 10) -> bytes:
    """A clip encoded in memory with PyAV (the video extra): ``frames`` flat frames, one shade each, so even an
    8K clip encodes in about a second and weighs a few hundred KB."""
    import av
    import numpy

    buffer = io.BytesIO()
    with av.open(buffer, "w", format=container) as output:
        stream = output.add_stream(codec, rate=rate)
        assert isinstance(stream, av.VideoStream)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        if codec == "libx264":
            stream.options = {"preset": "ultrafast", "tune": "zerolatency"}
        plane = numpy.zeros((height * 3 // 2, width), numpy.uint8)  # yuv420p: Y, then U and V at a quarter
        for index in range(frames):
            plane[:] = 16 + index * 40 % 200
            frame = av.VideoFrame.from_ndarray(plane, format="yuv420p")
            frame.pts = index
            output.mux(stream.encode(frame))
        output.mux(stream.encode(None))
    return buffer.getvalue()


def chat_with_video(uri: str, text: str = "what happens here?") -> dict[str, Any]:
    """An OpenAI chat request with a ``video_url`` part, as vLLM accepts it."""
    return {"model": "m", "messages": [{"role": "user", "content": [
        {"type": "text", "text": text}, {"type": "video_url", "video_url": {"url": uri}}]}]}


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


# --- photos and bodies for the benchmarks ----------------------------------------------------------------

def photo_sized(width: int, height: int, seed: int = 0, noise: int = 13) -> Image.Image:
    """Smooth colour fields plus ``noise`` levels of sensor-like noise (realistic JPEG/PNG sizes)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    sw, sh = max(2, width // 16), max(2, height // 16)
    y = np.linspace(0, 1, sh, dtype=np.float32)[:, None]
    x = np.linspace(0, 1, sw, dtype=np.float32)[None, :]
    fields = (0.5 + 0.5 * np.sin(6 * x + 3 * y), 0.5 + 0.5 * np.cos(4 * y - 5 * x * y), 0.7 * x + 0.3 * y)
    small = Image.fromarray(np.stack([(f * 230 + 12).astype(np.uint8) for f in fields], axis=-1), "RGB")
    pixels = np.asarray(small.resize((width, height), Image.Resampling.BILINEAR)).copy()
    pixels += rng.integers(0, noise, size=pixels.shape, dtype=np.uint8)  # 12..242 + noise: no overflow
    return Image.fromarray(pixels, "RGB")


def detailed_photo(width: int, height: int, seed: int = 0, slope: float = 1.0, contrast: float = 32.0,
                   shared: float = 0.7, optics: float = 0.8) -> Image.Image:
    """A deterministic high-detail photo: seeded 1/f noise, the amplitude spectrum of natural images.

    Each channel's amplitude falls as ``1 / f ** slope`` (1 is the natural-image statistic; larger is smoother),
    ``contrast`` is its standard deviation in levels around mid-grey, and ``shared`` how much of the pattern the
    three channels have in common (the rest is colour detail, what 4:2:0 chroma subsampling loses). ``optics`` is
    the sigma in pixels of the Gaussian blur a camera's lens and demosaicing leave (a photo holds little at its
    own pixel pitch); 0 makes detail up to the last pixel, which no camera records. Detail at every scale is
    the hard case for a resize and for JPEG alike.
    """
    import numpy as np

    rng = np.random.default_rng(seed)
    fy = np.fft.fftfreq(height).astype(np.float32)[:, None]
    fx = np.fft.rfftfreq(width).astype(np.float32)[None, :]
    frequency = np.sqrt(fx * fx + fy * fy)
    frequency[0, 0] = 1.0
    amplitude = frequency ** -slope * np.exp(-2 * (np.pi * optics * frequency) ** 2)  # the lens's Gaussian MTF
    amplitude[0, 0] = 0.0  # no mean: the contrast is set below

    def field() -> Any:
        spectrum = rng.standard_normal(amplitude.shape, np.float32) + 1j * rng.standard_normal(amplitude.shape,
                                                                                              np.float32)
        return np.fft.irfft2(spectrum * amplitude, s=(height, width)).astype(np.float32)

    common = field()
    pixels = np.stack([shared * common + (1 - shared) * field() for _ in range(3)], axis=-1)
    pixels *= contrast / pixels.std()
    return Image.fromarray(np.clip(pixels + 128, 0, 255).astype(np.uint8), "RGB")


def four_by_three(megapixels: float) -> tuple[int, int]:
    """The width and height of a 4:3 picture of about ``megapixels``."""
    height = int(math.sqrt(megapixels * 1e6 * 3 / 4))
    return height * 4 // 3, height


def high_detail_photo(width: int, height: int, optics: float = 0.7) -> Image.Image:
    """The high-detail photo of the fidelity bench and test: 1/f noise with colour detail behind a lens's blur,
    where JPEG q90 at a model's size loses the most of the photos tried (``optics=0``: detail to the last pixel)."""
    return detailed_photo(width, height, seed=1, slope=1.0, contrast=40, shared=0.4, optics=optics)


def encoded(image: Image.Image, fmt: str, **options: Any) -> bytes:
    """``image`` saved as ``fmt`` with Pillow's ``options``."""
    out = io.BytesIO()
    image.save(out, fmt, **options)
    return out.getvalue()


def camera_photo() -> Image.Image:
    """The 12 MP camera picture of the model-mode benches: 4000x3000, detail at every scale behind a lens's blur."""
    return detailed_photo(4200, 3200, seed=1, slope=1.0, contrast=40, shared=0.4, optics=0.7).crop(
        (37, 53, 4037, 3053))


def camera_jpeg(image: Image.Image) -> bytes:
    """``image`` as cameras write it: JPEG quality 90, 4:2:0 chroma."""
    out = io.BytesIO()
    image.save(out, "JPEG", quality=90, subsampling=2)
    return out.getvalue()


def psnr(image: Image.Image, reference: Image.Image) -> float:
    """Peak signal-to-noise ratio in dB of ``image`` against ``reference`` (RGB, 8 bits; inf when equal)."""
    import numpy as np

    a = np.asarray(image.convert("RGB"), np.float64)
    b = np.asarray(reference.convert("RGB"), np.float64)
    error = float(np.mean((a - b) ** 2))
    return float("inf") if error == 0 else float(10 * np.log10(255**2 / error))


def photo_jpeg() -> bytes:
    """A 4000x3000 photo-like JPEG (smooth gradients + low-frequency blobs + sensor-like noise, q85, ~2.6 MB).

    Deterministic (fixed seed); generated once and cached in the temp dir.
    """
    path = CACHE / f"photo_{PHOTO_SIZE[0]}x{PHOTO_SIZE[1]}_q{PHOTO_QUALITY}.jpg"
    if path.exists():
        return path.read_bytes()
    import numpy as np

    w, h = PHOTO_SIZE
    rng = np.random.default_rng(1234)
    y = np.linspace(0, 1, h, dtype=np.float32)[:, None]
    x = np.linspace(0, 1, w, dtype=np.float32)[None, :]
    img = np.empty((h, w, 3), np.float32)
    img[..., 0] = 200 * x + 40 * np.sin(6 * y)
    img[..., 1] = 180 * y + 30 * np.cos(5 * x)
    img[..., 2] = 120 + 80 * x * y
    small = np.clip(rng.normal(0, 25, (30, 40, 3)) + 128, 0, 255).astype(np.uint8)
    img += np.asarray(Image.fromarray(small).resize((w, h), Image.Resampling.BICUBIC), np.float32) - 128
    img += rng.normal(0, 10, (h, w, 3)).astype(np.float32)
    buf = io.BytesIO()
    Image.fromarray(np.clip(img, 0, 255).astype(np.uint8)).save(buf, "JPEG", quality=PHOTO_QUALITY)
    CACHE.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(buf.getvalue())
    tmp.replace(path)
    return buf.getvalue()


def chat_body(image: bytes, mime: str = "image/jpeg", *, stream: bool = False, max_tokens: int | None = None) -> bytes:
    """An OpenAI chat request with one inline data-URI image, as bytes (built once, sent many times)."""
    import pybase64

    uri = f"data:{mime};base64," + pybase64.b64encode(image).decode()
    body: dict[str, Any] = {"model": "stub-vlm", "stream": stream, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "Describe this image."},
        {"type": "image_url", "image_url": {"url": uri}}]}]}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    return json.dumps(body).encode()


# --- conversations (bench/cache.py, bench/front.py) -----------------------------------------------------

def tagged(jpeg: bytes, tag: str) -> bytes:
    """``jpeg`` with a comment segment after SOI: decoders skip it, so the decode work is the same, the bytes
    (and the cache key) are not."""
    text = tag.encode()
    return jpeg[:2] + b"\xff\xfe" + struct.pack(">H", len(text) + 2) + text + jpeg[2:]


def conversation(images: list[bytes]) -> bytes:
    """An OpenAI chat: one user turn per image (text + the image), an assistant answer between turns."""
    messages: list[dict[str, Any]] = []
    for n, image in enumerate(images):
        if n:
            messages.append({"role": "assistant", "content": f"Answer {n}: a photo of colour fields."})
        uri = "data:image/jpeg;base64," + base64.b64encode(image).decode()
        messages.append({"role": "user", "content": [{"type": "text", "text": f"Question {n + 1} about this photo."},
                                                     {"type": "image_url", "image_url": {"url": uri}}]})
    return json.dumps({"model": "stub-vlm", "max_tokens": 16, "messages": messages}).encode()


def turns(name: str, photo: bytes, tag: str, count: int) -> list[bytes]:
    """The bodies of one conversation, in order."""
    if name == "one_photo":
        one = tagged(photo, f"{tag}/one")
        return [conversation([one] * n) for n in range(1, count + 1)]
    if name == "new_photo_each_turn":
        images = [tagged(photo, f"{tag}/each/{n}") for n in range(count)]
        return [conversation(images[:n]) for n in range(1, count + 1)]
    return [conversation([tagged(photo, f"{tag}/new/{n}")]) for n in range(count)]
