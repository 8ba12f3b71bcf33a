"""bench/peer_client.py's model cells (``testkit.peer_cells``) measure the model mode only where mmgate found the
served model by itself: the Hugging Face cache the bench lays out is one mmgate finds through ``HF_HOME``, and a
cell whose mmgate has not the model it measures stops the bench instead of giving a figure. A real stub backend
and a real mmgate answer on loopback; what mmgate says is in force is read from its /mmgate/stats."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from testkit import peer_cells as pc
from testkit import vllm as h
from testkit.load import start_stub, stop
from testkit.models import hub_snapshot, idefics3_folder


@pytest.fixture
def hub_backend(tmp_path: Path) -> Iterator[tuple[pc.Backend, Path]]:
    """A stub serving ``HUB_ID``, whose files lie in a Hugging Face cache laid out by the bench; and that cache's
    HF_HOME."""
    home = tmp_path / "hf-home"
    snapshot = hub_snapshot(home / "hub", pc.HUB_ID, idefics3_folder(tmp_path / "built"))
    proc, url = start_stub("--model", pc.HUB_ID)
    try:
        yield pc.Backend(url, proc.pid, (), snapshot.resolve()), home
    finally:
        stop(proc)


def test_the_hub_cache_is_laid_out_as_huggingface_hub_keeps_it(tmp_path: Path) -> None:
    model = idefics3_folder(tmp_path / "built")
    snapshot = hub_snapshot(tmp_path / "home" / "hub", pc.HUB_ID, model)
    repo = tmp_path / "home" / "hub" / ("models--" + pc.HUB_ID.replace("/", "--"))
    assert (repo / "refs" / "main").read_text() == snapshot.name
    assert sorted(p.name for p in snapshot.iterdir()) == sorted(p.name for p in model.iterdir())
    for link in snapshot.iterdir():
        assert link.is_symlink() and Path(os.path.realpath(link)).parent == (repo / "blobs").resolve()
        assert link.read_bytes() == (model / link.name).read_bytes()


def test_the_model_cell_finds_the_model_through_hf_home(hub_backend: tuple[pc.Backend, Path],
                                                        tmp_path: Path) -> None:
    served, home = hub_backend
    with h.hf_home(home):
        gate = h.start_mmgate(served.url, *pc.mmgate_flags("model", served), log_dir=tmp_path)
    try:
        found = pc.check_model(gate, "model", served, wait=True)
        assert found["family"] == pc.MODEL_FAMILY and found["root"] == pc.HUB_ID
        assert found["folder"] == str(served.model_folder)
    finally:
        gate.stop()


def test_a_cell_whose_mmgate_has_another_model_in_force_stops_the_bench(hub_backend: tuple[pc.Backend, Path],
                                                                        tmp_path: Path) -> None:
    served, home = hub_backend
    with h.hf_home(home):
        gate = h.start_mmgate(served.url, log_dir=tmp_path)
    try:
        pc.check_model(gate, "model", served, wait=True)  # found: the stats name the model from here on
        elsewhere = pc.Backend(served.url, served.pid, (), tmp_path / "another-folder")
        with pytest.raises(SystemExit, match="the model mode is not in force as measured"):
            pc.check_model(gate, "model", elsewhere, wait=False)
        with pytest.raises(SystemExit, match="measures mmgate without a model"):
            pc.check_model(gate, "defaults", served, wait=False)
    finally:
        gate.stop()


def test_a_model_cell_whose_mmgate_has_no_model_in_force_stops_the_bench(hub_backend: tuple[pc.Backend, Path],
                                                                 tmp_path: Path) -> None:
    served, _ = hub_backend
    with h.hf_home(tmp_path / "empty-hf-home"):
        gate = h.start_mmgate(served.url, *pc.mmgate_flags("model", served), log_dir=tmp_path)
    try:
        pc.check_model(gate, "defaults", served, wait=False)  # nothing in force: what the defaults measure
        with pytest.raises(SystemExit, match="the model mode is not in force as measured"):
            pc.check_model(gate, "model", served, wait=False)
    finally:
        gate.stop()
