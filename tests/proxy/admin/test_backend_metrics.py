"""MMGATE_BACKEND_METRICS=merge: the backend's queue gauges carry mmgate's waiting media requests, read back with
prometheus_client's parser and scraped by a real Prometheus."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from proxy.admin.backend_metrics import merge
from proxy.app import build_admin_app
from proxy.ops.backend_scrapes import SCRAPE_REUSE_SECONDS
from proxy.settings import ConfigError
from testkit.media import chat_with_image, data_uri, eventually, image_bytes
from testkit.servers import proxy_settings
from tests.conftest import StartProxy, Upstream, require_heavy

VLLM = b"""# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 1.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="ti}ny \\"q\\""} 2.0
# HELP vllm:gpu_cache_usage_perc GPU KV-cache usage.
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{engine="0",model_name="tiny"} 0.25
"""
SGLANG = b"""# HELP sglang:num_queue_reqs The number of requests in the waiting queue
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="m"} 3.0
"""
TRTLLM = b"""# TYPE trtllm_num_requests_waiting gauge
trtllm_num_requests_waiting 0 1700000000000
"""
OTHER = b"""# HELP http_requests_total Requests.
# TYPE http_requests_total counter
http_requests_total{code="200"} 7.0
"""


def _samples(text: bytes) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text.decode()) for s in family.samples}


@pytest.mark.parametrize("exposition, name", [(VLLM, "vllm:num_requests_waiting"), (SGLANG, "sglang:num_queue_reqs"),
                                              (TRTLLM, "trtllm_num_requests_waiting")])
def test_merge_adds_waiting_to_the_queue_gauge_and_keeps_its_labels(exposition: bytes, name: str) -> None:
    own = b"# HELP mmgate_gate_waiting w\n# TYPE mmgate_gate_waiting gauge\nmmgate_gate_waiting 5.0\n"
    merged = merge(exposition, 5, own)
    assert merged is not None
    before, after = _samples(exposition), _samples(merged)
    for key, value in before.items():
        assert after[key] == (value + 5 if key[0] == name else value)
    assert after[("mmgate_gate_waiting", ())] == 5.0
    # every line but the gauge's samples is kept byte for byte, in order
    changed = [line for line in exposition.splitlines() if line.startswith(name.encode())]
    kept = [line for line in exposition.splitlines() if not line.startswith(name.encode())]
    assert [line for line in merged.splitlines() if line in kept] == kept
    assert not set(changed) & set(merged.splitlines()) or before == after


def test_merge_keeps_a_sample_timestamp() -> None:
    merged = merge(TRTLLM, 3, b"")
    assert merged is not None and b"trtllm_num_requests_waiting 3.0 1700000000000\n" in merged


def test_backend_without_a_queue_gauge_is_not_merged() -> None:
    assert merge(OTHER, 4, b"mmgate_x 1\n") is None


def test_openmetrics_exposition_keeps_one_eof_at_the_end() -> None:
    backend = b"# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting 1.0\n# EOF\n"
    own = b"# TYPE mmgate_gate_waiting gauge\nmmgate_gate_waiting 2.0\n# EOF\n"
    merged = merge(backend, 2, own)
    assert merged is not None and merged.endswith(b"mmgate_gate_waiting 2.0\n# EOF\n") and merged.count(b"# EOF") == 1
    assert b"vllm:num_requests_waiting 3.0\n" in merged


label_values = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=20)  # type: ignore[arg-type]


# Label names as Prometheus allows them: "__" starts the names it reserves for itself.
label_names = st.from_regex(r"([a-z]|_[a-z0-9])[a-z0-9_]{0,7}", fullmatch=True)


@given(labels=st.dictionaries(label_names, label_values, max_size=4),
       value=st.integers(0, 10_000), waiting=st.integers(0, 10_000))
def test_merge_of_any_labels_parses_back_with_the_sum(labels: dict[str, str], value: int, waiting: int) -> None:
    def escape(text: str) -> str:
        return text.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')

    label_text = ",".join(f'{k}="{escape(v)}"' for k, v in labels.items())
    line = f"vllm:num_requests_waiting{{{label_text}}} {value}\n" if labels else f"vllm:num_requests_waiting {value}\n"
    exposition = b"# TYPE vllm:num_requests_waiting gauge\n" + line.encode()
    merged = merge(exposition, waiting, b"")
    assert merged is not None
    samples = _samples(merged)
    assert samples == {("vllm:num_requests_waiting", tuple(sorted(labels.items()))): float(value + waiting)}


# ----- over HTTP -----


async def _metrics_backend(upstream: Upstream, exposition: bytes) -> None:
    async def metrics(request: web.Request) -> web.Response:
        return web.Response(body=exposition, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    async def held(request: web.Request) -> web.Response:
        await upstream.release.wait()
        return web.json_response({"ok": True})

    upstream.route("/metrics", metrics)
    upstream.route("/v1/chat/completions", held)


async def _hold_media(session: aiohttp.ClientSession, url: str, count: int) -> list[asyncio.Task[int]]:
    body = chat_with_image(data_uri(image_bytes()))

    async def post() -> int:
        async with session.post(url + "/v1/chat/completions", json=body) as response:
            await response.read()
            return response.status

    return [asyncio.create_task(post()) for _ in range(count)]


async def test_merged_metrics_count_media_waiting_in_mmgate(upstream: Upstream, start_proxy: StartProxy) -> None:
    await _metrics_backend(upstream, VLLM)
    proxy = await start_proxy(upstream.url, MMGATE_BACKEND_METRICS="merge", MMGATE_MAX_MM_CONCURRENCY="1",
                              MMGATE_RELEASE_AT="complete")
    async with aiohttp.ClientSession() as session:
        tasks = await _hold_media(session, proxy.url, 3)
        await upstream.arrived.get()  # one request reached the backend, holding the only slot
        await eventually(lambda: proxy.state.gate.counters().waiting == 2, "two media requests queued in mmgate")
        async with session.get(proxy.url + "/metrics") as response:
            assert response.status == 200
            merged = await response.read()
        async with session.get(proxy.url + "/mmgate/backend/metrics") as response:
            assert response.status == 200 and await response.read() == VLLM
        upstream.release.set()
        assert await asyncio.gather(*tasks) == [200, 200, 200]
    samples = _samples(merged)
    waiting_key = ("vllm:num_requests_waiting", (("engine", "0"), ("model_name", 'ti}ny "q"')))
    assert samples[waiting_key] == 2.0 + 2  # the backend's 2 and mmgate's 2; the forwarded one is not counted
    assert samples[("vllm:num_requests_running", (("engine", "0"), ("model_name", "tiny")))] == 1.0
    assert samples[("mmgate_gate_waiting", ())] == 2.0
    assert not any(name.startswith("process_") for name, _labels in samples)  # the backend's own, not repeated


async def test_passthrough_forwards_the_backend_metrics_untouched(upstream: Upstream, start_proxy: StartProxy) -> None:
    await _metrics_backend(upstream, VLLM)
    proxy = await start_proxy(upstream.url)
    async with aiohttp.ClientSession() as session, session.get(proxy.url + "/metrics") as response:
        assert response.status == 200 and await response.read() == VLLM


async def test_merge_passes_a_backend_without_queue_gauges_untouched(upstream: Upstream,
                                                                     start_proxy: StartProxy) -> None:
    await _metrics_backend(upstream, OTHER)
    proxy = await start_proxy(upstream.url, MMGATE_BACKEND_METRICS="merge")
    async with aiohttp.ClientSession() as session, session.get(proxy.url + "/metrics") as response:
        assert response.status == 200 and await response.read() == OTHER


async def test_merge_with_the_backend_down_is_a_bad_gateway(start_proxy: StartProxy) -> None:
    with socket.socket() as probe:  # a loopback port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    proxy = await start_proxy(f"http://127.0.0.1:{port}", MMGATE_BACKEND_METRICS="merge")
    async with aiohttp.ClientSession() as session, session.get(proxy.url + "/metrics") as response:
        assert response.status == 502
    assert proxy.state.metrics.upstream_errors.labels("connect")._value.get() == 1


def _prometheus() -> str | None:
    found = shutil.which("prometheus")
    if found is None and require_heavy():
        pytest.fail("prometheus is not installed (apt-get install prometheus)")
    return found


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


async def test_real_prometheus_scrapes_the_merged_queue(upstream: Upstream, start_proxy: StartProxy) -> None:
    binary = _prometheus()
    if binary is None:
        pytest.skip("prometheus is not installed")
    await _metrics_backend(upstream, VLLM)
    proxy = await start_proxy(upstream.url, MMGATE_BACKEND_METRICS="merge", MMGATE_MAX_MM_CONCURRENCY="1",
                              MMGATE_RELEASE_AT="complete")
    with tempfile.TemporaryDirectory() as workdir:
        config = Path(workdir) / "prometheus.yml"
        config.write_text(f"""global:
  scrape_interval: 1s
