"""The handoff rule (``preprocessors/handoff.py``) with the image processor configurations real checkpoints ship:
an image the model keeps nearly whole goes as it came, one it shrinks a lot goes at the model's size, the decode
and the forward estimate decide alike, and over HTTP the backend gets what the rule says."""

from __future__ import annotations

import base64
import io
from pathlib import Path

import aiohttp
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from preprocessors.base import ImagePolicy
from preprocessors.dataurl import Base64Ends
from preprocessors.errors import MediaError
from preprocessors.geometry import Geometry, resize_target
from preprocessors.handoff import draft_scale, forward_original, handoff_target
from preprocessors.header import inline_header
from preprocessors.image import process_image
from proxy.media.forwarded import forwarded_file_bytes
from proxy.media.model import Model
from proxy.media.model_folder import load_model
from testkit.media import chat_with_image, data_uri, decode_uri, photo_sized
from testkit.models import REAL_CHECKPOINTS
from tests.conftest import StartProxy, Upstream

pytest.importorskip("transformers", reason="the model extra: pip install -e '.[model]'")

FORMATS = ("JPEG", "PNG", "WEBP", "BMP", "GIF")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Model]:
    root = tmp_path_factory.mktemp("checkpoints")
    return {name: load_model(str(build(root / name.replace(" ", "_")))) for name, build in REAL_CHECKPOINTS.items()}


def _geometry(model: Model) -> Geometry:
    assert model.geometry is not None
    return model.geometry


def _bmp_bytes(width: int, height: int) -> int:
    return 54 + (width * 3 + 3) // 4 * 4 * height


@pytest.mark.parametrize("name", list(REAL_CHECKPOINTS))
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(width=st.integers(64, 8000), height=st.integers(64, 8000), bits_per_pixel=st.floats(0.05, 24.0),
       fmt=st.sampled_from(FORMATS), orientation=st.sampled_from((1, 6)))
def test_where_the_model_keeps_over_half_a_side_the_bytes_forwarded_never_pass_the_originals(
        name: str, width: int, height: int, bits_per_pixel: float, fmt: str, orientation: int,
        checkpoints: dict[str, Model]) -> None:
    """The handoff is the model's own size or nothing, and where no draft decode applies (both paths decode and
    resize the same pixels) it is chosen only when its BMP is smaller than the original: at most 1.5x, 1x in
    fact."""
    geometry = _geometry(checkpoints[name])
    source_bytes = max(1, int(width * height * bits_per_pixel / 8))
    try:
        target = resize_target(geometry, width, height, orientation)
    except MediaError:
        return
    chosen = handoff_target(geometry, fmt, source_bytes, width, height, orientation, False, "auto")
    assert chosen in (None, target)
    if chosen is not None and draft_scale(fmt, width, height, *chosen) == 1:
        assert _bmp_bytes(*chosen) <= 1.5 * source_bytes


# (checkpoint, stored size, file bytes) -> the original goes (True) or the handoff (False). The 3000x2000 photo
# is the (2.7 MB of base64); the camera JPEGs are 12 MP at quality 90.
CASES = [
    ("Qwen2.5-VL", (3000, 2000), 2_000_000, True),
    ("Qwen3-VL", (4032, 3024), 3_000_000, True),
    ("Qwen3-VL", (3264, 2448), 2_500_000, True),
    ("GLM-4.1V", (3000, 2000), 2_000_000, True),
    ("Idefics3", (4000, 3000), 3_600_000, False),
    ("Idefics3", (4032, 3024), 3_000_000, False),
    ("Gemma 3", (4000, 3000), 3_600_000, False),
    ("Gemma 3", (3000, 2000), 2_000_000, False),
    ("InternVL 3", (4000, 3000), 3_600_000, False),
    ("Mistral 3", (4000, 3000), 3_600_000, False),
]


