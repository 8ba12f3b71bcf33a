"""The benchmarks, one module per question; run each from the repository root as ``python -m bench.<name>``.

Why a package: run with ``-m`` from the repository root, a benchmark imports this checkout's ``proxy``,
``preprocessors`` and ``testkit`` (what it shares with the tests) like any package, with no ``sys.path`` edits
and whatever else is installed. Results go to ``bench/results/``.
"""
