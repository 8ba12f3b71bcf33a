"""Decode worker processes (MMGATE_DECODE_MODE=process): media work in processes that can really be ended.

``ProcessPool`` keeps ``DecodePool``'s threads, queue and accounting; each of its threads owns one worker
process and hands it its jobs. What changes against threads:

- **The GIL.** A worker process has its own: however long Pillow holds it, the event loop never waits.
- **Ending a job.** A job past its deadline (or whose client left) is ended for real: ``_abandoned``
  kills the processes running the batch's items, and each item counts as running until its thread has
  reaped the process, so the request keeps its gate slot until the worker is gone (``Batch.stopped``).
- **Memory.** A worker is recycled (killed and replaced) after ``max_jobs`` items or when
  its peak resident size (``VmHWM``), read from ``/proc`` after a job, is above ``max_rss_bytes``: the only
  sure way to hand a fragmented heap back to the OS. The peak, not the size now: a job that allocates a
  lot for a moment (a codec's index or frames, unmapped when freed) leaves a worker back at its resting
  size, and would never be seen; its successor starts with a fresh peak. Thread mode has no worker of its
  own to measure or replace: what bounds a job's memory there is what the media checks judge before they
  allocate (the pixel limits, the video probe's tables).
- **A death** while a worker processes an item is not taken on trust as the media's fault: the worker is
  replaced and the item runs once more on the fresh one. Only a crash (a fault signal: SIGSEGV, SIGABRT...)
  that the retry reproduces refuses the item with 400 ``decoder_crashed`` (``WorkerCrashed``, a
  ``MediaError``: the one verdict about a death that may be cached). A kill from outside (SIGKILL: the OOM
  killer, an operator) or a death the retry does not reproduce is no verdict on the media: the retry serves
  the item, or, when the retry's worker dies too, the client gets 503 ``decoder_unavailable`` with
  ``Retry-After`` (``WorkerLost``, never cached).

Workers are started with spawn semantics (``python -m preprocessors.worker_process``, a fresh interpreter that
imports this package only: Pillow, pybase64, never aiohttp or the proxy). ``start()`` starts one per pool
thread and waits until each has said it is ready (mmgate calls it at start-up, so the first request finds
warm workers and a worker that cannot start stops mmgate with ``WorkerStartError``); a thread whose worker
ended starts a new one on its next job, and a retired worker's successor starts at once. The task (small,
plain data: ``job.MediaTask``) is pickled over a socket pair; the payload travels through a memfd that
belongs to the worker: the parent writes the base64 text with ``os.pwrite`` and reads the answer back with
``os.pread`` (both release the GIL), the worker maps it. No big bytes are pickled, and a memfd is no named
segment: nothing can be left in ``/dev/shm``. It keeps up to ``KEEP_BYTES`` of pages for the next item.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable, Mapping
from typing import TypeVar

from .base import Cancelled
from .errors import DECODER_CRASHED, DECODER_UNAVAILABLE
from .job import MediaJob
from .pool import Batch, DecodePool, Job
from .worker_handle import WorkerGone, WorkerHandle, WorkerStartError

T = TypeVar("T")
log = logging.getLogger("mmgate")


# Signals a process gets from its own fault (a codec's bad read, a failed assertion), as opposed to a kill from
# outside (SIGKILL: the OOM killer, an operator, the pool itself).
CRASH_SIGNALS = frozenset({signal.SIGSEGV, signal.SIGBUS, signal.SIGABRT, signal.SIGFPE, signal.SIGILL,
                           signal.SIGSYS, signal.SIGTRAP})
RETRY_AFTER_S = 1  # a worker lost to a kill from outside: its successor is already starting
START_TIMEOUT = 60.0  # seconds for a fresh worker to say it is ready (an interpreter and Pillow's import)


class ProcessPool(DecodePool):
    """``workers`` threads, each with one decode process; same queue, metrics and ``Batch`` as threads.

    ``max_jobs`` (0 = never) and ``max_rss_bytes`` (0 = never, else against the peak): when a worker is
    recycled. ``recycled``
    counts the workers recycled, ``crashed`` those that ended of a fault signal while processing an item,
    ``lost`` those ended otherwise (a kill from outside) while processing one or while idle; ``on_exit``
    hears of every worker ended while the pool runs: ``recycled``, ``killed`` (by the pool, its request gave
    up), ``crashed`` or ``lost``.
    ``environment``: variables added to each worker's (the allocator tuning of ``proxy/runtime/memory.py``);
    ``trim_idle``: seconds after which an idle worker gives back the memory it keeps for the next item.
    """

    def __init__(self, workers: int, *, max_jobs: int = 0, max_rss_bytes: int = 0,
                 on_exit: Callable[[str], None] = lambda reason: None,
                 environment: Mapping[str, str] | None = None, trim_idle: float = 0.0) -> None:
        self.max_jobs = max_jobs
        self.trim_idle = trim_idle  # a worker gives back what it keeps after this many idle seconds (0 = never)
        self._environment = dict(environment or {})  # added to each worker's environment (allocator tuning)
        self._on_exit = on_exit  # called with recycled, killed, crashed or lost (from a pool thread)
        self.max_rss_bytes = max_rss_bytes
        self.recycled = 0
        self.crashed = 0
        self.lost = 0
        self._local = threading.local()
        self._all: set[WorkerHandle] = set()
        self._closed = False
        # The threads only wait; the processes lower their priority and warm up themselves, the formats only:
        # each task carries the served model's answers for its image (``job.MediaTask.known_targets``).
        super().__init__(workers, lower_priority=False)

    def worker_pids(self) -> list[int]:
        """The pids of the worker processes alive now (tests, the bench)."""
        with self._lock:
            return sorted(w.pid for w in self._all if w.alive())

    def busy_pids(self) -> list[int]:
        """The pids of the workers processing an item now."""
        with self._lock:
            return sorted(w.pid for w in self._all if w.batch is not None)

    def _worker(self) -> WorkerHandle:
        """This thread's worker, started (or replaced, when it ended) here."""
        worker: WorkerHandle | None = getattr(self._local, "worker", None)
        if worker is not None and not worker.alive():
            returncode = self._retire(worker)
            if not worker.killed and not self._closed:  # ended while idle, not by the pool
                self.lost += 1
                self._on_exit("lost")
                log.warning("decode worker %d ended while idle (%s); replaced", worker.pid,
                            _describe_exit(returncode))
            worker = None
        if worker is None:
            if self._closed:
                raise Cancelled()
            worker = WorkerHandle(self._environment, self.trim_idle)
            with self._lock:
                self._all.add(worker)
                closed = self._closed
            if closed:  # shut down while it started: nobody else will close it
                self._retire(worker)
                raise Cancelled()
            self._local.worker = worker
        return worker

    def _retire(self, worker: WorkerHandle) -> int:
        returncode = worker.close()
        with self._lock:
            self._all.discard(worker)
        if getattr(self._local, "worker", None) is worker:
            self._local.worker = None
        return returncode

    def _execute(self, batch: Batch, job: Job[T]) -> T:
        if not isinstance(job, MediaJob):  # a bare function cannot be sent to a worker process
            raise TypeError(f"a process pool runs MediaJob items only, not {type(job).__name__}")
        deaths: list[int | None] = []  # the exit statuses of the workers that ended on this item
        while True:
            worker = self._worker()
            with self._lock:
                if batch.abandoned:
                    raise Cancelled()
                worker.batch = batch
            try:
                verdict = worker.run(job)
            except WorkerGone:
                returncode = self._replace(worker)  # reaped: the item ends only once its process is gone
                if batch.abandoned or worker.killed_for is batch or self._closed:
                    if not self._closed:
                        self._on_exit("killed")
                    raise Cancelled() from None
                if worker.killed:
                    # Killed for the batch of its previous item, as that item was finishing: this item was
                    # never its fault. The successor takes it.
                    continue
                deaths.append(returncode)
                self._count_death(returncode)
                self._after_death(worker.pid, job, deaths)  # raises once the retry's worker died too
                continue
            finally:
                with self._lock:
                    worker.batch = None
            self._recycle_if_due(worker)
            return verdict  # type: ignore[return-value]

    def _count_death(self, returncode: int | None) -> None:
        if _crashed(returncode):
            self.crashed += 1
            self._on_exit("crashed")
        else:
            self.lost += 1
            self._on_exit("lost")

    def _after_death(self, pid: int, job: MediaJob, deaths: list[int | None]) -> None:
        """A worker ended on ``job``'s item, not by the pool: once, the item is retried on the successor;
        twice, it is refused, as the media's fault only when both were crashes."""
        how = _describe_exit(deaths[-1])
        both = " then ".join(map(_describe_exit, deaths))
        path = job.task.path
        if len(deaths) == 1:
            log.warning("decode worker %d ended while processing %s (%s); the item runs again on a fresh worker",
                        pid, path, how)
            return
        if all(_crashed(code) for code in deaths):
            log.warning("decode worker %d crashed on %s (%s), as its predecessor did on the same item; refused "
                        "as decoder_crashed", pid, path, how)
            raise DECODER_CRASHED.error(
                f"the decoder crashed twice while processing this media ({both}, on a fresh worker too); the file is "
                "most likely malformed or crafted, and was not forwarded", param=path)
        log.warning("decode worker %d ended while processing %s (%s), as its predecessor did (%s); the item "
                    "is not taken to be at fault: answered 503 decoder_unavailable", pid, path, how,
                    _describe_exit(deaths[0]))
        raise DECODER_UNAVAILABLE.error(
            f"the decode worker processing this media ended twice ({both}) without the media being at fault; retry",
            param=path, headers={"Retry-After": str(RETRY_AFTER_S), "x-should-retry": "true"})

    def _recycle_if_due(self, worker: WorkerHandle) -> None:
        peak = max(worker.rss_bytes(), peak_rss_bytes(worker.pid)) if self.max_rss_bytes else 0
        due = (self.max_jobs and worker.jobs >= self.max_jobs) or peak > self.max_rss_bytes
        if due:
            log.debug("decode worker %d recycled after %d items, its peak resident size %d MiB", worker.pid,
                      worker.jobs, peak >> 20)
            self._replace(worker)
            self.recycled += 1
            self._on_exit("recycled")

    def _replace(self, worker: WorkerHandle) -> int:
        """Retire ``worker`` and start its successor now: the new interpreter warms up while this thread
        is between jobs, instead of delaying the next one. Returns the retired worker's exit status."""
        returncode = self._retire(worker)
        try:
            self._worker()
        except Cancelled:  # the pool is shutting down
            pass
        except OSError as error:  # no process could start: the next job tries again, and says so
            log.warning("could not start a decode worker: %s", error)
        return returncode

    def _warm(self) -> None:
        """This thread's worker, started now and ready (``DecodePool.start``). A worker that ends as it starts
        gets one successor, as one that ends on an item does; a second one that ends fails the start."""
        for attempt in (1, 2):
            worker = self._worker()
            try:
                worker.wait_ready(START_TIMEOUT)
                return
            except WorkerGone:
                how = _describe_exit(self._retire(worker))
                if attempt == 1:
                    log.warning("decode worker %d ended as it started (%s); starting another", worker.pid, how)
                    continue
                raise WorkerStartError(
                    f"a decode worker process (MMGATE_DECODE_MODE=process) ended as it started ({how}), "
                    "twice; its own error, if any, is on stderr above") from None
            except WorkerStartError:
                self._retire(worker)
                raise

    def _abandoned(self, batch: Batch) -> None:
        with self._lock:  # the abandoning caller holds no lock here
            for worker in self._all:
                if worker.batch is batch:
                    worker.kill(batch)

    def shutdown(self) -> None:
        """Stop taking work, kill every worker and reap it: no process outlives the pool."""
        with self._lock:
            self._closed = True
            workers = list(self._all)
        super().shutdown()
        for worker in workers:
            worker.kill()
        for worker in workers:
            worker.close()
            with self._lock:
                self._all.discard(worker)


def peak_rss_bytes(pid: int) -> int:
    """The process's peak resident size (``VmHWM`` in ``/proc/<pid>/status``), 0 when it cannot be read."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"VmHWM:"):
                    return int(line.split()[1]) << 10  # kB
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _crashed(returncode: int | None) -> bool:
    """Whether a worker's exit status is a crash of its own (a fault signal), not a kill from outside."""
    return returncode is not None and -returncode in CRASH_SIGNALS


def _describe_exit(returncode: int | None) -> str:
    if returncode is not None and returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit status {returncode}"


