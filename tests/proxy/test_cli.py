"""The command line: config errors and warnings, --print-config, listen errors, and how a real mmgate process
stops: SIGTERM drains (Kubernetes), SIGINT (Ctrl-C) stops an idle server at once."""

from __future__ import annotations

import asyncio
import re
import signal
import socket
import subprocess
import sys
from functools import partial
from pathlib import Path

import aiohttp
import pytest

from proxy.cli import main
from proxy.runtime.memory import tune_allocators
from proxy.serve.demo import free_port
from proxy.serve.server import where_note
from proxy.settings import SPEC
from testkit.environment import mmgate_env
from tests.conftest import Upstream

# ``MMGATE_*`` variables the project reads outside Settings (tests, benchmarks, the real-vLLM suite). They are
# not settings of the proxy, but they are not typos either: the unknown-variable warning leaves them alone when
# given this list (``main(also_known=...)``). Add a name here when a test or benchmark starts reading a new one.
TOOLING_VARIABLES: frozenset[str] = frozenset({
    "MMGATE_E2E",  # tests/e2e: run the real-vLLM suite
    "MMGATE_E2E_DIR",
    "MMGATE_E2E_PYTHON",
    "MMGATE_E2E_SETUP_TIMEOUT",
    "MMGATE_E2E_VLLM_START_TIMEOUT",
    "MMGATE_E2E_VLLM_URL",
    "MMGATE_FUZZ_SAVE",  # testkit/fuzzing/corpus.py: save a failing example to the corpus
    "MMGATE_FUZZ_SEED",  # testkit/fuzzing/corpus.py: the hypothesis seed
    "MMGATE_REQUIRE_HEAVY",  # CI: a skipped heavy test fails instead
    "MMGATE_UPDATE_SCREENSHOT",  # tests/proxy/admin/test_dashboard.py: rewrite docs/dashboard.png
})


