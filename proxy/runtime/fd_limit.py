"""The file descriptors a serving process needs, against its ``RLIMIT_NOFILE``.

Every client connection is a descriptor, and so is every upstream connection it leads to, every media URL
fetch, every decode worker's pipes, and the few a process always holds (listening sockets, the event loop,
logs). A soft limit below what ``MMGATE_MAX_CONNECTIONS`` allows makes the upstream connect fail with EMFILE
once enough clients sit idle: a fault of mmgate's own that would look like the upstream's. So at start the soft
limit is raised to what the settings need, up to the hard limit; when even the hard limit is too low, the
connection cap is lowered to what fits, with a warning that says so.
"""

from __future__ import annotations

import logging
import resource
from dataclasses import dataclass, replace

from proxy.settings import ConfigError, Settings
from proxy.settings.sections import PROBE_RESERVE

log = logging.getLogger("mmgate")

# Descriptors a serving process holds whatever its traffic: the listening sockets, the event loop's, the
# standard streams, logs, the upstream readiness probe, the shared gate's link.
BASE_FDS = 64
# Per decode worker process: its pipes and the process handle.
FDS_PER_WORKER_PROCESS = 4


@dataclass(frozen=True, slots=True)
class FdPlan:
    """What to do about the limit: the soft limit to set (None: leave it), the connection cap to serve with,
    and what the needs were."""

    soft: int | None
    max_connections: int
    needed: int


def _fixed_fds(settings: Settings) -> int:
    """Descriptors that do not grow with the connection cap."""
    workers = settings.decode.decode_workers if settings.decode.decode_mode == "process" else 0
    fetch = settings.fetch.fetch_max_connections if settings.fetch.media_urls == "fetch" else 0
    return BASE_FDS + PROBE_RESERVE + fetch + FDS_PER_WORKER_PROCESS * workers


def fds_needed(settings: Settings, max_connections: int) -> int:
    """Descriptors a process serving ``max_connections`` clients may hold at once: each client connection, the
    upstream connection each may have open (at most MMGATE_UPSTREAM_MAX_CONNECTIONS) and the fixed ones."""
    upstream = min(settings.backend.upstream_max_connections, max_connections + PROBE_RESERVE)
    return max_connections + upstream + _fixed_fds(settings)


def connections_within(settings: Settings, limit: int) -> int:
    """The largest connection cap whose ``fds_needed`` fits in ``limit`` (0 when none does)."""
    room = limit - _fixed_fds(settings)
    upstream = settings.backend.upstream_max_connections
    # Past the upstream pool's size each client connection costs one descriptor; below it, two.
    if room - upstream >= upstream - PROBE_RESERVE:
        return room - upstream
    return max(0, (room - PROBE_RESERVE) // 2)


def plan_fd_limit(settings: Settings, soft: int, hard: int) -> FdPlan:
    """What the limits (``hard`` may be ``resource.RLIM_INFINITY``) call for: the soft limit raised to what the
    settings need when it is lower, up to ``hard``; the connection cap lowered to what ``hard`` allows when
    that is too low."""
    cap = settings.listen.max_connections
    needed = fds_needed(settings, cap)
    unlimited = hard == resource.RLIM_INFINITY
    if not unlimited and hard < needed:
        cap = connections_within(settings, hard)
    target = needed if unlimited else min(needed, hard)
    return FdPlan(soft=target if soft != resource.RLIM_INFINITY and soft < target else None,
                  max_connections=cap, needed=needed)


def fit_fd_limit(settings: Settings) -> Settings:
    """Apply ``plan_fd_limit`` to this process: the soft limit raised, or ``settings`` with a lower connection
    cap (logged, naming the limit). ConfigError when the limit leaves room for no connection at all."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    ceiling, plan = hard, plan_fd_limit(settings, soft, hard)
    if plan.soft is not None:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (plan.soft, hard))
            log.info("file descriptors: soft limit raised from %d to %d for MMGATE_MAX_CONNECTIONS=%d", soft,
                     plan.soft, settings.listen.max_connections)
        except (OSError, ValueError) as exc:  # e.g. above the kernel's nr_open: serve within the soft limit
            log.warning("file descriptors: the soft limit %d could not be raised to %d (%s)", soft, plan.soft, exc)
            ceiling, plan = soft, plan_fd_limit(settings, soft, soft)
    wanted = settings.listen.max_connections
    if plan.max_connections < 1:
        raise ConfigError(f"the file descriptor limit (RLIMIT_NOFILE {ceiling}) leaves no room for a client "
                          f"connection: mmgate needs {fds_needed(settings, 1)} at the least; raise it (ulimit -n)")
    if plan.max_connections < wanted:
        log.warning("file descriptors: the limit (RLIMIT_NOFILE %d) is below the %d that MMGATE_MAX_CONNECTIONS=%d "
                    "needs (client and upstream connections, headroom): MMGATE_MAX_CONNECTIONS lowered to %d; "
                    "raise the hard limit (ulimit -Hn, docker --ulimit nofile=) to keep %d",
                    ceiling, plan.needed, wanted, plan.max_connections, wanted)
        return replace(settings, listen=replace(settings.listen, max_connections=plan.max_connections))
    return settings
