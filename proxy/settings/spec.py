"""Every ``MMGATE_*`` variable read into its section: ``SPEC``, made from the sections' declarations, and the rules
that tie settings together.

A bad value raises ``ConfigError`` whose text is the one line the CLI prints before exiting with status 2. The
environment is injectable (``Settings.from_env(environ)``) so tests never touch ``os.environ``.
"""

from __future__ import annotations

import argparse
import difflib
from collections.abc import Collection, Mapping
from dataclasses import MISSING, Field, dataclass, fields
from typing import Any

from proxy.settings.cpus import auto_processes, default_decode_mode, default_mm_concurrency, usable_cpus
from proxy.settings.declare import AUTO, ConfigError, Info, env_name, flag_name, info_of
from proxy.settings.sections import SECTIONS


@dataclass(frozen=True, slots=True)
class Setting:
    """One variable: the section it is in (``Settings``' field name, e.g. ``gate``), its field and its ``Info``."""

    section: str
    field: Field[Any]
    info: Info

    @property
    def name(self) -> str:
        return self.field.name

    @property
    def default(self) -> Any:
        """The declared default, computed now for a default found from the machine."""
        if self.field.default is not MISSING:
            return self.field.default
        return self.field.default_factory()  # type: ignore[operator]

    @property
    def default_text(self) -> str:
        """The default as help and docs show it: its words where it is no plain value, else the value (``30``,
        not ``30.0``); "" where none is shown (a required setting)."""
        if self.info.shown is not None:
            return self.info.shown
        if self.info.required:
            return ""
        value = self.default
        return f"{value:g}" if isinstance(value, float) else spelt(value)

    @property
    def meaning(self) -> str:
        """The help text with what ``auto`` and ``0`` mean, as ``--help`` and the docs show it."""
        info = self.info
        return info.help + (f", or auto: {info.auto}" if info.auto else "") + (f" (0 = {info.zero})" if info.zero
                                                                              else "")


def spelt(value: Any) -> str:
    """A value as it is typed and as ``--print-config`` prints it: ``auto``, ``on``/``off``, lists with commas."""
    if isinstance(value, tuple):
        return ",".join(value)
    if value is AUTO:
        return str(AUTO)
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value)


def section_name(section: type) -> str:
    """``Limits`` -> ``limits``, ``GateSettings`` -> ``gate``: the name ``Settings`` holds the section under."""
    return section.__name__.removesuffix("Settings").lower()


def section_title(section: type) -> str:
    """``Gate``: the section's heading in --print-config and docs/configuration.md."""
    return section_name(section).capitalize()


def _settings() -> dict[str, Setting]:
    spec: dict[str, Setting] = {}
    for section in SECTIONS:
        for f in fields(section):
            info = info_of(f)
            if info is not None:
                spec[f.name] = Setting(section_name(section), f, info)
            elif f.init:
                raise TypeError(f"{section.__name__}.{f.name} is no setting: declare it with setting(...)")
    return spec


# Field name -> its setting, in the order of the sections, then of their fields: the order of `mmgate --help`,
# `--print-config` and docs/configuration.md.
SPEC: dict[str, Setting] = _settings()


def settings_of(section: type) -> list[Setting]:
    """The settings of one section (a class of ``SECTIONS``), in its fields' order."""
    name = section_name(section)
    return [setting for setting in SPEC.values() if setting.section == name]


def setting_default(name: str) -> Any:
    """The default of setting ``name`` as its section's field declares it (computed for a factory)."""
    return SPEC[name].default


def setting_value(settings: object, name: str) -> Any:
    """The effective value of setting ``name`` in a ``Settings``, e.g. ``setting_value(settings, "max_queue")``."""
    return getattr(getattr(settings, SPEC[name].section), name)


