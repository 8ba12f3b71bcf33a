"""MMGATE_DECODE_MODE=process: decode workers that are processes, ended for real and recycled.

Real worker processes, a real proxy and upstream on 127.0.0.1. A job that never ends is made by stopping its
worker with SIGSTOP (the process is there and takes the task, it just never answers); a crash is a real
SIGSEGV delivered to the worker while it holds an item.
"""

from __future__ import annotations

import asyncio
import base64
import io
import os
import signal
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import aiohttp
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from multidict import CIMultiDict
from PIL import Image

from preprocessors.base import AudioPolicy, ImagePolicy, no_checkpoint
from preprocessors.job import MediaJob, MediaTask, run_task
from preprocessors.worker_handle import WorkerStartError
from preprocessors.workers import ProcessPool
from proxy.admission.client import LocalGate
from proxy.admission.gate import Gate
from proxy.settings import PROCESS_MODE_FROM_CPUS, Settings, default_decode_mode
from proxy.state import STATE
from testkit.media import chat_with_image, data_uri, eventually, image_bytes, photo_sized
from tests.conftest import Proxy, StartProxy, Upstream

# No cache: these tests count the items each worker processes, and the cache would answer a repeated image.
PROCESS = {"MMGATE_DECODE_MODE": "process", "MMGATE_DECODE_WORKERS": "1", "MMGATE_RESIZE_MAX_SIDE": "32",
           "MMGATE_CACHE_MB": "0"}
CHAT = "/v1/chat/completions"


async def post(proxy: Proxy, body: dict) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as client, client.post(proxy.url + CHAT, json=body) as resp:
        return resp.status, await resp.json(content_type=None)


def image_chat(width: int = 64, height: int = 48) -> dict:
    return chat_with_image(data_uri(image_bytes(width, height)))


def pool_of(proxy: Proxy) -> ProcessPool:
    pool = proxy.state.pool
    assert isinstance(pool, ProcessPool)
    return pool


def exits(proxy: Proxy, reason: str) -> float:
    """``mmgate_decode_worker_exits_total{reason}`` as a scrape sees it."""
    return proxy.state.metrics.registry.get_sample_value("mmgate_decode_worker_exits_total",
                                                          {"reason": reason}) or 0.0


def gone(pid: int) -> bool:
    """No such process, not even a zombie: it was killed and reaped."""
    return not Path(f"/proc/{pid}").exists()


def mmgate_memfds() -> int:
    """The worker memfds this process holds open."""
    fds = Path("/proc/self/fd")
    count = 0
    for fd in fds.iterdir():
        try:
            count += os.readlink(fd).startswith("/memfd:mmgate-decode")
        except OSError:  # closed while listed
            pass
    return count


async def started(pool: ProcessPool) -> int:
    """The pool's one worker, once it has answered a job (a fresh interpreter may take longer to start than a
    short MMGATE_PREPROCESS_TIMEOUT allows); returns its pid."""
    payload = base64.b64encode(image_bytes())
    task = MediaTask("image", "warm-up", 1 << 20, ImagePolicy(), AudioPolicy())
    await pool.batch().run([MediaJob(task, lambda: payload)], 60)
    (pid,) = pool.worker_pids()
    return pid


async def warm_worker(proxy: Proxy) -> int:
    """One request through the pool, so its worker exists; returns that worker's pid."""
    assert (await post(proxy, image_chat()))[0] == 200
    pids = pool_of(proxy).worker_pids()
    assert len(pids) == 1
    return pids[0]


