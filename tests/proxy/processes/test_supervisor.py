"""MMGATE_PROCESSES: several front processes on one port behave as one mmgate.

Every test starts ``mmgate`` as a real process tree (``python -m proxy``: the supervisor and its fronts)
in front of a scriptable upstream, and talks to it over real HTTP on 127.0.0.1, each request on a fresh
connection so the kernel hands them to whichever front accepts first. Waits are on events (an answer, an
upstream arrival) or on bounded polls of /mmgate/stats; nothing is timed.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections.abc import AsyncIterator
from functools import partial
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web

from proxy.admission.adaptive import START
from proxy.serve.demo import free_port
from proxy.settings import Settings, auto_processes, usable_cpus
from testkit.environment import mmgate_env
from testkit.media import chat_with_image, data_uri, image_bytes
from tests.conftest import Upstream

PROCESSES = 2
POLLS = 600  # bounded polls of /mmgate/stats (each a real request), far more than any start-up needs


def _env(**settings: str) -> dict[str, str]:
    """This environment without a developer's own MMGATE_* (but the decode mode CI chooses), two fronts."""
    return mmgate_env(keep=("MMGATE_DECODE_MODE",), **{
        "MMGATE_HOST": "127.0.0.1", "MMGATE_PROCESSES": str(PROCESSES), "MMGATE_DECODE_WORKERS": "2",
        "MMGATE_ACCESS_LOG": "off", "MMGATE_DRAIN_GRACE": "0", **settings})


class Mmgate:
    def __init__(self, process: asyncio.subprocess.Process, port: int) -> None:
        self.process = process
        self.url = f"http://127.0.0.1:{port}"
        self.log: list[str] = []  # with ``log=True``: what the supervisor and its fronts wrote on stderr
        self.reading_log = asyncio.create_task(self._read_log()) if process.stderr is not None else None

    async def _read_log(self) -> None:
        assert self.process.stderr is not None
        async for line in self.process.stderr:
            self.log.append(line.decode(errors="replace"))
            sys.stderr.write(self.log[-1])  # still in the test's captured output

    async def gone(self, pid: int) -> None:
        """Wait (bounded) until process ``pid`` is gone. (With ``log=True``, ``process.wait()`` would also wait
        for the fronts to close the log pipe they share.)"""
        for _ in range(POLLS):
            if not self.alive(pid):
                return
            await asyncio.sleep(0.05)
        raise AssertionError(f"process {pid} still running")

    async def logged(self, text: str) -> None:
        """Wait (bounded) until a line of the log holds ``text``."""
        for _ in range(POLLS):
            if any(text in line for line in self.log):
                return
            await asyncio.sleep(0.05)
        raise AssertionError(f"never logged: {text!r}")

    async def get(self, path: str) -> Any:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as client:
            async with client.get(self.url + path) as response:
                assert response.status == 200, await response.text()
                return await response.json() if path != "/mmgate/metrics" else await response.text()

    async def answer(self, path: str) -> tuple[int, Any]:
        """``path``'s status and body (JSON where it is), whatever the status."""
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as client:
            async with client.get(self.url + path) as response:
                body = await response.read()
                is_json = response.content_type == "application/json"
                return response.status, orjson.loads(body) if is_json else body.decode()

    async def stats(self) -> dict[str, Any]:
        stats: dict[str, Any] = await self.get("/mmgate/stats")
        return stats

    async def readiness_is(self, status: int) -> None:
        """Wait (bounded) until /mmgate/ready answers ``status``."""
        for _ in range(POLLS):
            if (last := (await self.answer("/mmgate/ready"))[0]) == status:
                return
            await asyncio.sleep(0.05)
        raise AssertionError(f"/mmgate/ready never answered {status} (last: {last})")

    async def until(self, what: str, condition: Any) -> dict[str, Any]:
        """Poll /mmgate/stats (bounded) until ``condition(stats)`` holds; the last stats."""
        for _ in range(POLLS):
            stats = await self.stats()
            if condition(stats):
                return stats
            await asyncio.sleep(0.05)
        raise AssertionError(f"never: {what} (last: {stats})")

    def alive(self, pid: int) -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        try:  # a zombie not yet reaped by its parent is gone for every purpose here
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            return False


