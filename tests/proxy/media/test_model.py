"""MMGATE_MODEL: the served model's geometry and image tokens, checked against the model's own processor.

Processor folders are built locally (``testkit.models``: configurations and tiny tokenizers, no weights, no
downloads). For random image sizes and each family: mmgate's resize target and token estimate equal what the
processor computes when it runs on the image, running the processor on mmgate's output changes nothing, and
an image the processor would enlarge is forwarded as it is while still counted as the backend will see it.
"""

from __future__ import annotations

import base64
import io
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import orjson
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from PIL import Image

from preprocessors.base import ImagePolicy
from preprocessors.dataurl import Base64Ends
from preprocessors.dimensions import Dimensions, peek_dimensions
from preprocessors.errors import MediaError
from preprocessors.geometry import resize_target, upright
from preprocessors.image import process_image
from proxy.app import build_state
from proxy.cli import main
from proxy.media.model import Model
from proxy.media.model_folder import load_model
from proxy.settings import ConfigError, Settings
from testkit.media import chat_with_image, data_uri, decode_uri, photo_sized
from tests.conftest import StartProxy, Upstream

transformers = pytest.importorskip("transformers", reason="the model extra: pip install -e '.[model]'")

from testkit.models import (  # noqa: E402
    QWEN_VIDEO_CONFIG,
    gemma3_folder,
    idefics3_folder,
    llava_folder,
    llava_next_folder,
    qwen_folder,
)

FAMILIES = ["qwen2-vl", "qwen2.5-vl", "qwen3-vl", "idefics3", "smolvlm"]


def peek_dimensions_of(payload: bytes) -> Dimensions | None:
    return peek_dimensions(Base64Ends(payload).head)


def _build(family: str, path: Path) -> Path:
    if family == "qwen2-vl":
        return qwen_folder(path, "qwen2_vl")
    if family == "qwen2.5-vl":
        return qwen_folder(path, "qwen2_5_vl")
    if family == "qwen3-vl":
        return qwen_folder(path, "qwen3_vl")
    if family == "smolvlm":
        return idefics3_folder(path, "smolvlm", tile=512, longest_edge=2048)
    return idefics3_folder(path, "idefics3")


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {family: _build(family, tmp_path_factory.mktemp(family.replace(".", ""))) for family in FAMILIES}


# ---------------------------------------------------------------------------------------------------------
# what the processor itself does with an image (the reference every property compares against)


