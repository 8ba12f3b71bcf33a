"""Model folders built locally for the MMGATE_MODEL tests and benches: processor configurations and tiny
tokenizers only (no weights, no downloads), made with the same transformers classes a real model ships."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

# The special tokens the Idefics3/SmolVLM processors expand an image into.
_IDEFICS_SPECIALS = (["<|begin_of_text|>", "<end_of_utterance>", "<pad>", "<fake_token_around_image>", "<image>",
                      "<global-img>"] + [f"<row_{i}_col_{j}>" for i in range(1, 13) for j in range(1, 13)])


def _tokenizer(specials: list[str], **named: Any) -> Any:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "a": 1, "image": 2, "\n": 3}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("\n", behavior="isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token=specials[2] if len(specials) > 2
                                   else None, additional_special_tokens=specials, **named)


# A Qwen2-VL video processor configuration as newer checkpoints ship it (written as JSON: the class needs torch).
QWEN_VIDEO_CONFIG = {"video_processor_type": "Qwen2VLVideoProcessor", "patch_size": 14, "temporal_patch_size": 2,
                     "merge_size": 2, "size": {"shortest_edge": 128 * 28 * 28, "longest_edge": 768 * 28 * 28}}


# Qwen2.5-VL's own image bounds, as its checkpoints ship them: 4 to 16384 tokens of 28x28 pixels (12.8 MP).
QWEN25_MIN_PIXELS, QWEN25_MAX_PIXELS = 56 * 56, 28 * 28 * 16384


def qwen_folder(path: Path, model_type: str = "qwen2_vl", video: dict[str, Any] | None = None,
                max_pixels: int = 28 * 28 * 1280) -> Path:
    """A Qwen2-VL (``qwen2_vl``), Qwen2.5-VL (``qwen2_5_vl``) or Qwen3-VL (``qwen3_vl``) image processor, and
    with ``video`` a video processor configuration (without one, the video processor reads the image one's).
    Qwen2 and 2.5 bound an image at ``max_pixels``: 1 MP by default, ``QWEN25_MAX_PIXELS`` as shipped."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    if model_type == "qwen3_vl":  # 16 px patches, 2x2 merge: sides are multiples of 32
        processor = Qwen2VLImageProcessorPil(patch_size=16, merge_size=2, temporal_patch_size=2,
                                             size={"shortest_edge": 65536, "longest_edge": 16777216})
    else:  # Qwen2-VL and Qwen2.5-VL ship the same image processor: 14 px patches, sides multiples of 28
        processor = Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=max_pixels)
    processor.save_pretrained(path)
    if video is not None:
        (path / "video_preprocessor_config.json").write_text(json.dumps(video))
    (path / "config.json").write_text(json.dumps({"model_type": model_type}))
    return path


