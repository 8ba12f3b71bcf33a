"""The processed-media cache (MMGATE_CACHE_MB): media seen before is not decoded again, and nothing else changes.

Real proxy, real upstream: each test asserts what crossed the wire (the forwarded bodies) and what the
metrics endpoint says (hits, misses, evictions, bytes), and where a request must wait for another one it
awaits a state the proxy reports, never a duration.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
from collections import OrderedDict
from typing import Any

import aiohttp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from proxy.media.cache import (
    ENTRY_OVERHEAD,
    MediaCache,
    Verdict,
    cache_key,
    context_fingerprint,
    entry_bytes,
    media_digest,
    settings_fingerprint,
)
from proxy.settings import MIB, Settings
from testkit.load import scrape
from testkit.media import BlockedPool, chat_with_image, data_uri, eventually, image_bytes, photo_sized
from tests.conftest import Proxy, StartProxy, Upstream

CHAT = "/v1/chat/completions"
RESIZE = {"MMGATE_RESIZE_MAX_SIDE": "32"}
# Full validation: every image is decoded in the pool, so its verdict is cached (with header validation, the default,
# an image its header decides is judged from its head and never hashed or cached).
POOLED = {"MMGATE_VALIDATE": "full"}


def noisy_png(side: int, seed: int) -> bytes:
    buffer = io.BytesIO()
    photo_sized(side, side, seed, noise=40).save(buffer, "PNG")
    return buffer.getvalue()


PHOTO = noisy_png(64, 1)  # 64x64: resized to 32x32 under RESIZE


async def post(proxy: Proxy, body: dict[str, Any] | bytes, path: str = CHAT,
               headers: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with aiohttp.ClientSession() as client, client.post(proxy.url + path, data=raw, headers=headers) as r:
        return r.status, await r.json()


async def cache_metrics(proxy: Proxy) -> dict[str, float]:
    prom = await scrape(proxy.url)
    names = ("hits_total", "misses_total", "evictions_total", "bytes", "entries", "waiting", "limit_bytes")
    return {name: prom.get((f"mmgate_cache_{name}", ()), -1.0) for name in names}


def forwarded_image(seen_body: bytes) -> str:
    return str(json.loads(seen_body)["messages"][0]["content"][1]["image_url"]["url"])


# ---------------------------------------------------------------------------------------- hit, miss, bound


async def test_a_resent_image_is_a_hit_forwarded_with_the_same_rewritten_bytes(
    upstream: Upstream, start_proxy: StartProxy
) -> None:
    proxy = await start_proxy(upstream.url, **RESIZE)
    body = chat_with_image(data_uri(PHOTO))
    assert (await post(proxy, body))[0] == 200
    assert await cache_metrics(proxy) == {"hits_total": 0, "misses_total": 1, "evictions_total": 0,
                                          "bytes": pytest.approx(proxy.state.cache.bytes_held),
                                          "entries": 1, "waiting": 0, "limit_bytes": 256 * MIB}
    assert (await post(proxy, body))[0] == 200
    first, second = (seen.body for seen in upstream.seen)
    assert first == second
    assert forwarded_image(first) != data_uri(PHOTO)  # it really was rewritten: 32x32 now
    _, _, payload = forwarded_image(first).partition(",")
    assert Image.open(io.BytesIO(base64.b64decode(payload))).size == (32, 32)
    metrics = await cache_metrics(proxy)
    assert (metrics["hits_total"], metrics["misses_total"]) == (1, 1)  # the second one never reached the pool
    assert metrics["bytes"] > len(payload)
    prom = await scrape(proxy.url)
    assert prom[("mmgate_media_items_total", (("outcome", "rewritten"), ("type", "image")))] == 2


async def test_a_hit_takes_a_slot_and_weighs_only_what_it_forwards(upstream: Upstream,
                                                                    start_proxy: StartProxy) -> None:
    """Nothing of a hit is decoded, but its rewrite is forwarded: the byte budget holds its base64."""
    proxy = await start_proxy(upstream.url, MMGATE_RELEASE_AT="complete", **RESIZE)
    body = chat_with_image(data_uri(PHOTO))
    assert (await post(proxy, body))[0] == 200  # now cached
    upstream.route(CHAT, lambda request: _held(upstream))
    task = asyncio.create_task(post(proxy, body))
    await eventually(lambda: len(upstream.seen) == 2, "the hit forwarded")
    gate = proxy.state.gate
    _, _, payload = forwarded_image(upstream.seen[-1].body).partition(",")
    assert (gate.counters().in_use, gate.counters().bytes_in_use) == (1, len(payload))
    upstream.release.set()
    assert (await task)[0] == 200


async def _held(upstream: Upstream) -> Any:
    from aiohttp import web

    await upstream.release.wait()
    return web.json_response({"ok": True})


async def test_entries_are_evicted_least_recently_used_first_within_the_bound(
    upstream: Upstream, start_proxy: StartProxy
) -> None:
    """Each 600x600 photo becomes a ~0.45 MiB base64 PNG at 380 px: two fit in 1 MiB, a third evicts one."""
    proxy = await start_proxy(upstream.url, MMGATE_CACHE_MB="1", MMGATE_RESIZE_MAX_SIDE="380",
                              MMGATE_IMAGE_FORMAT="png")
    a, b, c = (chat_with_image(data_uri(noisy_png(600, seed))) for seed in (1, 2, 3))
    for body in (a, b):
        assert (await post(proxy, body))[0] == 200
    metrics = await cache_metrics(proxy)
    assert metrics["entries"] == 2 and 2 / 3 * MIB < metrics["bytes"] <= MIB  # a third cannot fit
    assert (await post(proxy, a))[0] == 200  # a hit: a is now the most recently used
    assert (await post(proxy, c))[0] == 200  # evicts b, the least recently used
    metrics = await cache_metrics(proxy)
    assert metrics["evictions_total"] == 1 and metrics["entries"] == 2
    assert 0 < metrics["bytes"] <= MIB
    assert (await post(proxy, a))[0] == 200  # still there
    assert (await cache_metrics(proxy))["misses_total"] == 3
    assert (await post(proxy, b))[0] == 200  # gone: decoded again
    metrics = await cache_metrics(proxy)
    assert (metrics["hits_total"], metrics["misses_total"]) == (2, 4)
    assert len({seen.body for seen in upstream.seen}) == 3  # a, b, c each forwarded the same way every time


# --------------------------------------------------------------------------- what the key sees and ignores


def test_every_setting_that_shapes_the_output_changes_the_key_and_others_do_not() -> None:
    base = Settings.from_env({"MMGATE_UPSTREAM": "http://127.0.0.1:1"})
    shaping = {"MMGATE_MAX_MEDIA_ITEM_MB": "7", "MMGATE_MAX_IMAGE_PIXELS": "1000", "MMGATE_MAX_FRAMES": "3",
               "MMGATE_VALIDATE": "full", "MMGATE_RESIZE_MAX_PIXELS": "1000", "MMGATE_RESIZE_MAX_SIDE": "30",
               "MMGATE_IMAGE_FORMAT": "webp", "MMGATE_JPEG_QUALITY": "50", "MMGATE_MAX_AUDIO_SECONDS": "9"}
    prints = {settings_fingerprint(base)}
    for name, value in shaping.items():
        changed = Settings.from_env({"MMGATE_UPSTREAM": "http://127.0.0.1:1", name: value})
        prints.add(settings_fingerprint(changed))
    assert len(prints) == len(shaping) + 1
    for name, value in {"MMGATE_MAX_QUEUE": "3", "MMGATE_CACHE_MB": "5", "MMGATE_PORT": "9"}.items():
        same = Settings.from_env({"MMGATE_UPSTREAM": "http://127.0.0.1:1", name: value})
        assert settings_fingerprint(same) == settings_fingerprint(base)
    printed = settings_fingerprint(base)
    digest = media_digest(b"iVBORw0K", "base64")
    keys = {cache_key(digest, context_fingerprint(printed, kind, fmt, extra))
            for kind, fmt, extra in [("image", None, ""), ("audio", None, ""), ("audio", "wav", ""),
                                     ("image", None, "model-a"), ("image", None, "model-b")]}
    assert len(keys) == 5


def test_base64_text_and_raw_bytes_never_share_a_digest() -> None:
    data = b"the same characters"
    assert media_digest(data, "base64") != media_digest(data, "raw")
    assert media_digest(memoryview(data), "raw") == media_digest(data, "raw")


async def test_a_setting_change_misses(upstream: Upstream, start_proxy: StartProxy) -> None:
    """Two proxies with different resize settings: the same image comes out at each one's size, decoded by each."""
    small = await start_proxy(upstream.url, **RESIZE)
    large = await start_proxy(upstream.url, MMGATE_RESIZE_MAX_SIDE="48")
    body = chat_with_image(data_uri(PHOTO))
    for proxy in (small, large, small, large):
        assert (await post(proxy, body))[0] == 200
    sizes = [Image.open(io.BytesIO(base64.b64decode(forwarded_image(seen.body).partition(",")[2]))).size
             for seen in upstream.seen]
    assert sizes == [(32, 32), (48, 48), (32, 32), (48, 48)]
    for proxy in (small, large):
        metrics = await cache_metrics(proxy)
        assert (metrics["hits_total"], metrics["misses_total"]) == (1, 1)


