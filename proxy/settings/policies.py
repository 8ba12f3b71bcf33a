"""What the settings make for the media work: the policies the decode workers receive and the cache's fingerprint,
both read from the declarations (``PolicyField`` and ``shapes_verdict`` on a setting in ``sections``), so a new
decode setting reaches the workers and the cache's key without a line written for it here or in the app.

A policy is a dataclass of ``preprocessors`` (``base.ImagePolicy`` extends ``policy_settings.ImageSettings``, and
so for audio and video). ``preprocessors`` may not import the proxy, so its part made of settings is written
into it as source: ``render_policy_settings`` makes preprocessors/policy_settings.py, which ``python -m
proxy.settings.reference`` writes and a test keeps current. ``policy_values`` gives the values each policy is
built with; ``verdict_settings`` every setting a cached verdict depends on.
"""

from __future__ import annotations

import json
import textwrap
import types
from dataclasses import MISSING
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

from proxy.settings.declare import AUTO, SETTING_DEFAULT, Auto, PolicyKind, env_name
from proxy.settings.frozen import Settings
from proxy.settings.sections import SECTIONS
from proxy.settings.spec import SPEC, Setting, section_name, setting_value

# Where ``render_policy_settings``' text is written, from the repository's root.
POLICY_SETTINGS_PATH = Path("preprocessors") / "policy_settings.py"
# What each policy's generated part is about, for its class's docstring.
POLICY_ABOUT: dict[PolicyKind, str] = {
    "image": "What the image preprocessor (``image.py``) enforces and produces",
    "audio": "What the audio check (``audio.py``) enforces",
    "video": "What the video probe (``video.py``) enforces",
}
_WIDTH = 120


def policy_class_name(kind: PolicyKind) -> str:
    """``image`` -> ``ImageSettings``: the generated dataclass ``base.ImagePolicy`` extends."""
    return kind.capitalize() + "Settings"


def policy_settings(kind: PolicyKind) -> list[Setting]:
    """The settings that are fields of ``kind``'s policy, in the order of ``SPEC`` (the policy's field order)."""
    return [setting for setting in SPEC.values() if setting.info.policy and setting.info.policy.kind == kind]


def field_name(setting: Setting) -> str:
    """The name of ``setting``'s field in its policy: the mark's, or the setting's own."""
    mark = setting.info.policy
    return mark.name if mark is not None and mark.name else setting.name


def worker_value(value: Any) -> Any:
    """A setting's value as the workers get it: ``auto`` as 0 (they tell auto by it), anything else as it is."""
    return 0 if value is AUTO else value


def policy_values(settings: Settings, kind: PolicyKind) -> dict[str, Any]:
    """The fields of ``kind``'s policy from ``settings``, by their policy names: ``ImagePolicy(**policy_values(
    settings, "image"), geometry=...)`` is the image policy those settings make."""
    return {field_name(setting): worker_value(setting_value(settings, setting.name))
            for setting in policy_settings(kind)}


def verdict_settings(settings: Settings) -> list[tuple[str, Any]]:
    """Every setting a cached verdict depends on, with its value, in ``SPEC``'s order: each policy field and each
    setting declared ``shapes_verdict``."""
    return [(name, setting_value(settings, name)) for name, setting in SPEC.items() if setting.info.in_verdict]


def _type_text(hint: Any) -> str:
    """A setting's type as the policy declares it: ``auto`` dropped from a union (it reaches the workers as 0),
    choices spelt out as their ``Literal`` (the alias is the settings' own)."""
    if hint in (int, float, str, bool):
        return str(hint.__name__)
    origin = get_origin(hint)
    if origin is Literal:
        return "Literal[" + ", ".join(json.dumps(value) for value in get_args(hint)) + "]"
    if origin in (Union, types.UnionType):
        return " | ".join(_type_text(part) for part in get_args(hint) if part is not Auto)
    raise TypeError(f"{hint!r}: a policy field holds a number, a string, a flag or a choice")


def _value_text(value: Any) -> str:
    """A default as source: ``64_000_000``, ``600.0``, ``"full"``; ``auto`` as 0."""
    value = worker_value(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:_}" if value >= 100_000 else str(value)
    return repr(value)


def _policy_default(setting: Setting) -> Any:
    mark = setting.info.policy
    if mark is not None and mark.default is not SETTING_DEFAULT:
        return mark.default
    if setting.field.default is MISSING:
        # A default found from the machine would make this file differ from one machine to the next.
        raise TypeError(f"{setting.name}: a policy field needs a plain default")
    return setting.field.default


def _field_lines(setting: Setting, hint: Any) -> list[str]:
    said = f"{env_name(setting.name)}: {setting.meaning}" + ("; auto is 0 here" if setting.info.auto else "")
    if _policy_default(setting) != setting.field.default:
        said += f"; the setting's default is {_value_text(setting.field.default)}"
    comment = textwrap.wrap(said, _WIDTH - 6, initial_indent="    # ", subsequent_indent="    # ")
    return [*comment, f"    {field_name(setting)}: {_type_text(hint)} = {_value_text(_policy_default(setting))}"]


def render_policy_settings() -> str:
    """preprocessors/policy_settings.py: one frozen dataclass per kind of media, a field per setting marked for it."""
    sections = {section_name(section): get_type_hints(section) for section in SECTIONS}
    classes = []
    for kind in get_args(PolicyKind):
        fields = [_field_lines(setting, sections[setting.section][setting.name]) for setting in policy_settings(kind)]
        classes.append("\n".join(["@dataclass(frozen=True, slots=True)", f"class {policy_class_name(kind)}:",
                                  f'    """{POLICY_ABOUT[kind]}: the settings marked for it."""', "",
                                  *(line for lines in fields for line in lines)]))
    body = "\n\n\n".join(classes)
    literal_import = "from typing import Literal\n" if "Literal[" in body else ""
    return f'''"""The settings the decode workers receive, one frozen dataclass per kind of media, which
``base.ImagePolicy``, ``AudioPolicy`` and ``VideoPolicy`` extend. A field is a setting marked
``policy=PolicyField(...)`` in proxy/settings/sections.py, named as the mark says, with the setting's default
unless the mark gives another; the proxy builds each policy from the settings with
``proxy.settings.policies.policy_values``.

Generated by ``python -m proxy.settings.reference`` from those declarations: edit them, not this file.
"""

from __future__ import annotations

from dataclasses import dataclass
{literal_import}

{body}
'''
