"""The README's snippets, run the way a new user pastes them, and the snippets ``mmgate demo`` prints.

Which blocks run: every fenced ``bash`` and ``python`` block of the sections in ``RUN_SECTIONS``. The sections
in ``NOT_RUN`` are skipped on purpose, each with its reason; a block in any other section fails
``test_every_snippet_is_run_or_skipped_by_section``, so a new snippet cannot stay untested unnoticed. How a
snippet runs (its ports, its shell, its environment): ``testkit.snippets``.
"""

from __future__ import annotations

import ast
import asyncio
import importlib.metadata
import re
import shutil
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest

from proxy.serve.demo import free_port
from testkit.snippets import (
    SNIPPET_TIMEOUT,
    Block,
    fenced_blocks,
    interrupt,
    port_replacements,
    run_block,
    run_to_end,
    snippet_env,
    start_server,
    wait_until_up,
    with_ports,
)

from .conftest import require_heavy

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
RUN_SECTIONS = ("Use it",)
NOT_RUN = {
    "Two commands": "each creates a venv and installs from the network; test_demo_snippets_work runs the "
    "demo command's `mmgate demo` part, and the test command is this suite",
}
STUB_ANSWER = "stub answer: saw 1 image(s)"  # every client snippet of "Use it" sends one image to the stub


@dataclass(frozen=True)
class Server:
    """A snippet that starts a server and runs until stopped: started in the background, polled until up."""

    starts_with: str  # the snippet's first command begins so
    port: int  # the docs' port it listens on
    health_path: str


SERVERS = (
    Server("python -m demo.backend ", 8000, "/health"),
    Server("mmgate ", 8080, "/mmgate/health"),
)


def readme_blocks() -> list[Block]:
    return fenced_blocks(README)


def installed_by(extra: str) -> set[str]:
    """Normalised names of the distributions ``pip install -e '.[extra]'`` installs directly."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    requirements = project["dependencies"] + project["optional-dependencies"][extra]
    return {_normalise(re.match(r"[A-Za-z0-9_.-]+", r).group()) for r in requirements}  # type: ignore[union-attr]


def _normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def assert_imports_installed_by(code: str, extra: str) -> None:
    """Every module the snippet imports is the standard library's or comes with ``.[extra]``."""
    provided = importlib.metadata.packages_distributions()
    wanted = installed_by(extra)
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            modules = [node.module]
        else:
            continue
        for module in (m.split(".")[0] for m in modules):
            if module in sys.stdlib_module_names:
                continue
            dists = {_normalise(d) for d in provided.get(module, [])}
            assert dists & wanted, f"the snippet imports {module}, which pip install -e '.[{extra}]' does not install"


def heredoc_python(snippet: str) -> str | None:
    """The Python of a ``python - <<'EOF' ... EOF`` shell snippet, if it is one."""
    match = re.search(r"python3? - <<'EOF'\n(.*?)^EOF$", snippet, re.DOTALL | re.MULTILINE)
    return match.group(1) if match else None


def require_curl() -> None:
    if shutil.which("curl") is None:
        if require_heavy():
            pytest.fail("curl is missing and MMGATE_REQUIRE_HEAVY=1")
        pytest.skip("the README's shell snippets use curl, which is not installed")


# ----------------------------------------------------------------------------------------------------------


def test_every_snippet_is_run_or_skipped_by_section() -> None:
    blocks = readme_blocks()
    assert {b.section for b in blocks} <= {*RUN_SECTIONS, *NOT_RUN}, [
        (b.section, b.line) for b in blocks if b.section not in (*RUN_SECTIONS, *NOT_RUN)]
    assert all(b.lang in ("bash", "python") for b in blocks), "only bash and python blocks can be run here"
    assert any(b.section in RUN_SECTIONS for b in blocks)


def test_use_it_starts_a_backend_before_mmgate() -> None:
    """A first try needs something behind mmgate: the README starts the stub before ``mmgate --upstream``."""
    firsts = [b.text.lstrip().splitlines()[0] for b in readme_blocks() if b.section in RUN_SECTIONS]
    servers = [s.port for first in firsts for s in SERVERS if first.startswith(s.starts_with)]
    assert servers == [8000, 8080]


def test_use_it_gives_the_upstream_without_v1() -> None:
    """An SDK's base URL ends in /v1; mmgate's upstream must not (clients send /v1/... paths as they are), and
    the README says so where it starts mmgate."""
    use_it = README.read_text().split("## Use it")[1].split("\n## ")[0]
    assert "without `/v1`" in use_it
    upstreams = re.findall(r"(?:--upstream[ =]|MMGATE_UPSTREAM=)(\S+)", README.read_text())
    assert upstreams and all(not url.rstrip("/").endswith("/v1") for url in upstreams), upstreams


def test_use_it_python_needs_only_the_demo_extra() -> None:
    python_blocks = [b for b in readme_blocks() if b.section in RUN_SECTIONS and b.lang == "python"]
    assert python_blocks
    for block in python_blocks:
        assert_imports_installed_by(block.text, "demo")


