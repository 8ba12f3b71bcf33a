"""What a Python dependency costs to carry (``bench/video_probe``): the size of the files its distribution
installed, from the distribution's own file list (its RECORD, bundled shared libraries included), and the time
one top-level import takes in a fresh interpreter (``python -X importtime``, its cumulative figure).
"""

from __future__ import annotations

import importlib.metadata
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def installed_mib(distribution: str) -> float:
    """MiB of the files ``distribution`` installed."""
    total = 0
    for file in importlib.metadata.distribution(distribution).files or []:
        path = Path(str(file.locate()))
        if path.is_file():
            total += path.stat().st_size
    return total / (1 << 20)


def import_ms(statement: str) -> float:
    """Milliseconds of ``statement`` (``import NAME``) in a fresh interpreter run from the repository root."""
    module = statement.split()[-1]
    out = subprocess.run([sys.executable, "-X", "importtime", "-c", statement], capture_output=True, text=True,
                         check=True, cwd=REPO).stderr
    for line in out.splitlines():
        found = re.match(r"import time:\s+\d+ \|\s+(\d+) \|\s*(\S+)$", line)
        if found and found.group(2) == module:
            return int(found.group(1)) / 1000
    raise RuntimeError(f"no importtime line for {module}")