async def _wait_listening(url: str, process: asyncio.subprocess.Process) -> None:
    async with aiohttp.ClientSession() as client:
        for _ in range(POLLS):
            assert process.returncode is None, "mmgate exited during start-up"
            try:
                async with client.get(url + "/mmgate/stats") as response:
                    if response.status == 200 and (await response.json())["processes"] == PROCESSES:
                        return
            except aiohttp.ClientConnectionError:
                pass
            await asyncio.sleep(0.05)
    raise AssertionError("mmgate did not start")


@pytest.fixture
async def start_mmgate() -> AsyncIterator[Any]:
    started: list[Mmgate] = []

    async def start(log: bool = False, **settings: str) -> Mmgate:
        """mmgate with ``settings``; ``log``: its stderr read into ``Mmgate.log``."""
        port = free_port()
        process = await asyncio.create_subprocess_exec(sys.executable, "-m", "proxy",
                                                       stderr=asyncio.subprocess.PIPE if log else None,
                                                       env=_env(MMGATE_PORT=str(port), **settings))
        mmgate = Mmgate(process, port)
        started.append(mmgate)
        await _wait_listening(mmgate.url, process)
        return mmgate

    yield start
    for mmgate in started:
        if mmgate.process.returncode is None:
            mmgate.process.kill()
        if mmgate.reading_log is not None:  # the log pipe ends once the last front has gone too
            async with asyncio.timeout(60):
                await mmgate.reading_log
        await mmgate.process.wait()


def _media_body(seed: int) -> bytes:
    return orjson.dumps(chat_with_image(data_uri(image_bytes(color=(seed, 0, 0)))))


async def _post(url: str, body: bytes) -> tuple[int, bytes]:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as client:
        async with client.post(url + "/v1/chat/completions", data=body,
                               headers={"Content-Type": "application/json"}) as response:
            return response.status, await response.read()


def _counted(metrics: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines() if line.startswith(name))


async def _stream_on_every_front(mmgate: Mmgate,
                                 streams: list[tuple[aiohttp.ClientSession, aiohttp.ClientResponse]]) -> None:
    """Open one held stream on each front. The fronts share one listening socket and the kernel picks which
    accepts, so the others are stopped (SIGSTOP) while a stream opens: only the chosen one can take it."""
    fronts = [front["pid"] for front in (await mmgate.stats())["fronts"]]
    for chosen in fronts:
        others = [pid for pid in fronts if pid != chosen]
        for pid in others:
            os.kill(pid, signal.SIGSTOP)
        try:
            client = aiohttp.ClientSession()
            response = await client.post(mmgate.url + "/v1/chat/completions", data=b'{"stream": true}')
            streams.append((client, response))
            assert await response.content.readuntil(b"\n\n") == b"data: first\n\n"
        finally:
            for pid in others:
                os.kill(pid, signal.SIGCONT)
    stats = await mmgate.stats()
    assert all(front["in_flight"] == 1 for front in stats["fronts"]), stats["fronts"]


