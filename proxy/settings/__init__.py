"""One frozen ``Settings``, built from ``MMGATE_*`` environment variables and CLI flags of the same names.

``sections`` holds the section dataclasses (each field's default is declared there once); ``spec`` how each
variable is parsed, checked, helped and printed; ``frozen`` the ``Settings`` they make together.
"""

from proxy.settings.frozen import Settings
from proxy.settings.parsers import AUTO_PROCESSES, MAX_PROCESSES
from proxy.settings.sections import (
    AUTO_CONCURRENCY,
    AUTO_JPEG_QUALITY,
    CONNECTION_BYTES,
    MIB,
    PRIORITY_MAX,
    PRIORITY_MIN,
    PROBE_RESERVE,
    PROCESS_MODE_FROM_CPUS,
    WORKER_PROCESS_BYTES,
    default_decode_mode,
    usable_cpus,
)
from proxy.settings.spec import (
    SPEC,
    ConfigError,
    add_arguments,
    auto_processes,
    env_name,
    flag_name,
    help_text,
    overrides_from_args,
    setting_default,
    setting_value,
    unknown_variables,
)

__all__ = [
    "AUTO_CONCURRENCY", "AUTO_JPEG_QUALITY", "AUTO_PROCESSES", "CONNECTION_BYTES", "MAX_PROCESSES", "MIB",
    "PRIORITY_MAX", "PRIORITY_MIN", "PROBE_RESERVE", "PROCESS_MODE_FROM_CPUS", "SPEC", "WORKER_PROCESS_BYTES",
    "ConfigError", "Settings",
    "add_arguments", "auto_processes", "default_decode_mode", "env_name", "flag_name",
    "help_text", "overrides_from_args", "setting_default", "setting_value", "unknown_variables", "usable_cpus",
]
