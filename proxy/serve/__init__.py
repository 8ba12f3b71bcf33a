"""Serving one process: the server's start and drain, signals, the process's memory and descriptor limits, and
the demo's stub backend."""
