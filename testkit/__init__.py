"""What the tests and the benchmarks share: servers, media, load, fuzzing and the real-vLLM harness.

Why a package of its own at the repository root, rather than the benchmarks importing ``tests``: a bench must
not depend on the test suite (its fixtures, its conftest), and ``tests`` is a name other distributions put in
site-packages too, so ``import tests`` may not even find this checkout's. ``testkit`` is imported by both sides
like any package when they run from the repository root (``python -m pytest``, ``python -m bench.<name>``),
with no ``sys.path`` edits. It is not shipped: ``[tool.setuptools] packages`` leaves it out.

- ``servers``: the scriptable upstream and the proxy handle (pytest fixtures in tests/conftest.py start them).
- ``media``: small images and requests for the tests; photo-like images and request bodies for the benches.
- ``fuzzing``: strategies, properties and the corpus of tests/proxy/test_app_fuzz.py and bench/fuzz.py.
- ``environment``: the environment of an mmgate a test or a bench starts as a process.
- ``load``: processes, /proc readings, Prometheus parsing, the load client and the prober of the benches.
- ``variants``: mmgate with a benchmark-only decode pool (workers at niceness 0, decode on the loop).
- ``vllm``: installs, starts and stops a real vLLM and mmgate for tests/e2e and bench/real_vllm.py.
"""
