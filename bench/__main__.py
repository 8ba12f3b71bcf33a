"""``python -m bench``: the one runner (``bench.harness``)."""

from bench.harness import main

raise SystemExit(main())
