"""What the tests and the benchmarks share: servers, media, load, fuzzing and the real-vLLM harness.

Why a package of its own at the repository root, rather than the benchmarks importing ``tests``: a bench must
not depend on the test suite (its fixtures, its conftest), and ``tests`` is a name other distributions put in
site-packages too, so ``import tests`` may not even find this checkout's. ``testkit`` is imported by both sides
like any package when they run from the repository root (``python -m pytest``, ``python -m bench.<name>``),
with no ``sys.path`` edits. It is not shipped: ``[tool.setuptools] packages`` leaves it out.

Shared by the tests and the benches:

- ``servers``: the scriptable upstream and the proxy handle (pytest fixtures in tests/conftest.py start them).
- ``media``: small images and requests for the tests; photo-like images and request bodies for the benches.
- ``models``: model folders built locally (processor configurations, tiny weights) for ``MMGATE_MODEL``.
- ``fuzzing``: strategies, properties, the corpus and the search of tests/proxy/test_app_fuzz.py and bench/fuzz.py.
- ``environment``: the environment of an mmgate a test or a bench starts as a process.
- ``load`` and ``procfs``: processes, /proc readings, Prometheus parsing, the load client and the prober.
- ``vllm``: installs, starts and stops a real vLLM and mmgate for tests/e2e and the real-vLLM benches.
- ``adaptive_sim``: the discrete-event simulation of ``MMGATE_MAX_MM_CONCURRENCY=auto``.
- ``snippets``: the README's code blocks, run as a new user pastes them.

The benches' machinery, so that a bench module is its scenario, goals and page: one concept a module, whose
docstring names the bench that uses it. The cells a bench runs (``fleet_cells``, ``limit_cell``, ``peer_cells``,
``memory_cell``, ``front_load``, ``worker_scaling``, ``health_under_load``, ``cache_hit_load``,
``downscale_cells``, ``allocator_burst``...), the backends and clients they run against (``curve_backend``,
``text_load``, ``text_targets``, ``peers``, ``bench_serve``, ``vllm_load``...), and what they read and compute
(``probed_load``, ``call_timing``, ``gil_probe``, ``memory_model``, ``idle_checkpoints``...). Two tools that
write no result live here too: ``worst_case_docs`` (the docs' worst-case memory figures) and
``handoff_calibration`` (the cost coefficients of preprocessors/handoff.py).
"""