async def test_two_processes_do_not_admit_twice_the_gate(upstream: Upstream, start_mmgate: Any) -> None:
    """Gate 2, queue 2, ten media requests at once on fresh connections: four served, six 429, and the upstream
    never sees more than two at once (the lease spans the upstream answer: MMGATE_RELEASE_AT=complete)."""
    at_once = most = 0
    two_held = asyncio.Event()

    async def held(request: web.Request) -> web.Response:
        nonlocal at_once, most
        at_once += 1
        most = max(most, at_once)
        if at_once == 2:
            two_held.set()
        await upstream.release.wait()
        at_once -= 1
        return web.json_response({"choices": []})

    upstream.route("/v1/chat/completions", held)
    mmgate = await start_mmgate(MMGATE_UPSTREAM=upstream.url, MMGATE_MAX_MM_CONCURRENCY="2",
                                MMGATE_MAX_QUEUE="2", MMGATE_RELEASE_AT="complete", MMGATE_QUEUE_TIMEOUT="120",
                                MMGATE_CACHE_MB="0")
    requests = [asyncio.create_task(_post(mmgate.url, _media_body(seed))) for seed in range(10)]
    refused = []
    pending = set(requests)
    while len(refused) < 6:  # the six the gate has no room for are answered while the others are held
        done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            status, body = task.result()
            assert status == 429, body
            refused.append(orjson.loads(body)["error"]["code"])
    assert refused == ["queue_full"] * 6
    stats = await mmgate.until("two admitted and two waiting", lambda s: (s["gate"]["in_use"], s["gate"]["waiting"])
                               == (2, 2))
    assert stats["gate"]["limit"] == 2 and most <= 2
    await two_held.wait()
    upstream.release.set()
    served = await asyncio.gather(*pending)
    assert [status for status, _ in served] == [200] * 4
    assert most == 2
    metrics = await mmgate.get("/mmgate/metrics")
    assert _counted(metrics, 'mmgate_requests_total{code="429"') == 6
    assert _counted(metrics, 'mmgate_requests_total{code="200"') == 4


async def test_answers_the_fronts_relay_move_the_supervisors_adaptive_limit(upstream: Upstream,
                                                                             start_mmgate: Any) -> None:
    """MMGATE_MAX_MM_CONCURRENCY=auto: each front's answered media requests cross the link as samples to the
    supervisor's controller, which grows the limit from where it starts while demand fills it."""
    mmgate = await start_mmgate(MMGATE_UPSTREAM=upstream.url, MMGATE_MAX_MM_CONCURRENCY="auto",
                                MMGATE_MIN_MM_CONCURRENCY="1", MMGATE_MAX_MM_CONCURRENCY_AUTO="8",
                                MMGATE_MAX_QUEUE="16")
    stats = await mmgate.stats()
    assert stats["gate"]["adaptive"] is True and stats["gate"]["limit"] == START
    grown = asyncio.Event()

    async def client_loop(seed: int) -> None:
        # quick answers at a steady latency from more loops than the limit: demand keeps it full, it grows
        for _ in range(250):
            if grown.is_set():
                return
            status, body = await _post(mmgate.url, _media_body(seed))
            assert status == 200, body

    async def watch() -> None:
        await mmgate.until("the limit grown from its start", lambda stats: stats["gate"]["limit"] > START)
        grown.set()

    await asyncio.gather(watch(), *(client_loop(seed) for seed in range(8)))


async def test_killed_front_processes_free_their_leases_and_are_replaced(upstream: Upstream,
                                                                          start_mmgate: Any) -> None:
    """A front killed while its request holds the only slot: the gate gives the slot back, the supervisor
    starts another front, and the next media request is admitted."""
    upstream.route("/v1/chat/completions", partial(upstream.held_stream, last=b"data: [DONE]\n\n"))
    mmgate = await start_mmgate(MMGATE_UPSTREAM=upstream.url, MMGATE_MAX_MM_CONCURRENCY="1",
                                MMGATE_RELEASE_AT="complete", MMGATE_CACHE_MB="0")
    before = {front["pid"] for front in (await mmgate.stats())["fronts"]}
    holding = asyncio.create_task(_post(mmgate.url, _media_body(1)))
    await upstream.arrived.get()
    await mmgate.until("the slot held", lambda s: s["gate"]["in_use"] == 1)
    for pid in before:  # both fronts: whichever holds the lease dies
        os.kill(pid, signal.SIGKILL)
    stats = await mmgate.until("two new fronts and a free slot", lambda s: s["processes"] == PROCESSES and not (
        {front["pid"] for front in s["fronts"]} & before) and s["gate"]["in_use"] == 0)
    assert stats["gate"]["waiting"] == 0
    with pytest.raises(aiohttp.ClientError):
        await holding  # its front died mid-answer
    upstream.release.set()
    status, _ = await _post(mmgate.url, _media_body(2))
    assert status == 200
    assert mmgate.process.returncode is None


