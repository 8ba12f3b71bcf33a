"""Processes: the supervisor, each front process, signals and the process's memory tuning."""
