"""``mmgate demo`` as a first-time user meets it: it listens on loopback unless told otherwise, its banner says
where, and the snippets it prints work pasted into a new shell, one where no virtual environment is active."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import signal
import sys
from pathlib import Path

import pytest

from proxy.serve.demo import demo_url, free_port
from testkit.environment import mmgate_env
from tests.conftest import require_heavy

BOUND = 120.0  # seconds: a bound on a hang, not a measure of speed


def demo_env() -> dict[str, str]:
    """The demo's own environment: none of the developer's MMGATE_* (MMGATE_HOST above all) but the event loop
    CI runs the suite on."""
    return mmgate_env(keep=("MMGATE_LOOP",))


def fresh_shell_env(home: Path) -> dict[str, str]:
    """A new login shell's environment: the system's PATH, no virtual environment, no PYTHONPATH, no proxy."""
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(home), "LANG": "C.UTF-8",
            "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost"}


async def run_in_fresh_shell(snippet: str, home: Path) -> tuple[int, str]:
    process = await asyncio.create_subprocess_exec("bash", "-c", snippet + "\n", cwd=home, env=fresh_shell_env(home),
                                                   stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    try:
        async with asyncio.timeout(BOUND):
            output, _ = await process.communicate()
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    return process.returncode or 0, output.decode(errors="replace")


async def test_the_demo_listens_on_loopback_and_its_snippets_work_in_a_fresh_shell(tmp_path: Path) -> None:
    port = free_port()
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "proxy", "demo", "--port", str(port), env=demo_env(),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, start_new_session=True)
    assert process.stdout is not None and process.stderr is not None
    try:
        printed: list[str] = []
        async with asyncio.timeout(BOUND):
            while not printed or "Ctrl-C to stop" not in printed[-1]:
                line = (await process.stdout.readline()).decode()
                assert line, "mmgate demo ended before printing its snippets"
                printed.append(line)
        paragraphs = [p for p in "".join(printed).split("\n\n") if p.strip()]
        assert f"mmgate demo: proxy on http://127.0.0.1:{port} -> stub backend at" in paragraphs[0], paragraphs[0]
        snippets = [p for p in paragraphs if p.lstrip().startswith(("curl", "#"))]
        assert len(snippets) == 2, paragraphs
        # What to do for a plain `python` of one's own: activate this venv, not install anything again.
        assert "pip install" not in "".join(printed)
        if sys.prefix != sys.base_prefix:
            assert f". {Path(sys.prefix) / 'bin' / 'activate'}" in snippets[1], snippets[1]
        for snippet in snippets:
            if snippet.lstrip().startswith("curl") and shutil.which("curl", path=fresh_shell_env(tmp_path)["PATH"]) \
                    is None:
                if require_heavy():
                    pytest.fail("curl is missing and MMGATE_REQUIRE_HEAVY=1")
                continue
            status, output = await run_in_fresh_shell(snippet, tmp_path)
            assert status == 0, f"{snippet}\nexit status {status}: {output[-2000:]}"
            assert re.search(r"stub answer: saw \d image\(s\)", output), output[-2000:]
    finally:
        if process.returncode is None:
            os.killpg(process.pid, signal.SIGINT)  # Ctrl-C, as a terminal sends it: the demo and its stub
        async with asyncio.timeout(BOUND):
            _, err = await process.communicate()
    log = err.decode()
    assert process.returncode == 0, log[-2000:]
    # Loopback only, said as it is: no "all interfaces" note.
    assert f"mmgate listening on http://127.0.0.1:{port} -> " in log and "all interfaces" not in log, log[-2000:]


@pytest.mark.parametrize(("host", "url"), [
    ("127.0.0.1", "http://127.0.0.1:8080"),
    ("0.0.0.0", "http://127.0.0.1:8080"),  # every interface: reached on loopback from this machine
    ("::", "http://127.0.0.1:8080"),
    ("::1", "http://[::1]:8080"),
    ("10.1.2.3", "http://10.1.2.3:8080"),
])
def test_the_snippets_reach_the_proxy_where_it_listens(host: str, url: str) -> None:
    assert demo_url(host, 8080) == url