async def test_metrics_count_every_request_whichever_process_served_it(upstream: Upstream,
                                                                        start_mmgate: Any) -> None:
    mmgate = await start_mmgate(MMGATE_UPSTREAM=upstream.url)
    for _ in range(20):
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as client:
            async with client.get(mmgate.url + "/v1/models") as response:
                assert response.status == 200
    for _ in range(4):  # each on a fresh connection: whichever front answers, it counts them all
        metrics = await mmgate.get("/mmgate/metrics")
        assert _counted(metrics, "mmgate_requests_total{") == 20
        stats = await mmgate.stats()
        assert stats["requests"]["total"] == 20 and stats["processes"] == PROCESSES
        assert stats["limits"]["decode_workers"] == 2 and stats["pool"]["workers"] == 2


async def test_an_image_decoded_by_one_front_is_a_hit_on_the_others(upstream: Upstream, start_mmgate: Any) -> None:
    """Each front has its own cache; a miss there is first asked of the other fronts. The same image sent
    again and again, each time on a fresh connection (whichever front takes it), is decoded once."""
    # full validation: the image is decoded, so its verdict is cached (a header-judged one is never cached)
    mmgate = await start_mmgate(MMGATE_UPSTREAM=upstream.url, MMGATE_VALIDATE="full")
    bodies = [_media_body(7) for _ in range(8)]
    for body in bodies:
        status, answer = await _post(mmgate.url, body)
        assert status == 200, answer
    metrics = await mmgate.get("/mmgate/metrics")
    assert _counted(metrics, "mmgate_cache_misses_total") == 1
    assert _counted(metrics, "mmgate_cache_hits_total") == 7
    forwarded = {seen.body for seen in upstream.seen}
    assert len(forwarded) == 1  # every front forwarded the very same processed body


async def test_sigterm_drains_streams_on_every_process(upstream: Upstream, start_mmgate: Any) -> None:
    """Streams open on both fronts; SIGTERM: readiness fails, every stream ends normally, mmgate exits 0 and
    no front is left."""
    upstream.route("/v1/chat/completions", partial(upstream.held_stream, last=b"data: last\n\n"))
    mmgate = await start_mmgate(MMGATE_UPSTREAM=upstream.url, MMGATE_DRAIN_TIMEOUT="60")
    fronts = [front["pid"] for front in (await mmgate.stats())["fronts"]]
    streams: list[tuple[aiohttp.ClientSession, aiohttp.ClientResponse]] = []
    try:
        await _stream_on_every_front(mmgate, streams)
        mmgate.process.send_signal(signal.SIGTERM)
        await mmgate.readiness_is(503)
        upstream.release.set()
        for _, response in streams:
            assert await response.content.read() == b"data: last\n\n"
    finally:
        for client, response in streams:
            response.release()
            await client.close()
    async with asyncio.timeout(60):
        assert await mmgate.process.wait() == 0
    assert not [pid for pid in fronts if mmgate.alive(pid)]