async def test_a_job_that_never_ends_is_killed_and_its_slot_comes_back_after(upstream: Upstream,
                                                                          start_proxy: StartProxy) -> None:
    proxy = await start_proxy(upstream.url, **PROCESS, MMGATE_PREPROCESS_TIMEOUT="0.3",
                              MMGATE_MAX_MM_CONCURRENCY="1")
    local = proxy.state.gate
    assert isinstance(local, LocalGate)  # one process: the Gate itself is watched
    gate = local.gate
    pid = await started(pool_of(proxy))
    os.kill(pid, signal.SIGSTOP)  # takes its next task and never answers
    seen_at_changes: list[tuple[int, bool]] = []  # (slots in use, worker gone) at every change of the gate
    report = gate._on_change

    def watch(changed: Gate) -> None:
        seen_at_changes.append((changed.in_use, gone(pid)))
        report(changed)

    gate._on_change = watch
    status, answer = await post(proxy, image_chat())
    assert (status, answer["error"]["code"]) == (504, "preprocess_timeout")
    # The proxy's own deadline, named with its setting; the client's media is not blamed.
    message = answer["error"]["message"]
    assert "0.3 s deadline (MMGATE_PREPROCESS_TIMEOUT)" in message and "smaller" not in message
    await eventually(lambda: gate.in_use == 0, "slot back")
    assert seen_at_changes == [(1, False), (0, True)]  # the slot came back once the worker was gone
    assert gone(pid)
    assert pool_of(proxy).stuck == 0
    assert (exits(proxy, "killed"), exits(proxy, "crashed")) == (1, 0)
    # the next request works, on a new worker
    successor = await started(pool_of(proxy))
    assert successor != pid
    assert (await post(proxy, image_chat()))[0] == 200
    assert len(upstream.seen) == 1


async def test_a_worker_is_recycled_after_max_jobs(upstream: Upstream, start_proxy: StartProxy) -> None:
    proxy = await start_proxy(upstream.url, **PROCESS, MMGATE_WORKER_MAX_JOBS="2")
    first = await warm_worker(proxy)
    assert (await post(proxy, image_chat()))[0] == 200  # its second item: recycled before the answer
    assert gone(first)
    assert pool_of(proxy).recycled == 1
    assert exits(proxy, "recycled") == 1
    second = await warm_worker(proxy)
    assert second != first
    assert pool_of(proxy).recycled == 1  # one item on the new worker: not yet due


async def test_a_worker_above_the_rss_limit_is_recycled_and_its_memory_gone(upstream: Upstream,
                                                                            start_proxy: StartProxy) -> None:
    proxy = await start_proxy(upstream.url, **PROCESS, MMGATE_WORKER_MAX_RSS_MB="1")  # every worker is above
    pool = pool_of(proxy)
    workers = []
    for round_ in range(1, 4):
        assert (await post(proxy, image_chat(600, 400)))[0] == 200
        assert pool.recycled == round_ and exits(proxy, "recycled") == round_
        (successor,) = pool.worker_pids()  # started at once
        workers.append(successor)
        if round_ > 1:
            assert gone(workers[-2])  # the worker that did this item: killed, reaped, its memory with it
    assert len(set(workers)) == 3


async def test_no_recycling_below_the_limits(upstream: Upstream, start_proxy: StartProxy) -> None:
    proxy = await start_proxy(upstream.url, **PROCESS)
    pid = await warm_worker(proxy)
    for _ in range(3):
        assert (await post(proxy, image_chat()))[0] == 200
    assert pool_of(proxy).worker_pids() == [pid] and pool_of(proxy).recycled == 0


async def end_on_item(pool: ProcessPool, pid: int, how: signal.Signals) -> None:
    """End worker ``pid``, stopped (SIGSTOP) with an item handed to it, by ``how``: SIGKILL as the OOM killer
    or an operator would; a fault signal delivered as it runs again, as a codec's crash would be."""
    await eventually(lambda: pid in pool.busy_pids(), "the item handed to the worker")
    os.kill(pid, how)
    if how != signal.SIGKILL:
        os.kill(pid, signal.SIGCONT)


async def hold_successor(pool: ProcessPool, predecessor: int) -> int:
    """Stop (SIGSTOP) the fresh worker that takes the item over from ``predecessor`` before it can answer:
    a fresh interpreter still imports Pillow for far longer than this takes to notice it."""
    successors: list[int] = []

    def taken_over() -> bool:
        successors[:] = [pid for pid in pool.busy_pids() if pid != predecessor]
        return bool(successors)

    await eventually(taken_over, "the item handed to a fresh worker")
    os.kill(successors[0], signal.SIGSTOP)
    return successors[0]


