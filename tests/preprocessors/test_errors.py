"""The error model holds together: docs/errors.md lists exactly the registry's (status, code) pairs and every
code the README names is one of them, no
raise site makes an error but through the registry, every error answer carries the request's X-Request-Id (the
middleware's too), and a fault of mmgate's own is logged with its traceback on ``mmgate.error``, not in the
access log."""

from __future__ import annotations

import ast
import logging
import re
from pathlib import Path

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

import preprocessors.errors as errors
from preprocessors.errors import REGISTRY, MediaError, MmgateError, UpstreamError, rebuild
from proxy.app import build_admin_app
from tests.conftest import Proxy, StartProxy, Upstream

ROOT = Path(__file__).resolve().parents[2]
TREE = {name for name, value in vars(errors).items() if isinstance(value, type) and issubclass(value, MmgateError)}


def table_pairs(path: Path, header: str) -> list[tuple[int, str]]:
    """The (status, code) pairs of the table under ``header`` in ``path``: one row each, the code in backticks."""
    lines = path.read_text().splitlines()
    start = lines.index(header)
    pairs: list[tuple[int, str]] = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        status, code = (cell.strip() for cell in line.strip("|").split("|")[:2])
        match = re.fullmatch(r"`(\w+)`", code)
        assert match, f"{path.name}: a row's code is not one backticked name: {line}"
        pairs.append((int(status), match.group(1)))
    return pairs


def test_the_errors_page_lists_exactly_the_registry() -> None:
    listed = table_pairs(ROOT / "docs" / "errors.md", "| status | code | when | what to change |")
    assert len(listed) == len(set(listed)), "a pair listed twice in docs/errors.md"
    assert sorted(set(REGISTRY) - set(listed)) == [], "answered by mmgate, missing from docs/errors.md"
    assert sorted(set(listed) - set(REGISTRY)) == [], "in docs/errors.md, never answered by mmgate"
    assert listed == sorted(listed, key=lambda pair: pair[0]), "docs/errors.md's rows go by status"


def test_the_readme_names_only_codes_mmgate_answers() -> None:
    """The README's 429/503 table names pairs of the registry, every 429 among them."""
    readme = ROOT / "README.md"
    listed = table_pairs(readme, "| status | code | what it means | what to change |")
    assert {status for status, _ in listed} == {429, 503}
    assert sorted(set(listed) - set(REGISTRY)) == []
    assert {code for status, code in REGISTRY if status == 429} <= {code for _, code in listed}


def test_every_status_and_code_the_docs_name_is_answered() -> None:
    """A ``429 `queue_full` `` in the README or docs/ names a pair of the registry."""
    for page in (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))):
        named = {(int(status), code) for status, code in re.findall(r"\b([45]\d\d) `(\w+)`", page.read_text())}
        assert sorted(named - set(REGISTRY)) == [], page.name


def test_every_entry_makes_its_own_status_and_code() -> None:
    for (status, code), entry in REGISTRY.items():
        error = entry.error("why", param="messages[0]", headers={"Retry-After": "1"})
        assert isinstance(error, entry.raised_as) and (error.status, error.code) == (status, code)
        assert (error.message, error.param, error.headers) == ("why", "messages[0]", {"Retry-After": "1"})
        again = rebuild(status, code, "why")  # as it comes back from a worker process or the shared gate
        assert type(again) is entry.raised_as and again.entry is entry
        assert entry.meaning and "\n" not in entry.meaning
    assert {entry.raised_as.__name__ for entry in REGISTRY.values()} | {"MmgateError"} == TREE
    upstream = [entry.error("x") for entry in REGISTRY.values() if entry.raised_as is UpstreamError]
    assert {error.kind for error in upstream if isinstance(error, UpstreamError)} == {"connect", "timeout", "reset"}
    assert issubclass(errors.WorkerCrashed, MediaError) and not issubclass(errors.WorkerLost, MediaError)


