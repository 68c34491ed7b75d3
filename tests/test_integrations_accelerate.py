"""``ampwatch.attach`` on what ``accelerator.prepare`` returns, one process per mode.

Each mode runs tests/helpers/accelerate_worker.py in its own process (accelerate's state is process-global);
the four run side by side. Ground truth is written by the worker from the loop itself.
"""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

import ampwatch

pytest.importorskip("accelerate")

MODES = ["fp16", "bf16", "fp16-scaler", "fp16-scaler-fused"]
WORKER = Path(__file__).parent / "helpers" / "accelerate_worker.py"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    procs = {}
    for mode in MODES:
        out = tmp_path_factory.mktemp(mode)
        procs[mode] = (out, subprocess.Popen([sys.executable, str(WORKER), mode, str(out)],
                                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    results = {}
    for mode, (out, proc) in procs.items():
        log, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, f"{mode} worker failed:\n{log}"
        results[mode] = (ampwatch.load(out / "run.sqlite"), json.loads((out / "truth.json").read_text()))
    return results


@pytest.mark.parametrize("mode", MODES)
def test_one_row_per_optimizer_step_with_loss_and_unscaled_pre_clip_norm(runs, mode):
    run, truth = runs[mode]
    steps = run.steps
    assert list(steps["step"]) == list(range(12)) and list(steps["micro_batches"]) == [2] * 12
    assert list(steps["loss"]) == pytest.approx(truth["loss"], rel=1e-6)
    finite = [(r, t) for r, t in zip(steps["grad_norm"], truth["grad_norm"]) if math.isfinite(t)]
    assert len(finite) >= 6
    assert [r for r, _ in finite] == pytest.approx([t for _, t in finite], rel=1e-4)
    assert truth["scaler"] == ("scaler" in mode)


@pytest.mark.parametrize("mode", MODES)
def test_skipped_agrees_with_the_parameters_and_accelerate(runs, mode):
    run, truth = runs[mode]
    assert list(run.steps["skipped"]) == truth["skipped"]
    if "scaler" in mode:
        assert 3 <= sum(truth["skipped"]) < 12, "the scale storm must skip some steps"
    if "fused" in mode:
        # A fused step is always called (the kernel skips the update itself), so accelerate cannot
        # tell (huggingface/accelerate#4242); ampwatch reads the scaler's found_inf instead.
        assert truth["steps_called"] == 12
    else:
        assert truth["accelerate_skipped"] == truth["skipped"]


def test_run_info_per_mode(runs):
    for mode in MODES:
        info = runs[mode][0].info
        assert info["optimizer"] == "AdamW", "the AcceleratedOptimizer was unwrapped"
        assert info["scaler_enabled"] == ("scaler" in mode) and info["status"] == "finished"
    # accelerate enters autocast inside the wrapped forward: the recorder still sees its dtype
    assert runs["bf16"][0].info["amp_dtype"] == "bfloat16"