class Reference:
    """The model's processor run on real pixels: the size it resizes to and the tokens it makes."""

    def __init__(self, family: str, folder: Path) -> None:
        self.family = family
        self.image_processor = transformers.AutoImageProcessor.from_pretrained(
            str(folder), local_files_only=True, backend="pil")
        self.processor: Any = None
        self.tokenizer: Any = None
        if family == "idefics3":
            self.processor = transformers.AutoProcessor.from_pretrained(str(folder), local_files_only=True,
                                                                        backend="pil")
        elif family == "smolvlm":
            self.tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder), local_files_only=True)

    def run(self, image: Image.Image) -> tuple[tuple[int, int], int]:
        """``((width, height), tokens)`` of the processor's output for ``image`` (upright, as the backend sees it)."""
        ip = self.image_processor
        if self.family.startswith("qwen"):
            out = ip(images=[image], return_tensors="np")
            _t, rows, cols = (int(v) for v in out["image_grid_thw"][0])
            return (cols * ip.patch_size, rows * ip.patch_size), rows * cols // ip.merge_size ** 2
        tile = ip.max_image_size["longest_edge"]
        out = ip(images=[[image]], return_row_col_info=True, return_tensors="np")
        rows, cols = int(out["rows"][0][0]), int(out["cols"][0][0])
        size = (max(cols, 1) * tile, max(rows, 1) * tile)
        if self.processor is not None:  # Idefics3: the processor expands "<image>" into its tokens
            ids = self.processor(text=["<image>"], images=[[image]])["input_ids"][0]
            return size, len(ids)
        from transformers.models.smolvlm.processing_smolvlm import get_image_prompt_string

        prompt = get_image_prompt_string(rows, cols, (tile // 14) ** 2 // 4, "<fake_token_around_image>", "<image>",
                                         "<global-img>")
        return size, len(self.tokenizer(prompt, add_special_tokens=False)["input_ids"])


@pytest.fixture(scope="module")
def references(folders: dict[str, Path]) -> dict[str, Reference]:
    return {family: Reference(family, folder) for family, folder in folders.items()}


sizes = st.tuples(st.integers(1, 3000), st.integers(1, 3000)).filter(lambda s: max(s) / min(s) < 150)


@pytest.mark.parametrize("family", FAMILIES)
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(size=sizes)
@example(size=(700, 500)).via("a photo Idefics3 upscales")
@example(size=(3000, 2000)).via("a photo every family downsizes")
@example(size=(3000, 100)).via("a strip: smaller on one side only")
@example(size=(28, 28)).via("below Qwen's minimum")
def test_target_and_tokens_equal_what_the_processor_computes(
        family: str, size: tuple[int, int], folders: dict[str, Path], references: dict[str, Reference]) -> None:
    model = load_model(str(folders[family]))
    assert model.family == family and model.geometry is not None
    width, height = size
    expected_size, expected_tokens = references[family].run(Image.new("RGB", size))
    assert model.geometry.backend_size(width, height) == expected_size
    assert model.image_tokens(width, height) == expected_tokens
    target = resize_target(model.geometry, width, height, 1)
    if target is None:  # forwarded as it is: the processor would enlarge it, or it is already the size
        assert expected_size[0] > width or expected_size[1] > height or expected_size == size
        return
    assert target == expected_size and target[0] <= width and target[1] <= height
    # The processor run on mmgate's output resizes nothing and counts the same tokens.
    assert references[family].run(Image.new("RGB", target)) == (target, expected_tokens)
    assert model.image_tokens(*target) == expected_tokens


CONSTANT_FAMILIES = {"llava": lambda p: llava_folder(p), "llava-pad": lambda p: llava_folder(p, pad=True),
                     "gemma3": lambda p: gemma3_folder(p)}


@pytest.fixture(scope="module")
def constant_folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {name: build(tmp_path_factory.mktemp(name)) for name, build in CONSTANT_FAMILIES.items()}


@pytest.mark.parametrize("name", list(CONSTANT_FAMILIES))
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(size=sizes)
@example(size=(700, 500)).via("enlarged by LLaVA on its short side, by Gemma 3 on both")
@example(size=(2000, 1500)).via("downsized by every family")
def test_llava_and_gemma3_target_and_tokens_follow_their_processor(
        name: str, size: tuple[int, int], constant_folders: dict[str, Path]) -> None:
    folder = str(constant_folders[name])
    model = load_model(folder)
    assert model.geometry is not None
    processor = transformers.AutoProcessor.from_pretrained(folder, local_files_only=True, backend="pil")
    if name.startswith("llava"):
        prompt = marker = processor.image_token
    else:  # Gemma 3 expands its begin-of-image marker into 256 soft tokens
        prompt, marker = processor.boi_token, processor.tokenizer.image_token
    image_token = processor.tokenizer.convert_tokens_to_ids(marker)

    def run(image_size: tuple[int, int]) -> tuple[tuple[int, ...], int]:
        out = processor(text=[prompt], images=[Image.new("RGB", image_size)], return_tensors="np")
        return tuple(out["pixel_values"].shape), int((out["input_ids"][0] == image_token).sum())

    width, height = size
    shape, tokens = run(size)
    assert model.image_tokens(width, height) == tokens
    target = resize_target(model.geometry, width, height, 1)
    if target is None:
        resized = model.geometry.backend_size(width, height)
        assert resized[0] > width or resized[1] > height or resized == size
        return
    assert target[0] <= width and target[1] <= height
    assert model.geometry.backend_size(*target) == target  # the processor's resize of mmgate's output is a no-op
    assert run(target) == (shape, tokens)
    if name == "llava":
        assert min(target) == 336
    elif name == "llava-pad":
        assert max(target) == 336
    else:
        assert target == (896, 896)


LLAVA_NEXT_GRIDS = {"v1.6": None, "wide": [[336, 336], [336, 1344], [1344, 336], [672, 1008], [1008, 672]]}


@pytest.fixture(scope="module")
def llava_next_folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {name: llava_next_folder(tmp_path_factory.mktemp(f"llava-next-{name}"), grid)
            for name, grid in LLAVA_NEXT_GRIDS.items()}


@pytest.mark.parametrize("grid", list(LLAVA_NEXT_GRIDS))
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(size=sizes)
@example(size=(1063, 2257)).via("the processor's patch size would count one row of tokens fewer")
@example(size=(2000, 1500)).via("a photo brought within the 672x672 grid")
@example(size=(300, 200)).via("smaller than every grid: the backend upscales it")
@example(size=(2230, 535)).via("a strip in the 1008x336 grid")
def test_llava_next_target_and_tokens_follow_its_processor(
        grid: str, size: tuple[int, int], llava_next_folders: dict[str, Path]) -> None:
    """The any-res grid: mmgate's size is the one the processor brings the image to within its best grid
    resolution, its count the processor's own; the processor run on mmgate's output resizes nothing and makes
    the same patches and tokens. A resize that would shift the count is not made."""
    from transformers.image_processing_utils import select_best_resolution
    from transformers.image_utils import PILImageResampling

    folder = str(llava_next_folders[grid])
    model = load_model(folder)
    assert model.family == "llava-next" and model.geometry is not None
    processor = transformers.AutoProcessor.from_pretrained(folder, local_files_only=True, backend="pil")
    image_token = processor.tokenizer.convert_tokens_to_ids(processor.image_token)
    ip = processor.image_processor

    def run(image_size: tuple[int, int]) -> tuple[tuple[int, int], tuple[int, ...], int]:
        """The size the processor resizes the image to for its grid, its patches, and its tokens."""
        best = select_best_resolution((image_size[1], image_size[0]), ip.image_grid_pinpoints)
        resized = ip._resize_for_patching(np.zeros((3, image_size[1], image_size[0]), np.uint8), best,
                                          PILImageResampling.BICUBIC)
        out = processor(text=[processor.image_token], images=[Image.new("RGB", image_size)], return_tensors="np")
        return ((resized.shape[2], resized.shape[1]), tuple(out["pixel_values"].shape),
                int((out["input_ids"][0] == image_token).sum()))

    width, height = size
    resized, shape, tokens = run(size)
    assert model.geometry.backend_size(width, height) == resized
    assert model.image_tokens(width, height) == tokens <= model.most_tokens
    target = resize_target(model.geometry, width, height, 1)
    if target is None:  # enlarged by the processor, already its size, or a resize would shift the count
        assert (resized[0] > width or resized[1] > height or resized == size
                or model.image_tokens(*resized) != tokens)
        return
    assert target == resized and target[0] <= width and target[1] <= height
    assert run(target) == (target, shape, tokens)
    assert model.image_tokens(*target) == tokens


def qwen2_video_reference(folder: Path) -> Callable[[int, int, int], int]:
    """``Qwen2VLVideoProcessor.get_num_of_video_patches // merge_size ** 2`` as transformers writes it, for the
    processor ``from_pretrained`` would load from ``folder``. The video processor's module imports torch and
    torchvision (which the model extra does not install), so its ``smart_resize``, its class defaults and the
    method are taken from the module's source and run as they are; only the loading (the folder's video
    configuration, else its image one, ``min_pixels``/``max_pixels`` over ``size``) is done here."""
    import ast
    import math
    import types

    source = Path(transformers.__file__).parent / "models" / "qwen2_vl" / "video_processing_qwen2_vl.py"
    tree = ast.parse(source.read_text())
    helper = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "smart_resize")
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Qwen2VLVideoProcessor")
    method = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "get_num_of_video_patches")
    namespace: dict[str, Any] = {"math": math}
    exec(compile(ast.Module([helper, method], type_ignores=[]), str(source), "exec"), namespace)
    defaults = {node.targets[0].id: eval(compile(ast.Expression(node.value), str(source), "eval"), {})
                for node in cls.body if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name)
                and node.targets[0].id in ("size", "patch_size", "temporal_patch_size", "merge_size")}
    video_file = folder / "video_preprocessor_config.json"
    config = orjson.loads((video_file if video_file.exists() else folder / "preprocessor_config.json").read_bytes())
    values = {**defaults, **{k: v for k, v in config.items() if k in defaults}}
    values["size"] = dict(values["size"])
    if "min_pixels" in config:
        values["size"]["shortest_edge"] = config["min_pixels"]
    if "max_pixels" in config:
        values["size"]["longest_edge"] = config["max_pixels"]
    processor = types.SimpleNamespace(**values)
    patches = namespace["get_num_of_video_patches"]
    return lambda frames, width, height: patches(processor, frames, height, width, {}) // processor.merge_size ** 2


