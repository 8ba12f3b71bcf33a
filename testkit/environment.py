"""The environment a test or a bench hands to an mmgate it starts as a process of its own."""

from __future__ import annotations

import os
from collections.abc import Collection

# CI runs the suite once per decode mode, again on several front processes and again on uvloop, by setting these
# in the environment of the whole pass.
PASS_SETTINGS = ("MMGATE_DECODE_MODE", "MMGATE_PROCESSES", "MMGATE_LOOP")


def mmgate_env(keep: Collection[str] = PASS_SETTINGS, **settings: str) -> dict[str, str]:
    """This process's environment without its ``MMGATE_*`` variables (a developer's own would change what is
    tested) but those named in ``keep``, then ``settings`` on top."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MMGATE_") or k in keep}
    return env | settings
