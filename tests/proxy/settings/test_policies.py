"""What the decode workers receive and what the cache's key holds are made from the settings' declarations: a
decode setting is its declaration and a regeneration, and reaches the workers and the key with no other edit."""

from __future__ import annotations

import filecmp
import os
import pickle
import shutil
import subprocess
import sys
from dataclasses import fields
from pathlib import Path
from typing import Any

from preprocessors.base import AudioPolicy, ImagePolicy, VideoPolicy
from proxy.app import build_state
from proxy.media.cache import settings_fingerprint
from proxy.settings import SPEC, Settings, env_name, policy_values, verdict_settings
from proxy.settings.declare import PolicyKind
from proxy.settings.policies import (
    POLICY_SETTINGS_PATH,
    field_name,
    policy_settings,
    render_policy_settings,
    worker_value,
)
from proxy.settings.reference import REPO
from proxy.settings.spec import Setting

BASE = {"MMGATE_UPSTREAM": "http://127.0.0.1:1", "MMGATE_MODEL": "none"}


def _other_value(setting: Setting) -> tuple[str, Any]:
    """A value of ``setting`` other than its default, as typed and as read: another choice, or a small number."""
    for raw in (*setting.info.choices, "3", "7", "50"):
        try:
            value = setting.info.read(raw)
        except ValueError:
            continue
        if value != setting.default:
            return raw, value
    raise AssertionError(f"no value to try for {setting.name}")


# Every setting the workers receive, at a value other than its default.
CHANGED = {name: _other_value(setting) for name, setting in SPEC.items() if setting.info.policy}


def test_the_workers_policy_fields_are_generated_from_the_declarations() -> None:
    assert (REPO / POLICY_SETTINGS_PATH).read_text() == render_policy_settings(), (
        "run python -m proxy.settings.reference")


def test_each_policy_is_its_marked_settings_and_nothing_else_but_the_found_geometry() -> None:
    kinds: list[tuple[type, PolicyKind]] = [(ImagePolicy, "image"), (AudioPolicy, "audio"), (VideoPolicy, "video")]
    for policy, kind in kinds:
        marked = [field_name(setting) for setting in policy_settings(kind)]
        found = ["geometry"] if policy is ImagePolicy else []
        assert [f.name for f in fields(policy)] == marked + found


def test_every_setting_the_workers_receive_reaches_their_policies_through_a_process() -> None:
    assert {"max_image_pixels", "validate", "jpeg_quality", "max_audio_seconds", "max_video_frames"} <= set(CHANGED)
    settings = Settings.from_env({**BASE, **{env_name(name): raw for name, (raw, _) in CHANGED.items()}})
    state = build_state(settings)
    sent = {"image": state.image_policy, "audio": state.audio_policy, "video": state.video_policy}
    received = pickle.loads(pickle.dumps(sent))
    assert received == sent
    for name, (_, value) in CHANGED.items():
        mark = SPEC[name].info.policy
        assert mark is not None
        assert getattr(received[mark.kind], field_name(SPEC[name])) == worker_value(value), name


def test_auto_reaches_the_workers_as_zero_and_the_defaults_as_the_settings_say() -> None:
    settings = Settings.from_env(BASE)
    assert policy_values(settings, "image")["jpeg_quality"] == 0
    # What mmgate does with its defaults, but for validation: a policy made by hand decodes every image.
    assert ImagePolicy(**policy_values(settings, "image")) == ImagePolicy(validate="header")
    assert AudioPolicy(**policy_values(settings, "audio")) == AudioPolicy()
    assert VideoPolicy(**policy_values(settings, "video")) == VideoPolicy()


def test_the_cache_key_holds_every_setting_a_verdict_depends_on_and_no_other() -> None:
    held = [name for name, _ in verdict_settings(Settings.from_env(BASE))]
    assert held == [name for name, setting in SPEC.items()
                    if setting.info.policy or name in ("max_media_item_mb", "model", "mm_processor_kwargs")]
    base = settings_fingerprint(Settings.from_env(BASE))
    shaping = {**{name: raw for name, (raw, _) in CHANGED.items()}, "max_media_item_mb": "7", "model": "auto",
               "mm_processor_kwargs": '{"max_pixels": 9}'}
    prints = {settings_fingerprint(Settings.from_env({**BASE, env_name(name): value}))
              for name, value in shaping.items()}
    assert base not in prints and len(prints) == len(shaping)
    for name, value in {"max_queue": "3", "cache_mb": "5", "port": "9", "decode_workers": "3"}.items():
        assert settings_fingerprint(Settings.from_env({**BASE, env_name(name): value})) == base


# One more image setting, declared in its section (the workers would read it in image.py); named so that no real
# setting will take its name.
NEW_SETTING = '''
    example_image_level: int = setting(1, parse=integer(0, 9), policy=PolicyField("image"),
                                       help="a level the image preprocessor would use")
'''
# Run in the copy: the new setting's value in the fingerprint and in the image policy a worker process unpickles.
CHECK = '''
import multiprocessing
from concurrent.futures import ProcessPoolExecutor

from proxy.app import build_state
from proxy.media.cache import settings_fingerprint
from proxy.settings import Settings, env_name

base = {"MMGATE_UPSTREAM": "http://127.0.0.1:1", "MMGATE_MODEL": "none"}
changed = Settings.from_env({**base, env_name("example_image_level"): "9"})
assert settings_fingerprint(changed) != settings_fingerprint(Settings.from_env(base))
policy = build_state(changed).image_policy
with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as worker:
    print(worker.submit(getattr, policy, "example_image_level").result())
'''


def _changed_files(before: Path, after: Path) -> list[str]:
    changed = []
    for path in sorted(after.rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts:
            name = path.relative_to(after)
            if not (before / name).is_file() or not filecmp.cmp(before / name, path, shallow=False):
                changed.append(str(name))
    return changed


def test_a_new_decode_setting_is_one_declaration_and_a_regeneration(tmp_path: Path) -> None:
    pristine, copy = tmp_path / "pristine", tmp_path / "repo"
    for folder in ("proxy", "preprocessors"):
        shutil.copytree(REPO / folder, pristine / folder, ignore=shutil.ignore_patterns("__pycache__"))
    (pristine / "docs").mkdir()
    shutil.copy(REPO / "docs" / "configuration.md", pristine / "docs")
    shutil.copytree(pristine, copy)
    sections = copy / "proxy" / "settings" / "sections.py"
    text = sections.read_text()
    end_of_decode = text.index("\n\n@dataclass(frozen=True, slots=True)\nclass Fetch:")
    sections.write_text(text[:end_of_decode] + NEW_SETTING.rstrip("\n") + text[end_of_decode:])  # the one edit

    env = {**os.environ, "PYTHONPATH": str(copy)}
    subprocess.run([sys.executable, "-m", "proxy.settings.reference", "--root", str(copy)], cwd=copy, env=env,
                   check=True, capture_output=True)
    assert _changed_files(pristine, copy) == ["docs/configuration.md", "preprocessors/policy_settings.py",
                                              "proxy/settings/sections.py"]
    assert env_name("example_image_level") in (copy / "docs" / "configuration.md").read_text()
    checked = subprocess.run([sys.executable, "-c", CHECK], cwd=copy, env=env, check=True, capture_output=True,
                             text=True)
    assert checked.stdout == "9\n"