async def post_full(proxy: Proxy, body: dict, path: str = CHAT) -> tuple[int, dict, CIMultiDict[str]]:
    async with aiohttp.ClientSession() as client, client.post(proxy.url + path, json=body) as resp:
        return resp.status, await resp.json(content_type=None), CIMultiDict(resp.headers)


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGSEGV])
async def test_a_worker_that_dies_mid_job_once_is_replaced_and_the_item_served_by_the_retry(
        upstream: Upstream, start_proxy: StartProxy, caplog: pytest.LogCaptureFixture, how: signal.Signals) -> None:
    proxy = await start_proxy(upstream.url, **PROCESS)
    pool = pool_of(proxy)
    pid = await warm_worker(proxy)
    os.kill(pid, signal.SIGSTOP)  # takes the item and holds it
    request = asyncio.create_task(post(proxy, image_chat()))
    await end_on_item(pool, pid, how)
    status, _answer = await request
    assert status == 200  # served by the fresh worker: neither a kill nor an unrepeated crash is the client's
    assert len(upstream.seen) == 2  # the warm-up and this one
    assert gone(pid)
    reason = "lost" if how == signal.SIGKILL else "crashed"
    assert exits(proxy, reason) == 1
    assert exits(proxy, "killed") == 0 and (pool.lost, pool.crashed) == ((1, 0) if how == signal.SIGKILL else (0, 1))
    assert how.name in caplog.text and "runs again on a fresh worker" in caplog.text
    assert (await post(proxy, image_chat()))[0] == 200


async def test_an_item_that_crashes_two_workers_is_refused_as_decoder_crashed_and_that_verdict_cached(
        upstream: Upstream, start_proxy: StartProxy, caplog: pytest.LogCaptureFixture) -> None:
    proxy = await start_proxy(upstream.url, **{**PROCESS, "MMGATE_CACHE_MB": "64"})
    pool = pool_of(proxy)
    pid = await warm_worker(proxy)
    body = image_chat(70, 50)  # not the warm-up's image: a miss
    os.kill(pid, signal.SIGSTOP)
    request = asyncio.create_task(post_full(proxy, body))
    await end_on_item(pool, pid, signal.SIGSEGV)
    successor = await hold_successor(pool, pid)
    await end_on_item(pool, successor, signal.SIGABRT)
    status, answer, headers = await request
    assert (status, answer["error"]["code"]) == (400, "decoder_crashed")
    assert answer["error"]["param"] == "messages[0].content[1]"
    assert "SIGSEGV then killed by SIGABRT" in answer["error"]["message"]
    assert headers["x-should-retry"] == "false"
    assert gone(pid) and gone(successor)
    assert (exits(proxy, "crashed"), exits(proxy, "lost"), exits(proxy, "killed")) == (2, 0, 0)
    assert "refused as decoder_crashed" in caplog.text
    # The media's own fault, shown twice: kept, and refused again without a decode.
    (worker,) = pool.worker_pids()
    jobs = pool._all.copy().pop().jobs
    status, answer, _ = await post_full(proxy, body)
    assert (status, answer["error"]["code"]) == (400, "decoder_crashed")
    assert proxy.state.metrics.registry.get_sample_value("mmgate_cache_hits_total") == 1
    assert pool.worker_pids() == [worker] and pool._all.copy().pop().jobs == jobs  # nothing decoded
    assert len(upstream.seen) == 1  # the warm-up only
    assert (await post(proxy, image_chat()))[0] == 200  # the replacement works