async def test_a_second_ctrl_c_to_the_supervisor_stops_every_front_now(upstream: Upstream,
                                                                        start_mmgate: Any) -> None:
    """Ctrl-C sent to the supervisor alone (not the terminal's whole group): the fronts drain their streams;
    Ctrl-C again and every front cuts them and exits, and mmgate exits 130, far inside the drain's 120 s."""
    upstream.route("/v1/chat/completions", partial(upstream.held_stream, last=b"data: last\n\n"))
    mmgate = await start_mmgate(MMGATE_UPSTREAM=upstream.url, MMGATE_DRAIN_GRACE="60", MMGATE_DRAIN_TIMEOUT="60")
    fronts = [front["pid"] for front in (await mmgate.stats())["fronts"]]
    streams: list[tuple[aiohttp.ClientSession, aiohttp.ClientResponse]] = []
    try:
        await _stream_on_every_front(mmgate, streams)
        mmgate.process.send_signal(signal.SIGINT)
        await mmgate.readiness_is(503)  # the fronts were told: it fails while they wait for their streams
        mmgate.process.send_signal(signal.SIGINT)
        async with asyncio.timeout(30):
            assert await mmgate.process.wait() == 130
        for _, response in streams:
            with pytest.raises(aiohttp.ClientPayloadError):  # cut: the upstream still holds every stream
                await response.content.read()
    finally:
        upstream.release.set()
        for client, response in streams:
            response.release()
            await client.close()
    assert not [pid for pid in fronts if mmgate.alive(pid)]


async def test_no_front_outlives_a_killed_supervisor(upstream: Upstream, start_mmgate: Any) -> None:
    """SIGKILL to the supervisor (no drain it could run): each front sees its link to the gate close and
    stops on its own."""
    mmgate = await start_mmgate(MMGATE_UPSTREAM=upstream.url)
    fronts = [front["pid"] for front in (await mmgate.stats())["fronts"]]
    mmgate.process.kill()
    await mmgate.process.wait()
    for _ in range(POLLS):
        if not [pid for pid in fronts if mmgate.alive(pid)]:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"front processes {fronts} still running")


async def test_a_hung_front_is_killed_and_replaced_and_its_slot_given_back(upstream: Upstream,
                                                                          start_mmgate: Any) -> None:
    """SIGSTOP to the front whose request holds the only slot: it answers no ping, so the supervisor kills it,
    the gate gives the slot back at once, another front starts, and the next media request is admitted."""
    upstream.route("/v1/chat/completions", partial(upstream.held_stream, last=b"data: [DONE]\n\n"))
    mmgate = await start_mmgate(MMGATE_UPSTREAM=upstream.url, MMGATE_MAX_MM_CONCURRENCY="1",
                                MMGATE_RELEASE_AT="complete", MMGATE_CACHE_MB="0", MMGATE_PROCESS_TIMEOUT="1",
                                log=True)
    holding = asyncio.create_task(_post(mmgate.url, _media_body(1)))
    await upstream.arrived.get()
    stats = await mmgate.until("the slot held", lambda s: s["gate"]["in_use"] == 1)
    hung = next(front["pid"] for front in stats["fronts"] if front["in_flight"] == 1)
    os.kill(hung, signal.SIGSTOP)
    try:
        stats = await mmgate.until("the hung front replaced, the slot free", lambda s: s["processes"] == PROCESSES
                                   and hung not in {front["pid"] for front in s["fronts"]}
                                   and s["gate"]["in_use"] == 0)
        assert not mmgate.alive(hung)
        await mmgate.logged(f"(pid {hung}) answered no ping")
    finally:
        if mmgate.alive(hung):
            os.kill(hung, signal.SIGKILL)
    with pytest.raises(aiohttp.ClientError):
        await holding  # its front was killed mid-answer
    upstream.release.set()
    status, _ = await _post(mmgate.url, _media_body(2))
    assert status == 200
    assert mmgate.process.returncode is None


