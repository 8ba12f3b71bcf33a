"""``mmgate`` (serve), ``mmgate demo`` (proxy + the built-in stub backend), ``mmgate --print-config``: the
command line, read into settings, then handed to one process (``proxy.serve.server``) or to the supervisor of
several (``proxy.processes.supervisor``)."""

from __future__ import annotations

import argparse
import difflib
import logging
import os
import re
import subprocess
import sys
from collections.abc import Collection, Sequence
from functools import partial

from preprocessors.worker_handle import WorkerStartError
from proxy.app import model_in_force, served_model
from proxy.processes.supervisor import supervise
from proxy.runtime.loop import loop_factory, run
from proxy.runtime.memory import tune_process
from proxy.serve.demo import DEMO_HOST, print_demo_help, start_stub_backend
from proxy.serve.server import ListenError, announce, bound, configure_logging, exit_with, serve
from proxy.settings import ConfigError, Settings, overrides_from_args, unknown_variables
from proxy.settings.reference import add_arguments

log = logging.getLogger("mmgate")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="mmgate",
        description="Admission-control and media-preprocessing sidecar for multimodal inference servers. "
        "Every flag is also an environment variable: --max-queue is MMGATE_MAX_QUEUE.",
    )
    parser.add_argument("command", nargs="?", choices=("serve", "demo"), default="serve",
                        help="serve (default) or demo: the proxy in front of the built-in stub backend")
    flags = ["-h", "--help"]  # argparse's own
    flags += parser.add_argument("--print-config", action="store_true",
                                 help="print the effective settings and exit").option_strings
    flags += add_arguments(parser)
    args = list(sys.argv[1:] if argv is None else argv)
    if (unknown := unknown_flag(flags, args)) is not None:
        # Checked first: argparse would take the misspelt flag's value for the command and name that instead.
        close = difflib.get_close_matches(unknown, flags, n=1)
        hint = f"did you mean {close[0]}?" if close else "mmgate --help lists every flag"
        parser.exit(2, f"mmgate: unknown flag {unknown} ({hint})\n")
    return parser.parse_args(args)


_NUMBER = re.compile(r"-\d+(\.\d*)?|-\.\d+")


def unknown_flag(known: Sequence[str], args: Sequence[str]) -> str | None:
    """The first ``-flag`` in ``args`` that is neither one of the ``known`` flags nor an abbreviation of one."""
    for arg in args:
        if arg == "--":
            return None
        if not arg.startswith("-") or arg == "-" or _NUMBER.fullmatch(arg):
            continue
        flag = arg.split("=", 1)[0]
        if flag in known or (flag.startswith("--") and any(option.startswith(flag) for option in known)):
            continue
        return flag
    return None


def main(argv: Sequence[str] | None = None, environ: dict[str, str] | None = None,
         also_known: Collection[str] = ()) -> None:
    """``mmgate``. ``also_known``: ``MMGATE_*`` names that are no setting but draw no warning (a tool's own)."""
    args = parse_args(argv)
    environ = dict(os.environ if environ is None else environ)
    warnings = unknown_variables(environ, also_known)
    for warning in warnings:
        print(f"mmgate: warning: {warning}", file=sys.stderr)
    overrides = overrides_from_args(args)
    stub: subprocess.Popen[bytes] | None = None
    try:
        try:
            if args.command == "demo":
                stub, upstream = start_stub_backend()
                overrides.setdefault("upstream", upstream)
                overrides.setdefault("host", environ.get("MMGATE_HOST", DEMO_HOST))
                overrides.setdefault("model", environ.get("MMGATE_MODEL", "none"))  # the stub serves no real model
            settings = Settings.from_env(environ, **overrides)
            if not settings.backend.upstream and not args.print_config:  # printed as not set, every other checked
                raise ConfigError("MMGATE_UPSTREAM is not set: point it at your backend (e.g. --upstream "
                                  "http://127.0.0.1:8000), or try `mmgate demo`")
            served_model(settings)  # loaded once here (cached), so a bad MMGATE_MODEL stops now with status 2
            loop_factory(settings.listen.loop)  # MMGATE_LOOP=uvloop without uvloop stops now, before anything starts
        except ConfigError as error:
            exit_with(error)
        if args.print_config:
            *described, memory = settings.describe().split("\n")  # the worst-case memory stays the last line
            print("\n".join([*described, f"# served model: {model_in_force(settings)}", memory]))
            return
        configure_logging(settings)
        decode = settings.decode
        applied = tune_process(environ, memory_first=settings.memory.malloc_tuning,
                               decode_threads=decode.decode_workers if decode.decode_mode == "thread" else 0)
        if settings.memory.malloc_tuning:
            log.info("memory: %s",
                     " ".join(applied) if applied else "allocator settings left as the environment set them")
        on_ready = print_demo_help if stub is not None else None
        if settings.listen.processes > 1:
            try:
                listen_sock = bound(settings.listen.host, settings.listen.port, "MMGATE_PORT / --port")
                admin_sock = (bound(settings.listen.host, settings.listen.admin_port,
                                    "MMGATE_ADMIN_PORT / --admin-port") if settings.listen.admin_port else None)
            except ListenError as error:
                exit_with(error)
            status = supervise(settings, listen_sock, admin_sock,
                               partial(announce, on_ready=on_ready, warnings=warnings))
            if status:
                raise SystemExit(status)
            return
        try:
            run(serve(settings, on_ready=on_ready, warnings=warnings), settings.listen.loop)
        except (ListenError, WorkerStartError, ConfigError) as error:
            exit_with(error)
    finally:
        if stub is not None:
            stub.terminate()
            stub.wait(10)
