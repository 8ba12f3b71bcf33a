"""The benchmarks, one module per question, each a scenario of ``bench/scenarios.py`` that one runner runs from
the repository root: ``python -m bench list``, ``python -m bench run <name>`` (``bench/harness.py``).

Why a package: run with ``-m`` from the repository root, a benchmark imports this checkout's ``proxy``,
``preprocessors`` and ``testkit`` (what it shares with the tests) like any package, with no ``sys.path`` edits
and whatever else is installed. Results go to ``bench/results/``.
"""
