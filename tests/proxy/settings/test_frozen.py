"""The one frozen ``Settings``: injectable, frozen, and what ``--print-config`` prints of it."""

from __future__ import annotations

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from proxy.settings import SPEC, ConfigError, Settings, env_name, setting_value


def test_settings_are_frozen_and_injectable() -> None:
    settings = Settings.from_env({"MMGATE_UPSTREAM": "http://127.0.0.1:9/", "MMGATE_SERVER_TIMING": "off"})
    assert settings.backend.upstream == "http://127.0.0.1:9" and settings.logs.server_timing is False
    with pytest.raises(AttributeError):
        settings.gate.max_queue = 3  # type: ignore[misc]
    with pytest.raises(ConfigError):
        Settings.from_env({"MMGATE_MAX_BODY_MB": "0"})


def test_print_config_groups_by_section_and_marks_what_differs_from_the_default() -> None:
    text = Settings.from_env({"MMGATE_UPSTREAM": "http://h:1", "MMGATE_MAX_QUEUE": "5",
                              "MMGATE_MAX_MM_CONCURRENCY": "auto", "MMGATE_RELEASE_AT": "complete",
                              "MMGATE_TRUST_FLOW_HEADERS_FROM": "10.0.0.0/8", "MMGATE_CACHE_MB": "256"}).describe()
    lines = text.splitlines()
    assert "MMGATE_MAX_QUEUE=5  # default: 64" in lines
    assert "MMGATE_MAX_MM_CONCURRENCY=auto  # default: 4" in lines
    assert "MMGATE_RELEASE_AT=complete  # default: auto" in lines
    assert "MMGATE_TRUST_FLOW_HEADERS_FROM=10.0.0.0/8  # default: none" in lines
    assert "MMGATE_UPSTREAM=http://h:1" in lines  # set, and no default to differ from
    assert "MMGATE_CACHE_MB=256" in lines and "MMGATE_JPEG_QUALITY=auto" in lines  # given, but the default
    assert "MMGATE_CLIENT_WRITE_TIMEOUT=30.0" in lines
    headers = [line for line in lines if line.startswith("# ") and "worst-case" not in line]
    assert headers == ["# Backend", "# Listen", "# Gate", "# Timeouts", "# Limits", "# Decode", "# Fetch",
                       "# Memory", "# Drain", "# Logs"]
    assert lines.index("# Gate") < lines.index("MMGATE_MAX_QUEUE=5  # default: 64") < lines.index("# Timeouts")
    assert lines[-1].startswith("# worst-case payload memory: ")  # the last line: testkit/worst_case_docs.py reads it


def test_print_config_of_no_upstream_says_it_is_required_to_serve() -> None:
    lines = Settings.from_env({}).describe().splitlines()
    assert lines[:2] == ["# Backend", "MMGATE_UPSTREAM=  # not set: required to serve"]
    assert not [line for line in lines if "# default:" in line]  # nothing changed


# Raw values to try: each setting is given those of them it takes.
POOL = ("0", "1", "2", "3", "7", "64", "1000", "65535", "100000", "0.5", "2.5", "auto", "On", "off", "http://h:1/",
        "/v1", "/v1, /health", "10.0.0.0/8", "X-Tenant", "images.example.com,*.cdn.net",
        *sorted({value for s in SPEC.values() for value in s.info.choices}))


def _takes(name: str, raw: str) -> bool:
    try:
        SPEC[name].info.read(raw)
    except ValueError:
        return False
    return True


TAKEN = {name: [raw for raw in POOL if _takes(name, raw)] for name in SPEC}
ASSIGNMENT = st.sampled_from(sorted(name for name in SPEC if TAKEN[name])).flatmap(
    lambda name: st.tuples(st.just(name), st.sampled_from(TAKEN[name])))


@given(st.lists(ASSIGNMENT, max_size=8).map(dict))
def test_what_print_config_prints_reads_back_as_the_same_settings(raw: dict[str, str]) -> None:
    """Each printed value is spelt as it is typed: the printed lines, read as variables, are the same settings."""
    environ = {env_name(name): value for name, value in raw.items()}
    try:
        settings = Settings.from_env(environ)
    except ConfigError:
        assume(False)
    printed = {}
    for line in settings.describe().splitlines():
        if line and not line.startswith("#"):
            variable, value = line.split("  # ")[0].split("=", 1)
            if value:  # unset: its default
                printed[variable] = value
    assert Settings.from_env(printed) == settings
    for name in raw:
        line = next(line for line in settings.describe().splitlines() if line.startswith(env_name(name) + "="))
        changed = not SPEC[name].info.required and setting_value(settings, name) != SPEC[name].default
        assert ("  # default: " in line) == changed
