"""The HTTP edge: connections, paths, the body read, the upstream call, refusals, pacing."""
