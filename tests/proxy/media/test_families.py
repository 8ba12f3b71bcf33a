"""The families added onto the shared interface, each checked against its own transformers processor run on real
pixels: the size mmgate forwards, the tokens it counts, on the sizes that break tiling rules (strips, tiny and
huge images, EXIF rotations), with a real checkpoint's configuration and with small test values.

Processor folders are built locally (``testkit.models``: configurations only, no weights, no downloads).
"""

from __future__ import annotations

import io
import types
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from preprocessors.base import ImagePolicy
from preprocessors.errors import MediaError
from preprocessors.geometry import resize_target, upright
from preprocessors.handoff import handoff_target
from preprocessors.image import process_image
from proxy.media.model_folder import load_model
from testkit.media import chat_with_image, data_uri, decode_uri
from tests.conftest import StartProxy, Upstream

transformers = pytest.importorskip("transformers", reason="the model extra: pip install -e '.[model]'")

from testkit import models  # noqa: E402

# (width, height): strips both ways, a tiny square, 12 MP, a photo most families shrink, one they enlarge, squares
# at and near a tile, and a wide banner.
SIZES = [(1, 4000), (4000, 1), (10, 10), (4000, 3000), (3000, 2000), (700, 500), (448, 448), (1000, 300),
         (1063, 2257), (2230, 535)]


@dataclass(frozen=True)
class Case:
    """A family's folder, and what its processor makes of an upright image: ``((width, height), tokens)``, where
    the size is the one the processor resizes the image to."""

    build: Callable[[Path], Path]
    family: str
    reference: Callable[[Path, Image.Image], tuple[tuple[int, int], int]]


def _image_processor(folder: Path) -> Any:
    return transformers.AutoImageProcessor.from_pretrained(str(folder), local_files_only=True, backend="pil")


def _internvl(folder: Path, image: Image.Image) -> tuple[tuple[int, int], int]:
    """InternVLProcessor's crop (its default) run on the pixels, the size read from the processor's first resize
    (the whole grid, or the one tile), the count from ``InternVLProcessor._get_num_multimodal_tokens`` (the
    processor cannot load without torch, so the method runs on a stand-in holding what it reads)."""
    from transformers.models.internvl.processing_internvl import InternVLProcessor

    ip = _image_processor(folder)
    seq = int(models.json.loads((folder / "processor_config.json").read_text())["image_seq_length"])
    resized: list[tuple[int, int]] = []
    resize = ip.resize

    def recording(pixels: Any, size: Any, *args: Any, **kwargs: Any) -> Any:
        resized.append((int(size.width), int(size.height)))
        return resize(pixels, size, *args, **kwargs)

    ip.resize = recording
    patches = int(ip(images=[image], crop_to_patches=True, return_tensors="np")["num_patches"][0])
    stand_in = types.SimpleNamespace(image_processor=ip, image_seq_length=seq,
                                     _merge_kwargs=lambda **_: {"images_kwargs": {"crop_to_patches": True}})
    tokens = int(InternVLProcessor._get_num_multimodal_tokens(
        stand_in, image_sizes=[[image.height, image.width]]).num_image_tokens[0])  # type: ignore[arg-type]
    assert tokens == 2 + seq * patches
    return resized[0], tokens


def _methods(module: str, cls: str, *names: str) -> dict[str, Any]:
    """Methods of a transformers class whose module imports torch (absent here), taken from its source and run
    as written."""
    import ast

    source = Path(transformers.__file__).parent.joinpath(*module.split(".")).with_suffix(".py")
    tree = ast.parse(source.read_text())
    body = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls).body
    methods: list[ast.stmt] = [n for n in body if isinstance(n, ast.FunctionDef) and n.name in names]
    namespace: dict[str, Any] = {}
    exec(compile(ast.Module(methods, type_ignores=[]), str(source), "exec"), namespace)
    return {name: namespace[name] for name in names}