@pytest.mark.parametrize(("model_type", "video"), [("qwen2_vl", None), ("qwen2_vl", QWEN_VIDEO_CONFIG),
                                                   ("qwen2_5_vl", QWEN_VIDEO_CONFIG)])
def test_qwen2_video_tokens_equal_what_its_video_processor_computes(
        model_type: str, video: dict[str, Any] | None, tmp_path: Path) -> None:
    folder = qwen_folder(tmp_path / model_type, model_type, video)
    model = load_model(str(folder))
    assert model.counts_video
    reference = qwen2_video_reference(folder)

    @settings(max_examples=80, deadline=None)
    @given(frames=st.integers(1, 4000), size=st.tuples(st.integers(1, 8000), st.integers(1, 8000))
           .filter(lambda s: max(s) / min(s) < 150))
    @example(frames=3, size=(7680, 4320)).via("an 8K clip: every frame brought within max_pixels")
    @example(frames=1, size=(64, 48)).via("one small frame, paired with itself, brought up to min_pixels")
    def check(frames: int, size: tuple[int, int]) -> None:
        assert model.video_tokens(frames, *size) == reference(frames, *size)

    check()
    with pytest.raises(MediaError) as caught:
        model.video_tokens(4, 4000, 10)
    assert caught.value.code == "video_unsupported_by_model" and "200" in caught.value.message


