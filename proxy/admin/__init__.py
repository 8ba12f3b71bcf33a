"""The /mmgate/* endpoints operators and probes use: liveness and readiness, /metrics (mmgate's, or merged with
the backend's), the dashboard and its JSON."""