scrape_configs:
  - job_name: mmgate
    static_configs:
      - targets: ["127.0.0.1:{proxy.server.port}"]
""")
        web_port = _free_port()
        process = await asyncio.create_subprocess_exec(
            binary, f"--config.file={config}", f"--storage.tsdb.path={workdir}/data",
            f"--web.listen-address=127.0.0.1:{web_port}", "--log.level=warn",
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, "HOME": workdir})
        try:
            async with aiohttp.ClientSession() as session:
                tasks = await _hold_media(session, proxy.url, 4)
                await upstream.arrived.get()
                await eventually(lambda: proxy.state.gate.counters().waiting == 3, "three media requests queued")
                query = f"http://127.0.0.1:{web_port}/api/v1/query"
                value = None
                for _attempt in range(600):  # Prometheus starts, then scrapes every second
                    try:
                        async with session.get(query, params={"query": "vllm:num_requests_waiting"}) as response:
                            result = (await response.json())["data"]["result"] if response.status == 200 else []
                    except aiohttp.ClientConnectionError:
                        result = []
                    if result:
                        value = result[0]
                        break
                    assert process.returncode is None, "prometheus exited"
                    await asyncio.sleep(0.1)
                upstream.release.set()
                await asyncio.gather(*tasks)
        finally:
            process.terminate()
            async with asyncio.timeout(10):
                await process.wait()
    assert value is not None, "Prometheus never stored the merged gauge"
    assert value["metric"]["model_name"] == 'ti}ny "q"' and value["metric"]["job"] == "mmgate"
    assert float(value["value"][1]) == 2.0 + 3


def _big_exposition(series: int) -> bytes:
    """A vLLM-like exposition of ``series`` histogram buckets after the queue gauge: past what one read returns."""
    lines = [b"# HELP vllm:e2e_request_latency_seconds Latency.", b"# TYPE vllm:e2e_request_latency_seconds histogram"]
    lines += [b'vllm:e2e_request_latency_seconds_bucket{engine="0",model_name="tiny",le="%d.0"} %d.0' % (n, n)
              for n in range(series)]
    lines += [b'vllm:e2e_request_latency_seconds_bucket{engine="0",model_name="tiny",le="+Inf"} %d.0' % series,
              b'vllm:e2e_request_latency_seconds_count{engine="0",model_name="tiny"} %d.0' % series,
              b'vllm:e2e_request_latency_seconds_sum{engine="0",model_name="tiny"} 1.0']
    return VLLM + b"\n".join(lines) + b"\n"


async def test_a_large_exposition_is_merged_whole(upstream: Upstream, start_proxy: StartProxy) -> None:
    """A real vLLM's exposition can pass 128 KiB, where one read of the body stops: the merge reads to the end."""
    exposition = _big_exposition(4000)
    assert len(exposition) > 300_000
    await _metrics_backend(upstream, exposition)
    proxy = await start_proxy(upstream.url, MMGATE_BACKEND_METRICS="merge")
    async with aiohttp.ClientSession() as session, session.get(proxy.url + "/metrics") as response:
        assert response.status == 200
        merged = await response.read()
    samples = _samples(merged)
    backend = _samples(exposition)
    assert {key: samples[key] for key in backend} == backend  # every series, each value (no queue waiting now)
    assert samples[("mmgate_gate_waiting", ())] == 0.0


