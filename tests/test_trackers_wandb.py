"""AMP series in Weights & Biases offline runs, live (mirror="wandb") and exported, read back from
the run's own transaction log (tests/helpers/wandb_offline.py) against the run file read with sqlite3."""
from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

import ampwatch
from helpers.loops import amp_step, data, mlp
from helpers.sqltruth import sql_frame
from helpers.wandb_offline import history

pytest.importorskip("wandb")

STEPS = 30


@pytest.fixture
def offline(tmp_path, monkeypatch):
    for key, value in {"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path), "WANDB_SILENT": "true",
                       "WANDB_PROJECT": "ampwatch-test", "WANDB_DISABLE_GIT": "true"}.items():
        monkeypatch.setenv(key, value)
    return tmp_path


def _train(path, **options):
    model = mlp(0)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 30, growth_interval=4)
    step = {"i": 0}
    model[2].weight.register_hook(lambda g: g * math.inf if step["i"] == 20 else g)
    watch = ampwatch.attach(model, opt, scaler, path=str(path), layer_every=5, **options)
    for i in range(STEPS):
        step["i"] = i
        amp_step(model, opt, scaler, *data(i))
    watch.close()


def _check(run_dir, run_file):
    rows = [r for r in history(run_dir) if "amp/skipped" in r]
    by_step = {r["amp/step"]: r for r in rows}
    assert len(by_step) == len(rows) == STEPS  # one row per optimizer step, none dropped
    truth = sql_frame(run_file, "SELECT step, loss_scale, skipped, grad_norm, nan_mask FROM steps ORDER BY step")
    assert truth["skipped"].sum() >= 3
    for row in truth.itertuples():
        got = by_step[row.step]
        assert got["amp/skipped"] == row.skipped and got["amp/loss_scale"] == row.loss_scale
        want = math.nan if row.nan_mask & 2 else row.grad_norm
        assert (math.isnan(got["amp/grad_norm"]) and math.isnan(want)) or \
            math.isclose(got["amp/grad_norm"], want, rel_tol=1e-12)
    (table_row,) = [r for r in history(run_dir) if "amp/findings/path" in r]
    table = json.loads((run_dir / "files" / table_row["amp/findings/path"]).read_text())
    findings = ampwatch.diagnose(str(run_file))
    assert findings and sorted(s for s, _ in table["data"]) == sorted({f.steps[0] for f in findings})
    assert all(f.title in dict(table["data"])[f.steps[0]] for f in findings)


def test_live_mirror_into_the_active_offline_run(tmp_path, offline):
    import wandb
    run = wandb.init()
    _train(tmp_path / "live.sqlite", mirror="wandb")
    assert wandb.run is run  # the user's run is left running
    run.log({"user/metric": 1.0})
    run.finish()
    (run_dir,) = (tmp_path / "wandb").glob("offline-run-*")
    _check(run_dir, tmp_path / "live.sqlite")


def test_export_to_wandb_offline(tmp_path, offline):
    _train(tmp_path / "exp.sqlite")
    proc = subprocess.run([sys.executable, "-m", "ampwatch", "export", str(tmp_path / "exp.sqlite"), "--to", "wandb"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    (run_dir,) = (tmp_path / "wandb").glob("offline-run-*")
    _check(run_dir, tmp_path / "exp.sqlite")
