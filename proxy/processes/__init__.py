"""Several front processes (``MMGATE_PROCESSES``): the supervisor, each front, the one gate they share and the
link between them, and the metrics the supervisor merges from the fronts."""