def test_families_without_video_tokens_count_none(folders: dict[str, Path],
                                                   llava_next_folders: dict[str, Path]) -> None:
    for folder in (folders["qwen3-vl"], folders["idefics3"], llava_next_folders["v1.6"]):
        assert not load_model(str(folder)).counts_video


def _jpeg(width: int, height: int, orientation: int = 1, exif_padding: int = 0) -> bytes:
    rng = np.random.default_rng(width * 7919 + height)
    image = Image.fromarray(rng.integers(0, 255, (height, width, 3), dtype=np.uint8))
    exif = Image.Exif()
    if orientation != 1:
        exif[0x0112] = orientation
    if exif_padding:
        exif[0x010E] = "x" * exif_padding  # ImageDescription: pushes the frame header past the first head
    buf = io.BytesIO()
    image.save(buf, "JPEG", quality=80, exif=exif.tobytes())
    return buf.getvalue()


@pytest.mark.parametrize("family", ["qwen2-vl", "idefics3"])
@pytest.mark.parametrize("orientation", [1, 6, 8, 3])
def test_a_rotated_photo_is_resized_upright_to_the_processor_size(
        family: str, orientation: int, folders: dict[str, Path], references: dict[str, Reference]) -> None:
    model = load_model(str(folders[family]))
    data = _jpeg(4800, 3200, orientation)
    found = peek_dimensions_of(base64.b64encode(data))
    assert found is not None and (found.width, found.height, found.orientation) == (4800, 3200, orientation)
    estimate = model.image_tokens(found.width, found.height, found.orientation)

    # Large enough that libjpeg decodes it at half scale: the handoff costs the path less than the original
    # (preprocessors/handoff.py), so what is sent is the resize.
    processed = process_image(data, ImagePolicy(geometry=model.geometry))
    assert processed is not None
    out = Image.open(io.BytesIO(processed.data))
    seen = out.size  # upright: EXIF applied and stripped
    assert seen == references[family].run(Image.new("RGB", upright(4800, 3200, orientation)))[0]
    assert references[family].run(out.convert("RGB")) == (seen, estimate)


def test_an_image_the_processor_would_enlarge_is_forwarded_as_it_is(folders: dict[str, Path]) -> None:
    model = load_model(str(folders["idefics3"]))
    data = _jpeg(700, 500)
    assert process_image(data, ImagePolicy(geometry=model.geometry)) is None
    assert model.image_tokens(700, 500) > 0


def test_an_aspect_ratio_the_processor_refuses_is_a_media_error(folders: dict[str, Path]) -> None:
    model = load_model(str(folders["qwen2-vl"]))
    with pytest.raises(MediaError) as caught:
        model.image_tokens(4000, 10)
    assert caught.value.code == "image_unsupported_by_model" and "200" in caught.value.message


# ---------------------------------------------------------------------------------------------------------
# dimensions from the first bytes