def sections_from_env(environ: Mapping[str, str], overrides: Mapping[str, str]) -> dict[str, Any]:
    """``Settings.from_env``'s sections by name: every value parsed and cross-checked, ``auto`` and unset computed
    defaults resolved (decode workers, decode mode, processes), then placed in its section."""
    values: dict[str, Any] = {}
    where: dict[str, str] = {}  # setting -> how the user spelt it, so an error names what they typed
    for name, setting in SPEC.items():
        raw = overrides.get(name)
        where[name] = flag_name(name) if raw is not None else env_name(name)
        if raw is None:
            raw = environ.get(env_name(name))
        if raw is None:
            continue
        try:
            values[name] = setting.info.read(str(raw))
        except ValueError as exc:
            raise ConfigError(f"{where[name]}={raw!r} is not allowed: expected {exc}") from None
    if "decode_workers" not in values:
        values["decode_workers"] = usable_cpus()
    elif values["decode_workers"] == 0:
        raise ConfigError(
            f"{where['decode_workers']}='0' is not allowed: expected an integer from 1 to 256 "
            "(0 = decode on the event loop exists only as a benchmark baseline)"
        )
    if values.get("max_inflight_image_tokens") and not values.get("model"):
        raise ConfigError(f"{where['max_inflight_image_tokens']} needs MMGATE_MODEL: image tokens are counted "
                          "with the served model's processor")
    if (values.get("max_mm_concurrency") is AUTO
            and values.get("min_mm_concurrency", setting_default("min_mm_concurrency"))
            > values.get("max_mm_concurrency_auto", setting_default("max_mm_concurrency_auto"))):
        raise ConfigError(f"{where['min_mm_concurrency']} is above {where['max_mm_concurrency_auto']}: "
                          "the adaptive limit needs a range")
    if values.get("max_mm_concurrency") is AUTO and values.get("release_at") in ("sent", "headers"):
        raise ConfigError(f"{where['release_at']}={values['release_at']!r} does not go with "
                          f"{where['max_mm_concurrency']}=auto: the adaptive limit reads the backend's load from "
                          "the leases held, so each must last until the answer ends (complete, what auto means here)")
    if values.get("backend_metrics") == "merge-admin" and not values.get("admin_port"):
        raise ConfigError(f"{where['backend_metrics']}='merge-admin' needs MMGATE_ADMIN_PORT: the merged /metrics "
                          "is served on the admin port only")
    if "decode_mode" not in values:
        values["decode_mode"] = default_decode_mode(usable_cpus())
    if "max_mm_concurrency" not in values:
        values["max_mm_concurrency"] = default_mm_concurrency(values["decode_workers"])
    if values.get("processes") is AUTO:
        values["processes"] = auto_processes(usable_cpus(), values["decode_workers"])
    elif values.get("processes", setting_default("processes")) > values["decode_workers"]:
        raise ConfigError(f"{where['processes']}={values['processes']} is above MMGATE_DECODE_WORKERS="
                          f"{values['decode_workers']}: each front process decodes with its share of the decode "
                          "workers, at least one; raise MMGATE_DECODE_WORKERS or lower the processes")
    by_section: dict[str, dict[str, Any]] = {section_name(section): {} for section in SECTIONS}
    for name, value in values.items():
        by_section[SPEC[name].section][name] = value
    return {section_name(section): section(**by_section[section_name(section)]) for section in SECTIONS}


def unknown_variables(environ: Mapping[str, str], also_known: Collection[str] = ()) -> list[str]:
    """One warning per ``MMGATE_*`` variable that is no setting, with the closest name when there is one.
    ``also_known``: names a caller reads itself (the tests' and benchmarks' own switches), left alone.

    A misspelt variable would otherwise be ignored without a word, and the default it meant to change would
    silently stay in force. Only a warning: an unknown name must not stop a rollout.
    """
    known = [name.upper() for name in SPEC]
    warnings = []
    for variable in sorted(environ):
        if not variable.startswith("MMGATE_") or variable[7:] in known or variable in also_known:
            continue
        # Compared without the prefix every name shares, which would make any two names look alike.
        close = difflib.get_close_matches(variable[7:], known, n=1)
        warnings.append(f"unknown variable {variable}" + (f" (did you mean MMGATE_{close[0]}?)" if close else ""))
    return warnings


def overrides_from_args(args: argparse.Namespace) -> dict[str, str]:
    """The settings given as flags (``reference.add_arguments``), as raw strings keyed by field name."""
    return {name: value for name in SPEC if (value := getattr(args, name, None)) is not None}
