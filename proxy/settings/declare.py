"""How a setting is declared: once, as a field of its section (``sections``), with everything said about it.

``setting(default, parse=..., help=...)`` is a dataclass ``field`` whose metadata is the setting's ``Info``: its
parser, its help text, what ``0`` means where ``0`` is no plain amount (``zero="off"``), what ``auto`` means where
the setting takes it (``auto=...``, the value then being ``AUTO``), whether it is one of the few an operator
turns (``essential``), and what it changes of the media: a field of a decode workers' policy (``policy=``) or,
carried otherwise, a setting a cached verdict depends on (``shapes_verdict``). Reading (``spec``), ``--help``,
``--print-config`` and docs/configuration.md (``reference``), the workers' policies and the cache's fingerprint
(``policies``) are all made from these declarations.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import MISSING, dataclass
from enum import Enum
from typing import Any, Final, Literal

METADATA_KEY = "mmgate"


class Auto(Enum):
    """``auto``: the setting's value is found by mmgate (how, its ``Info.auto`` says), not given as a number."""

    AUTO = "auto"

    def __str__(self) -> str:
        return self.value

    def __repr__(self) -> str:
        return "AUTO"


AUTO: Final = Auto.AUTO


class ConfigError(ValueError):
    """A configuration value that mmgate refuses; ``str()`` is one line naming variable, value and rule."""


PolicyKind = Literal["image", "audio", "video"]
# ``PolicyField.default`` where the policy's default is the setting's own.
SETTING_DEFAULT: Final = object()


@dataclass(frozen=True, slots=True)
class PolicyField:
    """Marks a setting as a field of the policy the decode workers receive for one kind of media: its
    ``Image``/``Audio``/``VideoSettings`` in preprocessors/policy_settings.py, which ``python -m
    proxy.settings.reference`` writes from these marks, and whose values ``policies.policy_values`` reads from
    the settings. ``name``: the field's name there, where it is not the setting's own (the policy is about one
    kind, so ``max_image_pixels`` is its ``max_pixels``). ``default``: the policy's default, where it is not the
    setting's. A setting's ``auto`` reaches the workers as 0, a plain number they can pickle and compare."""

    kind: PolicyKind
    name: str = ""
    default: Any = SETTING_DEFAULT


@dataclass(frozen=True, slots=True)
class Info:
    """Everything said about one setting but its name, type and default (the field's own).

    ``parse`` turns the raw text into the value or raises ``ValueError("what is allowed")``. ``help`` is the
    ``--help`` text without the meanings of ``auto`` and ``0`` and without the default, which are added from
    ``auto``, ``zero`` and the field. ``required``: mmgate cannot serve without it (it may still print its
    configuration). ``shown`` describes a default that is no plain value (computed at start, or
    empty meaning "all" or "none"); "" shows no default at all. ``details`` is what docs/configuration.md says
    beyond the help text. ``policy``: the decode workers' policy field it is (see ``PolicyField``).
    ``shapes_verdict``: it changes what a media item becomes although no policy carries it (the item limit, the
    model), so the cache's key must change with it as it does with every policy field."""

    parse: Callable[[str], Any]
    help: str
    shown: str | None = None
    zero: str | None = None
    auto: str | None = None
    required: bool = False
    essential: bool = False
    details: str = ""
    policy: PolicyField | None = None
    shapes_verdict: bool = False

    @property
    def in_verdict(self) -> bool:
        """A cached verdict depends on this setting: it is in the cache's fingerprint."""
        return self.policy is not None or self.shapes_verdict

    @property
    def choices(self) -> tuple[str, ...]:
        """The values of a choice setting (``parsers.Choice``), in their order; () for any other."""
        values: tuple[str, ...] = getattr(self.parse, "values", ())
        return values

    def read(self, raw: str) -> Any:
        """The value of ``raw``: ``AUTO`` where the setting takes ``auto``, else what ``parse`` makes of it."""
        if self.auto is None:
            return self.parse(raw)
        if raw.strip().lower() == AUTO.value:
            return AUTO
        try:
            return self.parse(raw)
        except ValueError as exc:
            raise ValueError(f"{exc}, or {AUTO}") from None


def setting(default: Any = MISSING, *, default_factory: Callable[[], Any] | None = None,
            parse: Callable[[str], Any], help: str, shown: str | None = None, zero: str | None = None,
            auto: str | None = None, required: bool = False, essential: bool = False, details: str = "",
            policy: PolicyField | None = None, shapes_verdict: bool = False) -> Any:
    """A section field declaring one setting: its default (or ``default_factory``, computed at start) and its
    ``Info``. Typed ``Any`` as ``dataclasses.field`` is, so that ``x: int = setting(4, ...)`` type-checks."""
    info = Info(parse, help, shown=shown, zero=zero, auto=auto, required=required, essential=essential,
                details=details, policy=policy, shapes_verdict=shapes_verdict)
    if default_factory is not None:
        return dataclasses.field(default_factory=default_factory, metadata={METADATA_KEY: info})
    return dataclasses.field(default=default, metadata={METADATA_KEY: info})


def info_of(field: dataclasses.Field[Any]) -> Info | None:
    """The ``Info`` of a section field declared with ``setting``; None for a field that is no setting."""
    info = field.metadata.get(METADATA_KEY)
    return info if isinstance(info, Info) else None


def env_name(name: str) -> str:
    """``max_queue`` -> ``MMGATE_MAX_QUEUE``."""
    return "MMGATE_" + name.upper()


def flag_name(name: str) -> str:
    """``max_queue`` -> ``--max-queue``."""
    return "--" + name.replace("_", "-")
