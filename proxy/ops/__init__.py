"""What mmgate measures: its Prometheus metrics, the backend's scraped metrics, and every front process's merged."""