async def test_summed_counts_skip_a_hung_front_and_never_go_backwards(upstream: Upstream,
                                                                      start_mmgate: Any) -> None:
    """Each front stopped in turn (so whichever served requests is among them): /mmgate/metrics and
    /mmgate/stats still answer, the stopped front listed as not answering, and the count of requests served
    stays what it was: the stopped front counts with its last report. Then both are killed and replaced: the
    count stays what it was, their last reports kept."""
    mmgate = await start_mmgate(MMGATE_UPSTREAM=upstream.url, MMGATE_PROCESS_TIMEOUT="60")
    for _ in range(20):
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as client:
            async with client.get(mmgate.url + "/v1/models") as response:
                assert response.status == 200
    assert (await mmgate.stats())["requests"]["total"] == 20
    fronts = [front["pid"] for front in (await mmgate.stats())["fronts"]]
    for pid in fronts:
        os.kill(pid, signal.SIGSTOP)
        try:
            stats = await mmgate.stats()
            assert stats["requests"]["total"] == 20
            assert [front["answering"] for front in stats["fronts"] if front["pid"] == pid] == [False]
            assert _counted(await mmgate.get("/mmgate/metrics"), "mmgate_requests_total{") == 20
        finally:
            os.kill(pid, signal.SIGCONT)
        await mmgate.until("the front answering again", lambda s: all(front["answering"] for front in s["fronts"]))
    for pid in fronts:  # both: every request was served by one of them
        os.kill(pid, signal.SIGKILL)
    stats = await mmgate.until("both killed fronts replaced", lambda s: s["processes"] == PROCESSES
                               and not {front["pid"] for front in s["fronts"]} & set(fronts))
    assert stats["requests"]["total"] == 20
    assert _counted(await mmgate.get("/mmgate/metrics"), "mmgate_requests_total{") == 20


async def test_a_hung_supervisor_gets_503s_and_failed_readiness_not_hangs(upstream: Upstream,
                                                                         start_mmgate: Any) -> None:
    """SIGSTOP to the supervisor: a media request is 503 gate_unavailable with Retry-After, readiness and the
    summed metrics 503, liveness 200, each answered well within the client's own timeout; SIGCONT and all is
    served again."""
    mmgate = await start_mmgate(MMGATE_UPSTREAM=upstream.url, MMGATE_PROCESS_TIMEOUT="1", MMGATE_QUEUE_TIMEOUT="60")
    os.kill(mmgate.process.pid, signal.SIGSTOP)
    try:
        async with asyncio.timeout(30):  # the client's patience, far above any bound involved
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as client:
                async with client.post(mmgate.url + "/v1/chat/completions", data=_media_body(3),
                                       headers={"Content-Type": "application/json"}) as response:
                    assert response.status == 503
                    error = (await response.json())["error"]
                    assert error["code"] == "gate_unavailable"
                    assert "within MMGATE_PROCESS_TIMEOUT (1 s)" in error["message"]  # the bound that ended it
                    assert response.headers["Retry-After"]
            answers = await asyncio.gather(*(mmgate.answer(path) for path in (
                "/mmgate/ready", "/mmgate/stats", "/mmgate/metrics", "/mmgate/health")))
        assert [status for status, _ in answers] == [503, 503, 503, 200]
        assert answers[1][1]["error"]["code"] == "gate_unavailable"
    finally:
        os.kill(mmgate.process.pid, signal.SIGCONT)
    await mmgate.readiness_is(200)
    status, body = await _post(mmgate.url, _media_body(4))
    assert status == 200, body
    assert (await mmgate.stats())["processes"] == PROCESSES  # no front was taken for hung meanwhile


