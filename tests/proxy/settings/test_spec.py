"""Reading the variables into their sections: the rules that tie settings together, and the settings other work
relies on."""

from __future__ import annotations

import pytest

from proxy.admission.adaptive import START
from proxy.admission.client import configured_limit
from proxy.settings import AUTO, SPEC, ConfigError, Settings, setting_default, setting_value
from proxy.settings.reference import help_text


@pytest.mark.parametrize("release_at", ["headers", "sent"])
@pytest.mark.parametrize("spelt", ["variables", "flags"])
def test_an_adaptive_limit_with_a_lease_ending_before_the_answer_is_refused(release_at: str, spelt: str) -> None:
    """The adaptive limit reads the backend's load from the leases held: one released at the headers or once
    sent would hide the requests still generating."""
    if spelt == "variables":
        environ, overrides = {"MMGATE_MAX_MM_CONCURRENCY": "auto", "MMGATE_RELEASE_AT": release_at}, {}
        named = (f"MMGATE_RELEASE_AT='{release_at}' does not go with MMGATE_MAX_MM_CONCURRENCY=auto: "
                 "the adaptive limit reads the backend's load from the leases held, so each must last until the "
                 "answer ends (complete, what auto means here)")
    else:
        environ, overrides = {}, {"max_mm_concurrency": "auto", "release_at": release_at}
        named = f"--release-at='{release_at}' does not go with --max-mm-concurrency=auto: "
    with pytest.raises(ConfigError) as refused:
        Settings.from_env(environ, **overrides)
    assert str(refused.value).startswith(named) and "\n" not in str(refused.value)


@pytest.mark.parametrize("release_at", ["auto", "complete"])
def test_an_adaptive_limit_takes_the_leases_that_last_the_answer(release_at: str) -> None:
    gate = Settings.from_env({"MMGATE_MAX_MM_CONCURRENCY": "auto", "MMGATE_RELEASE_AT": release_at}).gate
    assert gate.max_mm_concurrency is AUTO and gate.adaptive_concurrency and gate.release_at == release_at
    fixed = Settings.from_env({"MMGATE_MAX_MM_CONCURRENCY": "3", "MMGATE_RELEASE_AT": "headers"}).gate
    assert not fixed.adaptive_concurrency and configured_limit(fixed) == (3, None)
    assert fixed.mm_concurrency_ceiling == 3


@pytest.mark.parametrize(("floor", "ceiling", "start"), [(2, 12, START), (6, 12, 6), (1, 3, 3)])
def test_the_adaptive_limit_starts_at_its_start_within_its_floor_and_ceiling(floor: int, ceiling: int,
                                                                              start: int) -> None:
    gate = Settings.from_env({"MMGATE_MAX_MM_CONCURRENCY": "auto", "MMGATE_MIN_MM_CONCURRENCY": str(floor),
                              "MMGATE_MAX_MM_CONCURRENCY_AUTO": str(ceiling)}).gate
    limit, adaptive = configured_limit(gate)
    assert adaptive is not None and limit == adaptive.limit == start and gate.mm_concurrency_ceiling == ceiling


def test_the_client_write_timeout_is_read_in_seconds_with_0_off() -> None:
    assert setting_default("client_write_timeout") == 30.0
    assert Settings.from_env({}).timeouts.client_write_timeout == 30.0
    assert Settings.from_env({"MMGATE_CLIENT_WRITE_TIMEOUT": "2.5"}).timeouts.client_write_timeout == 2.5
    assert Settings.from_env({}, client_write_timeout="0").timeouts.client_write_timeout == 0
    with pytest.raises(ConfigError, match=r"^MMGATE_CLIENT_WRITE_TIMEOUT='-1' is not allowed: expected a number of "
                                          r"seconds >= 0 \(0 = off\)$"):
        Settings.from_env({"MMGATE_CLIENT_WRITE_TIMEOUT": "-1"})
    assert help_text("client_write_timeout") == ("a client that reads nothing of the answer for this long loses its "
                                                 "connection (like nginx send_timeout) (0 = off) [30]")
    names = list(SPEC)
    assert names.index("client_write_timeout") == names.index("upstream_read_timeout") + 1
    assert SPEC["client_write_timeout"].section == "timeouts"


def test_processes_auto_is_resolved_to_a_count_at_start() -> None:
    listen = Settings.from_env({"MMGATE_PROCESSES": "auto", "MMGATE_DECODE_WORKERS": "1"}).listen
    assert listen.processes == 1
    with pytest.raises(ConfigError, match=r"^MMGATE_PROCESSES='0' is not allowed: expected an integer from 1 to "
                                          r"64, or auto$"):
        Settings.from_env({"MMGATE_PROCESSES": "0"})


def test_a_setting_is_found_by_its_name_alone() -> None:
    """bench/ reads defaults and values by name (``setting_default``, ``setting_value``)."""
    settings = Settings.from_env({"MMGATE_CACHE_MB": "7"})
    assert setting_default("cache_mb") == 256 and setting_value(settings, "cache_mb") == 7
    assert setting_default("jpeg_quality") is AUTO and setting_default("decode_workers") >= 1
