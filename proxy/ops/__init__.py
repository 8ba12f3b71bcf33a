"""Operations: Prometheus metrics, the admin endpoints, the dashboard and the backend's metrics."""