VARIANTS: dict[str, tuple[str, str, dict[str, object]]] = {
    "PNG": ("PNG", "RGB", {}), "JPEG": ("JPEG", "RGB", {}),
    "JPEG progressive": ("JPEG", "RGB", {"progressive": True}), "JPEG grey": ("JPEG", "L", {}),
    "WEBP lossy": ("WEBP", "RGB", {}), "WEBP lossless": ("WEBP", "RGB", {"lossless": True}),
    "WEBP alpha": ("WEBP", "RGBA", {}), "GIF": ("GIF", "P", {}), "BMP": ("BMP", "RGB", {}),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
@given(width=st.integers(1, 3000), height=st.integers(1, 3000), orientation=st.integers(1, 8),
       big_endian=st.booleans())
@settings(max_examples=8, deadline=None)
def test_dimensions_from_the_head_equal_pillow_on_the_whole_file(
        variant: str, width: int, height: int, orientation: int, big_endian: bool) -> None:
    fmt, mode, options = VARIANTS[variant]
    image = Image.new(mode, (width, height))
    if fmt == "JPEG":
        exif = Image.Exif()
        exif.endian = ">" if big_endian else "<"
        exif[0x010E] = "a description before the orientation"
        exif[0x0112] = orientation
        options = {**options, "exif": exif.tobytes()}
    buf = io.BytesIO()
    image.save(buf, fmt, **options)
    found = peek_dimensions_of(base64.b64encode(buf.getvalue()))
    whole = Image.open(io.BytesIO(buf.getvalue()))
    expected_orientation = whole.getexif().get(0x0112, 1) if fmt == "JPEG" else 1
    assert found == Dimensions(whole.width, whole.height, expected_orientation)


def test_a_long_exif_block_is_read_through_and_junk_says_nothing() -> None:
    data = _jpeg(640, 480, 6, exif_padding=40_000)
    found = peek_dimensions_of(base64.b64encode(data))
    assert found is not None and (found.width, found.height, found.orientation) == (640, 480, 6)
    assert peek_dimensions_of(b"not base64 at all!") is None
    assert peek_dimensions_of(base64.b64encode(b"%PDF-1.7 not an image" * 10)) is None
    assert peek_dimensions_of(base64.b64encode(data[:200])) is None  # cut before the frame header


# ---------------------------------------------------------------------------------------------------------
# loading: offline, clear errors


def test_a_folder_without_a_processor_configuration_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"model_type": "qwen2_vl"}')
    with pytest.raises(ConfigError, match=r"no image processor configuration.*preprocessor_config.json"):
        load_model(str(tmp_path))
    with pytest.raises(ConfigError, match="no such folder"):
        load_model(str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match="not in the Hugging Face cache"):
        load_model("nobody/not-a-cached-model")


def test_a_missing_tokenizer_is_named(tmp_path: Path) -> None:
    folder = idefics3_folder(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).unlink()
    with pytest.raises(ConfigError, match="tokenizer"):
        load_model(str(folder))


def test_the_cli_stops_with_status_2_naming_what_is_missing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stopped:
        main(["--upstream", "http://127.0.0.1:9", "--model", str(tmp_path)], environ={})
    assert stopped.value.code == 2
    assert "has no image processor configuration" in capsys.readouterr().err
    with pytest.raises(SystemExit) as stopped:
        main(["--upstream", "http://127.0.0.1:9", "--max-inflight-image-tokens", "1000"], environ={})
    assert stopped.value.code == 2
    assert "needs MMGATE_MODEL" in capsys.readouterr().err


def _unknown_family_folder(path: Path) -> Path:
    """A vision model mmgate has no family for: CLIP's image processor under a model_type of its own."""
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    CLIPImageProcessorPil().save_pretrained(path)
    (path / "config.json").write_text('{"model_type": "blip-2"}')
    return path


def _torch_only_folder(path: Path) -> Path:
    """Llama 4 as its checkpoints ship it: an image processor transformers has only for torch."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "preprocessor_config.json").write_text('{"image_processor_type": "Llama4ImageProcessorFast"}')
    (path / "config.json").write_text('{"model_type": "llama4"}')
    return path


def _remote_code_folder(path: Path) -> Path:
    """A model whose image processor is remote code, mapped by ``auto_map`` as such checkpoints ship it."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "preprocessor_config.json").write_text(
        '{"image_processor_type": "OwnImageProcessor", "auto_map": {"AutoImageProcessor": "own.OwnImageProcessor"}}')
    (path / "config.json").write_text('{"model_type": "own_vl"}')
    return path


@pytest.mark.parametrize(("build", "family", "warned"), [
    (_unknown_family_folder, "blip-2", "blip-2 family (CLIPImageProcessor) has no model geometry"),
    (_remote_code_folder, "own_vl", "own_vl family (OwnImageProcessor) has no model geometry in mmgate (its "
                                    "processor is remote code"),
    (_torch_only_folder, "Llama 4", "Llama 4 family (Llama4ImageProcessor) has no model geometry in mmgate "
                                    "(transformers ships only a torch image processor")])