async def test_a_media_request_to_a_hung_supervisor_ends_at_its_queue_timeout_when_that_comes_first(
        upstream: Upstream, start_mmgate: Any) -> None:
    """SIGSTOP to the supervisor, a queue timeout far below MMGATE_PROCESS_TIMEOUT: the media request's one wait
    ends at its queue timeout, 503 gate_unavailable naming that bound, not at the process timeout (nor twice it)."""
    mmgate = await start_mmgate(MMGATE_UPSTREAM=upstream.url, MMGATE_PROCESS_TIMEOUT="600", MMGATE_QUEUE_TIMEOUT="1")
    os.kill(mmgate.process.pid, signal.SIGSTOP)
    try:
        async with asyncio.timeout(60):  # the client's patience, far below the process timeout
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as client:
                async with client.post(mmgate.url + "/v1/chat/completions", data=_media_body(5),
                                       headers={"Content-Type": "application/json"}) as response:
                    assert response.status == 503
                    error = (await response.json())["error"]
                    assert error["code"] == "gate_unavailable"
                    assert "within the request's queue timeout (1 s)" in error["message"]
                    assert response.headers["Retry-After"]
    finally:
        os.kill(mmgate.process.pid, signal.SIGCONT)
    await mmgate.readiness_is(200)
    status, body = await _post(mmgate.url, _media_body(6))
    assert status == 200, body


async def test_with_the_gate_lost_stats_and_metrics_are_503_not_500(upstream: Upstream, start_mmgate: Any) -> None:
    """SIGKILL to the supervisor while both fronts hold a stream: each drains, and meanwhile /mmgate/stats and
    /mmgate/metrics answer 503 in the error's own shape, not 500 with a traceback logged."""
    upstream.route("/v1/chat/completions", partial(upstream.held_stream, last=b"data: last\n\n"))
    mmgate = await start_mmgate(MMGATE_UPSTREAM=upstream.url, log=True)
    streams: list[tuple[aiohttp.ClientSession, aiohttp.ClientResponse]] = []
    try:
        await _stream_on_every_front(mmgate, streams)
        mmgate.process.kill()
        await mmgate.gone(mmgate.process.pid)
        for path in ("/mmgate/stats", "/mmgate/metrics"):
            status, body = await mmgate.answer(path)
            assert status == 503, body
            assert body["error"]["code"] == "draining"
        assert not [line for line in mmgate.log if "Traceback" in line]
        upstream.release.set()
        for _, response in streams:
            assert await response.content.read() == b"data: last\n\n"
    finally:
        for client, response in streams:
            response.release()
            await client.close()


def test_more_processes_than_decode_workers_is_refused() -> None:
    import subprocess

    result = subprocess.run([sys.executable, "-m", "proxy", "--print-config"], capture_output=True, text=True,
                            env=_env(MMGATE_UPSTREAM="http://127.0.0.1:1", MMGATE_PROCESSES="3",
                                     MMGATE_DECODE_WORKERS="2"), check=False, timeout=60)
    assert result.returncode == 2
    assert "MMGATE_PROCESSES=3 is above MMGATE_DECODE_WORKERS=2" in result.stderr


def test_the_fronts_shares_add_up_to_the_totals_configured() -> None:
    """Decode workers, cache and connections are totals: split between the fronts, never multiplied."""
    settings = Settings.from_env({"MMGATE_UPSTREAM": "http://127.0.0.1:1", "MMGATE_PROCESSES": "3",
                                  "MMGATE_DECODE_WORKERS": "4", "MMGATE_CACHE_MB": "256",
                                  "MMGATE_MAX_CONNECTIONS": "1000"})
    fronts = [settings.for_front(index) for index in range(3)]
    assert [f.decode.decode_workers for f in fronts] == [2, 1, 1]
    assert sum(f.memory.cache_mb for f in fronts) == 256 and sum(f.listen.max_connections for f in fronts) == 1000
    assert all(f.gate.max_mm_concurrency == settings.gate.max_mm_concurrency for f in fronts)  # the gate is one


def test_auto_is_one_front_per_usable_cpu_at_most_one_per_decode_worker() -> None:
    settings = Settings.from_env({"MMGATE_UPSTREAM": "http://127.0.0.1:1", "MMGATE_PROCESSES": "auto",
                                  "MMGATE_DECODE_WORKERS": "3"})
    assert settings.listen.processes == auto_processes(usable_cpus(), 3) == min(usable_cpus(), 3)
    assert auto_processes(16, 64) == 16 and auto_processes(1, 8) == 1