async def test_one_verdict_serves_parts_that_declare_differently(upstream: Upstream, start_proxy: StartProxy) -> None:
    """The cached verdict is the media's; the declared type, the dialect and the part's place are each request's."""
    proxy = await start_proxy(upstream.url, **POOLED)
    png = image_bytes(16, 16, "PNG")
    wrong = chat_with_image(data_uri(png, "image/jpeg"))
    right = chat_with_image(data_uri(png, "image/png"))
    b64 = base64.b64encode(png).decode()
    anthropic = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/gif", "data": b64}}]}]}
    assert (await post(proxy, wrong))[0] == 200
    assert (await post(proxy, right))[0] == 200
    assert (await post(proxy, anthropic, "/v1/messages"))[0] == 200
    first, _, third = (json.loads(seen.body) for seen in upstream.seen)
    assert first["messages"][0]["content"][1]["image_url"]["url"] == data_uri(png, "image/png")  # corrected
    assert upstream.seen[1].body == json.dumps(right).encode()  # untouched, byte for byte
    assert third["messages"][0]["content"][0]["source"]["media_type"] == "image/png"
    metrics = await cache_metrics(proxy)
    assert (metrics["hits_total"], metrics["misses_total"]) == (2, 1)


# ------------------------------------------------------------------------------------------- single flight


