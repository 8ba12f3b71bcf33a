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

from preprocessors.base import AudioPolicy, ImagePolicy, VideoPolicy
from proxy.app import build_state
from proxy.media.cache import settings_fingerprint
from proxy.settings import SPEC, Settings, env_name, policy_values, verdict_settings
from proxy.settings.declare import PolicyKind
from proxy.settings.policies import POLICY_SETTINGS_PATH, field_name, policy_settings, render_policy_settings
from proxy.settings.reference import REPO

BASE = {"MMGATE_UPSTREAM": "http://127.0.0.1:1", "MMGATE_MODEL": "none"}
# A value other than the default for every setting the workers receive.
CHANGED = {"max_image_pixels": "1000", "max_frames": "3", "max_audio_seconds": "9", "max_video_pixels": "4096",
           "max_video_frames": "8", "max_video_seconds": "5", "validate": "full", "resize_max_pixels": "1000",
           "resize_max_side": "30", "image_format": "webp", "jpeg_quality": "50"}


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
    assert set(CHANGED) == {setting.name for setting in SPEC.values() if setting.info.policy}
    state = build_state(Settings.from_env({**BASE, **{env_name(name): value for name, value in CHANGED.items()}}))
    received = pickle.loads(pickle.dumps((state.image_policy, state.audio_policy, state.video_policy)))
    assert received == (state.image_policy, state.audio_policy, state.video_policy)
    image, audio, video = received
    assert (image.max_pixels, image.max_frames, image.validate, image.resize_max_pixels, image.resize_max_side,
            image.output_format, image.jpeg_quality) == (1000, 3, "full", 1000, 30, "webp", 50)
    assert audio == AudioPolicy(max_seconds=9.0)
    assert video == VideoPolicy(max_pixels=4096, max_frames=8, max_seconds=5.0)


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
    shaping = {**CHANGED, "max_media_item_mb": "7", "model": "auto", "mm_processor_kwargs": '{"max_pixels": 9}'}
    prints = {settings_fingerprint(Settings.from_env({**BASE, env_name(name): value}))
              for name, value in shaping.items()}
    assert base not in prints and len(prints) == len(shaping)
    for name, value in {"max_queue": "3", "cache_mb": "5", "port": "9", "decode_workers": "3"}.items():
        assert settings_fingerprint(Settings.from_env({**BASE, env_name(name): value})) == base


# An example: one more image setting, declared in its section (the workers would read it in image.py).
NEW_SETTING = '''
    png_compress_level: int = setting(1, parse=integer(0, 9), policy=PolicyField("image"),
                                      help="zlib level of re-encoded PNG images: 1 fastest, 9 smallest")
'''
# Run in the copy: the new setting's value in the fingerprint and in the image policy a worker process unpickles.
CHECK = '''
import multiprocessing
from concurrent.futures import ProcessPoolExecutor

from proxy.app import build_state
from proxy.media.cache import settings_fingerprint
from proxy.settings import Settings, env_name

base = {"MMGATE_UPSTREAM": "http://127.0.0.1:1", "MMGATE_MODEL": "none"}
changed = Settings.from_env({**base, env_name("png_compress_level"): "9"})
assert settings_fingerprint(changed) != settings_fingerprint(Settings.from_env(base))
policy = build_state(changed).image_policy
with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as worker:
    print(worker.submit(getattr, policy, "png_compress_level").result())
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
    assert env_name("png_compress_level") in (copy / "docs" / "configuration.md").read_text()
    checked = subprocess.run([sys.executable, "-c", CHECK], cwd=copy, env=env, check=True, capture_output=True,
                             text=True)
    assert checked.stdout == "9\n"
