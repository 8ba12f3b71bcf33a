"""Pacing: while the event loop lags, big uploads' reading is held (TCP pushes back on their clients), small
requests and probes are still answered, and every held body is read whole and forwarded byte for byte once
the lag is gone. The lag is the test's to set: the pacer's ``measure`` (its sensor) reads an event here."""

from __future__ import annotations

import asyncio
import json
import random

import aiohttp
import pytest

from proxy.edge.pacing import Pacer
from testkit.media import eventually
from tests.conftest import Proxy, StartProxy, Upstream

PIECE = 64 << 10


def _lag_from(event: asyncio.Event) -> object:
    """The pacer's sensor: a lag far over any target while ``event`` is set, none otherwise."""
    return lambda _lateness: 10.0 if event.is_set() else 0.0


def _text_piece(rng: random.Random) -> bytes:
    """JSON string content with no media marker (no vowel the markers need), so the body takes the text path."""
    return bytes(rng.choice(b"bcdfghjklmnpqrstwxyz0123456789 ") for _ in range(PIECE))


class ChunkedUpload:
    """A chat request whose body goes out in chunks, a piece every turn, until ``finish`` is set."""

    def __init__(self, proxy: Proxy, seed: int) -> None:
        self.proxy = proxy
        self.rng = random.Random(seed)
        self.sent = bytearray()
        self.finish = asyncio.Event()
        self.answer: tuple[int, bytes] | None = None

    async def run(self) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", self.proxy.server.port)
        try:
            await self._send(reader, writer)
        except asyncio.CancelledError:
            writer.transport.abort()  # the client goes away mid-upload
            raise
        writer.close()

    async def _send(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n")
        await self._chunk(b'{"model":"m","messages":[{"role":"user","content":"', writer)
        while not self.finish.is_set():
            await self._chunk(_text_piece(self.rng), writer)
            await asyncio.sleep(0.001)
        await self._chunk(b'"}]}', writer)
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length"))
        self.answer = int(head.split()[1]), await reader.readexactly(length)

    async def _chunk(self, data: bytes, writer: asyncio.StreamWriter) -> None:
        self.sent += data
        writer.write(b"%x\r\n%s\r\n" % (len(data), data))
        await writer.drain()


async def _metric(proxy: Proxy, name: str) -> float:
    async with aiohttp.ClientSession() as client, client.get(proxy.url + "/mmgate/metrics") as r:
        text = await r.text()
    return next(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " "))


async def _one_of_two_uploads_held(proxy: Proxy, seeds: tuple[int, int]) -> tuple[
        asyncio.Event, ChunkedUpload, ChunkedUpload, list[asyncio.Task[None]]]:
    """The loop made to lag (the returned event), a first upload read, then a second, and one of them held.

    Which of the two is held may change at every tick (one that delivered nothing during a tick takes no
    share), so this awaits the hold itself rather than polling for a moment when one is held."""
    pacer = proxy.state.pacer
    lagging = asyncio.Event()
    lagging.set()
    pacer.measure = _lag_from(lagging)  # type: ignore[assignment]
    held = asyncio.Event()
    count_hold = pacer.on_hold

    def on_hold() -> None:
        count_hold()
        held.set()

    pacer.on_hold = on_hold
    first, second = ChunkedUpload(proxy, seeds[0]), ChunkedUpload(proxy, seeds[1])
    tasks = [asyncio.create_task(first.run())]
    await eventually(lambda: pacer.reading == 1, "the first upload is being read")
    tasks.append(asyncio.create_task(second.run()))
    await eventually(lambda: pacer.reading == 2, "the second upload is being read")
    try:
        await asyncio.wait_for(held.wait(), 10)
    except TimeoutError:
        raise AssertionError(f"neither of two busy uploads was held while the loop lagged (allowed="
                             f"{pacer.allowed}, held={pacer.held})") from None
    return lagging, first, second, tasks


async def test_a_big_upload_is_held_while_the_loop_lags_and_forwarded_byte_exact_after(
    upstream: Upstream, start_proxy: StartProxy
) -> None:
    proxy = await start_proxy(upstream.url)
    pacer = proxy.state.pacer
    lagging, first, second, tasks = await _one_of_two_uploads_held(proxy, (1, 2))

    # While an upload is held: liveness, readiness and a small text request are answered.
    async with aiohttp.ClientSession() as client:
        async with client.get(proxy.url + "/mmgate/health") as r:
            assert r.status == 200 and (await r.json())["status"] == "ok"
        async with client.get(proxy.url + "/mmgate/ready") as r:
            assert r.status == 200
        async with client.post(proxy.url + "/v1/chat/completions", json={"model": "m", "messages": []}) as r:
            assert r.status == 200
    assert await _metric(proxy, "mmgate_upload_holds_total") >= 1
    assert pacer.held == 1 or pacer.reading == 2  # one always reads: media never stops

    lagging.clear()
    first.finish.set()
    second.finish.set()
    await asyncio.gather(*tasks)
    assert first.answer is not None and first.answer[0] == 200
    assert second.answer is not None and second.answer[0] == 200
    forwarded = {bytes(seen.body) for seen in upstream.seen if seen.path == "/v1/chat/completions"}
    assert bytes(first.sent) in forwarded and bytes(second.sent) in forwarded
    for upload in (first, second):
        json.loads(upload.sent)  # what was sent is the whole JSON document
    assert pacer.held == 0 and pacer.reading == 0
    assert await _metric(proxy, "mmgate_uploads_held") == 0


