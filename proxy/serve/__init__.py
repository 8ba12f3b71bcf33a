"""Serving: one process, or one front process of several, from start to drain; and the demo's stub backend."""
