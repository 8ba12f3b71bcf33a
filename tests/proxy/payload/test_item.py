"""``MediaItem``: what the plan makes of one item, and what applying a verdict makes of it (``Applied``).

Each case walks a real body (``locate.plan_media``), applies a ``Verdict`` as a decode worker would make it, and
splices the replacements it makes into the body, asserting on the bytes the backend would receive.
"""

from __future__ import annotations

from dataclasses import FrozenInstanceError, replace

import orjson
import pytest

from preprocessors.job import Verdict
from proxy.edge.buffers import splice
from proxy.payload.item import Applied, MediaItem
from proxy.payload.locate import Limits, plan_media

LIMITS = Limits(max_parts=8, max_item_bytes=1 << 20)
PNG_B64 = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAIAAACQd1PeAAAADElEQVR4nGNgYGAAAAAEAAH2FzhVAAAAAElFTkSuQmCC"


def chat(url: str) -> bytes:
    return orjson.dumps({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": url}}]}]})


def messages(data: str, media_type: str) -> bytes:
    return orjson.dumps({"messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": media_type, "data": data}}]}]})


def planned(route: str, body: bytes) -> MediaItem:
    plan = plan_media(route, body, LIMITS)  # type: ignore[arg-type]
    assert plan.refusal is None and len(plan.items) == 1
    return plan.items[0]


def never() -> bytes:
    raise AssertionError("the item's own base64 is read only to rewrite a whole escaped token")


def test_an_item_is_planned_then_rewritten_into_a_data_uri() -> None:
    body = chat(f"data:image/png;base64,{PNG_B64}")
    item = planned("chat", body)
    assert (item.kind, item.declared_type, item.index) == ("image", "image/png", 0)
    applied = item.apply(Verdict(68, 40, sniffed_mime=b"image/png", mime=b"image/webp", encoded=b"UklGRg=="), never)
    assert (applied.outcome, applied.size_in, applied.size_out, applied.true_mime) == ("rewritten", 68, 40, b"")
    sent = orjson.loads(splice(body, applied.replacements))
    assert sent["messages"][0]["content"][1]["image_url"]["url"] == "data:image/webp;base64,UklGRg=="


def test_an_item_forwarded_unchanged_gets_its_true_type_in_place_of_the_declared_one() -> None:
    body = chat(f"data:image/jpeg;base64,{PNG_B64}")
    item = planned("chat", body)
    applied = item.apply(Verdict(68, 68, sniffed_mime=b"image/png"), never)
    assert (applied.outcome, applied.true_mime) == ("unchanged", b"image/png")
    sent = orjson.loads(splice(body, applied.replacements))
    assert sent["messages"][0]["content"][1]["image_url"]["url"] == f"data:image/png;base64,{PNG_B64}"


def test_an_anthropic_item_rewritten_changes_its_media_type_too() -> None:
    body = messages(PNG_B64, "image/png")
    item = planned("messages", body)
    assert (item.encoding, item.declared_type) == ("base64", "image/png")
    applied = item.apply(Verdict(68, 40, sniffed_mime=b"image/png", mime=b"image/webp", encoded=b"UklGRg=="), never)
    source = orjson.loads(splice(body, applied.replacements))["messages"][0]["content"][0]["source"]
    assert (source["media_type"], source["data"]) == ("image/webp", "UklGRg==")


def test_a_verdict_that_changes_nothing_replaces_nothing() -> None:
    item = planned("chat", chat(f"data:image/png;base64,{PNG_B64}"))
    assert item.apply(Verdict(68, 68, sniffed_mime=b"image/png"), never) == Applied("unchanged", 68, 68)


def test_a_probed_clip_goes_as_it_came() -> None:
    item = planned("chat", chat(f"data:image/png;base64,{PNG_B64}"))
    assert item.apply(Verdict(68, 68, video=(3, 64, 48)), never) == Applied("unchanged", 68, 68, video=(3, 64, 48))


def test_an_item_is_a_value_that_applying_a_verdict_leaves_as_it_was() -> None:
    """Each step that learns more of an item makes a new one: nothing writes onto it."""
    item = planned("chat", chat(f"data:image/jpeg;base64,{PNG_B64}"))
    before = replace(item)
    item.apply(Verdict(68, 40, sniffed_mime=b"image/png", mime=b"image/webp", encoded=b"UklGRg=="), never)
    assert item == before
    with pytest.raises(FrozenInstanceError):
        setattr(item, "size", 1)  # noqa: B010 (the assignment mypy would refuse, tried at run time)
