"""Fidelity with MMGATE_MODEL: what reaches the backend is close to what its own processor makes of the original.

The bound is a quality bound, not a timing: a deterministic high-detail photo (seeded 1/f noise) goes through
mmgate over HTTP with an Idefics3 processor folder (``testkit.models``), and the image the upstream received is
decoded and compared with the processor's own resize of the decoded original: its PIL backend, its ``resample``
(LANCZOS), run by the processor itself (``testkit.models.idefics3_resize``). That is the reference because it is
what the backend computes when mmgate forwards the original untouched. With a model the file is a lossless BMP
(the resize is the only difference); without one nothing changes: JPEG quality 90 with 4:2:0 chroma, BICUBIC.
"""

from __future__ import annotations

import io
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from PIL import Image, JpegImagePlugin

from preprocessors.base import ImagePolicy
from preprocessors.image import GENERIC_JPEG_QUALITY, MODEL_JPEG_QUALITY, _encode, process_image
from proxy.app import build_state
from proxy.media.model_folder import load_model
from proxy.settings import AUTO, ConfigError, Settings
from testkit.media import chat_with_image, data_uri, decode_uri, detailed_photo, psnr
from tests.conftest import StartProxy, Upstream

pytest.importorskip("transformers", reason="the model extra: pip install -e '.[model]'")

from testkit.models import idefics3_folder, idefics3_resize, qwen_folder

BOUND_DB = 40.0


@pytest.fixture(scope="module")
def idefics3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return idefics3_folder(tmp_path_factory.mktemp("idefics3"))


@pytest.fixture(scope="module")
def high_detail_jpeg() -> bytes:
    """The high-detail photo of bench/fidelity.py: a 4000x3000 camera JPEG (quality 92) of 1/f noise with colour
    detail, where JPEG q90 at the model's size loses the most; Idefics3 brings it to 1456x1092."""
    buf = io.BytesIO()
    detailed_photo(4000, 3000, seed=1, slope=1.0, contrast=40, shared=0.4, optics=0.7).save(buf, "JPEG", quality=92)
    return buf.getvalue()


def _jpeg(image: Image.Image, **options: Any) -> Image.Image:
    buf = io.BytesIO()
    image.save(buf, "JPEG", **options)
    return Image.open(io.BytesIO(buf.getvalue()))


async def test_the_upstream_gets_a_photo_within_40_db_of_the_processors_own_resize(
        upstream: Upstream, start_proxy: StartProxy, idefics3: Path, high_detail_jpeg: bytes) -> None:
    reference = idefics3_resize(idefics3, Image.open(io.BytesIO(high_detail_jpeg)))
    # A quality bound, not a timing: a worker's first image imports transformers, slow on a loaded machine.
    proxy = await start_proxy(upstream.url, MMGATE_MODEL=str(idefics3), MMGATE_PREPROCESS_TIMEOUT="300")
    async with aiohttp.ClientSession() as session:
        response = await session.post(proxy.url + "/v1/chat/completions",
                                      data=orjson.dumps(chat_with_image(data_uri(high_detail_jpeg, "image/jpeg"))),
                                      headers={"Content-Type": "application/json"})
        assert response.status == 200, await response.text()
    content = orjson.loads(upstream.seen[-1].body)["messages"][0]["content"]
    head, received = decode_uri(content[1]["image_url"]["url"])
    assert head == "data:image/bmp;base64" and received.format == "BMP"
    assert received.size == reference.size == (1456, 1092)  # the processor's size: its own resize is a no-op
    lossless = process_image(high_detail_jpeg, ImagePolicy(geometry=load_model(str(idefics3)).geometry,
                                                           output_format="bmp"))
    assert lossless is not None and psnr(received, Image.open(io.BytesIO(lossless.data))) == float("inf")
    assert psnr(received, reference) >= BOUND_DB


def test_a_model_resizes_with_its_processors_filter(idefics3: Path, high_detail_jpeg: bytes) -> None:
    """LANCZOS for Idefics3: the processor's filter is closer to the reference than the generic BICUBIC."""
    geometry = load_model(str(idefics3)).geometry
    assert geometry is not None and geometry.resample == Image.Resampling.LANCZOS
    reference = idefics3_resize(idefics3, Image.open(io.BytesIO(high_detail_jpeg)))
    lossless = process_image(high_detail_jpeg, ImagePolicy(geometry=geometry, output_format="bmp"))
    assert lossless is not None
    bicubic = replace(geometry, resample=Image.Resampling.BICUBIC)  # type: ignore[type-var]
    as_bicubic = process_image(high_detail_jpeg, ImagePolicy(geometry=bicubic, output_format="bmp"))
    assert as_bicubic is not None
    own, other = (psnr(Image.open(io.BytesIO(p.data)), reference) for p in (lossless, as_bicubic))
    assert own > other


