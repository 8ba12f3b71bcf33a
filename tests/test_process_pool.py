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
from pathlib import Path

import aiohttp
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from preprocessors.base import AudioPolicy, ImagePolicy, no_checkpoint
from preprocessors.job import MediaJob, MediaTask, run_task
from preprocessors.workers import ProcessPool
from proxy.admission import Gate
from proxy.settings import PROCESS_MODE_FROM_CPUS, Settings, default_decode_mode
from testkit.media import chat_with_image, data_uri, eventually, image_bytes

from .conftest import Proxy, StartProxy, Upstream

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
    gate = proxy.state.gate
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


async def test_a_worker_crash_refuses_that_media_and_the_worker_is_replaced(
        upstream: Upstream, start_proxy: StartProxy, caplog: pytest.LogCaptureFixture) -> None:
    proxy = await start_proxy(upstream.url, **PROCESS)
    pool = pool_of(proxy)
    pid = await warm_worker(proxy)
    os.kill(pid, signal.SIGSTOP)
    request = asyncio.create_task(post(proxy, image_chat()))
    await eventually(lambda: pool.busy_pids() == [pid], "the item handed to the worker")
    os.kill(pid, signal.SIGSEGV)  # pending until it runs again: it dies as a codec fault would
    os.kill(pid, signal.SIGCONT)
    status, answer = await request
    assert (status, answer["error"]["code"]) == (400, "decoder_crashed")
    assert answer["error"]["param"] == "messages[0].content[1]"
    assert "SIGSEGV" in answer["error"]["message"] or "SIGSEGV" in caplog.text
    assert gone(pid) and pool.crashed == 1
    assert (exits(proxy, "crashed"), exits(proxy, "killed")) == (1, 0)
    assert len(upstream.seen) == 1  # the warm-up only
    assert (await post(proxy, image_chat()))[0] == 200  # the replacement works
    assert "decoder_crashed" in caplog.text


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
    with pytest.raises(AssertionError):
        await process_pool.batch().run([lambda checkpoint: 1], 5)


# ----- the setting -----


def test_the_default_mode_follows_the_usable_cpus() -> None:
    assert default_decode_mode(1) == default_decode_mode(PROCESS_MODE_FROM_CPUS - 1) == "thread"
    assert default_decode_mode(PROCESS_MODE_FROM_CPUS) == default_decode_mode(64) == "process"
    settings = Settings.from_env({"MMGATE_UPSTREAM": "http://127.0.0.1:9"})
    assert settings.decode_mode in ("thread", "process")
    assert f"MMGATE_DECODE_MODE={settings.decode_mode}" in settings.describe()


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


@pytest.mark.parametrize(("tuning", "blocks"), [("on", "0"), ("off", "16")])
async def test_a_worker_gets_the_allocator_tuning_of_mmgate(upstream: Upstream, start_proxy: StartProxy,
                                                           tuning: str, blocks: str) -> None:
    if "PILLOW_BLOCKS_MAX" in os.environ:
        pytest.skip("the operator's own PILLOW_BLOCKS_MAX wins")
    proxy = await start_proxy(upstream.url, **PROCESS, MMGATE_MALLOC_TUNING=tuning)
    pid = await warm_worker(proxy)
    environ = dict(item.split(b"=", 1) for item in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if item)
    assert environ[b"PILLOW_BLOCKS_MAX"] == blocks.encode()
    assert (b"MALLOC_MMAP_THRESHOLD_" in environ) == (tuning == "on")


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