async def leader_and_waiter(proxy: Proxy, body: dict[str, Any]) -> tuple[asyncio.Task[Any], asyncio.Task[Any]]:
    """Two requests for the same new image, with every decode thread blocked: the first's item queued in the
    pool, the second waiting in the cache for the first's verdict."""
    leader = asyncio.create_task(post(proxy, body))
    await eventually(lambda: proxy.state.pool.queued == 1, "the leader's item queued")
    waiter = asyncio.create_task(post(proxy, body))
    await eventually(lambda: proxy.state.cache.waiting == 1, "the second waits for the first")
    return leader, waiter


async def test_concurrent_first_requests_decode_once(upstream: Upstream, start_proxy: StartProxy) -> None:
    proxy = await start_proxy(upstream.url, **RESIZE)
    body = chat_with_image(data_uri(PHOTO))
    blocked = BlockedPool(proxy.state.pool)
    try:
        leader, waiter = await leader_and_waiter(proxy, body)
        assert (await cache_metrics(proxy))["waiting"] == 1
        assert proxy.state.gate.counters().in_use == 1  # the waiter holds no slot while it waits
    finally:
        blocked.release()
    assert (await leader)[0] == 200 and (await waiter)[0] == 200
    assert upstream.seen[0].body == upstream.seen[1].body
    metrics = await cache_metrics(proxy)
    assert (metrics["hits_total"], metrics["misses_total"], metrics["waiting"]) == (1, 1, 0)


