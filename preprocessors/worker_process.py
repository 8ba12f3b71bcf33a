"""One decode worker process: ``python -m preprocessors.worker_process SOCKET_FD MEMFD TRIM_IDLE``.

The other end of ``workers.ProcessPool``. A fresh interpreter that imports this package only (Pillow,
pybase64, never aiohttp or the proxy): it says it is ready once warmed up (``job.warm_up``: the formats, not
the served model's helpers, whose answers each task carries), then answers one task at a time. The task
comes pickled over the socket; the payload lies in the memfd, which the answer's encoded bytes overwrite.
"""

from __future__ import annotations

import mmap
import os
import signal
import sys
import traceback
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from multiprocessing.connection import Connection

from .base import no_checkpoint
from .errors import MmgateError
from .job import run_task, warm_up
from .pool import lower_priority


def write_all(fd: int, data: bytes | memoryview) -> int:
    view = memoryview(data).cast("B")
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], done)
    return done


def serve(conn: Connection, memfd: int, trim_idle: float = 0.0) -> None:
    """Answer tasks until the socket closes: ``(task, payload length)`` in, one reply out per task. After
    items, once no task came for ``trim_idle`` seconds (0 = never), what the worker keeps for the next item
    (Pillow's freed blocks, glibc's free heap) goes back to the OS."""
    trim = _release_kept_memory() if trim_idle > 0 else None
    worked = False
    while True:
        try:
            if trim is not None and worked and not conn.poll(trim_idle):
                trim()
                worked = False
            task, length = conn.recv()
            worked = True
        except EOFError:  # mmgate closed the socket, or ended
            return
        except Exception:  # a task this worker cannot unpickle: mmgate's fault, not the media's
            conn.send(("fault", traceback.format_exc()))
            continue
        try:
            if length:
                with mmap.mmap(memfd, length, prot=mmap.PROT_READ) as mapped:
                    view = memoryview(mapped)
                    try:
                        verdict = run_task(task, partial(_same, view), no_checkpoint)
                    finally:
                        view.release()  # an error's traceback may still name it: the map must close
            else:
                verdict = run_task(task, partial(_same, b""), no_checkpoint)
        except MmgateError as error:
            conn.send(("refused", error.status, error.code, error.message, error.param))
            continue
        except Exception:
            conn.send(("fault", traceback.format_exc()))
            continue
        encoded = verdict.encoded
        if encoded is not None:
            write_all(memfd, encoded)  # over the payload, which is no longer needed
            verdict = replace(verdict, encoded=None)
        conn.send(("done", verdict, -1 if encoded is None else len(encoded)))


def _same(value: memoryview | bytes) -> memoryview | bytes:
    return value


def _release_kept_memory() -> Callable[[], None]:
    """Pillow's freed blocks, then glibc's free pages (``malloc_trim``, where glibc is the C library)."""
    import ctypes
    import ctypes.util

    from PIL import Image

    try:
        malloc_trim = ctypes.CDLL(ctypes.util.find_library("c")).malloc_trim
        malloc_trim.argtypes = [ctypes.c_size_t]
    except (OSError, AttributeError, TypeError):  # not glibc
        malloc_trim = None

    def release() -> None:
        Image.core.clear_cache()
        if malloc_trim is not None:
            malloc_trim(0)

    return release


def main(argv: list[str]) -> None:
    # Ctrl-C reaches the whole process group, and a terminal's SIGTERM may too: the worker must outlive them
    # while mmgate drains. mmgate ends it with SIGKILL, or by closing the socket.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    lower_priority()
    conn = Connection(int(argv[0]))
    try:
        # The formats only: the proxy gives each task the served model's answers for its image
        # (``geometry.known_targets``), so the processor's helpers (transformers: about a second and tens of MB
        # here) are imported only for an image whose header the proxy could not read.
        warm_up()
    except Exception:  # mmgate's start-up fails with this, instead of every item failing later
        conn.send(("fault", traceback.format_exc()))
        return
    conn.send(("ready", os.getpid()))  # mmgate's start-up waits for this
    serve(conn, int(argv[1]), float(argv[2]))


if __name__ == "__main__":
    main(sys.argv[1:])