def test_an_unsupported_family_keeps_the_generic_rule_with_a_warning(
        build: Callable[[Path], Path], family: str, warned: str, tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    folder = str(build(tmp_path / "model"))
    with caplog.at_level(logging.WARNING, logger="mmgate"):
        model = load_model(folder)
    assert not model.supported and model.family == family
    assert warned in caplog.text
    state = build_state(Settings.from_env({"MMGATE_UPSTREAM": "http://127.0.0.1:9", "MMGATE_MODEL": folder,
                                           "MMGATE_RESIZE_MAX_SIDE": "512"}))
    assert state.model is None and state.image_policy.geometry is None and state.image_policy.resize_max_side == 512
    with pytest.raises(ConfigError, match=f"MMGATE_MAX_INFLIGHT_IMAGE_TOKENS needs a model.* is a {family} model"):
        build_state(Settings.from_env({"MMGATE_UPSTREAM": "http://127.0.0.1:9", "MMGATE_MODEL": folder,
                                       "MMGATE_MAX_INFLIGHT_IMAGE_TOKENS": "1000"}))


# ---------------------------------------------------------------------------------------------------------
# over HTTP: the header, the metric, the access record, the budget


def _png(width: int, height: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (width, height), "olive").save(buf, "PNG")
    return buf.getvalue()


async def _post(proxy_url: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> aiohttp.ClientResponse:
    async with aiohttp.ClientSession() as session:
        response = await session.post(proxy_url + "/v1/chat/completions", data=orjson.dumps(body),
                                      headers={"Content-Type": "application/json", **(headers or {})})
        await response.read()
        return response


async def test_the_upstream_gets_the_processor_size_and_the_token_count(
        upstream: Upstream, start_proxy: StartProxy, folders: dict[str, Path],
        caplog: pytest.LogCaptureFixture) -> None:
    folder = str(folders["qwen2-vl"])
    model: Model = load_model(folder)
    proxy = await start_proxy(upstream.url, MMGATE_MODEL=folder, MMGATE_ACCESS_LOG="on")
    # A photo, not a flat colour: its re-encode at the model's size is smaller than it, so the resize is sent
    # (a re-encode no smaller than the original is not: the original goes as it is).
    photo = io.BytesIO()
    photo_sized(1900, 1300).save(photo, "PNG")
    body = chat_with_image(data_uri(photo.getvalue()))
    body["messages"][0]["content"].append({"type": "image_url", "image_url": {"url": data_uri(_png(300, 200))}})
    with caplog.at_level(logging.INFO, logger="mmgate.access"):
        response = await _post(proxy.url, body, {"x-mmgate-image-tokens": "1"})
    assert response.status == 200
    seen = upstream.seen[-1]
    expected = model.image_tokens(1900, 1300) + model.image_tokens(300, 200)
    assert seen.headers.getall("x-mmgate-image-tokens") == [str(expected)]  # the client's own is not passed on
    content = orjson.loads(seen.body)["messages"][0]["content"]
    _head, big = decode_uri(content[1]["image_url"]["url"])
    assert big.size == model.geometry.backend_size(1900, 1300)  # type: ignore[union-attr]
    # 300x200 becomes 308x196: one side would grow, so the backend resizes it itself (counted all the same).
    assert model.geometry.backend_size(300, 200) == (308, 196)  # type: ignore[union-attr]
    assert content[2]["image_url"]["url"] == data_uri(_png(300, 200))
    record = next(r for r in caplog.records if r.name == "mmgate.access")
    assert record.fields["image_tokens"] == expected  # type: ignore[attr-defined]
    metrics = proxy.state.metrics
    assert metrics.registry.get_sample_value("mmgate_image_tokens_count") == 2
    assert metrics.registry.get_sample_value("mmgate_image_tokens_sum") == expected
    text = {"model": "m", "messages": [{"role": "user", "content": "no image here"}]}
    assert (await _post(proxy.url, text, {"x-mmgate-image-tokens": "99"})).status == 200
    assert upstream.seen[-1].headers.getall("x-mmgate-image-tokens") == ["0"]


async def test_the_upstream_gets_the_video_token_count_of_the_probed_clips(
        upstream: Upstream, start_proxy: StartProxy, folders: dict[str, Path],
        caplog: pytest.LogCaptureFixture) -> None:
    """Qwen2-VL: a clip's tokens come from what the probe read (frames, frame size), after admission; the clip
    itself goes byte for byte. A family without video tokens sets no header, and a client's is not passed on."""
    from testkit.media import chat_with_video, video_clip

    folder = str(folders["qwen2-vl"])
    model: Model = load_model(folder)
    proxy = await start_proxy(upstream.url, MMGATE_MODEL=folder, MMGATE_ACCESS_LOG="on")
    body = chat_with_video(data_uri(video_clip(640, 360, 5), "video/mp4"))
    body["messages"][0]["content"].append({"type": "video_url", "video_url": {
        "url": data_uri(video_clip(96, 64, 2, codec="libvpx-vp9", container="webm"), "video/webm")}})
    with caplog.at_level(logging.INFO, logger="mmgate.access"):
        response = await _post(proxy.url, body, {"x-mmgate-video-tokens": "1"})
    assert response.status == 200
    seen = upstream.seen[-1]
    expected = model.video_tokens(5, 640, 360) + model.video_tokens(2, 96, 64)
    assert expected > 0 and seen.headers.getall("x-mmgate-video-tokens") == [str(expected)]
    assert seen.headers.getall("x-mmgate-image-tokens") == ["0"]
    assert seen.body == orjson.dumps(body)
    record = next(r for r in caplog.records if r.name == "mmgate.access")
    assert record.fields["video_tokens"] == expected  # type: ignore[attr-defined]

    strip = chat_with_video(data_uri(video_clip(4096, 16, 2), "video/mp4"))  # an aspect ratio of 256
    response = await _post(proxy.url, strip)
    assert response.status == 400 and len(upstream.seen) == 1
    error = orjson.loads(await response.read())["error"]
    assert error["code"] == "video_unsupported_by_model" and error["param"] == "messages[0].content[1]"

    other = await start_proxy(upstream.url, MMGATE_MODEL=str(folders["idefics3"]))
    assert (await _post(other.url, body, {"x-mmgate-video-tokens": "1"})).status == 200
    assert "x-mmgate-video-tokens" not in upstream.seen[-1].headers


async def test_without_a_model_nothing_changes(upstream: Upstream, start_proxy: StartProxy) -> None:
    proxy = await start_proxy(upstream.url)
    image = _png(1900, 1300)
    response = await _post(proxy.url, chat_with_image(data_uri(image)), {"x-mmgate-image-tokens": "7"})
    assert response.status == 200
    seen = upstream.seen[-1]
    assert seen.headers.getall("x-mmgate-image-tokens") == ["7"]
    assert orjson.loads(seen.body) == chat_with_image(data_uri(image))
    assert proxy.state.metrics.registry.get_sample_value("mmgate_image_tokens_count") == 0


async def test_a_request_over_the_whole_token_budget_is_413_naming_count_and_setting(
        upstream: Upstream, start_proxy: StartProxy, folders: dict[str, Path]) -> None:
    folder = str(folders["qwen2-vl"])
    tokens = load_model(folder).image_tokens(1900, 1300)
    proxy = await start_proxy(upstream.url, MMGATE_MODEL=folder, MMGATE_MAX_INFLIGHT_IMAGE_TOKENS=str(tokens - 1))
    response = await _post(proxy.url, chat_with_image(data_uri(_png(1900, 1300))))
    assert response.status == 413
    error = (await response.json())["error"]
    assert error["code"] == "too_many_image_tokens"
    assert str(tokens) in error["message"] and "MMGATE_MAX_INFLIGHT_IMAGE_TOKENS" in error["message"]
    assert not upstream.seen
    proxy_ok = await start_proxy(upstream.url, MMGATE_MODEL=folder, MMGATE_MAX_INFLIGHT_IMAGE_TOKENS=str(tokens))
    assert (await _post(proxy_ok.url, chat_with_image(data_uri(_png(1900, 1300))))).status == 200
    assert proxy_ok.state.gate.counters().tokens_in_use == 0


async def test_an_aspect_ratio_the_model_refuses_is_400_before_admission(
        upstream: Upstream, start_proxy: StartProxy, folders: dict[str, Path]) -> None:
    proxy = await start_proxy(upstream.url, MMGATE_MODEL=str(folders["qwen2-vl"]))
    response = await _post(proxy.url, chat_with_image(data_uri(_png(4000, 10))))
    assert response.status == 400
    error = (await response.json())["error"]
    assert error["code"] == "image_unsupported_by_model" and error["param"] == "messages[0].content[1]"
    assert not upstream.seen and proxy.state.gate.counters().in_use == 0


def test_settings_name_the_new_variables() -> None:
    settings = Settings.from_env({"MMGATE_MODEL": " /models/x ", "MMGATE_MAX_INFLIGHT_IMAGE_TOKENS": "20000"})
    assert settings.decode.model == "/models/x" and settings.gate.max_inflight_image_tokens == 20000
    with pytest.raises(ConfigError, match="MMGATE_MODEL=''"):
        Settings.from_env({"MMGATE_MODEL": ""})


def test_the_geometry_travels_to_a_worker_process_as_plain_data(
        folders: dict[str, Path], constant_folders: dict[str, Path], llava_next_folders: dict[str, Path]) -> None:
    """A decode pool of processes pickles the ImagePolicy: the geometry must survive it unchanged."""
    import pickle

    for folder in [*folders.values(), *constant_folders.values(), *llava_next_folders.values()]:
        policy = ImagePolicy(geometry=load_model(str(folder)).geometry)
        copy = pickle.loads(pickle.dumps(policy))
        assert copy == policy and copy.geometry.backend_size(3000, 2000) == policy.geometry.backend_size(3000, 2000)  # type: ignore[union-attr]


def test_a_head_that_says_nothing_counts_as_the_largest_image(folders: dict[str, Path]) -> None:
    """The token budget errs on the safe side: an image whose size mmgate cannot read from its head counts the
    tokens of an image past the family's cap (and the decode worker then refuses it)."""
    from proxy.media.tokens import plan_image_tokens
    from proxy.payload.locate import Limits, plan_media

    for family in ("qwen2-vl", "idefics3"):
        model = load_model(str(folders[family]))
        body = orjson.dumps(chat_with_image(data_uri(b"GIF89a but not really an image" * 4, "image/gif")))
        plan = plan_media("chat", body, Limits(max_parts=16, max_item_bytes=1 << 20))
        assert plan_image_tokens(model, plan, body) == [model.most_tokens]


@pytest.mark.parametrize("family", FAMILIES)
@given(size=st.tuples(st.integers(1, 20000), st.integers(1, 20000)).filter(lambda s: max(s) / min(s) < 150))
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@example(size=(4000, 3000)).via("more Qwen tokens than a square past the cap")
def test_no_image_makes_more_tokens_than_the_most_tokens(
        family: str, size: tuple[int, int], folders: dict[str, Path]) -> None:
    model = load_model(str(folders[family]))
    assert model.image_tokens(*size) <= model.most_tokens


@given(orientations=st.lists(st.integers(1, 8), min_size=2, max_size=2), sizes=st.lists(sizes, min_size=2, max_size=2))
@settings(max_examples=20, deadline=None)
def test_a_jpeg_with_two_frame_headers_and_two_exif_blocks_reads_as_pillow_does(
        orientations: list[int], sizes: list[tuple[int, int]]) -> None:
    """Crafted files: mmgate's reader must agree with the Pillow the decode worker uses, or the count would
    follow one size while the worker resizes another."""
    first, second = (_jpeg(w, h, o) for (w, h), o in zip(sizes, orientations, strict=True))
    # first's segments through its frame header, then all of second's: two EXIF blocks, two frame headers
    head_end = first.index(b"\xff\xc4", first.index(b"\xff\xc0"))
    crafted = first[:head_end] + second[2:]
    found = peek_dimensions_of(base64.b64encode(crafted))
    whole = Image.open(io.BytesIO(crafted))
    assert found == Dimensions(whole.width, whole.height, whole.getexif().get(0x0112, 1))


def test_headers_read_differently_before_admission_and_in_the_worker_are_refused() -> None:
    """A file crafted so that the header read before admission (the count) and Pillow's (the decode) disagree
    would slip past the token budget: with a model the decode worker checks both and refuses a mismatch. The
    reader follows Pillow (see the crafted-JPEG property above), so the check is exercised directly."""
    from preprocessors.image import _same_as_counted

    data = _jpeg(64, 48, 6)
    _same_as_counted(data, "JPEG", 64, 48)  # agrees: nothing raised
    for width, height in ((65, 48), (64, 47), (48, 64)):
        with pytest.raises(MediaError) as caught:
            _same_as_counted(data, "JPEG", width, height)
        assert caught.value.code == "image_decode_failed" and "disagree" in caught.value.message
    _same_as_counted(b"\xff\xd8\xff" + b"\x00" * 10, "JPEG", 1, 1)  # unreadable head: counted as the largest
