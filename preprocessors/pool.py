"""The bounded decode pool: media work off the event loop, with cancellation that really stops work.

A Python thread cannot be killed. So a request's items form a ``Batch`` sharing one stop flag: items not yet
started are dropped (``Future.cancel``), running items stop at their next ``checkpoint()``. ``Batch.stopped``
completes only when no item of the batch is running any more; the caller keeps the request's admission
slot until then (``Lease.release_after``), otherwise work abandoned by timed-out requests would keep
running beside newly admitted work and the real concurrency would silently exceed the limit.

Workers lower their own CPU priority (Linux, per thread): when decode threads saturate every core, the
event loop thread still gets the CPU first, so health checks and text traffic stay fast.

``DecodePool`` runs each job in its thread (MMGATE_DECODE_MODE=thread). ``workers.ProcessPool`` keeps this
queueing and accounting and overrides ``_execute`` (a thread hands its job to a worker process of its own
and waits) and ``_abandoned`` (running items are ended for real: their worker processes are killed).
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from typing import TypeVar

from .base import Cancelled, Checkpoint, ImagePolicy
from .job import warm_up

T = TypeVar("T")
Job = Callable[[Checkpoint], T]

WORKER_NICENESS = 10
START_BARRIER_TIMEOUT = 60.0  # seconds for the executor to start every thread


def lower_priority() -> None:
    """This thread (or a single-threaded process) yields the CPU to the event loop: niceness 10."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WORKER_NICENESS)
    except (AttributeError, OSError):  # pragma: no cover - not Linux, or not permitted
        pass


class DecodePool:
    """``workers`` threads (at least 1).

    ``queued`` (items waiting for a thread) and ``stuck`` (items still running for an abandoned request)
    are read by the metrics at scrape time.
    """

    def __init__(self, workers: int, *, lower_priority: bool = True, warm_policy: ImagePolicy | None = None) -> None:
        self.workers = workers
        self.warm_policy = warm_policy  # the image policy the threads (or worker processes) warm up with
        self._lower_priority = lower_priority
        self._executor = ThreadPoolExecutor(workers, thread_name_prefix="mmgate-decode",
                                            initializer=self._thread_started)
        self._lock = threading.Lock()
        self.queued = 0
        self.stuck = 0
        self._warmed = False

    def batch(self) -> Batch:
        return Batch(self)

    def start(self) -> None:
        """Start every thread now (and, in process mode, its worker process, waiting until it is ready)
        instead of on the first jobs; blocks, so the app calls it off the loop at start-up. Raises the
        first thread's failure once every thread has answered."""
        barrier = threading.Barrier(self.workers)
        futures = [self._executor.submit(self._start_thread, barrier) for _ in range(self.workers)]
        errors = [error for future in futures if (error := future.exception()) is not None]
        if errors:
            raise errors[0]

    def _start_thread(self, barrier: threading.Barrier) -> None:
        # Each call waits for the others: a thread that is done cannot take a second call, so every thread
        # of the pool runs exactly one (the executor starts a thread per call while none is idle).
        barrier.wait(START_BARRIER_TIMEOUT)
        self._warm()

    def _warm(self) -> None:
        """Runs in each pool thread at ``start``: what a thread needs before its first job (the codecs
        loaded, once for the process: ``job.warm_up``)."""
        with self._lock:
            first, self._warmed = not self._warmed, True
        if first:
            warm_up(self.warm_policy)

    def _thread_started(self) -> None:
        """Runs once in each pool thread as it starts."""
        if self._lower_priority:
            lower_priority()

    def _execute(self, batch: Batch, job: Job[T]) -> T:
        """Runs ``job`` for ``batch`` in a pool thread; returns its result or raises its error."""
        return job(batch.checkpoint)

    def _abandoned(self, batch: Batch) -> None:
        """``batch`` was given up (called once, with the stop flag set): threads stop at their next checkpoint."""

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


