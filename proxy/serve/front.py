"""``python -m proxy.serve.front``: one front process of several (``MMGATE_PROCESSES``), started by
``proxy.processes.supervisor`` with the listening sockets and its link to the shared gate as inherited file
descriptors and its Settings on stdin. Not a command for people: ``mmgate --processes N`` starts these."""

from __future__ import annotations

import argparse
import os
import pickle
import socket
import sys

from preprocessors.worker_handle import WorkerStartError
from proxy.runtime.loop import run
from proxy.runtime.memory import tune_process
from proxy.serve.server import FrontSockets, configure_logging, exit_with, serve
from proxy.settings import ConfigError, Settings


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m proxy.serve.front")
    parser.add_argument("--index", type=int, required=True)
    parser.add_argument("--listen-fd", type=int, required=True)
    parser.add_argument("--gate-fd", type=int, required=True)
    parser.add_argument("--admin-fd", type=int, default=None)
    args = parser.parse_args()
    settings = pickle.loads(sys.stdin.buffer.read())  # from the supervisor, which started this process
    if not isinstance(settings, Settings):
        raise TypeError(f"a front process reads its Settings on stdin, not a {type(settings).__name__}")
    configure_logging(settings)
    tune_process(dict(os.environ), memory_first=settings.memory.malloc_tuning,
                 decode_threads=settings.decode.decode_workers if settings.decode.decode_mode == "thread" else 0)
    sockets = FrontSockets(
        index=args.index,
        listen=socket.socket(fileno=args.listen_fd),
        admin=socket.socket(fileno=args.admin_fd) if args.admin_fd is not None else None,
        gate=socket.socket(fileno=args.gate_fd),
    )
    try:
        run(serve(settings, front=sockets), settings.listen.loop)
    except (WorkerStartError, ConfigError) as error:
        exit_with(error)


if __name__ == "__main__":
    main()
