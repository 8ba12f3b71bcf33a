"""A model folder read offline into a ``Model``: ``MMGATE_MODEL``'s folder or cached name, or the one
``discovery`` found.

The model is a local folder or a name already in the Hugging Face cache. Its processor configuration is
loaded with ``transformers`` through the PIL image processors, which need no torch, and with the network off
(``HF_HUB_OFFLINE``, ``local_files_only``): mmgate never downloads anything. What is missing (the folder, the
processor configuration, a tokenizer a count needs) is a ``ConfigError`` naming it, so ``mmgate`` stops at
start-up with status 2.

Families: one module each in ``proxy.media.families``, tried in the order ``FAMILIES`` lists them (docs/model.md's
table is generated from it). Any other model keeps the generic resize rule, with a warning naming it; so does a
family whose processor transformers ships only for torch or as remote code (``families.GENERIC``), with the
reason.
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import replace
from pathlib import Path

from proxy.media.model import PROCESSOR_FILES, Model, read_json
from proxy.settings import ConfigError

log = logging.getLogger("mmgate")

__all__ = ["load_model"]


@functools.cache
def load_model(spec: str) -> Model:
    """Load ``spec`` (a folder or a cached model name) once per process; ConfigError names what is missing."""
    # Before huggingface_hub or transformers is imported (they read these once): never the network, and not
    # transformers' note that torch is absent (none is needed).
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    folder = _resolve(spec)
    try:
        from transformers import AutoImageProcessor
    except ImportError:
        raise ConfigError("MMGATE_MODEL needs the model extra: pip install 'mmgate[model]' "
                          "(transformers is not installed)") from None
    # The families load with the first model, as transformers does: a start without one (MMGATE_MODEL=none, or
    # nothing found yet) does not pay their 20 ms.
    from proxy.media.families import FAMILIES, GENERIC
    from proxy.media.families.base import Found

    image_type = _image_processor_type(folder)
    model_type = _model_type(folder)
    generic = GENERIC.get(image_type) or _remote_code(folder, model_type or image_type)
    if generic is not None:  # no PIL processor to load: the generic rule, with the reason
        names, reason = generic
        log.warning("MMGATE_MODEL=%s: the %s family (%s) has no model geometry in mmgate (%s); images follow the "
                    "generic rule (MMGATE_RESIZE_MAX_*) and no image tokens are counted", spec, names, image_type,
                    reason)
        return Model(spec, names, None)
    try:
        processor = AutoImageProcessor.from_pretrained(str(folder), local_files_only=True, backend="pil")
    except Exception as error:
        raise ConfigError(f"MMGATE_MODEL={spec!r}: the image processor in {folder} could not be loaded "
                          f"offline ({type(error).__name__}: {str(error)[:200]})") from None
    found = Found(spec, folder, image_type, model_type, processor)
    family = next((family for family in FAMILIES if family.recognise(found)), None)
    if family is None:
        name = model_type or image_type
        log.warning("MMGATE_MODEL=%s: the %s family (%s) has no model geometry in mmgate; images follow the generic "
                    "rule (MMGATE_RESIZE_MAX_*) and no image tokens are counted", spec, name, image_type)
        return Model(spec, name, None)
    model = family.load(found)
    if model.geometry is None:
        return model
    # The filter the processor's PIL backend resizes with: mmgate resizes with the same (image.process_image).
    resample = getattr(processor, "resample", None)
    if resample is None:
        return model
    return replace(model, geometry=replace(model.geometry, resample=int(resample)))  # type: ignore[type-var]


def _resolve(spec: str) -> Path:
    """A local folder as it is; otherwise a name looked up in the Hugging Face cache, offline."""
    path = Path(spec).expanduser()
    if path.is_dir():
        return path
    if path.is_absolute() or spec.startswith((".", "~")) or spec.count("/") > 1:
        raise ConfigError(f"MMGATE_MODEL={spec!r}: no such folder")
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise ConfigError(f"MMGATE_MODEL={spec!r}: not a folder, and looking up a cached model name needs the "
                          "model extra: pip install 'mmgate[model]'") from None
    try:
        return Path(snapshot_download(spec, local_files_only=True))
    except Exception:
        raise ConfigError(f"MMGATE_MODEL={spec!r}: not a folder and not in the Hugging Face cache "
                          "(mmgate never downloads: fetch the model first, or point at its folder)") from None


def _image_processor_type(folder: Path) -> str:
    """The processor class the folder names, without its backend suffix (``Pil``, ``Fast``)."""
    for name in PROCESSOR_FILES:
        config = read_json(folder / name)
        if config is None:
            continue
        config = config.get("image_processor", config)
        kind = str(config.get("image_processor_type", ""))
        if kind:
            for suffix in ("Pil", "Fast"):
                kind = kind.removesuffix(suffix)
            return kind
    raise ConfigError(f"MMGATE_MODEL: {folder} has no image processor configuration (looked for "
                      f"{' or '.join(PROCESSOR_FILES)} naming an image_processor_type)")


def _remote_code(folder: Path, family: str) -> tuple[str, str] | None:
    """``(family, reason)`` where the folder's image processor is remote code (its configuration maps it with
    ``auto_map``), which transformers loads only with ``trust_remote_code`` and mmgate never runs."""
    for name in PROCESSOR_FILES:
        config = read_json(folder / name) or {}
        config = config.get("image_processor", config) if isinstance(config.get("image_processor"), dict) else config
        if isinstance(config.get("auto_map"), dict):
            return family, "its processor is remote code (`auto_map`), which mmgate never runs"
    return None


def _model_type(folder: Path) -> str:
    config = read_json(folder / "config.json") or {}
    return str(config.get("model_type", ""))
