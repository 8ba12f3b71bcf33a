"""The demo backend of mmgate: a stub vision-language server, kept out of the ``proxy`` package.

Why a package of its own: the stub is scaffolding for ``mmgate demo``, the tests and the benchmarks, not part
of the proxy, and it needs numpy, which the proxy does not. It ships beside ``proxy`` so ``mmgate demo`` works
from any install, but its dependency comes only with the ``demo`` extra (``pip install -e '.[demo]'``).
Run it with ``python -m demo.backend --host 127.0.0.1 --port 8000``; the code is in ``demo/backend.py``.
"""
