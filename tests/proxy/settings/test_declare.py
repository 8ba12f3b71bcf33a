"""How a setting is declared: every section field is one, ``auto`` is a value of its own, and what ``0`` means is
said on the field, so reading, help and docs cannot disagree about it."""

from __future__ import annotations

import pickle
from dataclasses import fields

import pytest

from proxy.settings import AUTO, SECTIONS, SPEC, Auto, ConfigError, Settings, env_name
from proxy.settings.declare import info_of
from proxy.settings.sections import GateSettings
from proxy.settings.spec import section_name, section_title


def test_every_section_field_is_a_declared_setting_and_every_setting_is_read() -> None:
    declared = {f.name for section in SECTIONS for f in fields(section) if f.init}
    assert declared == set(SPEC)
    assert all(info_of(f) is not None for section in SECTIONS for f in fields(section) if f.init)


def test_settings_holds_the_sections_in_their_order_named_after_them() -> None:
    assert [f.name for f in fields(Settings)] == [section_name(section) for section in SECTIONS]
    assert section_name(GateSettings) == "gate" and section_title(GateSettings) == "Gate"
    assert [type(getattr(Settings(), f.name)) for f in fields(Settings)] == list(SECTIONS)


def test_auto_is_a_value_of_its_own_that_survives_a_trip_to_another_process() -> None:
    assert str(AUTO) == "auto" and f"{AUTO}" == "auto" and AUTO is Auto.AUTO
    assert pickle.loads(pickle.dumps(AUTO)) is AUTO  # the supervisor pickles Settings to its fronts
    settings = Settings.from_env({"MMGATE_MAX_MM_CONCURRENCY": "auto"})
    assert pickle.loads(pickle.dumps(settings)).gate.max_mm_concurrency is AUTO
    assert AUTO != 0 and not isinstance(AUTO, int)


TAKE_AUTO = {name for name, setting in SPEC.items() if setting.info.auto}
AUTO_CHOICES = {name for name, setting in SPEC.items() if "auto" in setting.info.choices}


def test_the_settings_that_take_auto_say_so_on_their_field() -> None:
    assert sorted(TAKE_AUTO) == ["jpeg_quality", "max_mm_concurrency", "processes"]
    # A choice named auto: a word of that setting's own.
    assert sorted(AUTO_CHOICES) == ["image_format", "loop", "release_at"]


@pytest.mark.parametrize("name", sorted(TAKE_AUTO - {"processes"}))  # processes: resolved to a count at start
def test_auto_is_read_as_auto_where_a_setting_takes_it(name: str) -> None:
    settings = Settings.from_env({env_name(name): " Auto "})
    assert getattr(getattr(settings, SPEC[name].section), name) is AUTO


# Settings whose values are names: "auto" is a host, header or model name there, not a request to find one.
NAMES = {"host", "fairness_header", "priority_header", "model", "fetch_allow_hosts"}


@pytest.mark.parametrize("name", sorted(set(SPEC) - TAKE_AUTO - AUTO_CHOICES - NAMES))
def test_auto_is_refused_elsewhere_naming_what_is_allowed(name: str) -> None:
    with pytest.raises(ConfigError) as refused:
        Settings.from_env({env_name(name): "auto"})
    message = str(refused.value)
    assert message.startswith(f"{env_name(name)}='auto' is not allowed: expected ")
    assert "or auto" not in message and "\n" not in message


@pytest.mark.parametrize("name", sorted(name for name, setting in SPEC.items() if setting.info.zero))
def test_a_declared_meaning_of_0_is_a_value_the_setting_takes(name: str) -> None:
    info = SPEC[name].info
    assert info.read("0") == 0 and SPEC[name].meaning.endswith(f"(0 = {info.zero})")


def test_the_meanings_of_0_are_declared_not_written_into_the_help() -> None:
    zeros = {name: setting.info.zero for name, setting in SPEC.items() if setting.info.zero}
    assert zeros["admin_port"] == "same port" and zeros["worker_max_jobs"] == "never"
    assert zeros["client_write_timeout"] == "off" and len(zeros) >= 12
    assert not [name for name, setting in SPEC.items() if "0 =" in setting.info.help]
