"""The aiohttp mmgate runs on is one whose private parts ``proxy/edge/aiohttp_internals.py`` was checked against,
and ``pyproject.toml`` allows no other (what the module reads is exercised through test_connections.py and
test_pacing.py: idle connections, held reading)."""

from __future__ import annotations

import importlib.metadata
import re
import tomllib
from pathlib import Path

from proxy.edge.aiohttp_internals import CHECKED_BELOW, CHECKED_FROM

PYPROJECT = Path(__file__).resolve().parents[3] / "pyproject.toml"


def release(version: str) -> tuple[int, ...]:
    """``3.14.5`` -> (3, 14, 5); a pre-release or local suffix is dropped (``3.15.0a1`` -> (3, 15, 0))."""
    match = re.match(r"\d+(?:\.\d+)*", version)
    assert match, version
    return tuple(int(part) for part in match.group().split("."))


def test_the_installed_aiohttp_is_one_the_internals_were_checked_against() -> None:
    installed = importlib.metadata.version("aiohttp")
    assert release(CHECKED_FROM) <= release(installed) < release(CHECKED_BELOW), (
        f"aiohttp {installed} is outside the versions proxy/edge/aiohttp_internals.py was checked against: read "
        f"what it uses in the new version's source, then move CHECKED_FROM/CHECKED_BELOW and pyproject.toml")


def test_pyproject_bounds_aiohttp_to_the_checked_versions() -> None:
    dependencies = tomllib.loads(PYPROJECT.read_text())["project"]["dependencies"]
    [aiohttp] = [d for d in dependencies if re.match(r"aiohttp\b", d)]
    assert aiohttp.replace(" ", "") == f"aiohttp>={CHECKED_FROM},<{CHECKED_BELOW}"
