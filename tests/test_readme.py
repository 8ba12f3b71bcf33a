"""The README's snippets, run the way a new user pastes them, and the snippets ``mmgate demo`` prints.

Which blocks run: every fenced ``bash`` and ``python`` block of the sections in ``RUN_SECTIONS``. The sections
in ``NOT_RUN`` are skipped on purpose, each with its reason; a block in any other section fails
``test_every_snippet_is_run_or_skipped_by_section``, so a new snippet cannot stay untested unnoticed.

Ports: the README says 8000 for the backend and 8080 for mmgate. The snippets run with those replaced by free
ports, by the textual replacements of ``port_replacements()`` and nothing cleverer; a snippet that still
names 8000 or 8080 afterwards fails, since it would talk to whatever happens to listen there.

Shell snippets run with ``bash -c``, Python snippets with this venv's python, both with the venv's ``bin``
first on PATH (what ``. .venv/bin/activate`` does) and no HTTP proxy. Of ``MMGATE_*`` variables there is only
``MMGATE_HOST=127.0.0.1``: the README's mmgate listens on every interface, nothing a test starts may.
"""

from __future__ import annotations

import ast
import asyncio
import importlib.metadata
import os
import re
import shutil
import signal
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest

from proxy.serve.demo import free_port

from .conftest import require_heavy

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
VENV_BIN = Path(sys.executable).parent
RUN_SECTIONS = ("Use it",)
NOT_RUN = {
    "Two commands": "each creates a venv and installs from the network; test_demo_snippets_work runs the "
    "demo command's `mmgate demo` part, and the test command is this suite",
    "Deploy": "docker, docker compose and kubectl need an engine or a cluster this machine does not have",
    "The served model": "installs the model extra from the network and names a model folder this machine does not "
    "have; tests/proxy/media/test_model.py runs the same settings against processor folders it builds",
}
STUB_ANSWER = "stub answer: saw 1 image(s)"  # every client snippet of "Use it" sends one image to the stub
SNIPPET_TIMEOUT = 120.0  # seconds; a bound on a hang, not a measure of speed
STOP_TIMEOUT = 30.0  # seconds for a server to exit after Ctrl-C; the demo below runs with a 60 s drain grace


@dataclass(frozen=True)
class Block:
    section: str  # the enclosing "## " heading
    lang: str
    text: str
    line: int  # 1-based line of the opening fence, for messages


@dataclass(frozen=True)
class Server:
    """A snippet that starts a server and runs until stopped: started in the background, polled until up."""

    starts_with: str  # the snippet's first command begins so
    port: str  # which port of port_replacements() it listens on: "backend" or "mmgate"
    health_path: str


SERVERS = (
    Server("python -m demo.backend ", "backend", "/health"),
    Server("mmgate ", "mmgate", "/mmgate/health"),
)


def readme_blocks() -> list[Block]:
    """Fenced blocks with a language, each with the ``## `` section it sits in (``###`` stays inside it)."""
    blocks: list[Block] = []
    section, fence, lang, body, start = "", None, "", [], 0
    for number, line in enumerate(README.read_text().splitlines(), 1):
        stripped = line.strip()
        if fence is None:
            if line.startswith("## "):
                section = line[3:].strip()
            elif stripped.startswith("```"):
                fence, lang, body, start = line[: len(line) - len(line.lstrip())], stripped[3:].strip(), [], number
        elif stripped == "```":
            if lang:
                blocks.append(Block(section, lang, "\n".join(body) + "\n", start))
            fence = None
        else:
            body.append(line.removeprefix(fence))
    assert fence is None, f"README.md: the fence opened on line {start} is never closed"
    return blocks


def port_replacements(backend: int, mmgate: int) -> dict[str, str]:
    """The README's ports as its snippets spell them -> the free ports this run uses."""
    return {
        "127.0.0.1:8000": f"127.0.0.1:{backend}",
        "127.0.0.1:8080": f"127.0.0.1:{mmgate}",
        "--port 8000": f"--port {backend}",
        "--port 8080": f"--port {mmgate}",
    }


