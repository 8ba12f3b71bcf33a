"""The pool's handle on one decode worker process: starting it, handing it a job through its memfd and socket
pair, reading its answer, killing and reaping it. ``workers.ProcessPool`` owns one per pool thread; the
process's own side is ``worker_process``."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Mapping
from dataclasses import replace
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from .errors import rebuild
from .job import MediaJob, Verdict
from .pool import Batch
from .worker_process import write_all

log = logging.getLogger("mmgate")


_ROOT = str(Path(__file__).resolve().parent.parent)  # the directory holding this package


_PAGE = os.sysconf("SC_PAGE_SIZE")


# A worker's memfd keeps its pages up to this size between items (writing into fresh pages costs about four
# times as much as into kept ones); above it they go back after the item.
KEEP_BYTES = 8 << 20


_STOP_WAIT = 5.0  # seconds to reap a killed worker; SIGKILL cannot be ignored, so this is only a bound


class WorkerStartError(Exception):
    """A worker process could not start (mmgate's start-up stops with this one line)."""


class WorkerGone(Exception):
    """The worker process ended before it answered (killed by the pool, or crashed)."""


class WorkerFault(RuntimeError):
    """An unexpected exception in a worker process (a fault of mmgate's own): its traceback as text."""


class WorkerHandle:
    """One decode process and the memfd its payloads and answers travel through; owned by one pool thread."""

    def __init__(self, environment: Mapping[str, str], trim_idle: float = 0.0) -> None:
        self.memfd = os.memfd_create("mmgate-decode", os.MFD_CLOEXEC)
        ours, theirs = socket.socketpair()
        env = {**os.environ, **environment}
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_ROOT, env.get("PYTHONPATH")) if p)
        try:
            self.process = subprocess.Popen(
                # -P: never a ``preprocessors`` from the working directory, only the one beside this file
                [sys.executable, "-P", "-m", "preprocessors.worker_process", str(theirs.fileno()), str(self.memfd),
                 repr(trim_idle)],
                pass_fds=(theirs.fileno(), self.memfd), stdin=subprocess.DEVNULL, env=env, close_fds=True,
            )
        except BaseException:
            ours.close()
            os.close(self.memfd)
            raise
        finally:
            theirs.close()
        self.pid = self.process.pid
        self.conn = Connection(ours.detach())
        self.jobs = 0
        self.batch: Batch | None = None  # the batch whose item runs now; guarded by the pool's lock
        self.killed = False  # by the pool (abandoned batch, shutdown), not by a crash
        self.killed_for: Batch | None = None
        self.ready = False  # the process said it is ready (its first message), see ``wait_ready``
        self._closed = False
        self._close_lock = threading.Lock()

    def wait_ready(self, timeout: float | None = None) -> None:
        """Wait for the process's first message, sent once its imports are done. ``WorkerGone`` when it
        ended first; ``WorkerStartError`` when ``timeout`` passes, or when it says something else."""
        if self.ready:
            return
        try:
            if timeout is not None and not self.conn.poll(timeout):
                raise WorkerStartError(f"decode worker process {self.pid} did not start within {timeout:g} s")
            hello: tuple[Any, ...] = self.conn.recv()
        except (EOFError, OSError):
            raise WorkerGone() from None
        if hello[0] != "ready":
            raise WorkerStartError(f"decode worker process {self.pid} failed as it started:\n{hello[-1]}")
        self.ready = True

    def kill(self, batch: Batch | None = None) -> None:
        """SIGKILL without waiting (from any thread), for ``batch`` when its item is ended; whoever closes
        the worker reaps it."""
        self.killed = True
        self.killed_for = batch
        self._sigkill()

    def _sigkill(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def alive(self) -> bool:
        return self.process.poll() is None

    def close(self) -> int:
        """Kill, reap (the pid no longer exists afterwards), close the socket and the memfd; idempotent."""
        with self._close_lock:
            if not self._closed:
                self._closed = True
                if self.process.poll() is None:  # still running, or ending on its own right now
                    self._sigkill()
                try:
                    self.process.wait(_STOP_WAIT)
                except subprocess.TimeoutExpired:  # stuck in the kernel: subprocess reaps it later
                    log.warning("decode worker %d did not end within %g s of SIGKILL", self.pid, _STOP_WAIT)
                self.conn.close()
                os.close(self.memfd)
        return self.process.returncode

    def rss_bytes(self) -> int:
        """Resident size now (``/proc/<pid>/statm``), 0 when it cannot be read."""
        try:
            with open(f"/proc/{self.pid}/statm", "rb") as f:
                return int(f.read().split()[1]) * _PAGE
        except (OSError, ValueError, IndexError):
            return 0

    def run(self, job: MediaJob) -> Verdict:
        """Hand ``job`` to the process and wait for its answer; ``WorkerGone`` when the process ended."""
        length = write_all(self.memfd, job.payload())
        self.wait_ready()
        try:
            self.conn.send((job.task, length))
            reply: tuple[Any, ...] = self.conn.recv()
        except (EOFError, OSError):  # the socket's other end is gone: so is the process
            raise WorkerGone() from None
        try:
            kind = reply[0]
            if kind == "done":
                verdict: Verdict = reply[1]
                encoded_length: int = reply[2]
                if encoded_length >= 0:
                    verdict = replace(verdict, encoded=read_all(self.memfd, encoded_length))
                return verdict
            if kind == "refused":
                # never a local: the error's traceback holds this frame
                raise rebuild(reply[1], reply[2], reply[3], param=reply[4])
            raise WorkerFault(f"decode worker {self.pid} failed:\n{reply[1]}")
        finally:
            if os.fstat(self.memfd).st_size > KEEP_BYTES:
                os.ftruncate(self.memfd, 0)
            self.jobs += 1


def read_all(fd: int, length: int) -> bytes:
    if length == 0:
        return b""
    chunks = []
    done = 0
    while done < length:
        chunk = os.pread(fd, length - done, done)
        if not chunk:
            raise WorkerFault("the worker's answer is shorter than it said")
        chunks.append(chunk)
        done += len(chunk)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)
