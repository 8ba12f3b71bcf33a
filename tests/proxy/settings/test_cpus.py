"""MMGATE_MAX_MM_CONCURRENCY's default follows the decode workers, never under 4 (docs/tuning.md, "Concurrency")."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from proxy.settings import Settings
from proxy.settings.cpus import MIN_DEFAULT_MM_CONCURRENCY, usable_cpus


@given(workers=st.integers(1, 256))
def test_the_default_limit_is_one_request_a_decode_worker_and_at_least_4(workers: int) -> None:
    settings = Settings.from_env({"MMGATE_DECODE_WORKERS": str(workers)})
    assert settings.gate.max_mm_concurrency == max(MIN_DEFAULT_MM_CONCURRENCY, workers)


def test_without_decode_workers_set_it_follows_the_usable_cpus_and_a_set_limit_wins() -> None:
    assert Settings.from_env({}).gate.max_mm_concurrency == max(4, usable_cpus())
    chosen = Settings.from_env({"MMGATE_DECODE_WORKERS": "16", "MMGATE_MAX_MM_CONCURRENCY": "3"})
    assert chosen.gate.max_mm_concurrency == 3