async def test_use_it_snippets_work(tmp_path: Path) -> None:
    """Stub, mmgate, then every client snippet in README order; each answers with what the stub saw, and leaves
    nothing behind: not in the folder it runs in (a user's checkout), not in the temporary folder."""
    require_curl()
    checkout, tmpdir = tmp_path / "checkout", tmp_path / "tmp"
    checkout.mkdir()
    tmpdir.mkdir()
    ports = {server.port: free_port() for server in SERVERS}
    replacements = port_replacements(ports)
    servers: list[asyncio.subprocess.Process] = []
    try:
        for number, block in enumerate(b for b in readme_blocks() if b.section in RUN_SECTIONS):
            text = with_ports(block.text, replacements)
            server = next((s for s in SERVERS if text.lstrip().startswith(s.starts_with)), None)
            if server is not None:
                log = tmp_path / f"server-{number}.log"
                process = await start_server(text, tmp_path, log)
                servers.append(process)
                await wait_until_up(f"http://127.0.0.1:{ports[server.port]}{server.health_path}", process, log)
                continue
            status, output = await run_block(block, text, checkout, tmpdir)
            assert status == 0, f"{block.where}: exit status {status}: {output[-2000:]}"
            assert STUB_ANSWER in output, f"{block.where}: {output[-2000:]}"
            left = [str(p.relative_to(tmp_path)) for p in (*checkout.rglob("*"), *tmpdir.rglob("*"))]
            assert not left, f"{block.where}: the snippet left {left} behind"
        assert len(servers) == len(SERVERS)
    finally:
        statuses = [await interrupt(process) for process in reversed(servers)]
    assert statuses == [0] * len(servers), "Ctrl-C stops the stub and mmgate with status 0"


async def test_demo_snippets_work(tmp_path: Path) -> None:
    """The README's demo command (its ``mmgate demo`` part), then every line the demo prints, pasted."""
    require_curl()
    (demo,) = [b.text for b in readme_blocks() if b.section == "Two commands" and "mmgate demo" in b.text]
    assert "pip install -e '.[demo]'" in demo, "the demo command installs the extra its snippets need"
    command = demo.strip().split(" && ")[-1]
    assert command.startswith("mmgate demo ")
    port = free_port()
    command = with_ports(command, port_replacements({8080: port}))
    log = tmp_path / "demo.log"
    env = snippet_env() | {"MMGATE_DRAIN_GRACE": "60"}  # Ctrl-C below must not wait for it: nothing is in flight
    with log.open("wb") as err:
        process = await asyncio.create_subprocess_exec(
            "bash", "-c", command, cwd=tmp_path, env=env, stdout=asyncio.subprocess.PIPE, stderr=err,
            start_new_session=True)
    try:
        assert process.stdout is not None
        printed = []
        async with asyncio.timeout(SNIPPET_TIMEOUT):
            while not printed or "Ctrl-C to stop" not in printed[-1]:
                line = await process.stdout.readline()
                assert line, f"mmgate demo ended before printing its help: {log.read_text()[-2000:]}"
                printed.append(line.decode())
        paragraphs = [p for p in "".join(printed).split("\n\n") if p.strip()]
        snippets = [p for p in paragraphs if p.lstrip().startswith(("curl", "python", "#"))]
        assert len(snippets) == 2, paragraphs
        images_seen = []
        for snippet in snippets:
            code = heredoc_python(snippet)
            if code is not None:
                assert_imports_installed_by(code, "demo")
            status, output = await run_to_end(["bash", "-c", snippet + "\n"], tmp_path)
            assert status == 0, f"{snippet}\nexit status {status}: {output[-2000:]}"
            seen = re.search(r"stub answer: saw (\d+) image\(s\) \[([^\]]*)\]", output)
            assert seen, f"{snippet}\n{output[-2000:]}"
            images_seen.append(seen.groups())
        # one snippet sends text, one an image made on the fly that arrives at the stub decoded
        assert images_seen == [("0", ""), ("1", "640x480")], images_seen
        urls = re.findall(r"http://\S+", paragraphs[-1])
        assert len(urls) == 2 and all(f"127.0.0.1:{port}/" in url for url in urls), paragraphs[-1]
        async with aiohttp.ClientSession() as client:
            for url in urls:
                async with client.get(url) as response:
                    assert response.status == 200, url
    finally:
        status = await interrupt(process)
    assert status == 0 and "mmgate stopped" in log.read_text(), log.read_text()[-2000:]


def test_the_docs_name_the_decode_pool_as_it_is() -> None:
    """The default pool is worker processes from 2 usable CPUs (threads only on one): no text a user reads may
    call it a thread pool, but where it quotes another project's fix."""
    from proxy.settings import default_decode_mode

    assert [default_decode_mode(1), default_decode_mode(2), default_decode_mode(16)] == ["thread", "process", "process"]
    files = [README, *sorted((REPO / "docs").rglob("*.md")), *sorted((REPO / "deploy").rglob("*")),
             *sorted((REPO / "proxy").rglob("*.py")), *sorted((REPO / "preprocessors").rglob("*.py"))]
    said = [f"{path.relative_to(REPO)}:{number}: {line.strip()}"
            for path in files if path.is_file()
            for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
            if re.search(r"thread[- ]pool", line, re.IGNORECASE) and "Fix there:" not in line]
    assert not said, "\n".join(said)
    intro = README.read_text().split("## Two commands")[0]
    assert "worker processes" in intro and "threads on one CPU" in intro