async def test_an_image_twice_in_one_request_is_decoded_once(upstream: Upstream, start_proxy: StartProxy) -> None:
    proxy = await start_proxy(upstream.url, **RESIZE)
    uri = data_uri(PHOTO)
    body = chat_with_image(uri)
    body["messages"][0]["content"].append({"type": "image_url", "image_url": {"url": uri}})
    assert (await post(proxy, body))[0] == 200
    content = json.loads(upstream.seen[0].body)["messages"][0]["content"]
    assert content[1] == content[2] and content[1]["image_url"]["url"] != uri
    metrics = await cache_metrics(proxy)
    assert (metrics["hits_total"], metrics["misses_total"]) == (1, 1)


async def test_payloads_of_one_length_are_compared_not_assumed_equal(upstream: Upstream,
                                                                     start_proxy: StartProxy) -> None:
    """A repeated payload reuses its digest only when its bytes are the same: two photos whose base64 has the
    same length and differs in one comment byte are two items, the third part repeats the first."""
    proxy = await start_proxy(upstream.url, **RESIZE)
    photo = io.BytesIO()
    photo_sized(64, 64, 3).save(photo, "JPEG")
    jpeg = photo.getvalue()
    first, second = (jpeg[:2] + b"\xff\xfe\x00\x03" + tag + jpeg[2:] for tag in (b"a", b"b"))
    uris = [data_uri(first, "image/jpeg"), data_uri(second, "image/jpeg")]
    assert len(uris[0]) == len(uris[1]) and uris[0] != uris[1]
    body = chat_with_image(uris[0])
    body["messages"][0]["content"] += [{"type": "image_url", "image_url": {"url": uri}} for uri in (uris[1], uris[0])]
    assert (await post(proxy, body))[0] == 200
    metrics = await cache_metrics(proxy)
    assert (metrics["hits_total"], metrics["misses_total"], metrics["entries"]) == (1, 2, 2)


@pytest.mark.parametrize("how", ["client_gone", "deadline"])
async def test_a_waiter_does_not_inherit_a_failure_that_is_not_the_medias(
    upstream: Upstream, start_proxy: StartProxy, how: str
) -> None:
    """The leader stops (its client leaves, or its deadline passes) while its item waits for a decode thread:
    the waiter decodes the image itself and gets the right answer, not the leader's 499 or 504."""
    proxy = await start_proxy(upstream.url, **RESIZE)
    body = json.dumps(chat_with_image(data_uri(PHOTO))).encode()
    blocked = BlockedPool(proxy.state.pool)
    try:
        async with aiohttp.ClientSession() as client:
            headers = {"X-MMGate-Timeout": "2"} if how == "deadline" else {}
            leader = asyncio.create_task(client.post(proxy.url + CHAT, data=body, headers=headers))
            await eventually(lambda: proxy.state.pool.queued == 1, "the leader's item queued")
            waiter = asyncio.create_task(post(proxy, body))
            await eventually(lambda: proxy.state.cache.waiting == 1, "the second waits")
            if how == "client_gone":
                leader.cancel()
            else:
                response = await leader
                assert response.status == 504
                response.release()
            # The waiter takes the lead: its own item reaches the (still blocked) pool.
            await eventually(lambda: proxy.state.cache.waiting == 0 and proxy.state.pool.queued == 1,
                             "the waiter leads")
    finally:
        blocked.release()
    status, _ = await waiter
    assert status == 200
    assert len(upstream.seen) == 1
    _, _, payload = forwarded_image(upstream.seen[0].body).partition(",")
    assert Image.open(io.BytesIO(base64.b64decode(payload))).size == (32, 32)
    metrics = await cache_metrics(proxy)
    assert (metrics["hits_total"], metrics["misses_total"], metrics["entries"]) == (0, 1, 1)