class Batch:
    """One request's media work: ``run()`` all items under one deadline; ``stopped()`` when really over."""

    def __init__(self, pool: DecodePool) -> None:
        self._pool = pool
        self._stop = threading.Event()
        self._futures: list[Future[object]] = []
        self._running = 0  # guarded by pool._lock
        self.started = 0  # items a worker picked up: 0 after a timeout means the pool never got to them
        self._idle: asyncio.Event | None = None  # made by run(), on the loop the batch is run from

    def checkpoint(self) -> None:
        """Called by work between steps (in a worker thread): raise once the request gave up."""
        if self._stop.is_set():
            raise Cancelled()

    @property
    def abandoned(self) -> bool:
        return self._stop.is_set()

    async def run(self, jobs: Sequence[Job[T]], timeout: float,
                  on_each: Callable[[int, Future[T]], None] | None = None) -> list[T]:
        """Run ``jobs`` (each gets this batch's checkpoint) and return their results in order.

        Raises TimeoutError when ``timeout`` elapses, the first job's exception if one fails, and
        CancelledError if the caller is cancelled; in every case the rest of the batch is stopped.
        ``on_each(index, future)`` hears of every job as it ends (in the thread that ends it), the jobs of a
        batch that failed included: what finished is not lost with the batch.
        """
        pool = self._pool
        loop = asyncio.get_running_loop()
        idle = self._idle = asyncio.Event()
        idle.set()
        with pool._lock:
            pool.queued += len(jobs)
        self._futures = [pool._executor.submit(self._call, job, loop, idle) for job in jobs]
        if on_each is not None:
            _tell_each(self._futures, on_each)  # type: ignore[arg-type]  # the futures hold T results
        try:
            async with asyncio.timeout(timeout):
                results = await asyncio.gather(*(asyncio.wrap_future(f) for f in self._futures))
        except BaseException:
            self.abandon()
            raise
        finally:
            # The futures hold results and exceptions; an exception's traceback reaches the caller's frame,
            # which holds this batch: without this, that cycle keeps the request's media until a GC pass.
            self._futures = []
        return list(results)  # type: ignore[arg-type]

    def _call(self, job: Job[T], loop: asyncio.AbstractEventLoop, idle: asyncio.Event) -> T:
        pool = self._pool
        with pool._lock:
            pool.queued -= 1
            self._running += 1
            self.started += 1
            if self._stop.is_set():  # started in the instant the batch was abandoned
                pool.stuck += 1
        loop.call_soon_threadsafe(idle.clear)
        try:
            self.checkpoint()
            return pool._execute(self, job)
        finally:
            with pool._lock:
                self._running -= 1
                if self._stop.is_set():
                    pool.stuck -= 1
                last = self._running == 0
            if last:
                loop.call_soon_threadsafe(self._set_idle_if_still, idle)

    def _set_idle_if_still(self, idle: asyncio.Event) -> None:
        with self._pool._lock:
            if self._running == 0:
                idle.set()

    def abandon(self) -> None:
        """Stop the batch: drop items not started, make running ones stop at their next checkpoint."""
        if self._stop.is_set():
            return
        pool = self._pool
        with pool._lock:
            self._stop.set()
            pool.stuck += self._running
        pool._abandoned(self)
        for future in self._futures:
            if future.cancel():  # True only for an item that never started
                with pool._lock:
                    pool.queued -= 1

    async def stopped(self) -> None:
        """Wait until no item of this batch runs any more."""
        if self._idle is not None:
            with self._pool._lock:
                if self._running == 0:
                    return
            await self._idle.wait()


def _tell_each(futures: Sequence[Future[T]], on_each: Callable[[int, Future[T]], None]) -> None:
    """In a function of its own: a loop variable left in ``Batch.run``'s frame would hold a future, its
    exception, and through the traceback that frame again, keeping the request's media until a GC pass."""
    for index, future in enumerate(futures):
        future.add_done_callback(partial(on_each, index))
