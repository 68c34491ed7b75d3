"""Shared fixtures: tiny real models and a real AMP loop on the CPU (no mocks anywhere)."""
from __future__ import annotations

import gc
import os

import pytest
import torch

torch.set_num_threads(1)  # two threads on two shared cores swing 5-12x (research/overhead-anchors.md)


@pytest.fixture(autouse=True)
def no_watch_left_open():
    """Fail a test that leaves a recording open (its writer thread would leak into other tests)."""
    yield
    from ampwatch.record.watch import _open_watches
    gc.collect()
    left = [w for w in list(_open_watches) if not w.closed]
    for w in left:
        w.close()
    assert not left, f"test left {len(left)} watch(es) open"


@pytest.fixture(params=["host", "accelerator"])
def record_path(request, monkeypatch):
    """Run a test on both recorder paths: the CPU's free host reads, and the accelerator path
    (AMPWATCH_CPU_AS_ACCELERATOR=1: device-resident stats, foreach detail, no free reads)."""
    if request.param == "accelerator":
        monkeypatch.setenv("AMPWATCH_CPU_AS_ACCELERATOR", "1")
    else:
        monkeypatch.delenv("AMPWATCH_CPU_AS_ACCELERATOR", raising=False)
    return request.param


@pytest.fixture
def restore_runs_env():
    """The app tests set AMPWATCH_RUNS (the folder the dashboard opens): put it back after each."""
    before = os.environ.get("AMPWATCH_RUNS")
    yield
    if before is None:
        os.environ.pop("AMPWATCH_RUNS", None)
    else:
        os.environ["AMPWATCH_RUNS"] = before