async def test_an_item_killed_from_outside_on_both_workers_gets_a_retryable_503_that_is_never_cached(
        upstream: Upstream, start_proxy: StartProxy, caplog: pytest.LogCaptureFixture) -> None:
    proxy = await start_proxy(upstream.url, **{**PROCESS, "MMGATE_CACHE_MB": "64"})
    pool = pool_of(proxy)
    pid = await warm_worker(proxy)
    body = image_chat(70, 50)
    os.kill(pid, signal.SIGSTOP)
    request = asyncio.create_task(post_full(proxy, body))
    await end_on_item(pool, pid, signal.SIGKILL)
    successor = await hold_successor(pool, pid)
    await end_on_item(pool, successor, signal.SIGKILL)
    status, answer, headers = await request
    assert (status, answer["error"]["code"]) == (503, "decoder_unavailable")
    assert answer["error"]["param"] == "messages[0].content[1]"
    assert "killed by SIGKILL then killed by SIGKILL" in answer["error"]["message"]
    assert headers["Retry-After"] == "1" and headers["x-should-retry"] == "true"
    assert "X-Request-Id" in headers
    assert (exits(proxy, "lost"), exits(proxy, "crashed")) == (2, 0)
    assert "decoder_unavailable" in caplog.text
    assert proxy.state.cache is not None and proxy.state.cache.entries == 1  # the warm-up's image only
    # Nothing was kept about this media: the same request is decoded again, and served.
    status, _answer, _ = await post_full(proxy, body)
    assert status == 200
    assert proxy.state.metrics.registry.get_sample_value("mmgate_cache_hits_total") == 0
    assert len(upstream.seen) == 2


async def test_a_kill_the_retry_does_not_reproduce_is_never_a_refusal_even_after_a_crash(
        upstream: Upstream, start_proxy: StartProxy) -> None:
    """A crash, then a kill from outside on the retry: not shown to be the media's fault, so 503."""
    proxy = await start_proxy(upstream.url, **PROCESS)
    pool = pool_of(proxy)
    pid = await warm_worker(proxy)
    os.kill(pid, signal.SIGSTOP)
    request = asyncio.create_task(post(proxy, image_chat(70, 50)))
    await end_on_item(pool, pid, signal.SIGSEGV)
    successor = await hold_successor(pool, pid)
    await end_on_item(pool, successor, signal.SIGKILL)
    status, answer = await request
    assert (status, answer["error"]["code"]) == (503, "decoder_unavailable")
    assert (exits(proxy, "crashed"), exits(proxy, "lost")) == (1, 1)