@pytest.mark.parametrize(("name", "size", "source_bytes", "original"), CASES)
def test_a_photo_the_model_keeps_nearly_whole_goes_as_it_came_one_it_shrinks_a_lot_goes_resized(
        name: str, size: tuple[int, int], source_bytes: int, original: bool,
        checkpoints: dict[str, Model]) -> None:
    target = resize_target(_geometry(checkpoints[name]), *size, 1)
    assert target is not None  # the model would resize it: the rule decides
    assert forward_original("JPEG", source_bytes, *size, target, "bmp") is original


@pytest.mark.parametrize("name", ["Qwen2.5-VL", "Idefics3", "Gemma 3"])
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(width=st.integers(600, 3600), height=st.integers(600, 3600), quality=st.sampled_from((30, 90)),
       fmt=st.sampled_from(("JPEG", "PNG")))
def test_the_decode_and_the_forward_estimate_decide_alike(name: str, width: int, height: int, quality: int,
                                                          fmt: str, checkpoints: dict[str, Model]) -> None:
    """The estimate is 0 exactly where the decode forwards the original (they call the same rule)."""
    buffer = io.BytesIO()
    photo_sized(width, height, seed=width).save(buffer, fmt, **({"quality": quality} if fmt == "JPEG" else {}))
    policy = ImagePolicy(geometry=checkpoints[name].geometry, validate="header")
    processed = process_image(buffer.getvalue(), policy)
    estimated = forwarded_file_bytes(inline_header(Base64Ends(base64.b64encode(buffer.getvalue()))), policy)
    assert (processed is None) == (estimated == 0)


async def _forwarded(upstream: Upstream, start_proxy: StartProxy, folder: Path, sent: str) -> tuple[str, list[str]]:
    proxy = await start_proxy(upstream.url, MMGATE_MODEL=str(folder))
    async with aiohttp.ClientSession() as session:
        response = await session.post(proxy.url + "/v1/chat/completions", data=orjson.dumps(chat_with_image(sent)),
                                      headers={"Content-Type": "application/json"})
        assert response.status == 200, await response.text()
    seen = upstream.seen[-1]
    url = orjson.loads(seen.body)["messages"][0]["content"][1]["image_url"]["url"]
    return str(url), seen.headers.getall("x-mmgate-image-tokens")


def _jpeg(width: int, height: int) -> bytes:
    buffer = io.BytesIO()
    photo_sized(width, height, seed=3).save(buffer, "JPEG", quality=90)
    return buffer.getvalue()


async def test_a_3000x2000_photo_reaches_a_qwen25_backend_as_it_was_sent(
        upstream: Upstream, start_proxy: StartProxy, tmp_path: Path, checkpoints: dict[str, Model]) -> None:
    """Qwen2.5-VL's own 12.8 MP bound keeps it at 2996x1988: the backend gets the client's JPEG byte for byte
    (not a 17.9 MB BMP), with the same token count its processor makes of it."""
    sent = data_uri(_jpeg(3000, 2000), "image/jpeg")
    forwarded, tokens = await _forwarded(upstream, start_proxy, REAL_CHECKPOINTS["Qwen2.5-VL"](tmp_path), sent)
    assert forwarded == sent
    assert tokens == [str(checkpoints["Qwen2.5-VL"].image_tokens(3000, 2000))]


async def test_a_12_mp_camera_jpeg_reaches_an_idefics3_backend_at_its_size(
        upstream: Upstream, start_proxy: StartProxy, tmp_path: Path, checkpoints: dict[str, Model]) -> None:
    """Idefics3's 1456 px edge keeps an eighth of its pixels: the backend gets the 1456x1092 BMP."""
    sent = data_uri(_jpeg(4000, 3000), "image/jpeg")
    forwarded, tokens = await _forwarded(upstream, start_proxy, REAL_CHECKPOINTS["Idefics3"](tmp_path), sent)
    head, image = decode_uri(forwarded)
    assert head == "data:image/bmp;base64" and image.size == (1456, 1092)
    assert tokens == [str(checkpoints["Idefics3"].image_tokens(4000, 3000))]
    assert isinstance(image, Image.Image)
