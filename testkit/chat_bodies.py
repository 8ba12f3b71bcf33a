"""Chat request bodies of a given size, as Python's json writes them (``ensure_ascii``: non-ASCII becomes ``\\u``
escapes), for the benches of the body scans (``bench/sniff``, ``bench/locate``): text histories of random words,
chats carrying base64 images of random bytes, and both at once. Seeded: the same body every run.
"""

from __future__ import annotations

import json
import os
import random

import pybase64

# Words that name media (image, video) without carrying any: the sniff says "maybe" and the walk must find out.
MEDIA_WORDS = [
    "the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "an", "image", "of", "a", "video",
    "plays;", "café", "naïve", "lorem", "ipsum", "dolor", "sit", "amet,", "consectetur", "adipiscing", "elit"
]


def words_chat(words: list[str], size: int, seed: int) -> bytes:
    """A chat of about ``size`` bytes, user and assistant taking turns, each message 300 of ``words``."""
    rng = random.Random(seed)
    messages: list[dict[str, str]] = []
    total = 0
    while total < size:
        text = " ".join(rng.choice(words) for _ in range(300))
        messages.append({"role": "user" if len(messages) % 2 == 0 else "assistant", "content": text})
        total += len(json.dumps(text)) + 30
    return json.dumps({"model": "bench", "messages": messages}).encode()


def _history(size: int, rng: random.Random) -> list[dict[str, object]]:
    """A system message, then turns of 10 to 120 of ``MEDIA_WORDS`` (some with line breaks) up to ``size``."""
    messages: list[dict[str, object]] = [{"role": "system", "content": "You are a helpful assistant."}]
    total = 0
    while total < size:
        text = " ".join(rng.choice(MEDIA_WORDS) for _ in range(rng.randint(10, 120)))
        if rng.random() < 0.3:
            text = text.replace(" lorem", "\nlorem")
        messages.append({"role": "user" if len(messages) % 2 else "assistant", "content": text})
        total += len(text) + 40
    return messages


def _blob(size: int) -> str:
    """``size`` bytes of base64 of random bytes (incompressible, like an encoded image)."""
    return pybase64.b64encode(os.urandom(size * 3 // 4)).decode()


def text_history(size: int) -> bytes:
    """A text-only history of about ``size`` bytes whose words name images and videos."""
    return json.dumps({"model": "m", "messages": _history(size, random.Random(7)), "stream": False}).encode()


def images_chat(image_bytes: int, images: int) -> bytes:
    """A streamed chat with ``images`` data-URI images of ``image_bytes`` of base64 each (JPEG and PNG by turns)."""
    blob = _blob(image_bytes)
    content: list[dict[str, object]] = [{"type": "text", "text": "Compare these pictures.\nWhat changed?"}]
    for n in range(images):
        mime = "image/jpeg" if n % 2 == 0 else "image/png"
        content.append({"type": "image_url", "image_url": {"url": f"data:{mime};base64,{blob}", "detail": "auto"}})
    doc = {"model": "qwen2-vl", "messages": [{"role": "system", "content": "You are a careful assistant.\n"},
                                             {"role": "user", "content": content}],
           "max_tokens": 256, "temperature": 0.2, "stream": True}
    return json.dumps(doc).encode()


def history_then_image(size: int, image_bytes: int) -> bytes:
    """``text_history``'s kind of history (another seed), then one user turn with an image of ``image_bytes``."""
    messages = _history(size, random.Random(8))
    messages.append({"role": "user", "content": [
        {"type": "text", "text": "and this one?"},
        {"type": "image_url", "image_url": {"url": "data:image/jpeg;base64," + _blob(image_bytes)}}]})
    return json.dumps({"model": "m", "messages": messages}).encode()