def idefics3_folder(path: Path, family: str = "idefics3", tile: int = 364, longest_edge: int = 1456,
                    split: bool = True) -> Path:
    """An Idefics3 (or SmolVLM) processor: image processor, tokenizer with the image markers, image_seq_len."""
    image_seq_len = (tile // 14) ** 2 // 4
    if family == "smolvlm":  # its processor needs torch (video): the parts it would save, saved one by one
        from transformers.models.smolvlm.image_processing_pil_smolvlm import SmolVLMImageProcessorPil

        SmolVLMImageProcessorPil(size={"longest_edge": longest_edge}, max_image_size={"longest_edge": tile},
                                 do_image_splitting=split).save_pretrained(path)
        _tokenizer(_IDEFICS_SPECIALS).save_pretrained(path)
        (path / "processor_config.json").write_text(json.dumps({"image_seq_len": image_seq_len,
                                                                "processor_class": "SmolVLMProcessor"}))
    else:
        from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil
        from transformers.models.idefics3.processing_idefics3 import Idefics3Processor

        image_processor = Idefics3ImageProcessorPil(size={"longest_edge": longest_edge},
                                                    max_image_size={"longest_edge": tile}, do_image_splitting=split)
        Idefics3Processor(image_processor=image_processor, tokenizer=_tokenizer(_IDEFICS_SPECIALS),
                          image_seq_len=image_seq_len).save_pretrained(path)
    (path / "config.json").write_text(json.dumps({"model_type": family}))
    return path


def llava_folder(path: Path, pad: bool = False) -> Path:
    """A LLaVA 1.5 processor: CLIP's (shortest edge 336, centre crop) or, with ``pad``, LLaVA's own (pad to a
    square first), and a tokenizer with the ``<image>`` token."""
    from transformers import LlavaProcessor
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil
    from transformers.models.llava.image_processing_pil_llava import LlavaImageProcessorPil

    geometry: dict[str, Any] = {"size": {"shortest_edge": 336}, "crop_size": {"height": 336, "width": 336},
                                "do_center_crop": True}
    images: Any = LlavaImageProcessorPil(do_pad=True, **geometry) if pad else CLIPImageProcessorPil(**geometry)
    LlavaProcessor(image_processor=images, tokenizer=_tokenizer(["<image>"]), patch_size=14,
                   vision_feature_select_strategy="default", num_additional_image_tokens=1).save_pretrained(path)
    (path / "config.json").write_text(json.dumps({"model_type": "llava"}))
    return path


def gemma3_folder(path: Path, pan_and_scan: bool = False, side: int = 896, image_seq_length: int = 256,
                  **pan_and_scan_settings: Any) -> Path:
    """A Gemma 3 processor: 896 px squares, 256 tokens an image; a tokenizer with its image markers. With
    ``pan_and_scan``, the image processor says ``do_pan_and_scan`` and, where given, its ``pan_and_scan_*``
    settings (gemma-3 checkpoints leave them unset: the processor's defaults apply)."""
    from transformers import Gemma3Processor
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    tokenizer = _tokenizer(["<start_of_image>", "<image_soft_token>", "<end_of_image>"],
                           extra_special_tokens={"boi_token": "<start_of_image>", "image_token": "<image_soft_token>",
                                                 "eoi_token": "<end_of_image>"})
    images = Gemma3ImageProcessorPil(size={"height": side, "width": side}, do_pan_and_scan=pan_and_scan,
                                     **pan_and_scan_settings)
    Gemma3Processor(image_processor=images, tokenizer=tokenizer,
                    image_seq_length=image_seq_length).save_pretrained(path)
    (path / "config.json").write_text(json.dumps({"model_type": "gemma3"}))
    return path


def llava_next_folder(path: Path, pinpoints: list[list[int]] | None = None) -> Path:
    """A LLaVA-NeXT processor (any-res grid; LLaVA-v1.6's pinpoints unless given): image processor, the
    vision tower's patch size and feature strategy, and a tokenizer with the ``<image>`` token."""
    from transformers import LlavaNextProcessor
    from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil

    grid = pinpoints or [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]]
    images = LlavaNextImageProcessorPil(size={"shortest_edge": 336}, crop_size={"height": 336, "width": 336},
                                        image_grid_pinpoints=grid)
    LlavaNextProcessor(image_processor=images, tokenizer=_tokenizer(["<image>"]), patch_size=14,
                       vision_feature_select_strategy="default", num_additional_image_tokens=1).save_pretrained(path)
    (path / "config.json").write_text(json.dumps({"model_type": "llava_next"}))
    return path


def idefics3_resize(folder: Path, image: Any) -> Any:
    """What an Idefics3/SmolVLM processor's own resize makes of a PIL ``image``: its two resize steps (the longest
    edge to ``size``, then whole tiles), run by the processor itself (PIL backend, its own ``resample``). The
    reference that mmgate's output is compared with for fidelity."""
    import numpy as np
    from PIL import Image
    from transformers import AutoImageProcessor
    from transformers.image_processing_utils import SizeDict

    processor = AutoImageProcessor.from_pretrained(str(folder), local_files_only=True, backend="pil")
    pixels = np.asarray(image.convert("RGB")).transpose(2, 0, 1)  # the processor works channels-first
    pixels = processor.resize(pixels, SizeDict(longest_edge=processor.size["longest_edge"]),
                              resample=processor.resample)
    pixels = processor.resize_for_vision_encoder(pixels, processor.max_image_size["longest_edge"],
                                                 resample=processor.resample)
    return Image.fromarray(np.ascontiguousarray(pixels.transpose(1, 2, 0)), "RGB")


def internvl_folder(path: Path, tile: int = 448, max_patches: int = 12, image_seq_length: int = 256) -> Path:
    """InternVL 3 / 3.5 as its ``-hf`` checkpoints ship it (InternVL3-8B-hf's values by default): a
    ``GotOcr2ImageProcessor`` that does not crop on its own (the processor crops), ``processor_config.json``
    with the tokens a tile. The processor needs torch (its video processor), so its parts are saved one by one."""
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil

    GotOcr2ImageProcessorPil(size={"height": tile, "width": tile}, crop_to_patches=False, min_patches=1,
                             max_patches=max_patches).save_pretrained(path)
    (path / "processor_config.json").write_text(json.dumps({"image_seq_length": image_seq_length,
                                                            "processor_class": "InternVLProcessor"}))
    (path / "config.json").write_text(json.dumps({"model_type": "internvl"}))
    return path


