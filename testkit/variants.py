"""mmgate with a decode pool it does not ship: the baselines bench/loop_latency.py measures the real pool against.

    python -m testkit.variants {nice0,loop} [mmgate flags]

- ``nice0``: the decode workers keep the event loop's CPU priority (mmgate's own lower theirs to niceness 10).
- ``loop``: every decode runs on the event loop itself, as in a server without a decode pool.

Why here and not a setting of mmgate: a knob that exists only for benchmarks is one more thing the product
has to validate, document and hide, and nobody should run either variant in production. So the bench builds
the variant itself: the same settings (flags and ``MMGATE_*`` variables mean what they mean to ``mmgate``),
the same app from ``build_app``, runner and listening site as ``mmgate serve``; only the pool the app opens
at start-up is swapped for the variant's before the first request. Nothing in ``proxy/`` or
``preprocessors/`` is patched. Not reproduced from ``mmgate serve``: the drain on SIGTERM (a benchmark stops
mmgate once its load is over, so there is nothing to drain) and the separate admin port.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import Future
from typing import TypeVar

from aiohttp import web

from preprocessors.base import Checkpoint
from preprocessors.pool import Batch, DecodePool
from proxy.app import build_app, make_runner
from proxy.cli import parse_args
from proxy.edge.site import GuardedSite
from proxy.runtime.memory import PILLOW_BLOCKS_PER_THREAD, tune_allocators
from proxy.serve.server import configure_logging
from proxy.settings import Settings, overrides_from_args
from proxy.state import STATE

T = TypeVar("T")
log = logging.getLogger("mmgate")


class LoopBatch(Batch):
    """A request's media work done at once on the calling thread, which is the event loop."""

    async def run(self, jobs: Sequence[Callable[[Checkpoint], T]], timeout: float,
                  on_each: Callable[[int, Future[T]], None] | None = None) -> list[T]:
        """Each job in turn, blocking the loop meanwhile: that stall is what the baseline measures. ``timeout``
        cannot apply: nothing else runs on the loop to notice it. ``on_each`` hears of each job as it ends, as
        the real pool's callers expect; the first failure ends the batch."""
        results: list[T] = []
        for index, job in enumerate(jobs):
            done: Future[T] = Future()
            try:
                done.set_result(job(self.checkpoint))
            except Exception as error:
                done.set_exception(error)
            if on_each is not None:
                on_each(index, done)
            results.append(done.result())  # raises the job's error
        return results


class LoopPool(DecodePool):
    """Decodes on the event loop. Its inherited executor never starts a thread: nothing is submitted to it."""

    def batch(self) -> Batch:
        return LoopBatch(self)


POOLS: dict[str, Callable[[int], DecodePool]] = {
    "nice0": lambda workers: DecodePool(workers, lower_priority=False),
    "loop": LoopPool,
}


def use_pool(app: web.Application, make_pool: Callable[[int], DecodePool]) -> None:
    """Swap the pool ``build_app`` opens at start-up for ``make_pool(decode_workers)``.

    Appended last to the app's cleanup contexts, so it runs once the app's own pool exists (and before any
    request); on shutdown the app's own context shuts down whatever pool the state holds, so this one.
    """

    async def swap(app: web.Application) -> AsyncIterator[None]:
        state = app[STATE]
        state.pool.shutdown()
        state.pool = make_pool(state.settings.decode.decode_workers)
        yield

    app.cleanup_ctx.append(swap)


async def serve(settings: Settings, variant: str) -> None:
    """Listen like ``mmgate serve`` with the ``variant`` pool until SIGTERM or SIGINT."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    app = build_app(settings)
    use_pool(app, POOLS[variant])
    runner = make_runner(app)
    await runner.setup()
    try:
        site = GuardedSite(runner, settings.listen.host, settings.listen.port, app[STATE].connections)
        await site.start()
        log.info("mmgate (%s decode pool, a benchmark baseline) listening on http://%s:%s -> %s", variant,
                 settings.listen.host, site.port, settings.backend.upstream)
        await stop.wait()
    finally:
        await runner.cleanup()


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m testkit.variants VARIANT [mmgate flags]``: settings and start-up as ``mmgate`` does them."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in POOLS:
        raise SystemExit(f"usage: python -m testkit.variants {{{','.join(POOLS)}}} [mmgate flags]")
    settings = Settings.from_env(os.environ, **overrides_from_args(parse_args(argv[1:])))
    if settings.listen.admin_port:
        raise SystemExit("testkit.variants: MMGATE_ADMIN_PORT is not supported here; /mmgate/* stays on the port")
    configure_logging(settings)
    if settings.memory.malloc_tuning:
        # the variants' pools are threads, whatever MMGATE_DECODE_MODE says
        applied = tune_allocators(os.environ, kept_blocks=PILLOW_BLOCKS_PER_THREAD * settings.decode.decode_workers)
        log.info("memory: %s", " ".join(applied) if applied else "allocator settings left as the environment set them")
    asyncio.run(serve(settings, argv[0]))


if __name__ == "__main__":
    main()