async def test_an_exposition_over_the_cap_or_cut_short_is_a_bad_gateway(
        upstream: Upstream, start_proxy: StartProxy, caplog: pytest.LogCaptureFixture) -> None:
    from proxy.admin.backend_metrics import MAX_EXPOSITION_BYTES

    async def too_big(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/plain; version=0.0.4"})
        await response.prepare(request)
        line = b'vllm:num_requests_waiting{n="%d"} 1.0\n'
        for n in range(MAX_EXPOSITION_BYTES // 1000 + 2):
            await response.write(b"".join(line % (n * 100 + k) for k in range(30)))
        return response

    async def cut_short(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/plain; version=0.0.4"})
        response.content_length = len(VLLM) * 2
        await response.prepare(request)
        await response.write(VLLM)
        assert request.transport is not None
        request.transport.close()  # half the body it announced
        return response

    proxy = await start_proxy(upstream.url, MMGATE_BACKEND_METRICS="merge")
    for handler, reason in ((too_big, f"exceed {MAX_EXPOSITION_BYTES} bytes"), (cut_short, "failed")):
        upstream.route("/metrics", handler)
        caplog.clear()
        async with aiohttp.ClientSession() as session, session.get(proxy.url + "/metrics") as response:
            assert response.status == 502
            assert reason in await response.text()
        assert any(reason in record.getMessage() for record in caplog.records)


# ----- merge-admin, and one backend scrape shared -----


async def _admin_site(proxy_state: Any) -> tuple[web.AppRunner, str]:
    """The admin app ``mmgate serve`` starts on MMGATE_ADMIN_PORT, on a free loopback port."""
    runner = web.AppRunner(build_admin_app(proxy_state), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    return runner, f"http://127.0.0.1:{port}"


async def test_merge_admin_serves_the_merged_metrics_on_the_admin_port_only(upstream: Upstream,
                                                                             start_proxy: StartProxy) -> None:
    await _metrics_backend(upstream, VLLM)
    proxy = await start_proxy(upstream.url, MMGATE_BACKEND_METRICS="merge-admin", MMGATE_ADMIN_PORT="1",
                              MMGATE_ALLOW_PATHS="/v1")
    runner, admin_url = await _admin_site(proxy.state)
    try:
        async with aiohttp.ClientSession() as session:
            async with session.get(admin_url + "/metrics") as response:
                assert response.status == 200
                merged = _samples(await response.read())
            async with session.get(proxy.url + "/metrics") as response:  # outside MMGATE_ALLOW_PATHS: refused
                assert response.status == 404
                assert (await response.json())["error"]["code"] == "path_not_allowed"
    finally:
        await runner.cleanup()
    assert ("mmgate_gate_waiting", ()) in merged
    assert [seen.path for seen in upstream.seen] == ["/metrics"]  # the admin port's scrape only


async def test_merge_admin_leaves_the_main_port_metrics_to_the_backend(upstream: Upstream,
                                                                       start_proxy: StartProxy) -> None:
    await _metrics_backend(upstream, VLLM)
    proxy = await start_proxy(upstream.url, MMGATE_BACKEND_METRICS="merge-admin", MMGATE_ADMIN_PORT="1")
    async with aiohttp.ClientSession() as session, session.get(proxy.url + "/metrics") as response:
        assert response.status == 200 and await response.read() == VLLM  # forwarded as any allowed path


def test_merge_admin_without_an_admin_port_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"merge-admin.*needs MMGATE_ADMIN_PORT"):
        proxy_settings("http://127.0.0.1:9", MMGATE_BACKEND_METRICS="merge-admin")


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


async def test_scrapes_within_the_interval_share_one_backend_scrape(upstream: Upstream,
                                                                    start_proxy: StartProxy) -> None:
    release, scrapes = asyncio.Event(), []

    async def held_metrics(request: web.Request) -> web.Response:
        scrapes.append(request.path)
        await release.wait()
        return web.Response(body=VLLM, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    upstream.route("/metrics", held_metrics)
    proxy = await start_proxy(upstream.url, MMGATE_BACKEND_METRICS="merge")
    clock = _Clock()
    proxy.state.backend_scrapes.clock = clock

    async def scrape(path: str) -> bytes:
        async with session.get(proxy.url + path) as response:
            assert response.status == 200
            return await response.read()

    async with aiohttp.ClientSession() as session:
        concurrent = [asyncio.create_task(scrape("/metrics")), asyncio.create_task(scrape("/metrics")),
                      asyncio.create_task(scrape("/mmgate/backend/metrics"))]
        await eventually(lambda: len(scrapes) == 1, "the first scrape reached the backend")
        release.set()
        first, second, backend = await asyncio.gather(*concurrent)
        clock.now += SCRAPE_REUSE_SECONDS / 2
        within = await scrape("/metrics")
        assert len(scrapes) == 1  # three at once and one within the interval: one backend scrape
        clock.now += SCRAPE_REUSE_SECONDS
        await scrape("/metrics")
        assert len(scrapes) == 2  # past the interval: scraped afresh
    assert backend == VLLM
    assert _samples(first) == _samples(second) == _samples(within)


async def test_many_scrapes_between_two_of_the_backend_cost_one_merge(upstream: Upstream,
                                                                      start_proxy: StartProxy) -> None:
    """Scrapers looping on /metrics: every scrape of mmgate until the backend's next one is served from the one
    merge (mmgate_backend_metrics_merges_total, read over the wire, counts them), each with the waiting count
    as of its own request. The clock deciding when the backend is scraped again is the test's."""
    fetched = 0

    async def metrics(request: web.Request) -> web.Response:
        nonlocal fetched
        fetched += 1
        return web.Response(body=VLLM, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    upstream.route("/metrics", metrics)
    proxy = await start_proxy(upstream.url, MMGATE_BACKEND_METRICS="merge")
    now = [0.0]
    proxy.state.backend_scrapes.clock = lambda: now[0]

    async def merges(session: aiohttp.ClientSession) -> float:
        async with session.get(proxy.url + "/mmgate/metrics") as response:
            return _samples(await response.read())[("mmgate_backend_metrics_merges_total", ())]

    async def scrape(session: aiohttp.ClientSession) -> bytes:
        async with session.get(proxy.url + "/metrics") as response:
            assert response.status == 200
            return await response.read()

    async with aiohttp.ClientSession() as session:
        assert await merges(session) == 0
        first = await asyncio.gather(*(scrape(session) for _ in range(16)))
        assert (fetched, await merges(session)) == (1, 1)
        assert len(set(first)) == 1 and b'model_name="ti}ny \\"q\\""} 2.0\n' in first[0]
        now[0] += SCRAPE_REUSE_SECONDS  # the backend's scrape is stale: the next scrape of mmgate fetches anew
        second = [await scrape(session) for _ in range(8)]
        assert (fetched, await merges(session)) == (2, 2)
    backend = {key: value for key, value in _samples(first[0]).items() if key[0].startswith("vllm:")}
    assert {key: value for key, value in _samples(second[-1]).items() if key in backend} == backend


@pytest.mark.parametrize("merge_mode", ["merge", "passthrough"])
async def test_serving_a_large_exposition_copies_none_of_it_whole(upstream: Upstream, start_proxy: StartProxy,
                                                                  merge_mode: str) -> None:
    """Scrapers looping on a large exposition must not cost a copy of it each (issue 39): under
    ``runtime.memory``'s mmap threshold every copy of a few MB is a fresh memory mapping, and eight scrapers
    looping on a 4 MB exposition pushed health answers from 0.5 to 38 ms. Once the backend's scrape is kept,
    answering it allocates (Python's allocator, traced) well under the exposition's size, merged or passed
    through: what the client's reading and the loop's transport buffer (about 1 MB on uvloop), not a copy of
    the whole (each was at least the exposition's size). The client reads it in slices it drops. The body
    still arrives whole and in order."""
    import hashlib
    import tracemalloc

    exposition = _big_exposition(40_000)
    assert len(exposition) > 3_000_000
    await _metrics_backend(upstream, exposition)
    proxy = await start_proxy(upstream.url, MMGATE_BACKEND_METRICS="merge")
    now = [0.0]
    proxy.state.backend_scrapes.clock = lambda: now[0]  # the backend's first scrape is kept for the test
    path = "/metrics" if merge_mode == "merge" else "/mmgate/backend/metrics"

    async def scrape(session: aiohttp.ClientSession) -> tuple[int, str]:
        digest, size = hashlib.sha256(), 0
        async with session.get(proxy.url + path) as response:
            assert response.status == 200
            async for chunk in response.content.iter_chunked(1 << 16):
                digest.update(chunk)
                size += len(chunk)
        return size, digest.hexdigest()

    async with aiohttp.ClientSession() as session:
        first = await scrape(session)  # the backend's scrape (and the merge) made and kept
        tracemalloc.start()
        try:
            again = await scrape(session)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    assert again == first
    if merge_mode == "passthrough":
        assert first == (len(exposition), hashlib.sha256(exposition).hexdigest())
    assert peak < len(exposition) / 2, f"{peak} bytes allocated to answer a {len(exposition)}-byte exposition"