def pixtral_folder(path: Path, model_type: str = "mistral3", longest_edge: int = 1540, patch_size: int = 14,
                   spatial_merge_size: int = 2) -> Path:
    """Mistral 3 as Mistral-Small-3.1-24B ships it by default (1540 px, 14 px patches merged 2x2), or with
    ``model_type="llava"``, 1024, 16 and 1, Pixtral-12B: image processor and processor configuration. The
    processor needs torchvision to load, so its configuration is written as it saves it."""
    from transformers.models.pixtral.image_processing_pil_pixtral import PixtralImageProcessorPil

    PixtralImageProcessorPil(size={"longest_edge": longest_edge},
                             patch_size={"height": patch_size, "width": patch_size}).save_pretrained(path)
    (path / "processor_config.json").write_text(json.dumps({
        "processor_class": "PixtralProcessor", "patch_size": patch_size, "spatial_merge_size": spatial_merge_size,
        "image_token": "[IMG]", "image_break_token": "[IMG_BREAK]", "image_end_token": "[IMG_END]"}))
    (path / "config.json").write_text(json.dumps({"model_type": model_type}))
    return path


ONEVISION_PINPOINTS = [[384 * rows, 384 * columns] for rows in range(1, 7) for columns in range(1, 7)]


def llava_onevision_folder(path: Path, tile: int = 384, pinpoints: list[list[int]] | None = None,
                           num_image_tokens: int = 729, vision_aspect_ratio: str = "anyres_max_9") -> Path:
    """LLaVA-OneVision as llava-onevision-qwen2-7b-ov-hf ships it by default: 384 px squares, grids up to 6 x 6,
    729 tokens a square, ``anyres_max_9``. The processor needs torch (its video processor), so its
    configuration is written as it saves it."""
    from transformers.models.llava_onevision.image_processing_pil_llava_onevision import (
        LlavaOnevisionImageProcessorPil,
    )

    LlavaOnevisionImageProcessorPil(size={"height": tile, "width": tile},
                                    image_grid_pinpoints=pinpoints or ONEVISION_PINPOINTS).save_pretrained(path)
    (path / "processor_config.json").write_text(json.dumps({
        "processor_class": "LlavaOnevisionProcessor", "num_image_tokens": num_image_tokens,
        "vision_feature_select_strategy": "full", "vision_aspect_ratio": vision_aspect_ratio}))
    (path / "config.json").write_text(json.dumps({"model_type": "llava_onevision"}))
    return path


def mllama_folder(path: Path, tile: int = 560, max_image_tiles: int = 4) -> Path:
    """Llama 3.2 Vision as Llama-3.2-11B-Vision-Instruct ships it by default: 560 px tiles, up to 4; the vision
    configuration's patch size the count reads."""
    from transformers.models.mllama.image_processing_pil_mllama import MllamaImageProcessorPil

    MllamaImageProcessorPil(size={"height": tile, "width": tile}, max_image_tiles=max_image_tiles).save_pretrained(path)
    (path / "config.json").write_text(json.dumps({"model_type": "mllama", "vision_config": {
        "image_size": tile, "patch_size": 14, "max_num_tiles": max_image_tiles}}))
    return path


def glm4v_folder(path: Path, model_type: str = "glm4v", min_pixels: int = 12544, max_pixels: int = 9633792) -> Path:
    """GLM-4.1V as GLM-4.1V-9B-Thinking ships it by default (``glm4v_moe``: GLM-4.5V; ``glm46v``: GLM-4.6V, with
    its own image processor class): 14 px patches merged 2x2, pixels within ``min_pixels``–``max_pixels``."""
    from transformers.models.glm4v.image_processing_pil_glm4v import Glm4vImageProcessorPil
    from transformers.models.glm46v.image_processing_pil_glm46v import Glm46VImageProcessorPil

    kind = Glm46VImageProcessorPil if model_type == "glm46v" else Glm4vImageProcessorPil
    kind(size={"shortest_edge": min_pixels, "longest_edge": max_pixels}).save_pretrained(path)
    (path / "config.json").write_text(json.dumps({"model_type": model_type}))
    return path


