"""Several front processes (``MMGATE_PROCESSES``) as one mmgate: the supervisor, the one gate they share and the
link between them (each front runs ``serve.front``)."""