@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({"MMGATE_MAX_QUEUE": "lots"}, "MMGATE_MAX_QUEUE='lots'"),
        ({"MMGATE_QUEUE_TIMEOUT": "-1"}, "MMGATE_QUEUE_TIMEOUT='-1'"),
        ({"MMGATE_RELEASE_AT": "never"}, "one of auto, sent, headers, complete"),
        ({"MMGATE_UPSTREAM": "ftp://x"}, "MMGATE_UPSTREAM='ftp://x'"),
        ({"MMGATE_DECODE_WORKERS": "0"}, "benchmark baseline"),
        ({"MMGATE_PORT": "70000"}, "from 0 to 65535"),
        ({"MMGATE_TRUST_FLOW_HEADERS_FROM": "the-gateway"}, "comma-separated addresses or CIDR networks"),
        ({"MMGATE_FAIRNESS_HEADER": "x-tenant,bad name"}, "comma-separated HTTP header names"),
    ],
)
def test_bad_value_exits_2_with_one_line(env: dict[str, str], named: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--print-config"], environ={"MMGATE_UPSTREAM": "http://127.0.0.1:1", **env})
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and named in err


def test_missing_upstream_suggests_demo(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main([], environ={})
    assert exited.value.code == 2
    assert "mmgate demo" in capsys.readouterr().err


def test_demo_without_its_extra_says_what_to_install(monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """numpy comes only with the demo extra: without it, ``mmgate demo`` names the extra in one line."""
    monkeypatch.setitem(sys.modules, "numpy", None)  # find_spec() then answers None, as when it is not installed
    with pytest.raises(SystemExit) as exited:
        main(["demo"], environ={})
    assert exited.value.code == 2
    assert capsys.readouterr().err == "mmgate: mmgate demo needs the demo extra: pip install -e '.[demo]'\n"


def test_print_config_runs_without_an_upstream_and_checks_everything_else(capsys: pytest.CaptureFixture[str]) -> None:
    """The defaults can be looked at before there is a backend; the upstream shows as not set."""
    main(["--print-config"], environ={})
    out, err = capsys.readouterr()
    assert err == "" and out.startswith("# Backend\nMMGATE_UPSTREAM=  # not set: required to serve\n")
    assert out.splitlines()[-1].startswith("# worst-case payload memory: ")
    with pytest.raises(SystemExit) as exited:
        main(["--print-config", "--max-queue", "lots"], environ={})
    assert exited.value.code == 2
    assert capsys.readouterr().err == ("mmgate: --max-queue='lots' is not allowed: expected an integer from 0 to "
                                       "1000000\n")


def test_an_upstream_ending_in_v1_stops_start_up_with_the_url_to_use(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--upstream", "http://127.0.0.1:8000/v1"], environ={})
    assert exited.value.code == 2
    assert capsys.readouterr().err == (
        "mmgate: --upstream='http://127.0.0.1:8000/v1' is not allowed: expected the backend's base URL without /v1 "
        "(clients send /v1/... paths and mmgate forwards them as they come): http://127.0.0.1:8000\n")


def test_help_groups_the_flags_by_section_with_the_values_of_each_choice(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--help"], environ={})
    assert exited.value.code == 0
    options = capsys.readouterr().out.split("\n\n", 1)[1]  # past the usage line, which lists every flag too
    assert options.index("\nBackend:\n") < options.index("\n  --upstream V") < options.index("\nListen:\n")
    assert (options.index("\nGate:\n") < options.index("\n  --release-at {auto,sent,headers,complete}")
            < options.index("\nTimeouts:\n"))


@pytest.mark.parametrize(
    ("argv", "env", "named"),
    [
        (["--max-queue", "x"], {}, "--max-queue='x' is not allowed: expected an integer from 0 to 1000000"),
        ([], {"MMGATE_MAX_QUEUE": "x"}, "MMGATE_MAX_QUEUE='x' is not allowed: expected an integer from 0 to 1000000"),
        (["--max-queue", "x"], {"MMGATE_MAX_QUEUE": "3"}, "--max-queue='x' is not allowed"),
        (["--decode-workers", "0"], {}, "--decode-workers='0' is not allowed"),
        ([], {"MMGATE_DECODE_WORKERS": "0"}, "MMGATE_DECODE_WORKERS='0' is not allowed"),
    ],
    ids=["flag", "variable", "flag-over-variable", "decode-workers-flag", "decode-workers-variable"],
)
def test_a_bad_value_is_named_as_it_was_given(argv: list[str], env: dict[str, str], named: str,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    """A flag's error names the flag, a variable's the variable: what the user has to go and change."""
    with pytest.raises(SystemExit) as exited:
        main(["--print-config", *argv], environ={"MMGATE_UPSTREAM": "http://127.0.0.1:1", **env})
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"mmgate: {named}")


def test_unknown_variables_warn_with_the_closest_name(capsys: pytest.CaptureFixture[str]) -> None:
    main(["--print-config"], environ={"MMGATE_UPSTREAM": "http://127.0.0.1:1", "MMGATE_MAX_QUEU": "3",
                                      "MMGATE_SOMETHING_ELSE": "1", "MMGATE_E2E": "1", "MMGATE_REQUIRE_HEAVY": "1",
                                      "OTHER_MAX_QUEU": "3"}, also_known=TOOLING_VARIABLES)
    out, err = capsys.readouterr()
    assert err.splitlines() == [
        "mmgate: warning: unknown variable MMGATE_MAX_QUEU (did you mean MMGATE_MAX_QUEUE?)",
        "mmgate: warning: unknown variable MMGATE_SOMETHING_ELSE",
    ]
    assert "MMGATE_MAX_QUEUE=64" in out  # only a warning: start-up goes on, the misspelt value changed nothing


def test_the_cache_setting_is_known_printed_and_counted_in_the_bound(capsys: pytest.CaptureFixture[str]) -> None:
    main(["--print-config"], environ={"MMGATE_UPSTREAM": "http://127.0.0.1:1", "MMGATE_CACHE_MB": "100"})
    out, err = capsys.readouterr()
    assert "unknown variable" not in err
    assert "MMGATE_CACHE_MB=100" in out and "+ cache 100 MiB" in out


def test_every_mmgate_variable_in_the_repository_is_known() -> None:
    """Each MMGATE_ name the project spells is a setting or one of TOOLING_VARIABLES, so none draws the warning."""
    repo = Path(__file__).resolve().parents[2]
    known = {"MMGATE_" + name.upper() for name in SPEC} | TOOLING_VARIABLES
    placeholders = {"MMGATE_X"}  # "MMGATE_X=value" in docstrings
    unknown: dict[str, str] = {}
    results = repo / "bench" / "results"  # records of past runs: the environment they ran with, names since gone
    for top in ("proxy", "preprocessors", "demo", "testkit", "tests", "bench", "deploy", "docs", ".ci", "README.md",
                "pyproject.toml"):
        root = repo / top
        for path in [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file()):
            if path == Path(__file__).resolve() or "__pycache__" in path.parts or results in path.parents:
                continue  # this file spells unknown names on purpose
            try:
                text = path.read_text()
            except (UnicodeDecodeError, OSError):
                continue
            for name in re.findall(r"\bMMGATE_[A-Z0-9_]*[A-Z0-9]\b", text):
                if name not in known and name not in placeholders:
                    unknown.setdefault(name, str(path.relative_to(repo)))
    assert not unknown, f"add these to TOOLING_VARIABLES above (or to Settings): {unknown}"


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["--max-mm-concurency", "2"], "unknown flag --max-mm-concurency (did you mean --max-mm-concurrency?)"),
        (["demo", "--uptream=http://127.0.0.1:1"], "unknown flag --uptream (did you mean --upstream?)"),
        (["--print-confg"], "unknown flag --print-confg (did you mean --print-config?)"),
        (["--zzzzzzzz"], "unknown flag --zzzzzzzz (mmgate --help lists every flag)"),
    ],
)
def test_a_misspelt_flag_names_the_closest_real_flag(argv: list[str], said: str) -> None:
    """As a misspelt variable does: the real process, one line, status 2, nothing started."""
    result = subprocess.run([sys.executable, "-m", "proxy", *argv], check=False, capture_output=True, timeout=60,
                            env=_env(MMGATE_UPSTREAM="http://127.0.0.1:1", MMGATE_PORT=str(free_port())))
    assert result.returncode == 2
    assert result.stderr.decode() == f"mmgate: {said}\n"
    assert result.stdout == b""


@pytest.mark.parametrize("argv", [["--max-queue", "-1"], ["--max-q", "3"], ["--max-queue=4"], ["--", "serve"]])
def test_flags_abbreviations_and_negative_values_are_not_taken_for_misspellings(argv: list[str]) -> None:
    """Only a flag the parser does not know is refused: a negative value reaches the setting's own check."""
    result = subprocess.run([sys.executable, "-m", "proxy", "--print-config", *argv], check=False,
                            capture_output=True, timeout=60, env=_env(MMGATE_UPSTREAM="http://127.0.0.1:1"))
    assert "unknown flag" not in result.stderr.decode()


def test_the_default_listen_address_is_spelt_out() -> None:
    assert "all interfaces" in where_note("0.0.0.0") and "MMGATE_HOST=127.0.0.1" in where_note("0.0.0.0")
    assert where_note("127.0.0.1") == ""


@pytest.mark.parametrize("taken", ["port", "admin_port"])
def test_a_port_in_use_is_one_line_and_status_2(taken: str) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        busy = holder.getsockname()[1]
        ports = {name: str(busy if name == taken else free_port()) for name in ("port", "admin_port")}
        result = subprocess.run(
            [sys.executable, "-m", "proxy"], check=False, capture_output=True, timeout=60,
            env=_env(MMGATE_UPSTREAM="http://127.0.0.1:1", MMGATE_PORT=ports["port"],
                     MMGATE_ADMIN_PORT=ports["admin_port"]))
    err = result.stderr.decode()
    setting = {"port": "MMGATE_PORT / --port", "admin_port": "MMGATE_ADMIN_PORT / --admin-port"}[taken]
    assert result.returncode == 2, err
    assert "Traceback" not in err
    assert err.splitlines()[-1] == f"mmgate: cannot listen on 127.0.0.1:{busy}: address already in use ({setting})"


def test_flags_win_over_env_and_print_config(capsys: pytest.CaptureFixture[str]) -> None:
    main(["--print-config", "--max-queue", "5"], environ={"MMGATE_UPSTREAM": "http://h:1", "MMGATE_MAX_QUEUE": "9"})
    out = capsys.readouterr().out
    assert "MMGATE_MAX_QUEUE=5" in out and "MMGATE_UPSTREAM=http://h:1" in out
    assert "worst-case payload memory" in out


def _env(**settings: str) -> dict[str, str]:
    """This process's environment without its MMGATE_* (a developer's own would change what is tested), but
    for MMGATE_DECODE_MODE, with which CI runs the whole suite once per mode, MMGATE_PROCESSES, with which CI
    runs these tests again on several front processes, and MMGATE_LOOP, the event loop of the pass."""
    return mmgate_env(MMGATE_HOST="127.0.0.1", **settings)


async def _start_mmgate(env: dict[str, str]) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(sys.executable, "-m", "proxy", env=env,
                                                stderr=asyncio.subprocess.PIPE)


async def _stopped(process: asyncio.subprocess.Process, within: float = 30) -> tuple[int | None, str]:
    """Exit status and stderr; a process still running after ``within`` seconds fails the test (and is killed)."""
    try:
        async with asyncio.timeout(within):
            _, stderr = await process.communicate()
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    return process.returncode, stderr.decode()


async def _wait_listening(url: str, process: asyncio.subprocess.Process) -> None:
    """Poll the liveness endpoint until the new process answers (bounded; it is a readiness poll)."""
    async with aiohttp.ClientSession() as client:
        for _ in range(200):
            assert process.returncode is None, "mmgate exited during start-up"
            try:
                async with client.get(url + "/mmgate/health") as response:
                    if response.status == 200:
                        return
            except aiohttp.ClientConnectionError:
                await asyncio.sleep(0.05)
    raise AssertionError("mmgate did not start")


async def _stream_then_signal(client: aiohttp.ClientSession, url: str, process: asyncio.subprocess.Process,
                              signum: signal.Signals) -> aiohttp.ClientResponse:
    """Open a stream the upstream holds, send ``signum``, and wait (bounded) until readiness fails; the stream,
    still open, is returned."""
    streaming = await client.post(url + "/v1/chat/completions", data=b'{"stream": true}')
    assert await streaming.content.readuntil(b"\n\n") == b"data: first\n\n"
    process.send_signal(signum)
    for _ in range(200):
        async with client.get(url + "/mmgate/ready") as ready:
            if ready.status == 503:
                break
    assert ready.status == 503
    return streaming


async def test_sigterm_drains_in_flight_streams(upstream: Upstream) -> None:
    upstream.route("/v1/chat/completions", partial(upstream.held_stream, last=b"data: last\n\n"))
    port = free_port()
    process = await _start_mmgate(_env(MMGATE_UPSTREAM=upstream.url, MMGATE_PORT=str(port),
                                       MMGATE_DRAIN_GRACE="0", MMGATE_DRAIN_TIMEOUT="30"))
    url = f"http://127.0.0.1:{port}"
    try:
        await _wait_listening(url, process)
        async with aiohttp.ClientSession() as client:
            streaming = await _stream_then_signal(client, url, process, signal.SIGTERM)
            # New requests are refused, while the stream in flight goes on.
            async with client.get(url + "/v1/models") as refused:
                assert refused.status == 503
                assert (await refused.json())["error"]["code"] == "draining"
                assert refused.headers["Retry-After"]
            assert process.returncode is None
            upstream.release.set()
            assert await streaming.content.read() == b"data: last\n\n"
    finally:
        status, _ = await _stopped(process)
    assert status == 0


async def test_sigint_on_an_idle_server_stops_at_once(upstream: Upstream) -> None:
    """Ctrl-C with nothing in flight: no MMGATE_DRAIN_GRACE (60 s here, longer than the test waits)."""
    port = free_port()
    process = await _start_mmgate(_env(MMGATE_UPSTREAM=upstream.url, MMGATE_PORT=str(port),
                                       MMGATE_DRAIN_GRACE="60", MMGATE_DRAIN_TIMEOUT="60"))
    try:
        await _wait_listening(f"http://127.0.0.1:{port}", process)
        process.send_signal(signal.SIGINT)
    finally:
        status, stderr = await _stopped(process, within=30)
    assert status == 0 and "mmgate stopped" in stderr, stderr
    assert f"listening on http://127.0.0.1:{port} -> {upstream.url}" in stderr  # no "all interfaces" note here


async def test_sigint_lets_requests_in_flight_finish(upstream: Upstream) -> None:
    """Ctrl-C with a stream in flight: readiness fails, the stream ends normally, then mmgate stops (before
    the 60 s grace: the grace lasts only while requests are in flight)."""
    upstream.route("/v1/chat/completions", partial(upstream.held_stream, last=b"data: last\n\n"))
    port = free_port()
    process = await _start_mmgate(_env(MMGATE_UPSTREAM=upstream.url, MMGATE_PORT=str(port),
                                       MMGATE_DRAIN_GRACE="60", MMGATE_DRAIN_TIMEOUT="60"))
    url = f"http://127.0.0.1:{port}"
    try:
        await _wait_listening(url, process)
        async with aiohttp.ClientSession() as client:
            streaming = await _stream_then_signal(client, url, process, signal.SIGINT)
            assert process.returncode is None
            upstream.release.set()
            assert await streaming.content.read() == b"data: last\n\n"
    finally:
        status, stderr = await _stopped(process, within=30)
    assert status == 0 and "mmgate stopped" in stderr, stderr


def test_allocator_tuning_respects_the_operators_own_settings() -> None:
    from PIL import Image

    before = Image.core.get_blocks_max()
    try:
        Image.core.set_blocks_max(5)
        assert tune_allocators({"MALLOC_MMAP_THRESHOLD_": "65536", "PILLOW_BLOCKS_MAX": "5"}) == [
            "MALLOC_TRIM_THRESHOLD_=1048576"]
        assert Image.core.get_blocks_max() == 5  # left as the operator set it
        assert tune_allocators({}, kept_blocks=4) == ["MALLOC_MMAP_THRESHOLD_=1048576",
                                                      "MALLOC_TRIM_THRESHOLD_=1048576", "PILLOW_BLOCKS_MAX=4"]
        assert Image.core.get_blocks_max() == 4
    finally:
        Image.core.set_blocks_max(before)


@pytest.mark.parametrize(("extra", "expected"), [
    ({"MMGATE_DECODE_MODE": "thread", "MMGATE_DECODE_WORKERS": "3"},
     "memory: MALLOC_MMAP_THRESHOLD_=1048576 MALLOC_TRIM_THRESHOLD_=1048576 PILLOW_BLOCKS_MAX=6"),
    ({"MMGATE_DECODE_MODE": "process"},  # no decode thread frees images here
     "memory: MALLOC_MMAP_THRESHOLD_=1048576 MALLOC_TRIM_THRESHOLD_=1048576 PILLOW_BLOCKS_MAX=0"),
    ({"MMGATE_MALLOC_TUNING": "off"}, None),
], ids=["thread", "process", "off"])
async def test_serve_tunes_allocators_at_start(upstream: Upstream, extra: dict[str, str], expected: str | None) -> None:
    port = free_port()
    env = {k: v for k, v in _env().items() if not k.startswith(("MALLOC_", "PILLOW_"))}
    env |= {"MMGATE_UPSTREAM": upstream.url, "MMGATE_PORT": str(port),
            "MMGATE_DRAIN_GRACE": "0", "MMGATE_DRAIN_TIMEOUT": "1", **extra}
    process = await _start_mmgate(env)
    try:
        await _wait_listening(f"http://127.0.0.1:{port}", process)
        process.send_signal(signal.SIGTERM)
    finally:
        _, stderr = await _stopped(process)
    lines = [line for line in stderr.splitlines() if "memory:" in line]
    assert [line[line.index("memory: "):] for line in lines] == ([expected] if expected else [])


async def test_serve_caps_connections_answers_probes_over_the_cap_and_times_out_slow_heads(
    upstream: Upstream,
) -> None:
    """`mmgate serve` listens through the same guard the test fixtures use, not a plain TCPSite. One front
    process: with several, the kernel spreads the connections over fronts that each hold a share of the cap."""
    port = free_port()
    process = await _start_mmgate(_env(MMGATE_UPSTREAM=upstream.url, MMGATE_PORT=str(port), MMGATE_PROCESSES="1",
                                       MMGATE_HEADER_TIMEOUT="3", MMGATE_MAX_CONNECTIONS="1"))
    try:
        await _wait_listening(f"http://127.0.0.1:{port}", process)
        for _ in range(100):  # until the health probe's connection is gone and this one holds the only place
            slow_reader, slow_writer = await asyncio.open_connection("127.0.0.1", port)
            slow_writer.write(b"GET /v1/models HTTP/1.1\r\nHost: mmgate\r\n")  # a head that never ends
            try:
                early = await asyncio.wait_for(slow_reader.read(), 1.0)  # a refusal comes at once, a 408 later
            except TimeoutError:
                break
            assert early.startswith(b"HTTP/1.1 503"), early
            slow_writer.close()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /v1/models HTTP/1.1\r\nHost: mmgate\r\n\r\n")  # the only place is busy
        refused = await reader.read()
        writer.close()
        assert refused.startswith(b"HTTP/1.1 503") and b"too_many_connections" in refused
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /mmgate/health HTTP/1.1\r\nHost: mmgate\r\n\r\n")  # liveness still answers
        alive = await reader.read()
        writer.close()
        assert alive.startswith(b"HTTP/1.1 200") and b'"status":"ok"' in alive.replace(b" ", b"")
        timed_out = await slow_reader.read()
        assert timed_out.startswith(b"HTTP/1.1 408") and b"header_timeout" in timed_out
        slow_writer.close()
        process.send_signal(signal.SIGINT)
    finally:
        status, _ = await _stopped(process)
    assert status == 0