def paligemma_folder(path: Path, side: int = 448, image_seq_length: int = 1024) -> Path:
    """PaliGemma 2 as paligemma2-3b-pt-448 ships it by default: a SigLIP image processor that names its tokens an
    image, the processor, a tokenizer with ``<image>``."""
    from transformers import PaliGemmaProcessor
    from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil

    images = SiglipImageProcessorPil(size={"height": side, "width": side})
    images.image_seq_length = image_seq_length  # type: ignore[attr-defined]  # saved with it, as checkpoints have it
    PaliGemmaProcessor(image_processor=images, tokenizer=_tokenizer(["<image>", "<bos>", "<pad>"], bos_token="<bos>"),
                       ).save_pretrained(path)
    (path / "config.json").write_text(json.dumps({"model_type": "paligemma"}))
    return path


def paddleocr_vl_folder(path: Path, min_pixels: int = 147384, max_pixels: int = 2822400) -> Path:
    """PaddleOCR-VL as its checkpoint ships it by default: 14 px patches merged 2x2, pixels within
    ``min_pixels``–``max_pixels``."""
    from transformers.models.paddleocr_vl.image_processing_pil_paddleocr_vl import PaddleOCRVLImageProcessorPil

    PaddleOCRVLImageProcessorPil(min_pixels=min_pixels, max_pixels=max_pixels).save_pretrained(path)
    (path / "config.json").write_text(json.dumps({"model_type": "paddleocr_vl"}))
    return path


def aya_vision_folder(path: Path, tile: int = 364, max_patches: int = 12) -> Path:
    """Aya Vision as aya-vision-8b ships it by default: ``GotOcr2ImageProcessor`` with 364 px tiles, up to 12, the
    processor (28 px merged patches: 169 tokens a tile), a tokenizer with its image markers."""
    from transformers import AyaVisionProcessor
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil

    images = GotOcr2ImageProcessorPil(size={"height": tile, "width": tile}, crop_to_patches=True, min_patches=1,
                                      max_patches=max_patches)
    specials = ["<image>", "<|START_OF_IMG|>", "<|END_OF_IMG|>", "<|IMG_PATCH|>", "<|IMG_LINE_BREAK|>", "<pad>"]
    AyaVisionProcessor(image_processor=images, tokenizer=_tokenizer(specials), patch_size=14, img_size=tile,
                       downsample_factor=2).save_pretrained(path)
    (path / "config.json").write_text(json.dumps({"model_type": "aya_vision"}))
    return path


def gemma4_folder(path: Path, max_soft_tokens: int = 280) -> Path:
    """Gemma 4 as its checkpoints ship it by default: 16 px patches pooled 3 x 3, 280 soft tokens an image."""
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    Gemma4ImageProcessorPil(max_soft_tokens=max_soft_tokens).save_pretrained(path)
    (path / "config.json").write_text(json.dumps({"model_type": "gemma4"}))
    return path


# Real checkpoints' own image processor configurations, as they ship them: name -> the folder builder with its
# values (the handoff rule's tests and bench measure against these, not the small folders above).
REAL_CHECKPOINTS: dict[str, Any] = {
    "Qwen2.5-VL": lambda path: qwen_folder(path, "qwen2_5_vl", max_pixels=QWEN25_MAX_PIXELS),
    "Qwen3-VL": lambda path: qwen_folder(path, "qwen3_vl"),
    "Idefics3": lambda path: idefics3_folder(path),
    "Gemma 3": lambda path: gemma3_folder(path),
    "InternVL 3": lambda path: internvl_folder(path),
    "Mistral 3": lambda path: pixtral_folder(path),
    "LLaVA-OneVision": lambda path: llava_onevision_folder(path),
    "GLM-4.1V": lambda path: glm4v_folder(path),
}


HUB_REVISION = "0123456789abcdef0123456789abcdef01234567"


def hub_snapshot(hub: Path, name: str, folder: Path, revision: str = HUB_REVISION) -> Path:
    """``folder``'s files laid out in the Hugging Face cache ``hub`` (``HF_HUB_CACHE``, or ``HF_HOME``/hub) as
    huggingface_hub keeps the model ``name``: content-named blobs, a snapshot of links to them and ``refs/main``.
    Returns the snapshot."""
    repo = hub / ("models--" + name.replace("/", "--"))
    snapshot = repo / "snapshots" / revision
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for file in sorted(folder.iterdir()):
        blob = repo / "blobs" / hashlib.sha256(file.read_bytes()).hexdigest()
        shutil.copyfile(file, blob)
        (snapshot / file.name).symlink_to(Path("../../blobs") / blob.name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    return snapshot