async def test_with_pacing_off_no_upload_is_held_however_the_loop_lags(
    upstream: Upstream, start_proxy: StartProxy
) -> None:
    proxy = await start_proxy(upstream.url, MMGATE_LOOP_LAG_TARGET="0")
    pacer = proxy.state.pacer
    lagging = asyncio.Event()
    lagging.set()
    pacer.measure = _lag_from(lagging)  # type: ignore[assignment]
    uploads = [ChunkedUpload(proxy, n) for n in range(3)]
    tasks = [asyncio.create_task(u.run()) for u in uploads]
    await eventually(lambda: len(upstream.seen) == 0 and sum(len(u.sent) for u in uploads) > 3 * 4 * PIECE,
                     "the uploads are under way")
    for upload in uploads:
        upload.finish.set()
    await asyncio.gather(*tasks)
    assert all(u.answer is not None and u.answer[0] == 200 for u in uploads)
    assert {bytes(u.sent) for u in uploads} == {bytes(s.body) for s in upstream.seen}
    assert await _metric(proxy, "mmgate_upload_holds_total") == 0


async def test_a_client_that_disconnects_while_held_leaves_nothing_held(
    upstream: Upstream, start_proxy: StartProxy
) -> None:
    proxy = await start_proxy(upstream.url)
    pacer = proxy.state.pacer
    *_, tasks = await _one_of_two_uploads_held(proxy, (3, 4))
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await eventually(lambda: pacer.reading == 0, "both uploads ended")
    assert pacer.held == 0 and await _metric(proxy, "mmgate_uploads_held") == 0
    assert not [s for s in upstream.seen if s.path == "/v1/chat/completions"]


# --- the policy alone, on valves the test drives ------------------------------------------------------------


class Valve:
    def __init__(self) -> None:
        self.held = False
        self.bytes = 0

    def hold_reading(self) -> None:
        self.held = True

    def release_reading(self) -> None:
        self.held = False

    def take_bytes_read(self) -> int:
        count, self.bytes = self.bytes, 0
        return count


async def test_under_lag_the_oldest_busy_upload_reads_and_an_idle_one_takes_no_share() -> None:
    lag = [1.0]
    pacer = Pacer(0.005, measure=lambda _lateness: lag[0])
    slow, old, young = Valve(), Valve(), Valve()
    with pacer.upload(slow), pacer.upload(old), pacer.upload(young):
        for _ in range(4):
            old.bytes = young.bytes = 1 << 16  # both busy; ``slow`` (a stalled client) delivers nothing
            pacer._tick()
        assert pacer.allowed == 1
        assert not old.held and young.held and not slow.held  # the stalled client holds nobody back
        lag[0] = 0.0
        old.bytes = 1 << 16
        pacer._tick()  # under the target: one more may read
        assert pacer.allowed == 2 and not young.held
    assert not young.held and pacer.reading == 0


async def test_one_upload_always_reads_however_long_the_loop_lags() -> None:
    pacer = Pacer(0.005, measure=lambda _lateness: 1.0)
    valves = [Valve() for _ in range(5)]
    with pacer.upload(valves[0]), pacer.upload(valves[1]), pacer.upload(valves[2]), pacer.upload(valves[3]), \
            pacer.upload(valves[4]):
        for _ in range(10):
            for valve in valves:
                valve.bytes = 1
            pacer._tick()
            assert sum(not v.held for v in valves) >= 1
        assert [v.held for v in valves] == [False, True, True, True, True]
    assert not any(v.held for v in valves)


@pytest.mark.parametrize("raw", ["-1", "nan", "inf", "soon"])
def test_a_bad_loop_lag_target_is_refused(raw: str) -> None:
    from proxy.settings import ConfigError, Settings

    with pytest.raises(ConfigError, match="MMGATE_LOOP_LAG_TARGET"):
        Settings.from_env({"MMGATE_UPSTREAM": "http://127.0.0.1:1", "MMGATE_LOOP_LAG_TARGET": raw})
