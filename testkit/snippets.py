"""The fenced code blocks of a Markdown file, and running them the way a new user pastes them.

``fenced_blocks(path)`` returns every fenced block with a language, each with the ``## `` section it sits in
(a ``###`` stays inside its ``##``). tests/test_readme.py runs the README's blocks and tests/test_docs.py those
of docs/*.md, each by section: a block of a section that is neither run nor skipped with a stated reason fails
them, so a new snippet cannot stay untested unnoticed.

Ports: the docs say 8000 for the backend and 8080 for mmgate (and a few other fixed ports where a snippet
starts a second server). A snippet runs with those replaced by free ports, by the textual replacements of
``port_replacements`` and nothing cleverer; one that still names a docs port afterwards fails, since it would
talk to whatever happens to listen there.

Shell snippets run with ``bash -c``, Python snippets with this interpreter, both with its ``bin`` first on PATH
(what ``. .venv/bin/activate`` does) and no HTTP proxy. Of ``MMGATE_*`` variables there is only
``MMGATE_HOST=127.0.0.1``: the docs' mmgate listens on every interface, nothing a test starts may.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from testkit.environment import mmgate_env

VENV_BIN = Path(sys.executable).parent
SNIPPET_TIMEOUT = 120.0  # seconds; a bound on a hang, not a measure of speed
STOP_TIMEOUT = 30.0  # seconds for a server to exit after Ctrl-C
DOCS_PORTS = (8000, 8080, 8081, 9000)  # every port a snippet of the docs may name


@dataclass(frozen=True)
class Block:
    """One fenced block with a language."""

    path: Path
    section: str  # the enclosing "## " heading
    lang: str
    text: str
    line: int  # 1-based line of the opening fence, for messages

    @property
    def where(self) -> str:
        return f"{self.path.name} line {self.line}"


def fenced_blocks(path: Path) -> list[Block]:
    """Fenced blocks with a language, each with the ``## `` section it sits in (``###`` stays inside it)."""
    blocks: list[Block] = []
    section, fence, lang, start = "", None, "", 0
    body: list[str] = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        stripped = line.strip()
        if fence is None:
            if line.startswith("## "):
                section = line[3:].strip()
            elif stripped.startswith("```"):
                fence, lang, start = line[: len(line) - len(line.lstrip())], stripped[3:].strip(), number
                body = []
        elif stripped == "```":
            if lang:
                blocks.append(Block(path, section, lang, "\n".join(body) + "\n", start))
            fence = None
        else:
            body.append(line.removeprefix(fence))
    assert fence is None, f"{path.name}: the fence opened on line {start} is never closed"
    return blocks


def port_replacements(ports: Mapping[int, int]) -> dict[str, str]:
    """The docs' ports as their snippets spell them -> the free ports this run uses."""
    replacements: dict[str, str] = {}
    for old, new in ports.items():
        replacements[f"127.0.0.1:{old}"] = f"127.0.0.1:{new}"
        replacements[f"--port {old}"] = f"--port {new}"
        replacements[f"http.server {old}"] = f"http.server {new}"
    return replacements


def with_ports(text: str, replacements: Mapping[str, str]) -> str:
    for old, new in replacements.items():
        text = text.replace(old, new)
    named = "|".join(str(port) for port in DOCS_PORTS)
    left = re.findall(rf".*(?<!\d)(?:{named})(?!\d).*", text)
    assert not left, f"a snippet names a docs port that port_replacements() does not cover: {left}"
    return text


def snippet_env(tmpdir: Path | None = None) -> dict[str, str]:
    """A new user's shell with the venv active, no proxy for 127.0.0.1, and mmgate on loopback only; ``tmpdir``
    as its temporary folder (``mktemp``, Python's ``tempfile``); ``MMGATE_LOOP`` kept, the event loop of the
    test pass."""
    env = {k: v for k, v in mmgate_env(keep=("MMGATE_LOOP",), MMGATE_HOST="127.0.0.1").items()
           if k.lower() not in ("http_proxy", "https_proxy", "all_proxy")}
    env["PATH"] = f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}"
    env["VIRTUAL_ENV"] = str(VENV_BIN.parent)
    env["NO_PROXY"] = env["no_proxy"] = "127.0.0.1,localhost"
    if tmpdir is not None:
        env["TMPDIR"] = str(tmpdir)
    return env


async def run_to_end(argv: list[str], cwd: Path, tmpdir: Path | None = None) -> tuple[int, str]:
    """Run a snippet to its end (bounded by ``SNIPPET_TIMEOUT``): its exit status and its output."""
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


async def run_block(block: Block, text: str, cwd: Path, tmpdir: Path | None = None) -> tuple[int, str]:
    """A bash block with ``bash -c``, a python block as a script file beside ``cwd``."""
    if block.lang == "python":
        script = cwd.parent / f"snippet-{block.line}.py"
        script.write_text(text)
        return await run_to_end([sys.executable, str(script)], cwd, tmpdir)
    return await run_to_end(["bash", "-c", text], cwd, tmpdir)


async def start_server(text: str, cwd: Path, log: Path) -> asyncio.subprocess.Process:
    """A snippet that runs until stopped, in a session of its own (so ``interrupt`` reaches all of it)."""
    with log.open("wb") as out:
        return await asyncio.create_subprocess_exec("bash", "-c", text, cwd=cwd, env=snippet_env(), stdout=out,
                                                    stderr=out, start_new_session=True)


def tail(log: Path) -> str:
    """The end of a server's log, for a failure's message."""
    return log.read_text(errors="replace")[-2000:]


async def wait_until_up(url: str, process: asyncio.subprocess.Process, log: Path) -> None:
    """Poll until ``url`` answers 200 (bounded; a server that exits or never answers fails with its log)."""
    async with aiohttp.ClientSession() as client:
        for _ in range(600):
            assert process.returncode is None, f"the server snippet exited: {tail(log)}"
            try:
                async with client.get(url) as response:
                    if response.status == 200:
                        return
            except aiohttp.ClientConnectionError:
                pass
            await asyncio.sleep(0.05)
    raise AssertionError(f"{url} never answered: {tail(log)}")


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
