"""One body must not hold the event loop: the walk stops at the first part over the limit, a body whose JSON
structure is too big to parse in one call is refused before the parse, and the string walk runs in bounded
steps between which every other request is served. Over HTTP, against the real app; no timing is asserted."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import aiohttp
import orjson
from hypothesis import given
from hypothesis import strategies as st

from preprocessors.errors import MmgateError
from proxy.edge.buffers import JOIN_STEP, ONE_COPY_MAX
from proxy.payload.dialects import Route
from proxy.payload.locate import Limits, locate, plan_media
from proxy.payload.rawjson import run_steps, skeleton_steps, skeletonize
from testkit.media import data_uri, image_bytes
from tests.conftest import StartProxy, Upstream

from .test_rawjson import PROPERTY, Inserted, dump, media_doc, serialised

TINY_PNG = data_uri(image_bytes(1, 1), "image/png")


def image_flood(parts: int, *, after: list[dict[str, Any]] | None = None) -> bytes:
    part = {"type": "image_url", "image_url": {"url": TINY_PNG}}
    content = [part] * parts + (after or [])
    return orjson.dumps({"model": "m", "messages": [{"role": "user", "content": content}]})


def text_flood(parts: int) -> bytes:
    content = [{"type": "text", "text": "an image of a cat"}] * parts
    return orjson.dumps({"model": "m", "messages": [{"role": "user", "content": content}]})


async def post(url: str, body: bytes) -> tuple[int, dict[str, Any]]:
    async with aiohttp.ClientSession() as client:
        async with client.post(url, data=body, headers={"Content-Type": "application/json"}) as response:
            return response.status, await response.json()


async def test_image_flood_is_refused_at_the_first_part_over_the_limit(upstream: Upstream,
                                                                       start_proxy: StartProxy) -> None:
    proxy = await start_proxy(upstream.url)
    # A malformed image part after the flood would be 400 invalid_request if the walk reached it.
    body = image_flood(3000, after=[{"type": "image_url"}])
    status, answer = await post(proxy.url + "/v1/chat/completions", body)
    error = answer["error"]
    assert (status, error["code"], error["param"]) == (400, "too_many_media", "messages[0].content[16]")
    assert "more than 16 media parts" in error["message"] and "MMGATE_MAX_MEDIA_PER_REQUEST" in error["message"]
    assert upstream.seen == []


async def test_image_flood_over_the_structure_bound_is_refused_before_its_parse(upstream: Upstream,
                                                                                start_proxy: StartProxy) -> None:
    proxy = await start_proxy(upstream.url, MMGATE_MAX_JSON_STRUCTURE_KB="64")
    status, answer = await post(proxy.url + "/v1/chat/completions", image_flood(5000))
    error = answer["error"]
    assert (status, error["code"], error["type"]) == (400, "json_too_complex", "invalid_request_error")
    assert "MMGATE_MAX_JSON_STRUCTURE_KB" in error["message"] and "64 KiB" in error["message"]
    assert upstream.seen == []
    assert proxy.state.metrics.rejected.labels("json_too_complex")._value.get() == 1


async def test_text_flood_naming_images_is_refused_in_the_anthropic_shape(upstream: Upstream,
                                                                          start_proxy: StartProxy) -> None:
    proxy = await start_proxy(upstream.url, MMGATE_MAX_JSON_STRUCTURE_KB="64")
    async with aiohttp.ClientSession() as client:
        async with client.post(proxy.url + "/v1/messages", data=text_flood(20_000)) as response:
            status, answer = response.status, await response.json()
            should_retry = response.headers.get("x-should-retry")
    assert (status, answer["type"], answer["error"]["type"]) == (400, "error", "invalid_request_error")
    assert "[mmgate: json_too_complex]" in answer["error"]["message"] and should_retry == "false"
    assert upstream.seen == []


async def test_text_flood_without_a_marker_is_forwarded_untouched(upstream: Upstream,
                                                                  start_proxy: StartProxy) -> None:
    proxy = await start_proxy(upstream.url, MMGATE_MAX_JSON_STRUCTURE_KB="64")
    body = text_flood(20_000).replace(b"an image of", b"a picture of")
    status, _ = await post(proxy.url + "/v1/chat/completions", body)
    assert status == 200 and upstream.seen[-1].body == body  # the bound is for bodies mmgate parses


async def test_structure_under_the_bound_is_walked_as_before(upstream: Upstream, start_proxy: StartProxy) -> None:
    proxy = await start_proxy(upstream.url)
    body = text_flood(2_000)  # ~80 KB of small text parts naming images, then one image: under 512 KiB
    doc = orjson.loads(body)
    doc["messages"][0]["content"].append({"type": "image_url", "image_url": {"url": TINY_PNG}})
    status, _ = await post(proxy.url + "/v1/chat/completions", orjson.dumps(doc))
    assert status == 200 and upstream.seen[-1].body == orjson.dumps(doc)
    assert proxy.state.metrics.media_items.labels("image", "unchanged")._value.get() == 1


async def test_a_body_joined_in_steps_is_forwarded_byte_for_byte(upstream: Upstream, start_proxy: StartProxy) -> None:
    """A media body bigger than one copy is copied into its buffer in steps: every byte arrives."""
    proxy = await start_proxy(upstream.url)
    text = "an image of a cat, " * ((ONE_COPY_MAX + JOIN_STEP * 5 // 2) // 19)  # two steps and a half past it
    body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": [
        {"type": "text", "text": text}, {"type": "image_url", "image_url": {"url": TINY_PNG}}]}]})
    status, _ = await post(proxy.url + "/v1/chat/completions", body)
    assert status == 200 and upstream.seen[-1].body == body
    assert proxy.state.metrics.media_items.labels("image", "unchanged")._value.get() == 1


async def test_health_answers_while_a_long_string_walk_is_under_way(upstream: Upstream,
                                                                    start_proxy: StartProxy) -> None:
    """A text of many escaped quotes takes many steps to walk. Between the end of that request's read and its
    admission (which follows the walk at once) nothing of it awaits but the steps: a health probe answered in
    that window was served while the walk was under way."""
    proxy = await start_proxy(upstream.url, MMGATE_RELEASE_AT="complete")  # admitted until its answer is relayed
    text = '"' * 2_000_000  # each one escaped: 4 MB of \\" to walk, 2000 steps
    body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": [
        {"type": "text", "text": text}, {"type": "image_url", "image_url": {"url": TINY_PNG}}]}]})
    state = proxy.state
    async with aiohttp.ClientSession() as client:
        walked = asyncio.ensure_future(post(proxy.url + "/v1/chat/completions", body))
        answered_during_walk = 0
        while not walked.done():
            if state.in_flight and not state.reading:
                async with client.get(proxy.url + "/mmgate/health") as health:
                    assert health.status == 200
                if state.in_flight and not state.reading and not state.gate.counters().in_use:  # read, not yet admitted
                    answered_during_walk += 1
            else:
                await asyncio.sleep(0)
        status, _ = await walked
    assert status == 200 and orjson.loads(upstream.seen[-1].body) == orjson.loads(body)
    assert answered_during_walk >= 1


# ---------------------------------------------------------------------------------------------------
# property tests: the walk in steps and stopped at the limit lands where the one-call walk does


@PROPERTY
@given(body=serialised(), step_bytes=st.integers(1, 64), step_tokens=st.integers(1, 8))
def test_skeleton_in_steps_is_the_skeleton_in_one_call(body: bytes, step_bytes: int, step_tokens: int) -> None:
    stepped = run_steps(skeleton_steps(body, step_bytes=step_bytes, step_tokens=step_tokens))
    whole = skeletonize(body)
    assert stepped.resolve() == whole.resolve()
    assert stepped.spans == whole.spans


@PROPERTY
@given(case=media_doc(), rng=st.randoms(use_true_random=False), escape=st.sampled_from([0.0, 0.05, 1.0]),
       max_parts=st.integers(1, 4))
def test_walk_stopped_at_the_limit_plans_what_the_full_walk_plans(
    case: tuple[Route, dict[str, Any], list[Inserted]], rng: random.Random, escape: float, max_parts: int
) -> None:
    route, doc, _inserted = case
    body = dump(doc, rng, escape).encode()
    limits = Limits(max_parts=max_parts, max_item_bytes=1 << 30, max_structure=1 << 30)
    try:
        full = locate(route, skeletonize(body))
    except MmgateError as error:  # a malformed part the full walk reached: the bounded walk may stop first
        try:
            plan = plan_media(route, body, limits)
        except MmgateError as same:
            assert same.code == error.code
        else:
            assert plan.refusal is not None and plan.refusal.code == "too_many_media"
        return
    plan = plan_media(route, body, limits)
    if len(full) > max_parts:
        assert plan.refusal is not None and plan.refusal.code == "too_many_media"
        assert plan.refusal.param == full[max_parts].path and plan.parts == max_parts + 1
    else:
        assert plan.refusal is None or plan.refusal.code != "too_many_media"
        assert plan.parts == len(full)
        paths = [p.path for p in full]
        assert {item.path for item in plan.items} | {url.path for url in plan.urls} <= set(paths)


_SCHEME_CHARS = st.text("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789+.-", max_size=12)
_IGNORED_BEFORE = st.text("".join(map(chr, range(0x21))), max_size=4)  # C0 controls and space


def _scattered(rng: random.Random, scheme: str) -> str:
    """``scheme`` in random case, with tabs and line breaks put between its letters (URL parsers drop them)."""
    return "".join(rng.choice(["", "", "\t", "\n", "\r"]) + rng.choice([c.lower(), c.upper()]) for c in scheme)


@given(first=st.sampled_from("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"), rest=_SCHEME_CHARS,
       before=_IGNORED_BEFORE, rng=st.randoms(use_true_random=False))
def test_a_url_part_with_a_scheme_but_http_is_refused_in_every_mode(first: str, rest: str, before: str,
                                                                    rng: random.Random) -> None:
    scheme = (first + rest).lower()
    url = before + _scattered(rng, first + rest) + "://127.0.0.1/cat.png"
    body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}}]}]})
    for mode in ({}, {"reject_urls": True}, {"fetch_urls": True}):
        plan = plan_media("chat", body, Limits(max_parts=4, max_item_bytes=1 << 20, **mode))
        if scheme in ("http", "https"):
            assert plan.refusal is None or plan.refusal.code != "media_url_scheme_not_allowed"
            continue
        assert plan.refusal is not None
        assert (plan.refusal.code, plan.refusal.param) == ("media_url_scheme_not_allowed",
                                                           "messages[0].content[0]")
        assert f"the scheme {scheme[:32]!r}" in plan.refusal.message
        assert plan.items == [] and plan.urls == []


@given(value=st.text(st.characters(blacklist_characters=":", codec="utf-8"), max_size=40))  # JSON: no surrogate
def test_a_url_part_with_no_scheme_is_left_to_the_backend(value: str) -> None:
    body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": value or "x"}}]}]})
    plan = plan_media("chat", body, Limits(max_parts=4, max_item_bytes=1 << 20))
    assert plan.refusal is None or plan.refusal.code != "media_url_scheme_not_allowed"