async def test_a_waiter_inherits_the_refusal_of_bad_media(upstream: Upstream, start_proxy: StartProxy) -> None:
    proxy = await start_proxy(upstream.url, **POOLED)
    body = chat_with_image(data_uri(b"\x89PNG\r\n\x1a\n" + b"\x00" * 64, "image/png"))  # a PNG that is no PNG
    blocked = BlockedPool(proxy.state.pool)
    try:
        leader, waiter = await leader_and_waiter(proxy, body)
    finally:
        blocked.release()
    (status_a, answer_a), (status_b, answer_b) = await leader, await waiter
    assert status_a == status_b == 400 and answer_a["error"] == answer_b["error"]
    metrics = await cache_metrics(proxy)
    assert (metrics["hits_total"], metrics["misses_total"]) == (1, 1)
    assert upstream.seen == []


# ---------------------------------------------------------------------------------------------- refusals


def bomb_png(width: int, height: int) -> bytes:
    """A valid PNG header claiming ``width`` x ``height``: refused from the header, never decoded."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\x00")) + chunk(b"IEND", b"")


async def test_a_refusal_is_cached_and_names_each_requests_own_part(upstream: Upstream,
                                                                   start_proxy: StartProxy) -> None:
    proxy = await start_proxy(upstream.url, **POOLED)
    uri = data_uri(bomb_png(20000, 20000))
    first = chat_with_image(uri)
    second = chat_with_image(uri)
    second["messages"].insert(0, {"role": "system", "content": "be brief"})
    status, answer = await post(proxy, first)
    assert status == 400 and answer["error"]["code"] == "image_too_large"
    assert answer["error"]["param"] == "messages[0].content[1]"
    status, again = await post(proxy, second)
    assert status == 400 and again["error"]["code"] == "image_too_large"
    assert again["error"]["message"] == answer["error"]["message"]
    assert again["error"]["param"] == "messages[1].content[1]"
    metrics = await cache_metrics(proxy)
    assert (metrics["hits_total"], metrics["misses_total"], metrics["entries"]) == (1, 1, 1)
    prom = await scrape(proxy.url)
    assert prom[("mmgate_media_items_total", (("outcome", "rejected"), ("type", "image")))] == 2
    assert prom[("mmgate_gate_in_use", ())] == 0 and upstream.seen == []


# -------------------------------------------------------------------------- off: exactly today's behaviour


def _corpus() -> list[tuple[str, bytes]]:
    """Bodies whose media mmgate rewrites in each way it can: resized, kept, type corrected (data URI, escaped
    token, Anthropic), refused."""
    png, jpeg = image_bytes(16, 16, "PNG"), image_bytes(16, 16, "JPEG")
    escaped = data_uri(jpeg, "image/png").replace("/", "\\/")
    anthropic = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/gif",
                                     "data": base64.b64encode(jpeg).decode()}}]}]}
    return [
        (CHAT, json.dumps(chat_with_image(data_uri(PHOTO))).encode()),
        (CHAT, json.dumps(chat_with_image(data_uri(png))).encode()),
        (CHAT, json.dumps(chat_with_image(data_uri(png, "image/jpeg"))).encode()),
        (CHAT, b'{"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": '
               b'{"url": "' + escaped.encode() + b'"}}]}]}'),
        ("/v1/messages", json.dumps(anthropic).encode()),
        (CHAT, json.dumps(chat_with_image(data_uri(bomb_png(20000, 20000)))).encode()),
    ]


async def test_cache_off_is_exactly_the_behaviour_without_a_cache(upstream: Upstream, start_proxy: StartProxy) -> None:
    off = await start_proxy(upstream.url, MMGATE_CACHE_MB="0", **RESIZE, **POOLED)
    on = await start_proxy(upstream.url, **RESIZE, **POOLED)
    answers: dict[str, list[tuple[int, bytes | None]]] = {"off": [], "on": [], "on again": []}
    for name, proxy in (("off", off), ("on", on), ("on again", on)):
        for path, raw in _corpus():
            before = len(upstream.seen)
            status, answer = await post(proxy, raw, path)
            forwarded = upstream.seen[-1].body if len(upstream.seen) > before else None
            answers[name].append((status, forwarded if status == 200 else json.dumps(answer).encode()))
    assert answers["off"] == answers["on"] == answers["on again"]
    off_metrics = await cache_metrics(off)
    assert (off_metrics["hits_total"], off_metrics["misses_total"], off_metrics["limit_bytes"]) == (0, 0, 0)
    on_metrics = await cache_metrics(on)
    # Four distinct payloads (the photo, the PNG, the JPEG, the bomb) in six bodies, sent twice.
    assert (on_metrics["hits_total"], on_metrics["misses_total"]) == (8, 4)
    assert off.state.cache.entries == 0 < on.state.cache.entries


# ------------------------------------------------------------------------------------- the store, as a model


def _verdict(payload: int) -> Verdict:
    return Verdict(1, 1, b"image/png", b"image/png", b"x" * payload)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 6).map(lambda n: n * 1000),
       st.lists(st.tuples(st.sampled_from(["put", "get"]), st.integers(0, 7), st.integers(0, 3000)), max_size=60))
def test_the_store_is_an_lru_bounded_by_bytes(limit: int, ops: list[tuple[str, int, int]]) -> None:
    async def run() -> None:
        evicted: list[int] = []
        cache = MediaCache(limit, "", on_evict=lambda: evicted.append(1))
        model: OrderedDict[bytes, Verdict] = OrderedDict()
        try:
            for op, index, payload in ops:
                key = bytes([index]) * 48
                if op == "get":
                    assert cache.get(key) == model.get(key)
                    if key in model:
                        model.move_to_end(key)
                    continue
                verdict = _verdict(payload)
                cache.put(key, verdict)
                if entry_bytes(verdict) > limit:
                    continue
                model.pop(key, None)
                model[key] = verdict
                while sum(entry_bytes(v) for v in model.values()) > limit:
                    model.popitem(last=False)
            assert list(cache._entries) == list(model)
            assert cache.bytes_held == sum(entry_bytes(v) for v in model.values()) <= limit
            assert all(entry_bytes(v) >= ENTRY_OVERHEAD for v in model.values())
        finally:
            cache.close()

    asyncio.run(run())


# ---------------------------------------------------------------------------------------------- hashing


async def test_a_big_payload_is_hashed_off_the_loop_and_a_request_that_leaves_lets_go(
    upstream: Upstream, start_proxy: StartProxy
) -> None:
    """Past 64 KiB the hash runs in the cache's hasher threads. Those held busy, a request waits for its hash;
    its client leaves: its body is freed, nothing is cached or led, and the next request is served."""
    import threading

    proxy = await start_proxy(upstream.url, **RESIZE)
    cache = proxy.state.cache
    assert isinstance(cache, MediaCache)
    body = chat_with_image(data_uri(noisy_png(300, 4)))
    assert len(json.dumps(body)) > 64 << 10
    go = threading.Event()
    hogs = [cache.hasher.submit(go.wait) for _ in range(cache.hasher._max_workers)]
    try:
        leaving = asyncio.create_task(post(proxy, body))
        await eventually(lambda: cache.hasher._work_queue.qsize() == 1, "the hash waits for a thread")
        leaving.cancel()
        await eventually(lambda: proxy.state.in_flight == 0, "the request ended")
    finally:
        go.set()
        for hog in hogs:
            hog.result()
    await eventually(lambda: proxy.state.buffers.owners_live == 0, "every buffer owner freed")
    assert (cache.entries, cache._leads, upstream.seen) == (0, {}, [])
    assert (await post(proxy, body))[0] == 200
    assert (await cache_metrics(proxy))["misses_total"] == 1