@pytest.mark.parametrize(("sides", "sent_as"), [((2000, 1500), None), ((4000, 3000), ("image/bmp", 1456, 1092))])
def test_with_a_model_an_image_it_keeps_nearly_whole_goes_as_it_came(idefics3: Path, sides: tuple[int, int],
                                                                      sent_as: tuple[str, int, int] | None) -> None:
    """A grainy photo compressed hard makes a bigger file at the model's size than it came as. Where the model
    keeps more than half of each side, mmgate's resize would repeat the backend's decode and resize and add
    bytes: it goes as it came (preprocessors/handoff.py). Twice that size, libjpeg decodes it at half scale and
    the backend decodes a BMP instead of resizing 12 MP: it goes at the model's size."""
    import numpy as np

    geometry = load_model(str(idefics3)).geometry
    grain = np.random.default_rng(7).integers(0, 256, (sides[1], sides[0], 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(grain).save(out, "JPEG", quality=25)
    processed = process_image(out.getvalue(), ImagePolicy(geometry=geometry))
    assert (processed and (processed.mime, processed.width, processed.height)) == sent_as


def test_with_a_model_a_camera_jpeg_and_its_reencode_get_the_same_treatment(idefics3: Path,
                                                                            high_detail_jpeg: bytes) -> None:
    """A camera writes quality 90 with 4:2:0 chroma; a client re-encodes at its own settings: both reach the
    backend at the model's size, in the same format."""
    geometry = load_model(str(idefics3)).geometry
    camera = io.BytesIO()
    Image.open(io.BytesIO(high_detail_jpeg)).save(camera, "JPEG", quality=90, subsampling=2)
    sent = [process_image(data, ImagePolicy(geometry=geometry)) for data in (camera.getvalue(), high_detail_jpeg)]
    assert [(p.mime, p.width, p.height) for p in sent if p is not None] == [("image/bmp", 1456, 1092)] * 2


def test_with_a_model_alpha_is_kept_losslessly_as_png(idefics3: Path) -> None:
    """The handoff's encode (a PNG's costs the path more than most originals do, preprocessors/handoff.py, so
    it is written to directly)."""
    geometry = load_model(str(idefics3)).geometry
    data, mime = _encode(Image.new("RGBA", (1456, 1092), (10, 200, 30, 128)), ImagePolicy(geometry=geometry))
    assert mime == "image/png"
    received = Image.open(io.BytesIO(data))
    assert received.mode == "RGBA" and received.getpixel((5, 5))[3] == 128


def test_without_a_model_auto_quality_stays_90_with_subsampled_chroma(high_detail_jpeg: bytes) -> None:
    processed = process_image(high_detail_jpeg, ImagePolicy(resize_max_pixels=1456 * 1092))
    assert processed is not None
    out = Image.open(io.BytesIO(processed.data))
    assert JpegImagePlugin.get_sampling(out) == 2  # 4:2:0
    assert out.quantization == _jpeg(out.convert("RGB"), quality=GENERIC_JPEG_QUALITY).quantization


def test_with_a_model_an_explicit_jpeg_keeps_full_chroma(idefics3: Path, high_detail_jpeg: bytes) -> None:
    geometry = load_model(str(idefics3)).geometry
    for quality, expected in ((0, MODEL_JPEG_QUALITY), (85, 85)):  # 0: the worker's auto
        processed = process_image(high_detail_jpeg, ImagePolicy(geometry=geometry, jpeg_quality=quality,
                                                                output_format="jpeg"))
        assert processed is not None
        out = Image.open(io.BytesIO(processed.data))
        assert JpegImagePlugin.get_sampling(out) == 0
        assert out.quantization == _jpeg(out.convert("RGB"), quality=expected, subsampling=0).quantization


def test_jpeg_quality_is_auto_by_default_and_takes_1_to_100(tmp_path: Path) -> None:
    assert Settings.from_env({}).decode.jpeg_quality is AUTO
    assert Settings.from_env({"MMGATE_JPEG_QUALITY": "Auto"}).decode.jpeg_quality is AUTO
    assert Settings.from_env({"MMGATE_JPEG_QUALITY": "95"}).decode.jpeg_quality == 95
    for bad in ("0", "101", "high"):
        with pytest.raises(ConfigError, match=r"MMGATE_JPEG_QUALITY.*from 1 to 100, or auto"):
            Settings.from_env({"MMGATE_JPEG_QUALITY": bad})
    assert "MMGATE_JPEG_QUALITY=auto" in Settings.from_env({"MMGATE_UPSTREAM": "http://127.0.0.1:9"}).describe()
    # The policy a decode worker gets keeps auto (0); the worker resolves it with or without a model.
    state = build_state(Settings.from_env({"MMGATE_UPSTREAM": "http://127.0.0.1:9",
                                           "MMGATE_MODEL": str(qwen_folder(tmp_path))}))
    assert state.image_policy.jpeg_quality == 0 and state.image_policy.geometry is not None