async def test_a_worker_that_dies_while_idle_is_replaced_and_counted(upstream: Upstream,
                                                                    start_proxy: StartProxy) -> None:
    proxy = await start_proxy(upstream.url, **PROCESS)
    pid = await warm_worker(proxy)
    os.kill(pid, signal.SIGKILL)  # the OOM killer picks an idle worker
    await eventually(lambda: gone(pid) or Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z", "dead")
    assert (await post(proxy, image_chat()))[0] == 200
    assert exits(proxy, "lost") == 1 and pool_of(proxy).worker_pids() != [pid]


async def test_shutdown_leaves_no_process_memfd_or_shared_memory(upstream: Upstream) -> None:
    from testkit.servers import start_proxy_server

    shm_before = set(os.listdir("/dev/shm"))
    memfds_before = mmgate_memfds()
    proxy, stop = await start_proxy_server(upstream.url, **{**PROCESS, "MMGATE_DECODE_WORKERS": "2"})
    await asyncio.gather(*(post(proxy, image_chat(300, 200)) for _ in range(6)))
    pids = pool_of(proxy).worker_pids()
    assert pids and mmgate_memfds() == memfds_before + len(pids)
    await stop()
    assert all(gone(pid) for pid in pids)
    assert mmgate_memfds() == memfds_before
    assert set(os.listdir("/dev/shm")) == shm_before


async def test_workers_are_started_and_ready_before_the_first_request(upstream: Upstream,
                                                                     start_proxy: StartProxy) -> None:
    proxy = await start_proxy(upstream.url, **{**PROCESS, "MMGATE_DECODE_WORKERS": "2"})
    pool = pool_of(proxy)
    pids = pool.worker_pids()
    assert len(pids) == 2 and all(worker.ready for worker in pool._all)  # nothing sent yet
    assert pool.workers == len({id(thread) for thread in pool._executor._threads}) == 2
    await asyncio.gather(*(post(proxy, image_chat()) for _ in range(4)))
    assert pool.worker_pids() == pids  # the first requests ran on the workers started with mmgate


async def test_decode_threads_are_started_with_mmgate_too(upstream: Upstream, start_proxy: StartProxy) -> None:
    proxy = await start_proxy(upstream.url, MMGATE_DECODE_MODE="thread", MMGATE_DECODE_WORKERS="3")
    pool = proxy.state.pool
    assert pool is not None and not isinstance(pool, ProcessPool)
    threads = set(pool._executor._threads)
    assert len(threads) == 3 and all(thread.is_alive() for thread in threads)  # nothing sent yet
    assert (await post(proxy, image_chat()))[0] == 200
    assert set(pool._executor._threads) == threads


async def test_a_worker_that_cannot_start_stops_start_up_with_a_clear_error(
        upstream: Upstream, monkeypatch: pytest.MonkeyPatch) -> None:
    from proxy.app import build_app, make_runner
    from testkit.servers import proxy_settings

    monkeypatch.setenv("PYTHONHOME", "/nonexistent")  # a worker's interpreter cannot even find its stdlib
    app = build_app(proxy_settings(upstream.url, **{**PROCESS, "MMGATE_DECODE_WORKERS": "2"}))
    runner = make_runner(app)
    children_before = children()
    with pytest.raises(WorkerStartError, match=r"decode worker process \(MMGATE_DECODE_MODE=process\) ended as "
                                               r"it started \(exit status 1\), twice"):
        await runner.setup()
    await runner.cleanup()
    pool = app[STATE].pool
    assert isinstance(pool, ProcessPool) and pool.worker_pids() == [] and not pool._all
    assert children() == children_before  # every worker that did start was killed and reaped


def children() -> set[int]:
    """This process's child processes (zombies included: a worker not reaped would show here)."""
    me = os.getpid()
    found = set()
    for task in Path(f"/proc/{me}/task").iterdir():
        try:
            found.update(int(pid) for pid in (task / "children").read_text().split())
        except OSError:
            pass
    return found


async def test_a_refusal_from_a_worker_keeps_its_code_status_and_part(upstream: Upstream,
                                                                     start_proxy: StartProxy) -> None:
    proxy = await start_proxy(upstream.url, **PROCESS)
    status, answer = await post(proxy, chat_with_image("data:image/png;base64," + "QUJD" * 100))
    assert (status, answer["error"]["code"]) == (400, "unsupported_media_type")
    assert answer["error"]["param"] == "messages[0].content[1]"
    huge = image_bytes(5000, 5000, "PNG")
    status, answer = await post(proxy, chat_with_image(data_uri(huge)))
    assert status == 200  # within the default limits: resized by the worker
    forwarded = orjson.loads(upstream.seen[-1].body)["messages"][0]["content"][1]["image_url"]["url"]
    assert forwarded.startswith("data:image/jpeg;base64,")


# ----- the same results in both modes -----


@pytest.fixture
async def process_pool() -> AsyncIterator[ProcessPool]:
    pool = ProcessPool(1)
    yield pool
    pool.shutdown()


IMAGE_FORMATS = st.sampled_from(["PNG", "JPEG", "WEBP", "GIF", "BMP"])
MODES = st.sampled_from(["RGB", "RGBA", "L", "P"])


@settings(deadline=None, max_examples=25, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(width=st.integers(1, 300), height=st.integers(1, 300), fmt=IMAGE_FORMATS, mode=MODES,
       side=st.sampled_from([0, 16, 100]), out=st.sampled_from(["auto", "jpeg", "png", "webp"]),
       cut=st.sampled_from([None, None, 40, 3]), fetched=st.booleans())
async def test_results_are_the_same_in_a_thread_and_in_a_process(
        process_pool: ProcessPool, width: int, height: int, fmt: str, mode: str, side: int, out: str,
        cut: int | None, fetched: bool) -> None:
    if fmt == "JPEG" and mode in ("RGBA", "P"):
        mode = "RGB"
    buf = io.BytesIO()
    Image.new(mode, (width, height), 7 if mode == "P" else "teal").save(buf, fmt)
    data = buf.getvalue()[:cut]  # cut short: the same refusal from both
    payload = data if fetched else base64.b64encode(data)  # a fetched body, or inline base64
    task = MediaTask("image", "p", 1 << 24, ImagePolicy(resize_max_side=side, output_format=out),  # type: ignore[arg-type]
                     AudioPolicy(), fetched_mime="image/png" if fetched else None)
    try:
        here = run_task(task, lambda: payload, no_checkpoint)
    except Exception as error:  # the process must refuse the same way
        with pytest.raises(type(error)) as there:
            await process_pool.batch().run([MediaJob(task, lambda: payload)], 30)
        assert str(there.value) == str(error)
        return
    (there,) = await process_pool.batch().run([MediaJob(task, lambda: payload)], 30)
    assert there == here


async def test_a_job_in_a_process_pool_must_be_a_media_job(process_pool: ProcessPool) -> None:
    with pytest.raises(TypeError, match="MediaJob items only"):
        await process_pool.batch().run([lambda checkpoint: 1], 5)


# ----- the setting -----


def test_the_default_mode_follows_the_usable_cpus() -> None:
    assert default_decode_mode(1) == default_decode_mode(PROCESS_MODE_FROM_CPUS - 1) == "thread"
    assert default_decode_mode(PROCESS_MODE_FROM_CPUS) == default_decode_mode(64) == "process"
    settings = Settings.from_env({"MMGATE_UPSTREAM": "http://127.0.0.1:9"})
    assert settings.decode.decode_mode in ("thread", "process")
    assert f"MMGATE_DECODE_MODE={settings.decode.decode_mode}" in settings.describe()


def test_process_mode_counts_its_workers_in_the_worst_case_memory() -> None:
    env = {"MMGATE_UPSTREAM": "http://127.0.0.1:9", "MMGATE_DECODE_WORKERS": "4"}
    threads = Settings.from_env({**env, "MMGATE_DECODE_MODE": "thread"}).worst_case_memory_bytes()
    processes = Settings.from_env({**env, "MMGATE_DECODE_MODE": "process"}).worst_case_memory_bytes()
    assert threads["processes"] == 0 < processes["processes"]
    assert processes["total"] - threads["total"] == processes["processes"]


async def test_a_worker_imports_media_code_only(upstream: Upstream, start_proxy: StartProxy) -> None:
    proxy = await start_proxy(upstream.url, **PROCESS)
    pid = await warm_worker(proxy)
    maps = Path(f"/proc/{pid}/maps").read_text()
    assert "PIL" in maps  # Pillow's C core is mapped: the check below looks at the right thing
    assert "aiohttp" not in maps and "multidict" not in maps and "yarl" not in maps


@pytest.mark.parametrize(("tuning", "blocks"), [("on", "4"), ("off", "16")])
async def test_a_worker_gets_the_allocator_tuning_of_mmgate(upstream: Upstream, start_proxy: StartProxy,
                                                           tuning: str, blocks: str) -> None:
    if "PILLOW_BLOCKS_MAX" in os.environ:
        pytest.skip("the operator's own PILLOW_BLOCKS_MAX wins")
    proxy = await start_proxy(upstream.url, **PROCESS, MMGATE_MALLOC_TUNING=tuning)
    pid = await warm_worker(proxy)
    environ = dict(item.split(b"=", 1) for item in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if item)
    assert environ[b"PILLOW_BLOCKS_MAX"] == blocks.encode()
    assert (b"MALLOC_MMAP_THRESHOLD_" in environ) == (tuning == "on")
    if tuning == "on":  # big buffers come from a heap the next item reuses, not from fresh mappings
        assert int(environ[b"MALLOC_MMAP_THRESHOLD_"]) >= 32 << 20


def rss_bytes(pid: int) -> int:
    return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


async def test_an_idle_worker_gives_back_what_it_keeps_for_the_next_item(upstream: Upstream,
                                                                        start_proxy: StartProxy) -> None:
    if "PILLOW_BLOCKS_MAX" in os.environ or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        pytest.skip("the operator's own allocator settings win")
    proxy = await start_proxy(upstream.url, **PROCESS, MMGATE_MALLOC_TUNING="on", MMGATE_TRIM_IDLE="0.2")
    pid = await warm_worker(proxy)
    idle = rss_bytes(pid)
    assert (await post(proxy, image_chat(4000, 3000)))[0] == 200  # 48 MiB decoded: blocks kept for reuse
    await eventually(lambda: rss_bytes(pid) < idle + (16 << 20), "the kept memory given back once idle")
    assert pool_of(proxy).worker_pids() == [pid]  # given back by the worker itself, not by recycling it


async def test_a_worker_killed_for_another_request_never_fails_the_next_item(process_pool: ProcessPool) -> None:
    """``abandon`` may kill a worker just as its item finishes: the thread's next item, from another request,
    then finds its worker dead (or dying) and must run on the successor, neither cancelled nor refused."""
    payload = base64.b64encode(image_bytes())
    task = MediaTask("image", "p", 1 << 20, ImagePolicy(), AudioPolicy())
    pid = await started(process_pool)
    for _ in range(3):
        (worker,) = process_pool._all
        worker.kill(process_pool.batch())  # for a batch that is not the next one
        (outcome,) = await process_pool.batch().run([MediaJob(task, lambda: payload)], 60)
        assert outcome.size_in == len(image_bytes())
    assert gone(pid) and process_pool.crashed == 0


async def test_a_worker_outlives_ctrl_c(process_pool: ProcessPool) -> None:
    """Ctrl-C reaches the whole process group: mmgate drains on SIGINT, and its workers must still answer."""
    pid = await started(process_pool)
    os.kill(pid, signal.SIGINT)
    os.kill(pid, signal.SIGTERM)
    assert await started(process_pool) == pid and process_pool.crashed == 0


async def test_a_thread_pool_warms_up_with_the_served_models_geometry() -> None:
    """The first image the model would shrink must not pay for importing the processor's helpers: decode threads
    run the policy's geometry while the pool starts. A geometry whose processor module cannot be imported
    therefore stops the start."""
    from preprocessors.geometry import Idefics3
    from preprocessors.pool import DecodePool

    broken = ImagePolicy(geometry=Idefics3("idefics3", "no_such_processor_module", 1456, 364, True))
    working = ImagePolicy(geometry=Idefics3("idefics3", "preprocessors.geometry", 1456, 364, False))
    for policy, fails in ((broken, True), (working, False)):
        pool = DecodePool(1, warm_policy=policy)
        try:
            if fails:
                with pytest.raises(ModuleNotFoundError, match="no_such_processor_module"):
                    await asyncio.to_thread(pool.start)
            else:
                await asyncio.to_thread(pool.start)
        finally:
            pool.shutdown()


async def test_a_worker_process_resizes_to_the_models_size_without_its_helpers(process_pool: ProcessPool) -> None:
    """A decode worker process never imports the served model's helpers (transformers: about a second of each
    worker's start, and tens of MB): the task carries the answers the proxy worked out from the image's header
    (``job.with_planned_targets``). Shown with a geometry whose processor module does not exist: planned from
    the real Idefics3 processor's answers, the worker resizes to exactly its size; without them, it has to
    import the module, and fails."""
    from preprocessors.dataurl import Base64Ends
    from preprocessors.dimensions import peek_dimensions
    from preprocessors.geometry import Idefics3, planned_targets
    from preprocessors.job import with_planned_targets

    real = Idefics3("idefics3", "transformers.models.idefics3.image_processing_pil_idefics3", 1456, 364, True)
    pytest.importorskip(real.module)
    broken = Idefics3("idefics3", "no_such_processor_module", 1456, 364, True)
    photo = io.BytesIO()
    photo_sized(3000, 2000).save(photo, "PNG")  # a PNG this size costs the backend more than the handoff
    payload = base64.b64encode(photo.getvalue())
    task = MediaTask("image", "p", 1 << 26, ImagePolicy(geometry=broken), AudioPolicy())
    found = peek_dimensions(Base64Ends(payload).head)
    planned = with_planned_targets(replace(task, image_policy=ImagePolicy(geometry=real)), found).known_targets
    assert planned == planned_targets(real, 3000, 2000) and len(planned) == 8
    (verdict,) = await process_pool.batch().run([MediaJob(replace(task, known_targets=planned), lambda: payload)], 60)
    assert verdict.encoded is not None
    with Image.open(io.BytesIO(base64.b64decode(verdict.encoded))) as resized:
        assert resized.size == real.backend_size(3000, 2000)
    with pytest.raises(Exception, match="no_such_processor_module"):
        await process_pool.batch().run([MediaJob(task, lambda: payload)], 60)