def _pixtral(folder: Path, image: Image.Image) -> tuple[tuple[int, int], int]:
    """The image processor run on the pixels with the patch PixtralProcessor gives it (``_process_images``: the
    patch times the spatial merge), the size it reports, and the tokens of the prompt the processor's
    ``replace_image_token`` builds of it (its module imports torch, so the method is taken from the source)."""
    config = models.json.loads((folder / "processor_config.json").read_text())
    ip = _image_processor(folder)
    stand_in = types.SimpleNamespace(image_token="[IMG]", image_break_token="[IMG_BREAK]",
                                     image_end_token="[IMG_END]", patch_size=config["patch_size"],
                                     spatial_merge_size=config["spatial_merge_size"])
    merged = config["patch_size"] * config["spatial_merge_size"]
    out = ip(images=[image], patch_size={"height": merged, "width": merged}, return_tensors="np")
    height, width = (int(v) for v in out["image_sizes"][0])
    replace = _methods("models.pixtral.processing_pixtral", "PixtralProcessor", "replace_image_token")
    prompt = replace["replace_image_token"](stand_in, out, 0)
    tokens = prompt.count("[IMG]") + prompt.count("[IMG_BREAK]") + prompt.count("[IMG_END]")
    return (width, height), tokens


def _llava_onevision(folder: Path, image: Image.Image) -> tuple[tuple[int, int], int]:
    """The size the image processor brings the image to for its grid (``_resize_for_patching`` in its best
    resolution), checked against the patches it cuts, and ``LlavaOnevisionProcessor._get_num_multimodal_tokens``
    (the processor cannot load without torch, so the method runs on a stand-in holding what it reads)."""
    from transformers.image_processing_utils import select_best_resolution
    from transformers.image_utils import PILImageResampling
    from transformers.models.llava_onevision.processing_llava_onevision import LlavaOnevisionProcessor

    config = models.json.loads((folder / "processor_config.json").read_text())
    ip = _image_processor(folder)
    best = select_best_resolution((image.height, image.width), ip.image_grid_pinpoints)
    resized = ip._resize_for_patching(np.zeros((3, image.height, image.width), np.uint8), best,
                                      PILImageResampling.BICUBIC)
    patches = ip(images=[image], return_tensors="np")["pixel_values"].shape[1]
    assert patches == 1 + (best[0] // ip.size.height) * (best[1] // ip.size.width)
    stand_in = types.SimpleNamespace(image_processor=ip, **config)
    stand_in._get_number_of_features = types.MethodType(LlavaOnevisionProcessor._get_number_of_features, stand_in)
    stand_in._get_unpadded_features = types.MethodType(LlavaOnevisionProcessor._get_unpadded_features, stand_in)
    stand_in._merge_kwargs = lambda **_: {"images_kwargs": {}}
    tokens = LlavaOnevisionProcessor._get_num_multimodal_tokens(
        stand_in, image_sizes=[[image.height, image.width]]).num_image_tokens[0]  # type: ignore[arg-type]
    return (resized.shape[2], resized.shape[1]), int(tokens)


def _gemma3_pan_and_scan(folder: Path, image: Image.Image) -> tuple[tuple[int, int], int]:
    """Gemma3Processor run on the pixels with ``do_pan_and_scan`` (its own default is off; vLLM takes the image
    processor's setting first, as mmgate does): the square it resizes to and the soft image tokens in its
    prompt."""
    processor = transformers.AutoProcessor.from_pretrained(str(folder), local_files_only=True, backend="pil")
    # The processor's call would put its own defaults over the image processor's settings; vLLM counts with the
    # image processor's where set, so they are passed as such.
    settings = {key: value for key in ("pan_and_scan_min_crop_size", "pan_and_scan_max_num_crops",
                                       "pan_and_scan_min_ratio_to_activate")
                if (value := getattr(processor.image_processor, key, None)) is not None}
    out = processor(text=[processor.boi_token], images=[image], do_pan_and_scan=True, return_tensors="np",
                    **settings)
    image_token = processor.tokenizer.convert_tokens_to_ids(processor.tokenizer.image_token)
    square = out["pixel_values"].shape[-1], out["pixel_values"].shape[-2]
    return square, int((out["input_ids"][0] == image_token).sum())


def _mllama(folder: Path, image: Image.Image) -> tuple[tuple[int, int], int]:
    """The Mllama image processor run on the pixels: the size its resize fits the image to, the tiles it cuts;
    the count is vLLM's, the tiles' patches and class tokens in the encoder prompt."""
    ip = _image_processor(folder)
    resized: list[tuple[int, int]] = []
    resize = ip.resize

    def recording(*args: Any, **kwargs: Any) -> Any:
        pixels, tiles = resize(*args, **kwargs)
        resized.append((pixels.shape[-1], pixels.shape[-2]))
        return pixels, tiles

    ip.resize = recording
    tiles = int(ip(images=[[image]], return_tensors="np")["num_tiles"][0][0])
    vision = models.json.loads((folder / "config.json").read_text())["vision_config"]
    return resized[0], tiles * ((vision["image_size"] // vision["patch_size"]) ** 2 + 1)


def _glm4v(folder: Path, image: Image.Image) -> tuple[tuple[int, int], int]:
    """The GLM (or PaddleOCR-VL) image processor run on the pixels: its patch grid, and the processor's count of
    it (``image_grid_thw.prod() // merge_size ** 2``, the prompt's image tokens)."""
    ip = _image_processor(folder)
    _t, rows, columns = (int(v) for v in ip(images=[image], return_tensors="np")["image_grid_thw"][0])
    return (columns * ip.patch_size, rows * ip.patch_size), _t * rows * columns // ip.merge_size ** 2


def _paligemma(folder: Path, image: Image.Image) -> tuple[tuple[int, int], int]:
    """PaliGemmaProcessor run on the pixels: the square it makes and the image tokens in its prompt."""
    processor = transformers.AutoProcessor.from_pretrained(str(folder), local_files_only=True, backend="pil")
    out = processor(text=["<image>describe"], images=[image], return_tensors="np")
    square = out["pixel_values"].shape[-1], out["pixel_values"].shape[-2]
    return square, int((out["input_ids"][0] == processor.image_token_id).sum())


def _aya_vision(folder: Path, image: Image.Image) -> tuple[tuple[int, int], int]:
    """AyaVisionProcessor run on the pixels: the size of its first resize (the whole grid, or the one tile) and
    the tokens of the prompt it puts in place of ``<image>``."""
    processor = transformers.AutoProcessor.from_pretrained(str(folder), local_files_only=True, backend="pil")
    resized: list[tuple[int, int]] = []
    resize = processor.image_processor.resize

    def recording(pixels: Any, size: Any, *args: Any, **kwargs: Any) -> Any:
        resized.append((int(size.width), int(size.height)))
        return resize(pixels, size, *args, **kwargs)

    processor.image_processor.resize = recording
    out = processor(text=["<image>"], images=[image], add_special_tokens=False)
    return resized[0], len(out["input_ids"][0])


def _gemma4(folder: Path, image: Image.Image) -> tuple[tuple[int, int], int]:
    """The Gemma 4 image processor run on the pixels: the patch grid its positions span, and its own count of
    soft tokens (``num_soft_tokens_per_image``)."""
    ip = _image_processor(folder)
    out = ip(images=[image], return_tensors="np")
    positions = out["image_position_ids"][0]
    valid = positions[(positions >= 0).all(axis=1)]
    columns, rows = (int(v) + 1 for v in valid.max(axis=0))
    return (columns * ip.patch_size, rows * ip.patch_size), int(out["num_soft_tokens_per_image"][0])


CASES = {
    "internvl": Case(lambda p: models.internvl_folder(p), "internvl", _internvl),
    "internvl-small": Case(lambda p: models.internvl_folder(p, tile=64, max_patches=6, image_seq_length=16),
                           "internvl", _internvl),
    "mistral3": Case(lambda p: models.pixtral_folder(p), "mistral3", _pixtral),
    "pixtral": Case(lambda p: models.pixtral_folder(p, "llava", 1024, 16, 1), "pixtral", _pixtral),
    "llava-onevision": Case(lambda p: models.llava_onevision_folder(p), "llava-onevision", _llava_onevision),
    "llava-onevision-small": Case(lambda p: models.llava_onevision_folder(
        p, 56, [[56 * r, 56 * c] for r in range(1, 4) for c in range(1, 4)], 16, "anyres_max_2"),
        "llava-onevision", _llava_onevision),
    "gemma3-pan-and-scan": Case(lambda p: models.gemma3_folder(p, pan_and_scan=True), "gemma3 with pan-and-scan",
                                _gemma3_pan_and_scan),
    "gemma3-pan-and-scan-small": Case(lambda p: models.gemma3_folder(
        p, True, 64, 16, pan_and_scan_min_crop_size=32, pan_and_scan_max_num_crops=3,
        pan_and_scan_min_ratio_to_activate=1.5), "gemma3 with pan-and-scan", _gemma3_pan_and_scan),
    "mllama": Case(lambda p: models.mllama_folder(p), "mllama", _mllama),
    "mllama-small": Case(lambda p: models.mllama_folder(p, 56, 6), "mllama", _mllama),
    "glm-4.1v": Case(lambda p: models.glm4v_folder(p), "glm-4.1v", _glm4v),
    "glm-4.5v": Case(lambda p: models.glm4v_folder(p, "glm4v_moe"), "glm-4.5v", _glm4v),
    "glm-4.6v-small": Case(lambda p: models.glm4v_folder(p, "glm46v", 56 * 56, 28 * 28 * 64), "glm-4.6v", _glm4v),
    "paligemma": Case(lambda p: models.paligemma_folder(p), "paligemma", _paligemma),
    "paligemma-small": Case(lambda p: models.paligemma_folder(p, 32, 4), "paligemma", _paligemma),
    "paddleocr-vl": Case(lambda p: models.paddleocr_vl_folder(p), "paddleocr-vl", _glm4v),
    "paddleocr-vl-small": Case(lambda p: models.paddleocr_vl_folder(p, 28 * 28 * 4, 28 * 28 * 32), "paddleocr-vl",
                               _glm4v),
    "aya-vision": Case(lambda p: models.aya_vision_folder(p), "aya-vision", _aya_vision),
    "aya-vision-small": Case(lambda p: models.aya_vision_folder(p, 56, 4), "aya-vision", _aya_vision),
    "gemma4": Case(lambda p: models.gemma4_folder(p), "gemma4", _gemma4),
    "gemma4-small": Case(lambda p: models.gemma4_folder(p, 70), "gemma4", _gemma4),
    "pixtral-small": Case(lambda p: models.pixtral_folder(p, "llava", 200, 8, 2), "pixtral", _pixtral),
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {name: case.build(tmp_path_factory.mktemp(name)) for name, case in CASES.items()}


@pytest.mark.parametrize("size", SIZES, ids=[f"{w}x{h}" for w, h in SIZES])
@pytest.mark.parametrize("name", list(CASES))
def test_size_and_tokens_equal_what_the_processor_makes(name: str, size: tuple[int, int],
                                                        folders: dict[str, Path]) -> None:
    case, folder = CASES[name], folders[name]
    model = load_model(str(folder))
    assert model.family == case.family and model.geometry is not None
    width, height = size
    try:
        expected_size, expected_tokens = case.reference(folder, Image.new("RGB", size))
    except ValueError:  # the processor refuses the image: so does mmgate, in the API's shape
        with pytest.raises(MediaError):
            model.image_tokens(width, height)
        return
    assert model.geometry.backend_size(width, height) == expected_size
    assert model.image_tokens(width, height) == expected_tokens <= model.most_tokens
    target = resize_target(model.geometry, width, height, 1)
    if target is None:  # the processor would enlarge it, it is already its size, or a resize would count otherwise
        assert (expected_size[0] > width or expected_size[1] > height or expected_size == size
                or case.reference(folder, Image.new("RGB", expected_size))[1] != expected_tokens)
        return
    assert target == expected_size and target[0] <= width and target[1] <= height
    # The processor run on what mmgate forwards resizes nothing more and counts the same tokens.
    assert case.reference(folder, Image.new("RGB", target)) == (target, expected_tokens)


def _jpeg(width: int, height: int, orientation: int) -> bytes:
    rng = np.random.default_rng(width + height)
    exif = Image.Exif()
    exif[0x0112] = orientation
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (height, width, 3), dtype=np.uint8)).save(
        buf, "JPEG", quality=80, exif=exif.tobytes())
    return buf.getvalue()


@pytest.mark.parametrize("orientation", [6, 8])
@pytest.mark.parametrize("name", list(CASES))
def test_a_rotated_photo_is_counted_and_resized_upright(name: str, orientation: int,
                                                        folders: dict[str, Path]) -> None:
    """EXIF orientation 6 or 8 swaps the sides the backend sees: the count and the resize follow the upright
    image, and the processor run on what mmgate forwards counts what mmgate counted."""
    case, folder = CASES[name], folders[name]
    model = load_model(str(folder))
    stored = (1800, 600)
    upright_size = upright(*stored, orientation)
    expected_size, expected_tokens = case.reference(folder, Image.new("RGB", upright_size))
    assert model.image_tokens(*stored, orientation) == expected_tokens
    processed = process_image(_jpeg(*stored, orientation), ImagePolicy(geometry=model.geometry, jpeg_quality=90))
    sent = upright_size if processed is None else Image.open(io.BytesIO(processed.data)).size
    assert processed is None or sent == expected_size
    assert case.reference(folder, Image.new("RGB", sent))[1] == expected_tokens


@pytest.mark.parametrize("name", list(CASES))
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(size=st.tuples(st.integers(1, 5000), st.integers(1, 5000)).filter(lambda s: max(s) / min(s) < 150))
def test_any_size_counts_as_the_processor_does(name: str, size: tuple[int, int], folders: dict[str, Path]) -> None:
    case, folder = CASES[name], folders[name]
    model = load_model(str(folder))
    assert model.geometry is not None
    expected_size, expected_tokens = case.reference(folder, Image.new("RGB", size))
    assert model.geometry.backend_size(*size) == expected_size
    assert model.image_tokens(*size) == expected_tokens


@pytest.mark.parametrize("name", list(CASES))
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(size=st.tuples(st.integers(1, 20000), st.integers(1, 20000)).filter(lambda s: max(s) / min(s) < 150))
def test_no_image_makes_more_tokens_than_the_most_tokens(name: str, size: tuple[int, int],
                                                         folders: dict[str, Path]) -> None:
    """What an image whose head says no size is counted as bounds what any image makes."""
    model = load_model(str(folders[name]))
    assert model.image_tokens(*size) <= model.most_tokens


def test_every_geometry_travels_to_a_worker_process_as_plain_data(folders: dict[str, Path]) -> None:
    """A decode pool of processes pickles the ImagePolicy: each family's geometry survives it unchanged."""
    import pickle

    for name, folder in folders.items():
        policy = ImagePolicy(geometry=load_model(str(folder)).geometry)
        copy = pickle.loads(pickle.dumps(policy))
        assert copy == policy, name
        assert copy.geometry is not None and policy.geometry is not None
        assert copy.geometry.backend_size(3000, 2000) == policy.geometry.backend_size(3000, 2000)


@pytest.mark.parametrize(("name", "size"), [("internvl", (1900, 1300)), ("mistral3", (1900, 1300)),
                                            ("gemma3-pan-and-scan", (2000, 600)), ("mllama", (1900, 1300))])
async def test_the_upstream_gets_the_family_size_and_its_count(
        name: str, size: tuple[int, int], upstream: Upstream, start_proxy: StartProxy,
        folders: dict[str, Path]) -> None:
    """Over HTTP: the image reaches the backend at the size mmgate's geometry says (or as it was sent, where the
    processor would enlarge it or its tiles or crops would change), with its count in the header."""
    folder = str(folders[name])
    model = load_model(folder)
    assert model.geometry is not None
    proxy = await start_proxy(upstream.url, MMGATE_MODEL=folder)
    photo = io.BytesIO()
    # Incompressible: the model-sized BMP is smaller than this PNG, so it is what goes (preprocessors/handoff.py).
    noise = np.random.default_rng(sum(size)).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    Image.fromarray(noise).save(photo, "PNG", compress_level=1)
    sent = data_uri(photo.getvalue())
    async with aiohttp.ClientSession() as session:
        response = await session.post(proxy.url + "/v1/chat/completions", data=orjson.dumps(chat_with_image(sent)),
                                      headers={"Content-Type": "application/json"})
        assert response.status == 200
    seen = upstream.seen[-1]
    assert seen.headers.getall("x-mmgate-image-tokens") == [str(model.image_tokens(*size))]
    forwarded = orjson.loads(seen.body)["messages"][0]["content"][1]["image_url"]["url"]
    target = handoff_target(model.geometry, "PNG", len(photo.getvalue()), *size, 1, False, "auto")
    assert target == resize_target(model.geometry, *size, 1)
    if target is None:
        assert forwarded == sent
    else:
        assert decode_uri(forwarded)[1].size == target == model.geometry.backend_size(*size)


def test_a_strip_under_a_small_pixel_range_stays_within_the_most_tokens(tmp_path: Path) -> None:
    """``smart_resize`` keeps a strip one token wide whatever ``max_pixels`` says, so a checkpoint whose range is
    under a strip's tokens must still bound what a strip makes."""
    model = load_model(str(models.qwen_folder(tmp_path / "qwen", max_pixels=28 * 28 * 64)))
    strip = (28, 28 * 150)
    assert model.image_tokens(*strip) > 64
    assert model.image_tokens(*strip) <= model.most_tokens
