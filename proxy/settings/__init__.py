"""One frozen ``Settings``, built from ``MMGATE_*`` environment variables and CLI flags of the same names.

``declare`` says how a setting is declared (``setting(...)``, ``AUTO``); ``sections`` declares every setting, once,
as a field of its section; ``spec`` reads them (``SPEC``, made from those fields); ``frozen`` holds the
``Settings`` they make together (``Settings.describe`` is ``--print-config``); ``policies`` makes from them what
the decode workers receive and what the cache's key holds; ``reference`` makes ``--help``'s flags,
docs/configuration.md and the workers' policy fields from the declarations (imported on its own: ``python -m``
runs it).
"""

from proxy.settings.cpus import PROCESS_MODE_FROM_CPUS, auto_processes, default_decode_mode, usable_cpus
from proxy.settings.declare import AUTO, Auto, ConfigError, Info, env_name, flag_name, setting
from proxy.settings.frozen import Settings
from proxy.settings.parsers import MAX_PROCESSES
from proxy.settings.policies import policy_values, verdict_settings
from proxy.settings.sections import (
    CONNECTION_BYTES,
    MIB,
    PRIORITY_MAX,
    PRIORITY_MIN,
    PROBE_RESERVE,
    SECTIONS,
    WORKER_PROCESS_BYTES,
)
from proxy.settings.spec import (
    SPEC,
    overrides_from_args,
    setting_default,
    setting_value,
    unknown_variables,
)

__all__ = [
    "AUTO", "CONNECTION_BYTES", "MAX_PROCESSES", "MIB", "PRIORITY_MAX", "PRIORITY_MIN", "PROBE_RESERVE",
    "PROCESS_MODE_FROM_CPUS", "SECTIONS", "SPEC", "WORKER_PROCESS_BYTES",
    "Auto", "ConfigError", "Info", "Settings",
    "auto_processes", "default_decode_mode", "env_name", "flag_name",
    "overrides_from_args", "policy_values", "setting", "setting_default", "setting_value", "unknown_variables",
    "usable_cpus", "verdict_settings",
]
