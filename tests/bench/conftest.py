"""A throwaway git repository shaped like this one, for the staleness rules: commits made in a test, read back
by ``bench.staleness`` and ``bench.report.freshness`` through git as they read the real history."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Mapping
from pathlib import Path

import pytest

# bench/x.py reaches proxy/media/helper.py only through a relative import of proxy/media/step.py, and
# proxy/limits.py directly; proxy/edge.py is outside its rooms. bench/starts.py runs mmgate as a process.
TREE = {
    "proxy/__init__.py": "",
    "proxy/media/__init__.py": '"""Media."""\n',
    "proxy/media/step.py": '"""Step."""\n\nfrom .helper import scale\n\n\ndef run(x):\n    """Run."""\n'
                           "    return scale(x)\n",
    "proxy/media/helper.py": '"""Helper."""\n\n\ndef scale(x):\n    """Double it."""\n    return x * 2\n',
    "proxy/limits.py": "CAP = 3\n",
    "proxy/edge.py": "def serve():\n    return 1\n",
    "preprocessors/__init__.py": "",
    "preprocessors/image.py": "def decode():\n    return 0\n",
    "bench/__init__.py": "",
    "bench/x.py": "from proxy.limits import CAP\nfrom proxy.media.step import run\n\nprint(run(CAP))\n",
    "bench/starts.py": 'import subprocess\nimport sys\n\nsubprocess.run([sys.executable, "-m", "proxy"])\n',
}


class Repo:
    """A git repository in a temporary folder, committed to by the test."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.git("init", "-q")

    def git(self, *args: str) -> str:
        env = os.environ | {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.invalid",
                            "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@example.invalid"}
        return subprocess.run(["git", "-C", str(self.root), "-c", "commit.gpgsign=false", *args], env=env,
                              check=True, capture_output=True, text=True).stdout.strip()

    def commit(self, files: Mapping[str, str | None]) -> str:
        """Write (or, for None, delete) the files, commit everything and return the commit's id."""
        for name, text in files.items():
            path = self.root / name
            if text is None:
                path.unlink()
                continue
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        self.git("add", "-A")
        self.git("commit", "-q", "--allow-empty", "-m", "change")
        return self.git("rev-parse", "HEAD")

    def move(self, old: str, new: str) -> str:
        (self.root / new).parent.mkdir(parents=True, exist_ok=True)
        self.git("mv", old, new)
        return self.commit({})


@pytest.fixture
def repo(tmp_path: Path) -> Repo:
    made = Repo(tmp_path)
    made.commit(TREE)
    return made