def test_no_raise_site_makes_an_error_but_through_the_registry() -> None:
    """A class of the tree called directly (``MmgateError(400, "code", ...)``) would be a pair outside the registry."""
    found = []
    for package in ("proxy", "preprocessors"):
        for path in sorted((ROOT / package).rglob("*.py")):
            if path == ROOT / "preprocessors" / "errors.py":
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in TREE:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert found == []


def test_the_error_tree_is_drawn_whole_in_the_registry_docstring() -> None:
    drawn = set(re.findall(r"[├└]── (\w+)", errors.__doc__ or ""))
    assert drawn | {"MmgateError"} == TREE and "MmgateError(" in (errors.__doc__ or "")


async def test_the_admin_port_keeps_the_request_id_on_its_refusals(upstream: Upstream,
                                                                   start_proxy: StartProxy) -> None:
    """The middleware's answers (no route, no such method) used to go out without X-Request-Id."""
    proxy = await start_proxy(upstream.url, MMGATE_ADMIN_PORT="1")
    admin = TestServer(build_admin_app(proxy.state), host="127.0.0.1")
    await admin.start_server()
    try:
        async with aiohttp.ClientSession() as client:
            base = f"http://127.0.0.1:{admin.port}"
            async with client.get(base + "/v1/models", headers={"X-Request-Id": "admin-404"}) as response:
                assert (response.status, response.headers["X-Request-Id"]) == (404, "admin-404")
                assert (await response.json())["error"]["code"] == "path_not_allowed"
            async with client.post(base + "/mmgate/health", headers={"X-Request-Id": "admin-405"}) as response:
                assert (response.status, response.headers["X-Request-Id"]) == (405, "admin-405")
                assert (await response.json())["error"]["code"] == "invalid_request"
            async with client.get(base + "/v1/models") as response:  # none sent: one is made, as the pipeline does
                assert re.fullmatch(r"[0-9a-f]{32}", response.headers["X-Request-Id"])
    finally:
        await admin.close()


async def test_a_fault_in_an_admin_route_is_logged_apart_from_the_access_log(
    proxy: Proxy, caplog: pytest.LogCaptureFixture
) -> None:
    """A real fault in the middleware's path: the upstream client session is closed under the proxy's feet, so
    ``/mmgate/backend/metrics`` fails in a way no handler expects."""
    assert proxy.state.session is not None
    await proxy.state.session.close()
    with caplog.at_level(logging.DEBUG, logger="mmgate"):
        async with aiohttp.ClientSession() as client:
            async with client.get(proxy.url + "/mmgate/backend/metrics", headers={"X-Request-Id": "admin-fault"},
                                  ) as response:
                status, request_id, answer = response.status, response.headers["X-Request-Id"], await response.json()
    assert (status, request_id, answer["error"]["code"]) == (500, "admin-fault", "internal_error")
    assert "admin-fault" in answer["error"]["message"]
    faults = [r for r in caplog.records if r.exc_info is not None]
    assert [(r.name, r.levelno) for r in faults] == [("mmgate.error", logging.ERROR)]
    assert "admin-fault" in faults[0].getMessage()


async def test_a_fault_in_the_pipeline_is_logged_apart_from_the_access_log(
    proxy: Proxy, caplog: pytest.LogCaptureFixture
) -> None:
    assert proxy.state.session is not None
    await proxy.state.session.close()
    with caplog.at_level(logging.DEBUG, logger="mmgate"):
        async with aiohttp.ClientSession() as client:
            async with client.post(proxy.url + "/v1/chat/completions", json={"model": "m", "messages": []},
                                   headers={"X-Request-Id": "pipeline-fault"}) as response:
                assert (response.status, response.headers["X-Request-Id"]) == (500, "pipeline-fault")
    faults = [r for r in caplog.records if r.exc_info is not None]
    assert [(r.name, r.levelno) for r in faults] == [("mmgate.error", logging.ERROR)]
    assert "pipeline-fault" in faults[0].getMessage()
    assert all(r.levelno < logging.ERROR for r in caplog.records if r.name == "mmgate.access")
