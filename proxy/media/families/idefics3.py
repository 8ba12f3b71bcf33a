"""Idefics3 and SmolVLM: the longest edge to ``size``, then whole tiles; the count from the processor and its
tokenizer (row and column markers)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from preprocessors.geometry import Idefics3
from proxy.settings import ConfigError

from .base import Family, Found, Model, checked, read_json

_MODULES = {
    "Idefics3ImageProcessor": ("idefics3", "transformers.models.idefics3.image_processing_pil_idefics3"),
    "SmolVLMImageProcessor": ("smolvlm", "transformers.models.smolvlm.image_processing_pil_smolvlm"),
}


@dataclass(frozen=True)
class Idefics3Family(Family):
    image_types = tuple(_MODULES)

    def load(self, found: Found) -> Model:
        family, module = _MODULES[found.image_type]
        image_processor = found.image_processor
        geometry = Idefics3(family, module, int(image_processor.size.longest_edge),
                            int(image_processor.max_image_size["longest_edge"]),
                            bool(image_processor.do_image_splitting))
        try:
            layout_tokens = _layout_tokens(family, found)
            layout_tokens(1, 1, (0, 0, 0))
        except Exception as error:
            raise ConfigError(f"MMGATE_MODEL={found.spec!r}: counting {family} image tokens needs the model's "
                              f"processor configuration and tokenizer in {found.folder}, which could not be loaded "
                              f"offline ({type(error).__name__}: {str(error)[:200]})") from None
        by_layout: dict[Any, int] = {}

        def count(width: int, height: int) -> int:
            layout = image_processor.get_number_of_image_patches(height, width, {})  # (patches, rows, columns)
            tokens = by_layout.get(layout)
            if tokens is None:  # bounded: rows and columns are at most the longest edge over the tile
                tokens = by_layout[layout] = layout_tokens(width, height, layout)
            return tokens

        return Model(found.spec, family, geometry, checked(geometry, count))


def _layout_tokens(family: str, found: Found) -> Callable[[int, int, Any], int]:
    """How many tokens an image of a given patch layout becomes, from the processor itself. Idefics3's processor
    counts it as the prompt it builds: ``image_seq_len`` tokens and two markers a tile, a newline a row, and the
    global image's tokens and three markers, with one token more where the tokenizer keeps the "\\n\\n" between
    the rows and the global image as two. SmolVLM's cannot load without torch (its video processor), so its image
    prompt (``get_image_prompt_string``) is built and counted with the model's own tokenizer."""
    folder = found.folder
    if family == "idefics3":
        from transformers import AutoProcessor

        processor = AutoProcessor.from_pretrained(str(folder), local_files_only=True, backend="pil")
        seq = int(processor.image_seq_len)
        split_newline = len(processor.tokenizer("\n\n", add_special_tokens=False)["input_ids"]) - 1

        def idefics3_tokens(_width: int, _height: int, layout: Any) -> int:
            _patches, rows, columns = layout
            return seq + 3 + (split_newline + rows * ((seq + 2) * columns + 1) if rows else 0)

        return idefics3_tokens
    from transformers import AutoTokenizer
    from transformers.models.smolvlm.processing_smolvlm import get_image_prompt_string

    tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    config = read_json(folder / "processor_config.json") or {}
    image_seq_len = int(config.get("image_seq_len", 169))  # SmolVLMProcessor's default
    markers = (getattr(tokenizer, "fake_image_token", "<fake_token_around_image>"),
               getattr(tokenizer, "image_token", "<image>"), getattr(tokenizer, "global_image_token", "<global-img>"))

    def layout_tokens(_width: int, _height: int, layout: Any) -> int:
        _patches, rows, columns = layout
        prompt = get_image_prompt_string(rows, columns, image_seq_len, *markers)
        return len(tokenizer(prompt, add_special_tokens=False)["input_ids"])

    return layout_tokens


IDEFICS3 = Idefics3Family(
    names="Idefics3, SmolVLM",
    processor="`Idefics3ImageProcessor`, `SmolVLMImageProcessor`",
    resizes_to="longest edge to `size[\"longest_edge\"]`, both sides to whole 364 / 512 px tiles",
    counts="tiles × `image_seq_len` + row/column markers, from the processor and tokenizer",
    kwargs=("size", "do_image_splitting", "max_image_size"),
)