def with_ports(text: str, replacements: dict[str, str]) -> str:
    for old, new in replacements.items():
        text = text.replace(old, new)
    left = re.findall(r".*(?<!\d)80[08]0(?!\d).*", text)
    assert not left, f"a snippet names a README port that port_replacements() does not cover: {left}"
    return text


def snippet_env(tmpdir: Path | None = None) -> dict[str, str]:
    """A new user's shell with the venv active, no proxy for 127.0.0.1, and mmgate on loopback only; ``tmpdir``
    as its temporary folder (``mktemp``, Python's ``tempfile``)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("MMGATE_") and k.lower() not in ("http_proxy", "https_proxy", "all_proxy")}
    env["MMGATE_HOST"] = "127.0.0.1"
    env["PATH"] = f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}"
    env["VIRTUAL_ENV"] = str(VENV_BIN.parent)
    env["NO_PROXY"] = env["no_proxy"] = "127.0.0.1,localhost"
    if tmpdir is not None:
        env["TMPDIR"] = str(tmpdir)
    return env


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


async def run_to_end(argv: list[str], cwd: Path, tmpdir: Path | None = None) -> tuple[int, str]:
    process = await asyncio.create_subprocess_exec(*argv, cwd=cwd, env=snippet_env(tmpdir),
                                                   stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    try:
        async with asyncio.timeout(SNIPPET_TIMEOUT):
            output, _ = await process.communicate()
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    return process.returncode or 0, output.decode(errors="replace")


async def wait_until_up(url: str, process: asyncio.subprocess.Process, log: Path) -> None:
    """Poll until ``url`` answers 200 (bounded; a server that exits or never answers fails with its log)."""
    async with aiohttp.ClientSession() as client:
        for _ in range(600):
            assert process.returncode is None, f"the server snippet exited: {log.read_text()[-2000:]}"
            try:
                async with client.get(url) as response:
                    if response.status == 200:
                        return
            except aiohttp.ClientConnectionError:
                pass
            await asyncio.sleep(0.05)
    raise AssertionError(f"{url} never answered: {log.read_text()[-2000:]}")


async def interrupt(process: asyncio.subprocess.Process) -> int:
    """Ctrl-C, as a terminal sends it: SIGINT to the snippet's whole process group; then its exit status."""
    if process.returncode is None:
        os.killpg(process.pid, signal.SIGINT)
    try:
        async with asyncio.timeout(STOP_TIMEOUT):
            return await process.wait()
    finally:
        if process.returncode is None:
            os.killpg(process.pid, signal.SIGKILL)
            await process.wait()


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
    assert servers == ["backend", "mmgate"]


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
    ports = {"backend": free_port(), "mmgate": free_port()}
    replacements = port_replacements(ports["backend"], ports["mmgate"])
    servers: list[asyncio.subprocess.Process] = []
    try:
        for number, block in enumerate(b for b in readme_blocks() if b.section in RUN_SECTIONS):
            text = with_ports(block.text, replacements)
            where = f"README.md line {block.line}"
            server = next((s for s in SERVERS if text.lstrip().startswith(s.starts_with)), None)
            if server is not None:
                log = tmp_path / f"server-{number}.log"
                with log.open("wb") as out:
                    process = await asyncio.create_subprocess_exec(
                        "bash", "-c", text, cwd=tmp_path, env=snippet_env(), stdout=out, stderr=out,
                        start_new_session=True)
                servers.append(process)
                await wait_until_up(f"http://127.0.0.1:{ports[server.port]}{server.health_path}", process, log)
                continue
            if block.lang == "python":
                script = tmp_path / f"snippet-{number}.py"
                script.write_text(text)
                status, output = await run_to_end([sys.executable, str(script)], checkout, tmpdir)
            else:
                status, output = await run_to_end(["bash", "-c", text], checkout, tmpdir)
            assert status == 0, f"{where}: exit status {status}: {output[-2000:]}"
            assert STUB_ANSWER in output, f"{where}: {output[-2000:]}"
            left = [str(p.relative_to(tmp_path)) for p in (*checkout.rglob("*"), *tmpdir.rglob("*"))]
            assert not left, f"{where}: the snippet left {left} behind"
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
    command = with_ports(command, port_replacements(free_port(), port))
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
