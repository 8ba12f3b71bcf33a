"""MMGATE_WORKER_MAX_RSS_MB judges a decode worker's peak resident size, not only the size it rests at: a job
that allocates a lot for a moment and unmaps it (an 8K clip's frames in the video probe, 50 MB each) leaves
the worker back near its resting size, and it is recycled all the same."""

from __future__ import annotations

from testkit.media import chat_with_video, data_uri, video_clip
from tests.conftest import StartProxy, Upstream
from tests.preprocessors.test_workers import PROCESS, exits, gone, pool_of, post, warm_worker


def resident_mib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) >> 10 for line in f if line.startswith("VmRSS:"))


async def test_a_worker_whose_peak_went_over_the_limit_is_recycled(upstream: Upstream,
                                                                  start_proxy: StartProxy) -> None:
    proxy = await start_proxy(upstream.url, **PROCESS, MMGATE_WORKER_MAX_RSS_MB="100",
                              MMGATE_MAX_VIDEO_PIXELS=str(7680 * 4320))
    first = await warm_worker(proxy)
    assert (await post(proxy, chat_with_video(data_uri(video_clip(), "video/mp4"))))[0] == 200
    assert pool_of(proxy).worker_pids() == [first] and resident_mib(first) < 100  # below: kept
    assert (await post(proxy, chat_with_video(data_uri(video_clip(7680, 4320, 2), "video/mp4"))))[0] == 200
    assert gone(first) and pool_of(proxy).recycled == 1 and exits(proxy, "recycled") == 1
